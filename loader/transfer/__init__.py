"""Moving weights between two (sharded) models without files: each destination rank receives exactly its bytes.

:mod:`.cells` (the source's cells, who sends each) ← :mod:`.plan` (the pure plan: moves, the whole world's or
one rank's) ← :mod:`.schedule` (moves in bounded rounds) ← :mod:`.sides` (the two
models as plain values: the source's save mapping, the destination's traced load) ← :mod:`.exchange` (packing,
``all_to_all_single``, unpacking), :mod:`.memory` (the local memory checked: no meta tensor, no overlapping
writes), :mod:`.agreement` (the values shared through the store under the transfer's timeout, the ranks' views
of each tensor compared) ← :mod:`.prepared`
(``prepare_transfer``, ``PreparedTransfer``: planned once, replayed every step) ← :mod:`.api` (``transfer_weights``,
``TransferReport`` of :mod:`.report`); :mod:`.simulate` (the plan
for any two meshes on meta models: ``simulate_transfer``); :mod:`.destination` (``TensorDestination``: a trainer's
weight-sync pushes into plain local tensors of other processes; imported when first used, as it builds on
:mod:`loader.vllm`'s wire, which imports this package's cells).
"""

from .api import BUCKET_BYTES, TransferReport, TransferRun, transfer_weights
from .plan import (
    Cell,
    DestConversion,
    DestSide,
    Fallback,
    Move,
    Slot,
    Slots,
    SourceConversion,
    SourceSide,
    TransferPlan,
    plan_transfer,
)
from .prepared import PreparedTransfer, fingerprint, prepare_transfer
from .schedule import rounds
from .sides import as_rules, dest_side, model_parts, source_side
from .simulate import RankTransfer, TransferFigures, TransferMeshes, mesh_parts, simulate_transfer

__all__ = [
    "BUCKET_BYTES",
    "TransferReport",
    "TransferRun",
    "transfer_weights",
    "PreparedTransfer",
    "fingerprint",
    "prepare_transfer",
    "Cell",
    "DestConversion",
    "DestSide",
    "Fallback",
    "Move",
    "Slot",
    "Slots",
    "SourceConversion",
    "SourceSide",
    "TransferPlan",
    "as_rules",
    "dest_side",
    "model_parts",
    "plan_transfer",
    "rounds",
    "source_side",
    "RankTransfer",
    "TransferFigures",
    "TransferMeshes",
    "mesh_parts",
    "simulate_transfer",
    "TensorDestination",
]


def __getattr__(name: str):
    if name == "TensorDestination":  # lazily: loader.vllm.sync_pieces imports this package's cells
        from .destination import TensorDestination

        return TensorDestination
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
