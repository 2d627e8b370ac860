"""Executing a rank's plan: region reads then deferred conversions, with a progress bar and rollback."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ..options import LoadOptions
from ..plan import BlockRead, DeferredRead, RankPlan, ValueRead
from ..plan.gcpause import paused_gc
from ..storage import RangeReader
from .deferred import run_deferred
from .fills import run_fills
from .pool import in_page_cache, resolve_io_threads
from .reads import BlockExecutor
from .rollback import Rollback
from .routes import routes_of
from .staging import StagingRing
from .values import run_values


def _progress_bar(enabled: bool | None, plan: RankPlan) -> Any:
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return None  # the plan's bytes are counted for a bar only
    from tqdm.auto import tqdm

    return tqdm(total=plan.planned_bytes(), unit="B", unit_scale=True, desc="loading", leave=False)


@paused_gc()  # a few acyclic records per block: no full collections over the model meanwhile
def execute_plan(
    plan: RankPlan,
    reader: RangeReader,
    options: LoadOptions | None = None,
    *,
    reads: Sequence[BlockRead] | None = None,
    deferred: Sequence[DeferredRead] | None = None,
    values: Sequence[ValueRead] | None = None,
    fills: Sequence[BlockRead] | None = None,
) -> None:
    """Run ``plan`` (or the given subsets of its reads) against the checkpoint files, writing the model tensors:
    constant fills, region reads, then value reads, then deferred conversions.

    Args:
        plan: this rank's plan.
        reader: the open file reader (counts the bytes read).
        options: ``progress`` (tqdm progress bar; default on when stderr is a terminal), ``rollback`` (restore
            every tensor the plan writes if a read fails), ``staging_bytes`` (bytes per staging buffer: two are
            used, double-buffered; pinned for GPU targets), ``io_threads`` (threads reading at once, sharing that
            budget); the others are a distributed load's or the reader's. Default: :class:`~loader.options.LoadOptions`
            ().
        reads: the region reads to run (default: all of the plan's).
        deferred: the deferred conversions to run (default: all of the plan's).
        values: the value reads to run (default: all of the plan's).
        fills: the constant fills to run (default: all of the plan's; no byte read): run on every rank that runs
            any part of the plan (a broadcast owner has them before it sends its boxes).

    Raises:
        CheckpointError: a file is short, or changed since its header was read (with ``rollback``, after the
            tensors were restored).
    """
    options = options if options is not None else LoadOptions()
    checkpoint, slots = plan.checkpoint, plan.slots
    reads = plan.reads if reads is None else reads
    deferred = plan.deferred if deferred is None else deferred
    values = plan.values if values is None else values
    fills = plan.fills if fills is None else fills
    rollback = Rollback(options.rollback)  # a flow of several ranks passes rollback=False: it owns one
    rollback.keep(plan)
    bar = _progress_bar(options.progress, plan)
    try:
        run_fills(fills, slots)  # no byte read: first, so a load failing later rolls them back too
        threads = resolve_io_threads(options.io_threads)
        if options.io_threads is None and threads > 1:  # a direct reader tells no page cache: kept
            reads = reads if isinstance(reads, Sequence) else list(reads)
            # a cold checkpoint is read in one stream: on this machine's disk one stream measured faster than
            # several (docs/benchmarks.md, issue 19); a warm one with the CPU share of threads
            threads = threads if in_page_cache(reader, checkpoint, reads) else 1
        ring = StagingRing.for_threads(options.staging_bytes, threads)  # one ring (pinned for GPU targets) for all
        progress = bar.update if bar else None
        routes = routes_of(plan)  # kept by the executor: a reused plan's blocks are not decided again
        BlockExecutor(
            checkpoint, slots, reader, progress=progress, staging=ring, io_threads=threads, routes=routes
        ).run(reads)
        run_values(values, checkpoint, slots, reader, progress=bar.update if bar else None, staging=ring)
        for d in deferred:
            if d.boxes:
                run_deferred(d, checkpoint, slots, reader)
                if bar:
                    bar.update(sum(checkpoint[k].nbytes for k in d.conversion.sources))
    except BaseException:
        rollback.undo()
        raise
    finally:
        if bar:
            bar.close()
