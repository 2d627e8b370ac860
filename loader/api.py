"""``load_hf_checkpoint``: load a Hugging Face safetensors checkpoint into a built model, in place."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .checkpoint import SafetensorsCheckpoint
from .execute import execute_plan
from .load import load_distributed
from .materialize import MetaAllocation, on_meta
from .options import DEFAULT_TIMEOUT, STAGING_BYTES, LoadOptions, Rules
from .placements import rank_and_world
from .plan import describe
from .plan.gcpause import paused_gc
from .planner import HFLoadPlanner
from .report import LoadReport, load_report

log = logging.getLogger("loader")


@paused_gc()  # one pause over planning, reading and reporting: its collections walked the whole model (0.4-1.3 s at
# 200 000 tensors, as the counters fell where each phase's pause ended); reference counting frees as usual
def load_hf_checkpoint(
    model: torch.nn.Module,
    path: str,
    *,
    weights_mapping: Sequence[Any] | None = None,
    extra_weights_mapping: Sequence[Any] = (),
    key_mapping: Mapping[str, str] | None = None,
    strict: bool | None = None,
    planner: HFLoadPlanner | None = None,
    progress: bool | None = None,
    rollback: bool = False,
    broadcast_replicated_tensors: bool = False,
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT,
    revision: str | None = None,
    device: str | torch.device | None = None,
    staging_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    io_threads: int | None = None,
    direct_io: bool = False,
    exchange_reads: bool | None = None,
) -> LoadReport:
    """Load a Hugging Face checkpoint into ``model`` in place, reading only the bytes its tensors need.

    The keyword arguments build two values passed down whole: the planner's :class:`~loader.options.Rules`
    (with ``strict``, planning settings: :class:`HFLoadPlanner` holds them) and a
    :class:`~loader.options.LoadOptions` (how the load runs and reads).

    Args:
        model: an already-built module (tensors materialised, possibly DTensors).
        path: a ``.safetensors`` file, a folder with ``model.safetensors`` or shards + index.json, a
            Hugging Face repo id (``"org/name"``, resolved through the local hub cache), or the URL of a file or
            folder in an object store or on the Hub (``s3://``, ``https://``, ``hf://org/name``): each rank then
            fetches only its byte ranges (docs/remote.md).
        weights_mapping: rules replacing the default ones (transformers' conversion mapping for a
            ``PreTrainedModel``, none otherwise): ``WeightRenaming``/``WeightConverter``, ``Rename``/``Convert``.
        extra_weights_mapping: rules tried before all others.
        key_mapping: ``{regex: replacement}`` renames, like ``from_pretrained(key_mapping=...)``.
        strict: raise, before anything is read, when a model tensor is loaded by nothing; None: True (or the
            ``planner``'s own).
        planner: a (customised) :class:`HFLoadPlanner`, which carries the rules and ``strict``: passing it
            together with a rule argument or ``strict`` is a ``ValueError``.
        progress: tqdm progress bar; default on when stderr is a terminal.
        rollback: keep a copy of every tensor written and restore it if a read fails mid-load.
        broadcast_replicated_tensors: in a distributed run, read each replicated box once and broadcast.
        timeout: in a distributed run, seconds (or a ``timedelta``) each rank waits for the others at the end
            of planning and at the end of reading; a rank that has not arrived by then (or has died) fails
            the load on every rank with :class:`~loader.errors.PeerFailure`. None: no limit.
        revision: the revision (branch, tag or commit) of a repo id ``path``; None: the default branch.
        device: where to materialise the tensors of ``model`` still on the meta device (a DTensor allocates
            its local shard only), once the load is planned and validated; the tensors the checkpoint does not
            hold are initialised as the model would (a transformers model's ``initialize_weights``, else
            ``reset_parameters()`` of their module, else zeros) before anything is read. On any error the model is
            left on the meta device. None: a meta tensor is an error. The meta device itself is refused
            (``ValueError``).
        staging_bytes: bytes per host staging buffer reads land in (two are held: double-buffered; pinned when
            a target is on a GPU). None: 64 MiB (``loader.options.STAGING_BYTES``).
        storage_options: options for a URL's backend (endpoint, credentials, timeouts, concurrency: see
            docs/remote.md); only for URLs.
        io_threads: threads reading (and copying) independent blocks at once, sharing the staging budget.
            None: from the CPUs this process may use, shared with the other ranks on this host (1 when ranks
            already fill the cores, or when the checkpoint is not in the page cache: a cold load reads in one stream).
        direct_io: read local files with ``O_DIRECT``, bypassing the page cache (a cold load of a checkpoint
            read once); where the filesystem refuses it, a log line and buffered reads.
        exchange_reads: in a distributed run, fetch the bytes ranks want interleaved (column shards) once, each
            rank a contiguous chunk, and exchange them over the process group. None: for a URL (a request per row
            is what each rank would pay otherwise), not for local files.

    Returns:
        A :class:`LoadReport` for this rank.

    Raises:
        CheckpointError: a bad checkpoint file (names the file and tensor); nothing was written.
        ValueError: a mapping problem (shape mismatch, duplicate key, missing tensors with ``strict``), or, with
            ``device`` and ``strict``, a meta tensor nothing loads or initialises (before anything is read); a
            ``planner`` with rule arguments or ``strict``; a timeout that is not positive, ``staging_bytes`` below 1,
            ``io_threads`` below 1, ``direct_io`` not a bool, ``exchange_reads`` not a bool or None.
        PeerFailure: in a distributed run, another rank hung past ``timeout``, died or left the process group
            (with ``rollback``, this rank's tensors are restored first).
    """
    started = time.perf_counter()
    options = LoadOptions(
        rollback=rollback,
        progress=progress,
        timeout=timeout,
        staging_bytes=STAGING_BYTES if staging_bytes is None else staging_bytes,
        broadcast_replicated_tensors=broadcast_replicated_tensors,
        io_threads=io_threads,
        direct_io=direct_io,
        exchange_reads=exchange_reads,
    )  # a bad timeout is refused in one process too
    rules = Rules(weights_mapping, tuple(extra_weights_mapping), key_mapping)
    if planner is None:
        planner = HFLoadPlanner(model, rules=rules, strict=True if strict is None else strict)
    elif rules.given or strict is not None:
        raise ValueError(
            "load_hf_checkpoint: the planner carries the rules and strict; pass weights_mapping, "
            "extra_weights_mapping, key_mapping and strict to HFLoadPlanner(...), not beside planner="
        )
    rank, world = rank_and_world()
    # a meta model is planned on meta and allocated (and initialised) only once its plan is valid; on any error
    # after that its meta tensors are put back
    allocate = None
    if device is not None and torch.device(device).type == "meta":
        raise ValueError(
            f"load_hf_checkpoint(device={device!r}): the meta device holds no data, so nothing could be loaded; "
            "device= is where the model's meta tensors are materialised ('cpu', 'cuda', a torch.device)"
        )
    if device is not None and on_meta(model):
        allocate = MetaAllocation(model, device, strict=planner.strict, slot_for=planner.hooks.target_slot)
    try:
        if world > 1:
            return load_distributed(
                planner, path, options, revision=revision, allocate=allocate, storage_options=storage_options
            )
        checkpoint = SafetensorsCheckpoint.open(path, revision=revision, storage_options=storage_options)
        plan = planner.build_plan(checkpoint, check_devices=allocate is None)
        plan = allocate(plan) if allocate is not None else plan
        log.info(describe(plan))
        with checkpoint.reader(direct_io=options.direct_io) as reader:
            execute_plan(plan, reader, options)
            bytes_read, requests = reader.bytes_read, reader.reads
    except BaseException:
        if allocate is not None:
            allocate.undo()
        raise
    plan.keyplan.record_on_model(model)
    report = load_report(plan, bytes_read, rank, world, seconds=time.perf_counter() - started, requests=requests)
    log.info("loaded %d tensors, read %d bytes", len(report.loaded_keys), bytes_read)
    return report
