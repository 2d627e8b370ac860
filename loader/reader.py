"""SafetensorsReader: a ``torch.distributed.checkpoint`` StorageReader over Hugging Face safetensors files.

It validates every header at ``read_metadata`` (see :class:`~loader.checkpoint.SafetensorsCheckpoint`),
honours ``model.safetensors.index.json``, and reads byte ranges itself with ``os.pread``. With a planner that
offers ``planned_reads(load_plan)`` (:class:`~loader.planner.HFLoadPlanner`) it executes the planner's
RemapBlocks directly (any strided read); with any other planner it serves plain box reads. How it reads
(rollback, timeout, staging buffers, broadcasting) is the reader's :class:`~loader.options.LoadOptions`, as
torch DCP puts I/O settings on the storage reader.

Each file's identity (device, inode, size, mtime, ctime), recorded when its header was read, travels in the
metadata's ``storage_data`` (one :class:`~loader.checkpoint.FileIdentity` per file) to the reads, which check
it when the file is opened and after its last read: a file replaced or rewritten since is a ``CheckpointError``
naming it; the checkpoint's folder travels there too (a :class:`~loader.dcpload.CheckpointRoot`). With
``rollback=True`` a failed read restores every tensor it wrote.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import regiontrace as rt
from regiontrace.executor import contiguous_strides

from .checkpoint import Checkpoint, SafetensorsCheckpoint
from .dcpload import checkpoint_from_metadata, checkpoint_metadata, holds_headers
from .distributed import LoadSession
from .distributed.versions import open_agreed
from .execute import BlockExecutor, execute_plan, restore
from .load import opener, read_together
from .options import DEFAULT_TIMEOUT, STAGING_BYTES, LoadOptions
from .placements import rank_and_world
from .plan import BlockRead
from .plan.slots import full_box, plain_slot
from .storage import RangeReader, is_url


def open_on_every_rank(
    path: str, storage_options: Mapping[str, Any] | None, timeout: float | datetime.timedelta | None
) -> SafetensorsCheckpoint:
    """The checkpoint ``path``; at a URL under a process group of several ranks, at rank 0's version of every file
    on every rank (:func:`~loader.distributed.versions.open_agreed`), a failure on one rank raised on all.
    Collective there (``read_metadata`` runs on every rank of ``dcp.load``)."""
    open_at = opener(path, None, storage_options)
    if not is_url(path) or not torch.distributed.is_initialized() or rank_and_world()[1] < 2:
        return open_at(None)
    with LoadSession(timeout) as session:
        checkpoint, error = None, None
        try:
            checkpoint = open_agreed(session, open_at, remote=True)
        except Exception as e:  # agreed below: every rank raises, none waits for the others at the reads
            error = e
        session.agree(error, "planning")
    assert checkpoint is not None
    return checkpoint


class SafetensorsReader(StorageReader):
    """Reads a Hugging Face safetensors checkpoint (a file, or a folder with shards and index.json).

    Args:
        path: the checkpoint file or folder, or its URL (``s3://``, ``https://``, ``hf://``; docs/remote.md).
        rollback: when a read fails (a file truncated, replaced or rewritten since its header was read), restore
            every model tensor this ``read_data`` wrote before raising (at the cost of a copy of them), as
            ``load_hf_checkpoint(rollback=True)`` does; in a distributed load, when a read failed on any rank.
        timeout: in a distributed load, seconds (or a ``timedelta``) each rank waits for the others at the end of
            reading (with :class:`~loader.HFLoadPlanner`); a hung or dead rank then fails the load with
            :class:`~loader.errors.PeerFailure`. None: no limit.
        staging_bytes: bytes per staging buffer reads land in (two are used: double-buffered; pinned for GPU
            targets).
        broadcast_replicated_tensors: in a distributed load (with :class:`~loader.HFLoadPlanner`), read boxes
            several ranks need once and broadcast them.
        storage_options: options for a URL's backend (endpoint, credentials, timeouts); only for URLs.
        io_threads: threads reading independent blocks at once (with :class:`~loader.HFLoadPlanner`), sharing the
            staging budget; None: from the CPUs this process may use, shared with the ranks on this host.
        direct_io: read local files with ``O_DIRECT`` (bypassing the page cache); buffered where refused.
        exchange_reads: in a distributed load (with :class:`~loader.HFLoadPlanner`), fetch bytes ranks want
            interleaved once and exchange them over the process group; None: for a URL only.

    Attributes:
        options: the :class:`~loader.options.LoadOptions` built from these arguments.
        bytes_read: bytes this reader read from checkpoint files (this process).

    Raises:
        ValueError: a timeout that is not positive, ``staging_bytes`` below 1, ``io_threads`` below 1,
            ``direct_io`` not a bool.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        rollback: bool = False,
        timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT,
        staging_bytes: int = STAGING_BYTES,
        broadcast_replicated_tensors: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        io_threads: int | None = None,
        direct_io: bool = False,
        exchange_reads: bool | None = None,
    ) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.storage_options = dict(storage_options or {})
        self.options = LoadOptions(
            rollback=rollback,
            timeout=timeout,
            staging_bytes=staging_bytes,
            broadcast_replicated_tensors=broadcast_replicated_tensors,
            io_threads=io_threads,
            direct_io=direct_io,
            exchange_reads=exchange_reads,
        )
        self.checkpoint: Checkpoint | None = None
        self._metadata: Metadata | None = None
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.checkpoint = self._metadata = None
        self.bytes_read = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        p = os.fspath(checkpoint_id)
        return is_url(p) or os.path.isdir(p) or p.endswith(".safetensors")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("SafetensorsReader needs a checkpoint path (or checkpoint_id)")
        self.checkpoint = open_on_every_rank(self.path, self.storage_options or None, self.options.timeout)
        self._metadata = checkpoint_metadata(self.checkpoint)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata is not self._metadata and holds_headers(metadata):
            # headers read elsewhere: read what they say, checked against the identities they recorded
            self.checkpoint = checkpoint_from_metadata(metadata, self.storage_options or None)
        elif self.checkpoint is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.checkpoint is not None
        with self._file_reader() as reader:
            try:
                if callable(getattr(planner, "planned_reads", None)):  # HFLoadPlanner: run its RemapBlocks
                    _read_planned(plan, planner, reader, self.options)
                else:
                    self._read_boxes(plan, planner, reader)
            finally:
                self.bytes_read += reader.bytes_read
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _file_reader(self) -> RangeReader:
        """The reader of one ``read_data``, told every file's identity (checked on open and after the last read)."""
        assert self.checkpoint is not None
        return self.checkpoint.reader(direct_io=self.options.direct_io)

    def _read_boxes(self, plan: LoadPlan, planner: LoadPlanner, reader: RangeReader) -> None:
        saved: dict[str, torch.Tensor] = {}  # rollback: each target's values before it was written
        targets: dict[str, Any] = {}
        try:
            for i, item in enumerate(plan.items):
                info = self.checkpoint[item.storage_index.fqn]
                strides = contiguous_strides(info.shape)
                offset = sum(o * s for o, s in zip(item.storage_offsets, strides))
                lengths = tuple(item.lengths)
                block = rt.RemapBlock(
                    info.key,
                    lengths,
                    offset,
                    strides,
                    (0,) * len(lengths),
                    tuple(range(len(lengths))),
                    (1,) * len(lengths),
                    tuple(info.shape),
                    info.dtype,
                )
                staged = torch.empty(lengths, dtype=info.dtype)
                read = BlockRead("", full_box(lengths), block)
                BlockExecutor(self.checkpoint, {"": plain_slot("", staged)}, reader).run([read])
                target = planner.resolve_tensor(item).detach()
                if self.options.rollback:
                    saved[str(i)], targets[str(i)] = target.clone(), plain_slot(str(i), target)
                target.copy_(staged)
                planner.commit_tensor(item, target)
        except BaseException:
            restore(saved, targets)
            raise


def _read_planned(dcp_plan: LoadPlan, planner: Any, reader: RangeReader, options: LoadOptions) -> None:
    """Execute the RemapBlocks, value reads and deferred conversions ``dcp_plan``'s items stand for (any strided
    read), as ``planner.planned_reads`` lists them; with ``options.rollback``, a failure restores every tensor the
    plan writes (every rank's, in a distributed load)."""
    plan, reads, deferred, values = planner.planned_reads(dcp_plan)
    before, calls, exchanged = reader.bytes_read, reader.reads, 0
    if rank_and_world()[1] > 1:  # shared targets read once and broadcast; failures raised on every rank
        exchanged = read_together(plan, reader, reads, deferred, options, values=values)
    else:
        execute_plan(plan, reader, options, reads=reads, deferred=deferred, values=values)
    planner.add_bytes_read(reader.bytes_read - before, reader.reads - calls, exchanged)
