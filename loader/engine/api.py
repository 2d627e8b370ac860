"""``load_engine_weights``: a safetensors checkpoint into a module through the module's own ``load_weights``.

The flow: open the checkpoint (headers only) → trace ``load_weights`` key by key into parameter stand-ins
(:mod:`~loader.engine.trace`) → check every parameter's coverage certificate and each key's shape
(:mod:`~loader.engine.check`) → plan the region reads of exactly the elements each parameter holds
(:mod:`~loader.engine.plan`) → execute them and the constant fills (locally, at a URL, in a process group) →
load the keys that did not trace for real (:mod:`~loader.engine.fallback`). Nothing is read before every check
passed; in a process group the outcome of planning is agreed by every rank first, as in
:func:`loader.load_hf_checkpoint`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from ..checkpoint import open_checkpoint
from ..distributed import Session
from ..distributed.versions import open_agreed
from ..execute import Rollback, execute_plan
from ..load import opener, read_on_every_rank
from ..options import LoadOptions, StorageOptions
from ..placements import rank_and_world
from ..plan.slots import storage_of
from ..report import LoadReport, load_report, natural_sorted
from ..storage import is_url
from .check import certificates, check_coverage, check_shapes, check_union, key_spans
from .fallback import log_fallbacks, run_fallbacks
from .plan import EnginePlan, engine_plan
from .trace import EngineTrace, trace_load_weights

__all__ = ["load_engine_weights", "plan_engine_load"]

log = logging.getLogger("loader")


def load_engine_weights(
    module: torch.nn.Module,
    path: str,
    *,
    options: LoadOptions | None = None,
    storage: StorageOptions | None = None,
    group: Any = None,
    tp_size: int | None = None,
) -> LoadReport:
    """Load a checkpoint (safetensors, ``.bin``, DCP) into ``module`` through its own ``load_weights`` (vLLM's
    calling convention: an iterable of ``(checkpoint key, tensor)`` pairs), reading only the bytes of the elements
    its parameters take.

    Args:
        module: a built module whose ``load_weights(weights)`` writes each parameter in place (its
            ``weight_loader``s narrowing this rank's slot out of each checkpoint tensor).
        path: a ``.safetensors`` file, a folder (``model.safetensors`` or shards + index.json), or a URL the
            loader opens (``s3://``, ``https://``, ``hf://``).
        options: how the load runs and reads (:class:`~loader.options.LoadOptions`);
            ``broadcast_replicated_tensors`` is not used (two ranks' parameters of one name hold different slots).
        storage: where and how the checkpoint's bytes are reached (:class:`~loader.options.StorageOptions`).
        group: in a distributed run, the process group of the load (None: the default group, when
            ``torch.distributed`` is initialized).
        tp_size: the tensor-parallel size the module was built for (its loaders narrow each key into
            ``tp_size`` shares): the shape check's (:mod:`loader.engine.check`). None: the group's world size.

    Returns:
        This rank's :class:`~loader.LoadReport`: ``loaded_keys`` the parameters loaded, ``traced`` those read
        by region reads, ``deferred`` those a key that did not trace wrote, ``deferred_reasons`` per such key the
        op that stopped it, ``certificates`` each parameter's coverage certificate.

    Raises:
        ValueError: a parameter with elements unwritten or written twice, or a checkpoint tensor whose shape does
            not fit what the module's loader reads of it (naming the parameter, the box, the keys), before any
            byte is read; on every rank in a process group.
        CheckpointError: a bad checkpoint file (names the file and tensor).
        PeerFailure: in a distributed run, another rank hung past ``options.timeout``, died or left the group.

    Keys that fall back are loaded after the region reads; a parameter they leave incomplete is refused then
    (after writing: with ``options.rollback`` the module's tensors are restored).
    """
    started = time.perf_counter()
    options = replace(options if options is not None else LoadOptions(), broadcast_replicated_tensors=False)
    storage = storage if storage is not None else StorageOptions()
    rank, world = rank_and_world()
    tp = tp_size if tp_size is not None else world
    if world > 1:
        with Session(options.timeout, group) as session, Rollback(options.rollback) as rollback:
            with session.stage("planning"):
                checkpoint = open_agreed(session, opener(path, storage), remote=is_url(path))
                trace, planned = plan_engine_load(module, checkpoint, tp)
            with session.stage("planning", point="spans"):  # indices only the union of the ranks shows unread
                mine = json.dumps(key_spans(trace, checkpoint)).encode()
                spans = session.gather(mine, "planning", "gathering the spans")
                check_union([json.loads(s) for s in spans], checkpoint)
            rank, world = session.rank, session.world
            _keep(rollback, trace, planned, options)
            with checkpoint.reader(direct_io=storage.direct_io) as reader:
                plan = planned.plan
                received = read_on_every_rank(plan, reader, plan.reads, (), options, session=session, rollback=None)
                with session.stage("reading", point="fallbacks"):  # a rank's failure is every rank's
                    written = _finish(module, trace, planned, reader)
                bytes_read, requests = reader.bytes_read, reader.reads
    else:
        received = 0
        checkpoint = open_checkpoint(path, storage=storage)
        trace, planned = plan_engine_load(module, checkpoint, tp)
        with Rollback(options.rollback) as rollback, checkpoint.reader(direct_io=storage.direct_io) as reader:
            _keep(rollback, trace, planned, options)
            execute_plan(planned.plan, reader, replace(options, rollback=False))
            written = _finish(module, trace, planned, reader)
            bytes_read, requests = reader.bytes_read, reader.reads
    seconds = time.perf_counter() - started
    report = load_report(planned.plan, bytes_read, rank, world, seconds=seconds, requests=requests, exchanged=received)
    return _engine_report(report, trace, written, planned.plan.checkpoint)


def plan_engine_load(
    module: torch.nn.Module, checkpoint: Any, tp_size: int = 1, *, reuse: bool = True
) -> tuple[EngineTrace, EnginePlan]:
    """Trace ``module.load_weights`` on ``checkpoint`` (headers alone), check it, and plan its reads.

    ``reuse``: repeated layers traced once (:mod:`loader.engine.repeats`); the plan is the same either way.

    Raises:
        ValueError: a check failed (see :mod:`loader.engine.check`).
    """
    description = f"{type(module).__name__}.load_weights"
    trace = trace_load_weights(module, checkpoint, reuse=reuse)
    log_fallbacks(trace, description)
    trace.certificates = certificates(trace)
    missing = check_coverage(trace, trace.certificates)
    check_shapes(trace, checkpoint, tp_size)
    planned = engine_plan(trace, checkpoint, missing, description)
    plan = planned.plan
    log.info(
        "%s: %d parameters as %d region reads and %d constant fills, %d key(s) read whole, %d bytes planned",
        description,
        len(plan.traced),
        len(plan.reads),
        len(plan.fills),
        len(planned.fallback_keys),
        plan.planned_bytes(),
    )
    return trace, planned


def _keep(rollback: Rollback, trace: EngineTrace, planned: EnginePlan, options: LoadOptions) -> None:
    """What the rollback restores: the planned parameters, every parameter when keys fall back (their writes are
    not known beforehand)."""
    if not options.rollback:
        return
    if trace.fallbacks:
        rollback.keep_tensors({n: storage_of(p) for n, p in trace.real.items()})
    else:
        rollback.keep(planned.plan)


def _finish(module: torch.nn.Module, trace: EngineTrace, planned: EnginePlan, reader: Any) -> tuple[str, ...]:
    """The fallback keys (after the region reads and constant fills); the parameters they wrote.

    Raises:
        ValueError: a parameter the traced keys left incomplete that no fallback key wrote either.
    """
    written = run_fallbacks(module, trace, planned.plan.checkpoint, reader)
    for name, cov in trace.certificates.items():
        if cov.writes and cov.undefined and name not in written:
            raise ValueError(
                f"parameter {name!r}: elements {cov.undefined[:4]} are written neither by the traced keys nor by "
                f"the keys loaded for real ({', '.join(f.key for f in trace.fallbacks)})"
            )
    return written


def _engine_report(report: LoadReport, trace: EngineTrace, written: tuple[str, ...], checkpoint: Any) -> LoadReport:
    """The report with the fallback keys' parameters (their keys planned whole) and the certificates."""
    fell_back = {n for f in trace.fallbacks for n in f.touched} | set(written)
    missing = tuple(k for k in report.missing_keys if k not in fell_back)
    loaded = natural_sorted(set(report.loaded_keys) | fell_back)
    reasons = {f.key: f.reason for f in trace.fallbacks}
    whole = sum(checkpoint[f.key].nbytes for f in trace.fallbacks)
    return replace(
        report,
        planned_bytes=report.planned_bytes + whole,
        loaded_keys=loaded,
        missing_keys=missing,
        deferred=natural_sorted(fell_back),
        deferred_reasons=reasons,
        certificates=dict(trace.certificates),
    )
