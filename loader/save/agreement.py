"""What the ranks of a distributed save compare before anything is written.

Every rank plans its own writes from its own model: ranks that hold a tensor differently (one ``Shard(0)``, another
``Shard(1)``; one a plain tensor, another a DTensor; another global shape or dtype) would each write their own idea
of it, leaving elements nobody writes. So each rank describes every model tensor it saves (its *view*: kind,
global shape, dtype, placements, mesh shape) and the checkpoint layout, and the ranks compare through the
process group's store: every rank counts itself under the hash of its description, rank 0 publishes its own;
after the planning agreement a rank whose hash is not every rank's writes nothing, and one whose description
differs from rank 0's raises, naming the first tensor they hold differently and both views.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from .filelayout import SaveLayout

_ABSENT = "no such tensor"


def tensor_view(tensor: torch.Tensor) -> str:
    """One model tensor as every rank must hold it: kind, global shape, dtype and, for a DTensor, its placements
    and mesh (shape and dim names)."""
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    shape = f"shape {tuple(data.shape)} {str(data.dtype).removeprefix('torch.')}"
    mesh = getattr(data, "device_mesh", None)
    if mesh is None:
        return f"a plain tensor of {shape}"
    names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"a DTensor of {shape}, placements {tuple(data.placements)!r} on a mesh of shape {tuple(mesh.shape)}{names}"


class RankAgreement:
    """This rank's description of a save (every saved model tensor's view and the layout), compared across ranks.

    Args:
        tensors: the model tensors the save writes, by name (``SaveMapping.tensors``).
        layout: the checkpoint layout this rank computed.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], layout: SaveLayout) -> None:
        self.views = {name: tensor_view(t) for name, t in tensors.items()}
        self.layout = layout.digest()
        self.text = json.dumps([list(self.views.items()), self.layout])
        # of the sorted views: equal digests exactly when :meth:`check` finds equal descriptions, so that a rank
        # whose digest is not every rank's always finds one that raises
        canonical = json.dumps([sorted(self.views.items()), self.layout])
        self.digest = hashlib.sha256(canonical.encode()).hexdigest()

    def publish(self, store: Any, rank: int) -> None:
        """Count this rank under its digest; rank 0 also publishes its description (before the planning agreement)."""
        if rank == 0:
            store.set("save/agreement", zlib.compress(self.text.encode()))
        store.add(f"save/agreement/{self.digest}", 1)

    def check(self, store: Any, rank: int, world: int) -> bool:
        """After the planning agreement: True when every rank described the save alike.

        Returns:
            False when some ranks disagree but this one agrees with rank 0: it must write nothing (a disagreeing
            rank raises, and the agreement point after writing fails every rank with its error).

        Raises:
            ValueError: this rank's description differs from rank 0's, naming the first tensor they hold
                differently and both views (or the layout).
        """
        if store.add(f"save/agreement/{self.digest}", 0) == world:
            return True
        items, layout = json.loads(zlib.decompress(store.get("save/agreement")).decode())
        theirs = dict(items)
        if theirs == self.views and layout == self.layout:
            return False
        for name in [*theirs, *(n for n in self.views if n not in theirs)]:
            mine, first = self.views.get(name, _ABSENT), theirs.get(name, _ABSENT)
            if mine != first:
                raise ValueError(
                    f"the ranks hold model tensor {name!r} differently: rank 0 holds {first}, rank {rank} holds "
                    f"{mine}; every rank must save the same model sharded the same way (nothing was written)"
                )
        raise ValueError(
            f"rank {rank} computed another checkpoint layout than rank 0 from the same model tensors (different "
            "rules, max_shard_size or metadata on different ranks?); nothing was written"
        )
