"""``load_hf_checkpoint``: load a Hugging Face safetensors checkpoint into a built model, in place."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .checkpoint import Checkpoint, open_checkpoint
from .distributed.collectives import group_rank_and_world
from .execute import execute_plan
from .load import load_distributed
from .materialize import MetaAllocation, on_meta
from .options import LoadOptions, Rules, StorageOptions
from .plan import describe
from .plan.gcpause import paused_gc
from .planner import HFLoadPlanner
from .report import LoadReport, load_report

log = logging.getLogger("loader")


@paused_gc()  # one pause over planning, reading and reporting: its collections walked the whole model (0.4-1.3 s at
# 200 000 tensors, as the counters fell where each phase's pause ended); reference counting frees as usual
def load_hf_checkpoint(
    model: torch.nn.Module,
    path: str | Checkpoint,
    *,
    rules: Rules | None = None,
    options: LoadOptions | None = None,
    storage: StorageOptions | None = None,
    planner: HFLoadPlanner | None = None,
    device: str | torch.device | None = None,
    group: Any = None,
) -> LoadReport:
    """Load a Hugging Face checkpoint into ``model`` in place, reading only the bytes its tensors need.

    Args:
        model: an already-built module (tensors materialised, possibly DTensors, or on the meta device with
            ``device``).
        path: a ``.safetensors`` file, a folder with ``model.safetensors`` or shards + index.json (without
            safetensors files: ``pytorch_model.bin`` or ``.bin`` shards + their index, ``torch.save``'s format), a
            Hugging Face repo id (``"org/name"``, resolved through the local hub cache), or the URL of a file or
            folder in an object store or on the Hub (``s3://``, ``https://``, ``hf://org/name``): each rank then
            fetches only its byte ranges (docs/remote.md); or a checkpoint of any format, opened
            (:class:`~loader.checkpoint.Checkpoint`; each rank its own).
        rules: which checkpoint keys become which tensors, and ``strict`` (:class:`~loader.options.Rules`);
            None: the default rules, strict.
        options: how the load runs and reads (:class:`~loader.options.LoadOptions`: rollback, progress, timeout,
            staging buffers, broadcasting, I/O threads, exchanged reads); None: the defaults.
        storage: where and how the checkpoint's bytes are reached (:class:`~loader.options.StorageOptions`: a
            repo id's revision, direct I/O, a URL's backend settings and requests); None: the defaults.
        planner: a (customised) :class:`HFLoadPlanner`, which carries the rules: passing it together with
            ``rules`` is a ``ValueError``.
        device: where to materialise the tensors of ``model`` still on the meta device (a DTensor allocates
            its local shard only), once the load is planned and validated; the tensors the checkpoint does not
            hold are initialised as the model would (a transformers model's ``initialize_weights``, else
            ``reset_parameters()`` of their module, else zeros) before anything is read. On any error the model is
            left on the meta device. None: a meta tensor is an error. The meta device itself is refused
            (``ValueError``).
        group: in a distributed run, the process group of the load (None: the default group).

    Returns:
        A :class:`LoadReport` for this rank.

    Raises:
        CheckpointError: a bad checkpoint file (names the file and tensor); nothing was written.
        ValueError: a mapping problem (shape mismatch, duplicate key, missing tensors with ``rules.strict``), or,
            with ``device`` and ``strict``, a meta tensor nothing loads or initialises (before anything is read);
            a ``planner`` with ``rules``.
        PeerFailure: in a distributed run, another rank hung past ``options.timeout``, died or left the process
            group (with ``options.rollback``, this rank's tensors are restored first).
    """
    started = time.perf_counter()
    options = options if options is not None else LoadOptions()
    storage = storage if storage is not None else StorageOptions()
    if planner is None:
        planner = HFLoadPlanner(model, rules=rules)
    elif rules is not None:
        raise ValueError(
            "load_hf_checkpoint: the planner carries the rules; pass rules= to HFLoadPlanner(...), not beside planner="
        )
    rank, world = group_rank_and_world(group)
    # a meta model is planned on meta and allocated (and initialised) only once its plan is valid; on any error
    # after that its meta tensors are put back
    allocate = None
    if device is not None and torch.device(device).type == "meta":
        raise ValueError(
            f"load_hf_checkpoint(device={device!r}): the meta device holds no data, so nothing could be loaded; "
            "device= is where the model's meta tensors are materialised ('cpu', 'cuda', a torch.device)"
        )
    if device is not None and on_meta(model):
        allocate = MetaAllocation(model, device, strict=planner.rules.strict, slot_for=planner.hooks.target_slot)
    try:
        if world > 1:
            return load_distributed(planner, path, options, storage=storage, allocate=allocate, group=group)
        checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path, storage=storage)
        plan = planner.build_plan(checkpoint, check_devices=allocate is None)
        plan = allocate(plan) if allocate is not None else plan
        log.info(describe(plan))
        with checkpoint.reader(direct_io=storage.direct_io) as reader:
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
