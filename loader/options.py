"""The settings of a load, a save or a transfer as values, built once by the caller and passed down whole.

Vocabulary:
    rules: which checkpoint keys become which model tensors, through which conversions, and whether every model
        tensor must be loaded (:class:`Rules`). A planning setting: :class:`~loader.HFLoadPlanner` carries them.
    options: how a load runs and reads (:class:`LoadOptions`), how a save writes (:class:`SaveOptions`), how a
        transfer moves weights (:class:`TransferOptions`); each option is documented once, in its value's
        docstring.
    storage options: where and how a checkpoint's bytes are reached (:class:`StorageOptions`): the revision of a
        repo id, direct I/O of local files, a URL's backend settings and how its requests run
        (:class:`RemoteOptions`) and are planned (:class:`RequestCosts`).

This module imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT",
    "EXCHANGE_ROUND_BYTES",
    "MAX_SECONDS",
    "STAGING_BYTES",
    "LoadOptions",
    "RemoteOptions",
    "RequestCosts",
    "Rules",
    "SaveOptions",
    "StorageOptions",
    "TransferOptions",
    "check_io_threads",
    "timeout_seconds",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits at an agreement point for the others (:attr:`LoadOptions.timeout`)."""

STAGING_BYTES = 64 << 20
"""Bytes per host staging buffer reads land in (two are held: double-buffered)."""

EXCHANGE_ROUND_BYTES = 1 << 30
"""Most bytes a rank holds for one round of exchanged reads (:attr:`LoadOptions.exchange_round_bytes`)."""

BUCKET_BYTES = 64 << 20
"""Most payload bytes one rank sends, and receives, per round of a transfer (:attr:`TransferOptions.bucket_bytes`)."""

#: the most seconds a seconds-valued remote option may be (about 11 days; ``inf`` overflows the clocks' timeouts)
MAX_SECONDS = 1e6


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
    """The rules of a load, a save or a transfer, as one value.

    Attributes:
        weights_mapping: rules replacing the default ones (transformers' conversion mapping for a
            ``PreTrainedModel``, none otherwise): ``WeightRenaming``/``WeightConverter``, ``Rename``/``Convert``.
            None: the default.
        extra_weights_mapping: rules tried before all others.
        key_mapping: ``{regex: replacement}`` renames, like ``from_pretrained(key_mapping=...)``.
        strict: a load raises, before anything is read, when a model tensor is loaded by nothing (with a model on
            the meta device: also when nothing initialises it). A save and a transfer write every tensor anyway.
    """

    weights_mapping: Sequence[Any] | None = None
    extra_weights_mapping: tuple[Any, ...] = field(default=())
    key_mapping: Mapping[str, str] | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_weights_mapping", tuple(self.extra_weights_mapping))

    @property
    def given(self) -> bool:
        """Whether any rule is given (not left at its default; ``strict`` is no rule)."""
        return self.weights_mapping is not None or bool(self.extra_weights_mapping) or bool(self.key_mapping)


@dataclass(frozen=True)
class LoadOptions:
    """How a load runs and reads, as one value (validated once, here): ``load_hf_checkpoint(options=...)``, and
    inside ``dcp.load`` ``SafetensorsReader(options=...)`` (torch DCP puts I/O settings on the storage reader).

    Attributes:
        rollback: keep a copy of every tensor written and restore it if a read fails (on any rank).
        progress: tqdm progress bar; None: on when stderr is a terminal.
        timeout: in a distributed run, seconds (or a ``timedelta``) each rank waits for the others at each
            agreement point (the end of planning, the end of reading); a rank that has not arrived by then (or has
            died) fails the load on every rank with :class:`~loader.errors.PeerFailure`. None: no limit.
        staging_bytes: bytes per host staging buffer reads land in (two are held: double-buffered; pinned when a
            target is on a GPU).
        broadcast_replicated_tensors: in a distributed run, read each box several ranks hold identically on
            one of them, and broadcast it.
        io_threads: threads reading (and copying) independent blocks at once; the staging budget (two buffers
            of ``staging_bytes``) is split among them. None: from the CPUs this process may use, shared with the
            other ranks on this host (1 when ranks already fill the cores), and 1 for a checkpoint whose first
            blocks are not in the page cache (a cold load: one stream of reads measured faster on disk here).
        exchange_reads: in a distributed run, bytes several ranks want interleaved (column shards: a run of every
            row each) are fetched once, each rank a contiguous share, and exchanged over the process group.
            None: for a checkpoint at a URL (where a request per run is what it would cost), not for local files
            (where the page cache serves runs cheaply).
        exchange_round_bytes: the most bytes a rank holds for one round of exchanged reads (what it fetched and
            what it received), unless one tensor alone holds more (default :data:`EXCHANGE_ROUND_BYTES`, 1 GiB).

    Raises:
        ValueError: a timeout that is not positive, ``staging_bytes`` or ``exchange_round_bytes`` below 1,
            ``io_threads`` below 1 (or not an int), ``exchange_reads`` not a bool or None.
    """

    rollback: bool = False
    progress: bool | None = None
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT
    staging_bytes: int = STAGING_BYTES
    broadcast_replicated_tensors: bool = False
    io_threads: int | None = None
    exchange_reads: bool | None = None
    exchange_round_bytes: int = EXCHANGE_ROUND_BYTES

    def __post_init__(self) -> None:
        timeout_seconds(self.timeout)
        if self.exchange_reads is not None and not isinstance(self.exchange_reads, bool):
            raise ValueError(f"exchange_reads must be True, False or None, got {self.exchange_reads!r}")
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be at least 1, got {self.staging_bytes}")
        if self.exchange_round_bytes < 1:
            raise ValueError(f"exchange_round_bytes must be at least 1, got {self.exchange_round_bytes}")
        check_io_threads(self.io_threads)


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs and writes, as one value (``save_hf_checkpoint(options=...)``).

    Attributes:
        max_shard_size: most bytes per file, as ``save_pretrained`` splits: a positive int, or a number and a unit
            (``"5GB"``, ``"1.5MB"``; ``"10GiB"``: KiB, MiB, GiB, TiB are powers of 1024); checked when the save
            is planned (in a distributed save: on every rank, together).
        metadata: safetensors ``__metadata__`` of every file (``{"format": "pt"}`` is added).
        progress: tqdm progress bar; None: on when stderr is a terminal.
        timeout: in a distributed run, seconds (or a ``timedelta``) each rank waits for the others at each
            agreement point (end of preparing, of writing, of finishing); in any run, also the most the commit
            waits for another save's commit into the same path (saves into one path commit one at a time).
            None: no limit (a rank that dies is still detected by its heartbeat).

    Raises:
        ValueError: a timeout that is not positive.
    """

    max_shard_size: int | str = "5GB"
    metadata: Mapping[str, str] | None = None
    progress: bool | None = None
    timeout: float | datetime.timedelta | None = None

    def __post_init__(self) -> None:
        timeout_seconds(self.timeout)


@dataclass(frozen=True)
class TransferOptions:
    """How a transfer moves weights, as one value (``transfer_weights(options=...)``).

    Attributes:
        bucket_bytes: the most payload one rank sends, and receives, per round.
        timeout: seconds (or a ``timedelta``) to wait for the other ranks at each step: every agreement point of
            the planning and each round's collective; it, not the process group's timeout, bounds every wait.
            None: no limit.
        rollback: on failure, put back every destination tensor this rank had written.
        progress: True logs each round on the ``loader`` logger; a callable gets ``(done, total)`` rounds.

    Raises:
        ValueError: ``bucket_bytes`` below 1, a timeout that is not positive.
    """

    bucket_bytes: int = BUCKET_BYTES
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT
    rollback: bool = False
    progress: Any = None

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        timeout_seconds(self.timeout)


def _check_numbers(value: object, nonnegative: tuple[str, ...], seconds: tuple[str, ...]) -> None:
    """Refuse a field of the remote value ``value`` of the wrong type or out of range."""
    for f in fields(value):  # type: ignore[arg-type]
        v = getattr(value, f.name)
        if f.type not in ("int", "float"):
            continue
        kind = float if f.type == "float" else int
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise ValueError(f"{type(value).__name__}.{f.name} must be a {kind.__name__}, got {v!r}")
        if v <= 0 and f.name not in nonnegative:
            raise ValueError(f"{type(value).__name__}.{f.name} must be positive, got {v!r}")
        if v < 0:
            raise ValueError(f"{type(value).__name__}.{f.name} must not be negative, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{type(value).__name__}.{f.name} must be a finite number, got {v!r}")
        if f.name in seconds and v > MAX_SECONDS:
            raise ValueError(f"{type(value).__name__}.{f.name} is seconds, at most {MAX_SECONDS:g}; got {v!r}")


@dataclass(frozen=True)
class RequestCosts:
    """Which requests a remote read makes: the cost model that plans them (:mod:`loader.storage.remote`).

    Attributes:
        latency: seconds a request costs beyond its bytes (a gap is read through when reading it costs less than
            another request: ``gap < latency * bandwidth``).
        bandwidth: bytes per second of one connection (the cost model's other half).
        max_request_bytes: a range larger than this is split into several requests (fetched in parallel).
        max_ranges: ranges one multi-range request may carry (where the backend supports them; 1: never).
        max_overread: gap bytes read through for fewer requests, at most, as a fraction of the bytes wanted: 0.05
            keeps a column shard's bytes within 1.05x, at one request per row on a store without multi-range
            requests (S3); raise it where requests cost more than bytes (a fast link to a distant store).

    Raises:
        ValueError: a field of the wrong type, not finite, or out of range.
    """

    latency: float = 0.002
    bandwidth: float = 250e6
    max_request_bytes: int = 64 << 20
    max_ranges: int = 64
    max_overread: float = 0.05

    def __post_init__(self) -> None:
        _check_numbers(self, ("latency", "max_overread"), ("latency",))

    @property
    def gap_bytes(self) -> int:
        """The largest gap worth reading through rather than paying another request for."""
        return int(self.latency * self.bandwidth)


@dataclass(frozen=True)
class RemoteOptions:
    """How a remote read's requests run (a checkpoint at a URL).

    Attributes:
        requests_in_flight: requests in flight at once, per reader.
        request_timeout: seconds a request may wait for the server (connect, and between bytes); a server that
            hangs fails the request after this (then retried, then a :class:`~loader.errors.CheckpointError`).
        min_rate: bytes per second a request's body must arrive at, on average: an HTTP(S) or ``hf://`` request
            lasts ``request_timeout + bytes / min_rate`` seconds at most (a server that trickles fails it).
        retries: attempts after the first for a failure a retry may cure, with exponential backoff.
        backoff: seconds before the first retry (doubled each time).
        fetch_ahead_bytes: bytes fetched ahead of the reads at most (bounds the reader's memory).
        costs: which requests are made (:class:`RequestCosts`).

    Raises:
        ValueError: a field of the wrong type, not finite, or out of range (seconds over :data:`MAX_SECONDS`).
    """

    requests_in_flight: int = 8
    request_timeout: float = 30.0
    min_rate: float = 32e3
    retries: int = 4
    backoff: float = 0.2
    fetch_ahead_bytes: int = 512 << 20
    costs: RequestCosts = field(default_factory=RequestCosts)

    def __post_init__(self) -> None:
        _check_numbers(self, ("retries", "backoff"), ("request_timeout", "backoff"))


@dataclass(frozen=True)
class StorageOptions:
    """Where and how a checkpoint's bytes are reached, as one value (``storage=`` of ``load_hf_checkpoint``,
    ``SafetensorsReader`` and ``SafetensorsCheckpoint.open``).

    Attributes:
        revision: the revision (branch, tag or commit) of a Hugging Face repo id or ``hf://`` URL; None: the
            default branch. Only for those.
        direct_io: read local files with ``O_DIRECT`` (bypassing the page cache: for checkpoints read once, or
            larger than the cache), through aligned buffers; where a filesystem refuses it (tmpfs), a log line
            and buffered reads.
        backend: a URL's backend settings, by the backend's own names (docs/remote.md): the endpoint and
            credentials (s3fs' ``endpoint_url``, ``key``, ``secret``...), HTTP ``headers``, ``verify``... Only for
            URLs.
        remote: how a URL's requests run and are planned (:class:`RemoteOptions`). Only for URLs.

    Raises:
        ValueError: ``direct_io`` not a bool, ``backend`` not a mapping.
    """

    revision: str | None = None
    direct_io: bool = False
    backend: Mapping[str, object] = field(default_factory=dict)
    remote: RemoteOptions = field(default_factory=RemoteOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"direct_io must be True or False, got {self.direct_io!r}")
        if not isinstance(self.backend, Mapping):
            raise ValueError(f"backend must be a mapping of the backend's settings, got {self.backend!r}")
        if not isinstance(self.remote, RemoteOptions):
            raise ValueError(f"remote must be a RemoteOptions, got {self.remote!r}")

    @property
    def for_urls_only(self) -> bool:
        """Whether anything only a URL (or a repo id) can use is set (refused for a local path)."""
        return bool(self.backend) or self.remote != RemoteOptions()
