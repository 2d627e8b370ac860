"""One shared gloo world of subprocess ranks for the distributed tests: spawn, bound, collect results.

A worker script is run once per rank as ``python WORKER RANK WORLD CTX_JSON``; it runs every scenario in order
and saves ``{scenario: {"ok": bool, "error": str, ...}}`` to ``RESULTS/rank{r}.pt`` after each one. The last
scenario of each world kills rank 2 (a dead peer), so the expected exit codes are ``[0, 0, -SIGKILL, 0]``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from ranks import run_ranks

WORLD = 4
LIMIT = int(os.environ.get("GLOO_WORLD_LIMIT", 300))  # seconds; a world normally finishes in well under a minute
EXPECTED_CODES = [0, 0, -signal.SIGKILL, 0]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_world(
    worker: str, logs_dir: Path, results_dir: str, ctx: dict, *, expected_codes: list[int] = EXPECTED_CODES
) -> list[dict]:
    """Run every rank of the world as a subprocess and return each rank's saved results.

    Fails the test (with every rank's log and failed scenarios) when a rank hangs past ``LIMIT`` or the exit
    codes are not ``expected_codes`` (a world whose last scenario kills no rank: ``[0] * WORLD``).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    argv = [[sys.executable, worker, str(r), str(WORLD), json.dumps(ctx)] for r in range(WORLD)]
    logs = [logs_dir / f"rank{r}.log" for r in range(WORLD)]
    codes = run_ranks(argv, logs, cwd=REPO, env=env, limit=LIMIT)
    if None in codes:
        pytest.fail(
            f"the {WORLD}-rank world did not finish within {LIMIT} s: a rank hangs\n" + logs_of(logs_dir, results_dir)
        )
    assert codes == expected_codes, f"exit codes {codes}\n" + logs_of(logs_dir, results_dir)
    return [torch.load(os.path.join(results_dir, f"rank{r}.pt")) for r in range(WORLD)]


def logs_of(logs_dir: Path, results_dir: str) -> str:
    """Each rank's output and the errors of the scenarios it saved, for a failure message."""
    parts = []
    for r in range(WORLD):
        parts.append(f"--- rank {r}\n{(logs_dir / f'rank{r}.log').read_text()[-8000:]}")
        path = os.path.join(results_dir, f"rank{r}.pt")
        if os.path.exists(path):
            parts += [f"{n}: {res['error'][-1500:]}" for n, res in torch.load(path).items() if not res["ok"]]
    return "\n".join(parts)


def ok(results: list[dict], name: str) -> list[dict]:
    """Scenario ``name``'s results on every rank, asserting it ran without error everywhere."""
    for r, res in enumerate(results):
        assert res[name]["ok"], f"rank {r}:\n{res[name].get('error')}"
    return [res[name] for res in results]


def worker_main(scenarios: list, *, timeout: float = 120, lost_a_rank: bool = True, setup=None) -> None:
    """A worker script's ``__main__``: ``WORKER RANK WORLD CTX_JSON`` joins the gloo world through the file store
    ``ctx["store"]`` (one torch thread), runs ``setup(world)`` then the scenarios, and exits; ``lost_a_rank``: the
    last scenario killed a rank, so the process exits at once (no barrier, no process-group teardown)."""
    import faulthandler
    from datetime import timedelta

    import torch.distributed as dist

    rank, world, ctx = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_world dumps a hung rank's stacks with it
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{ctx['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    if setup is not None:
        setup(world)
    run_scenarios(scenarios(ctx) if callable(scenarios) else scenarios, ctx, rank)
    if not lost_a_rank:
        dist.barrier()
        dist.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_scenarios(scenarios: list, ctx: dict, rank: int) -> None:
    """The worker side: run ``(name, fn)`` scenarios in order, saving every result after each one.

    A barrier separates scenarios (not after the last one, which kills rank 2). The results file is what
    :func:`run_world` collects.
    """
    import time
    import traceback

    import torch.distributed as dist

    results = {}
    for name, fn in scenarios:
        t0 = time.time()
        try:
            results[name] = {"ok": True, **fn(ctx)}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["wall"] = time.time() - t0
        torch.save(results, os.path.join(ctx["out"], f"rank{rank}.pt"))
        if name != scenarios[-1][0]:
            dist.barrier()
