"""The settings of a load or a save as two values, built once at the API boundary and passed down whole.

Vocabulary:
    rules: the three rule arguments of a load or a save (:class:`Rules`): which checkpoint keys become which
        model tensors, and through which conversions. A planning setting: :class:`~loader.HFLoadPlanner`
        carries them.
    options: how a load runs and reads (:class:`LoadOptions`): rollback, progress bar, timeout, staging buffer,
        broadcasting, I/O threads, direct I/O. An I/O setting, as torch DCP puts them on the storage reader:
        ``load_hf_checkpoint`` builds one from its keyword arguments, :class:`~loader.SafetensorsReader` holds
        one inside ``dcp.load``. A save's are a :class:`SaveOptions`.

This module imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT",
    "STAGING_BYTES",
    "LoadOptions",
    "Rules",
    "SaveOptions",
    "check_io_threads",
    "timeout_seconds",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits at an agreement point for the others (``load_hf_checkpoint(timeout=...)``)."""

STAGING_BYTES = 64 << 20
"""Bytes per host staging buffer reads land in (two are held: double-buffered)."""


def timeout_seconds(timeout: float | datetime.timedelta | None) -> float | None:
    """``timeout`` in seconds (None: no limit).

    Raises:
        ValueError: a timeout that is not positive.
    """
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be positive (or None for no limit), got {timeout!r}")
    return seconds


def check_io_threads(io_threads: int | None) -> None:
    """Refuse an ``io_threads`` that is neither None (automatic) nor an int of at least 1.

    Raises:
        ValueError: any other value (``0``, ``-1``, ``2.0``, ``True``).
    """
    if io_threads is None:
        return
    if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
        raise ValueError(f"io_threads must be an int of at least 1 (or None: from the free CPUs), got {io_threads!r}")


@dataclass(frozen=True)
class Rules:
    """The rules of a load or a save, as one value.

    Attributes:
        weights_mapping: rules replacing the default ones (transformers' conversion mapping for a
            ``PreTrainedModel``, none otherwise): ``WeightRenaming``/``WeightConverter``, ``Rename``/``Convert``.
            None: the default.
        extra_weights_mapping: rules tried before all others.
        key_mapping: ``{regex: replacement}`` renames, like ``from_pretrained(key_mapping=...)``.
    """

    weights_mapping: Sequence[Any] | None = None
    extra_weights_mapping: tuple[Any, ...] = field(default=())
    key_mapping: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_weights_mapping", tuple(self.extra_weights_mapping))

    @property
    def given(self) -> bool:
        """Whether any rule is given (not left at its default)."""
        return self.weights_mapping is not None or bool(self.extra_weights_mapping) or bool(self.key_mapping)

    def as_kwargs(self) -> dict[str, Any]:
        """The three keyword arguments (``weights_mapping=``, ``extra_weights_mapping=``, ``key_mapping=``)."""
        return {
            "weights_mapping": self.weights_mapping,
            "extra_weights_mapping": self.extra_weights_mapping,
            "key_mapping": self.key_mapping,
        }


@dataclass(frozen=True)
class LoadOptions:
    """How a load runs and reads, as one value (validated once, here).

    Attributes:
        rollback: keep a copy of every tensor written and restore it if a read fails (on any rank).
        progress: tqdm progress bar; None: on when stderr is a terminal.
        timeout: in a distributed run, seconds (or a ``timedelta``) each rank waits for the others at each
            agreement point; None: no limit.
        staging_bytes: bytes per host staging buffer reads land in (two are held: double-buffered; pinned when a
            target is on a GPU).
        broadcast_replicated_tensors: in a distributed run, read each box several ranks hold identically on
            one of them, and broadcast it.
        io_threads: threads reading (and copying) independent blocks at once; the staging budget (two buffers
            of ``staging_bytes``) is split among them. None: from the CPUs this process may use, shared with the
            other ranks on this host (1 when ranks already fill the cores), and 1 for a checkpoint whose first
            blocks are not in the page cache (a cold load: one stream of reads measured faster on disk here).
        direct_io: read local files with ``O_DIRECT`` (bypassing the page cache: for checkpoints read once, or
            larger than the cache), through aligned buffers; where a filesystem refuses it (tmpfs), a log line
            and buffered reads.
        exchange_reads: in a distributed run, bytes several ranks want interleaved (column shards: a run of every
            row each) are fetched once, each rank a contiguous chunk, and exchanged over the process group
            (:mod:`loader.distributed.exchange_reads`). None: for a checkpoint at a URL (where a request per run
            is what it would cost), not for local files (where the page cache serves runs cheaply).

    Raises:
        ValueError: a timeout that is not positive, ``staging_bytes`` below 1, ``io_threads`` below 1 (or not an
            int), ``direct_io`` not a bool.
    """

    rollback: bool = False
    progress: bool | None = None
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT
    staging_bytes: int = STAGING_BYTES
    broadcast_replicated_tensors: bool = False
    io_threads: int | None = None
    direct_io: bool = False
    exchange_reads: bool | None = None

    def __post_init__(self) -> None:
        timeout_seconds(self.timeout)
        if self.exchange_reads is not None and not isinstance(self.exchange_reads, bool):
            raise ValueError(f"exchange_reads must be True, False or None, got {self.exchange_reads!r}")
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be at least 1, got {self.staging_bytes}")
        check_io_threads(self.io_threads)
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"direct_io must be True or False, got {self.direct_io!r}")


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs and writes, as one value (see :func:`loader.save_hf_checkpoint`).

    Attributes:
        max_shard_size: most bytes per file: a positive int, or a number and a unit (``"5GB"``); checked when
            the save is planned (in a distributed save: on every rank, together).
        metadata: safetensors ``__metadata__`` of every file.
        progress: tqdm progress bar; None: on when stderr is a terminal.
        timeout: seconds (or a ``timedelta``) each rank waits for the others at each agreement point, and the
            most the commit waits for another save's commit into the same path; None: no limit.

    Raises:
        ValueError: a timeout that is not positive.
    """

    max_shard_size: int | str = "5GB"
    metadata: Mapping[str, str] | None = None
    progress: bool | None = None
    timeout: float | datetime.timedelta | None = None

    def __post_init__(self) -> None:
        timeout_seconds(self.timeout)
