"""A small gloo world of subprocess ranks for the in-process vLLM tests: spawn, bound, collect results.

``python vllm_worker.py RANK WORLD CTX_JSON`` runs once per rank; each saves ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: seconds a world may take (6 families, 3 builds each, on 2 shared cores: normally well under this)
LIMIT = int(os.environ.get("VLLM_WORLD_LIMIT", 900))
#: what every rank's environment adds: vLLM's CPU KV cache small, the project importable
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def run_world(world: int, folders: dict[str, str], out: Path, **more: dict[str, str]) -> list[dict]:
    """Run ``world`` ranks of ``vllm_worker.py`` over ``folders`` (``more``: ``misfits``, checkpoints that do not
    fit; ``urls``, where ours reads a family from) and return each rank's saved results."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = {"out": str(out), "init": f"file://{out / 'store'}", "folders": folders, **more}
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    logs = [open(out / f"rank{r}.log", "w") for r in range(world)]
    argv = [[sys.executable, str(HERE / "vllm_worker.py"), str(r), str(world), json.dumps(ctx)] for r in range(world)]
    procs = [subprocess.Popen(a, cwd=HERE, env=env, stdout=f, stderr=subprocess.STDOUT) for a, f in zip(argv, logs)]
    try:
        for p in procs:
            p.wait(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {world}-rank vLLM world did not finish within {LIMIT} s\n" + tails(out, world))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}\n" + tails(out, world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def tails(out: Path, world: int, chars: int = 3000) -> str:
    return "\n".join(f"--- rank {r}\n" + (out / f"rank{r}.log").read_text()[-chars:] for r in range(world))
