"""SafetensorsReader: a ``torch.distributed.checkpoint`` StorageReader over Hugging Face safetensors files.

It validates every header at ``read_metadata`` (see :class:`~loader.checkpoint.SafetensorsCheckpoint`),
honours ``model.safetensors.index.json``, and reads byte ranges itself with ``os.pread``. With a planner that
offers ``planned_reads(load_plan)`` (:class:`~loader.planner.HFLoadPlanner`) it executes the planner's
RemapBlocks directly (any strided read), and counts the bytes it read; with any other planner it serves plain box
reads. How it reads is the reader's :class:`~loader.options.LoadOptions` (as torch DCP puts I/O settings on the
storage reader), where its bytes are its :class:`~loader.options.StorageOptions`.

Each file's identity (device, inode, size, mtime, ctime), recorded when its header was read, travels in the
metadata's ``storage_data`` (one :class:`~loader.checkpoint.FileIdentity` per file) to the reads, which check
it when the file is opened and after its last read: a file replaced or rewritten since is a ``CheckpointError``
naming it; the checkpoint's folder travels there too (a :class:`~loader.dcpload.CheckpointRoot`). With
``LoadOptions(rollback=True)`` a failed read restores every tensor it wrote.
"""

from __future__ import annotations

import datetime
import os
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
from .distributed import Session
from .distributed.collectives import group_rank_and_world
from .distributed.versions import open_agreed
from .execute import BlockExecutor, Rollback, execute_plan
from .load import opener, read_on_every_rank
from .options import LoadOptions, StorageOptions
from .plan import BlockRead
from .plan.slots import full_box, plain_slot
from .storage import RangeReader, is_url


def open_on_every_rank(
    path: str, storage: StorageOptions, timeout: float | datetime.timedelta | None, group: Any = None
) -> SafetensorsCheckpoint:
    """The checkpoint ``path``; at a URL under a process group of several ranks, at rank 0's version of every file
    on every rank (:func:`~loader.distributed.versions.open_agreed`), a failure on one rank raised on all.
    Collective there, over ``group`` (``read_metadata`` runs on every rank of ``dcp.load``)."""
    open_at = opener(path, storage)
    if not is_url(path) or not torch.distributed.is_initialized() or group_rank_and_world(group)[1] < 2:
        return open_at(None)
    with Session(timeout, group) as session, session.stage("planning"):  # a failure raised on every rank
        checkpoint = open_agreed(session, open_at, remote=True)
    return checkpoint


class SafetensorsReader(StorageReader):
    """Reads a Hugging Face safetensors checkpoint (a file, or a folder with shards and index.json).

    Args:
        path: the checkpoint file or folder, or its URL (``s3://``, ``https://``, ``hf://``; docs/remote.md).
        options: how it reads (:class:`~loader.options.LoadOptions`; with :class:`~loader.HFLoadPlanner` all of
            them, with another planner ``rollback`` and ``timeout``); None: the defaults.
        storage: where and how the checkpoint's bytes are reached (:class:`~loader.options.StorageOptions`);
            None: the defaults.
        group: in a distributed load, the process group of its agreements and exchanges (None: the default
            group).

    Attributes:
        options: the :class:`~loader.options.LoadOptions`. storage: the :class:`~loader.options.StorageOptions`.
        bytes_read: bytes this reader read from checkpoint files in the current ``dcp.load`` (this process).
        requests: read requests it made for them. bytes_exchanged: bytes it received from other ranks
            (exchanged reads). :meth:`~loader.HFLoadPlanner.finish` reports them.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        options: LoadOptions | None = None,
        storage: StorageOptions | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.options = options if options is not None else LoadOptions()
        self.storage = storage if storage is not None else StorageOptions()
        self.group = group
        self.checkpoint: Checkpoint | None = None
        self._metadata: Metadata | None = None
        self.bytes_read = self.requests = self.bytes_exchanged = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.checkpoint = self._metadata = None
        self.bytes_read = self.requests = self.bytes_exchanged = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        p = os.fspath(checkpoint_id)
        return is_url(p) or os.path.isdir(p) or p.endswith(".safetensors")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("SafetensorsReader needs a checkpoint path (or checkpoint_id)")
        self.checkpoint = open_on_every_rank(self.path, self.storage, self.options.timeout, self.group)
        self._metadata = checkpoint_metadata(self.checkpoint)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.bytes_read = self.requests = self.bytes_exchanged = 0  # counted per dcp.load, on every rank
        if metadata is not self._metadata and holds_headers(metadata):
            # headers read elsewhere: read what they say, checked against the identities they recorded
            self.checkpoint = checkpoint_from_metadata(metadata, self.storage)
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
                    self.bytes_exchanged += _read_planned(plan, planner, reader, self.options, self.group)
                else:
                    self._read_boxes(plan, planner, reader)
            finally:
                self.bytes_read += reader.bytes_read
                self.requests += reader.reads
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _file_reader(self) -> RangeReader:
        """The reader of one ``read_data``, told every file's identity (checked on open and after the last read)."""
        assert self.checkpoint is not None
        return self.checkpoint.reader(direct_io=self.storage.direct_io)

    def _read_boxes(self, plan: LoadPlan, planner: LoadPlanner, reader: RangeReader) -> None:
        rollback = Rollback(self.options.rollback)  # each target's values before it was written
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
                rollback.keep_tensors({str(i): target})
                target.copy_(staged)
                planner.commit_tensor(item, target)
        except BaseException:
            rollback.undo()
            raise


def _read_planned(dcp_plan: LoadPlan, planner: Any, reader: RangeReader, options: LoadOptions, group: Any) -> int:
    """Execute the RemapBlocks, value reads and deferred conversions ``dcp_plan``'s items stand for (any strided
    read), as ``planner.planned_reads`` lists them; with ``options.rollback``, a failure restores every tensor the
    plan writes (every rank's of ``group``, in a distributed load). Returns the bytes received from other ranks."""
    plan, reads, deferred, values = planner.planned_reads(dcp_plan)
    if group_rank_and_world(group)[1] > 1:  # shared targets read once and broadcast; failures raised on every rank
        with Session(options.timeout, group) as session, Rollback(options.rollback) as rollback:
            return read_on_every_rank(
                plan, reader, reads, deferred, options, values=values, session=session, rollback=rollback
            )
    execute_plan(plan, reader, options, reads=reads, deferred=deferred, values=values)
    return 0
