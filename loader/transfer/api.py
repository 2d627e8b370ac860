"""``transfer_weights``: move the weights of one (sharded) model into another, shard to shard, without files.

Every rank of the world calls it; each holds a part of the source, of the destination, of both or of neither.
The steps, each agreed by every rank before the next through the process group's store
(:mod:`.agreement`: every wait bounded by ``timeout``, a rank that never arrives named):

It is :func:`~loader.transfer.prepare_transfer` then one :meth:`~loader.transfer.PreparedTransfer.run`; to
transfer again (each training step) keep the prepared transfer and run it: the planning below is not repeated.

1. every rank describes what it holds of each model (names, global shapes, dtypes, boxes, and a digest of its
   tensors' views: the ranks holding one tensor must hold it alike);
2. the first rank holding the source maps it to its checkpoint layout and inverts it (as a save does); the first
   rank holding the destination traces its load from that layout (as a load does): both shared;
3. every rank computes its own part of the :class:`~loader.transfer.TransferPlan` from those values (pure:
   ``plan_transfer(..., rank=r)``, the moves it sends or receives), checks the local memory it reads and writes
   (:mod:`.memory`), and its rounds from its plan and every rank's count of peers (shared, then the number of
   rounds);
4. rounds of ``all_to_all_single`` with exact split sizes move the payload (:mod:`.exchange`), each waiting at
   most ``timeout``; destination conversions that do not trace run on the destination ranks from their keys
   moved whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..options import BUCKET_BYTES, Rules, TransferOptions
from .prepared import prepare_transfer
from .report import TransferReport, TransferRun

__all__ = ["BUCKET_BYTES", "TransferReport", "TransferRun", "transfer_weights"]

Mapping_ = Rules | Sequence[Any] | None


def transfer_weights(
    src: torch.nn.Module | None,
    dst: torch.nn.Module | None,
    *,
    src_mapping: Mapping_ = None,
    dst_mapping: Mapping_ = None,
    group: dist.ProcessGroup | None = None,
    options: TransferOptions | None = None,
    source_shapes: Any = None,
) -> TransferReport:
    """Copy the weights of ``src`` into ``dst`` through their checkpoint layout, each rank receiving exactly its
    shards' elements. Collective: every rank of the world calls it.

    Args:
        src: the source model (plain or DTensor tensors) on ranks holding a part of it, else None.
        dst: the destination model on ranks holding a part of it, else None.
        src_mapping, dst_mapping: each model's rules to and from the checkpoint layout: a
            :class:`~loader.options.Rules`, a list of rules (replacing the default ones, like
            ``weights_mapping=``), or None (transformers' conversion mapping for a ``PreTrainedModel``, none
            otherwise), as for ``save_hf_checkpoint`` and ``load_hf_checkpoint``.
        group: the process group of the exchanges, holding every rank of the world (default: the world; e.g. a
            gloo group for CPU tensors beside a default NCCL one).
        options: how the transfer moves weights (:class:`~loader.options.TransferOptions`: bucket size, timeout,
            rollback, progress); None: the defaults.
        source_shapes: the source's checkpoint keys with their shapes (or ``(shape, dtype)``), or a checkpoint
            (a path or a :class:`~loader.checkpoint.Checkpoint`): needed when ``src_mapping`` has a ``Convert``
            rule, whose keys cannot be derived from the model (as for ``save_hf_checkpoint``).

    Returns:
        This rank's :class:`TransferReport`.

    Raises:
        ValueError: on every rank, before anything is sent: shapes or dtypes that do not match, a key the
            destination needs that the source lacks, a source conversion that is not a bijection, ranks holding
            a tensor differently, a tensor on the meta device, destination tensors overlapping in memory (each
            other, or a source tensor read).
        PeerFailure: on every rank, a rank failed, died, hung or never called (past ``options.timeout``, naming it).
    """
    t0 = time.perf_counter()
    prepared = prepare_transfer(
        src, dst, src_mapping=src_mapping, dst_mapping=dst_mapping, group=group, options=options,
        source_shapes=source_shapes,
    )  # fmt: skip
    t1 = time.perf_counter()
    report = prepared.run(src, dst)
    run = report.run
    seconds, plan_seconds = time.perf_counter() - t0, t1 - t0 + run.plan_seconds
    run = dataclasses.replace(run, seconds=seconds, planned=True, plan_seconds=plan_seconds)
    return dataclasses.replace(report, run=run)
