"""A small gloo world of subprocess ranks for the in-process vLLM tests: spawn, bound, collect results.

``python vllm_worker.py RANK WORLD CTX_JSON`` runs once per rank; each saves ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # tests/ranks.py

from ranks import run_ranks  # noqa: E402

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
    argv = [[sys.executable, str(HERE / "vllm_worker.py"), str(r), str(world), json.dumps(ctx)] for r in range(world)]
    codes = run_ranks(argv, [out / f"rank{r}.log" for r in range(world)], cwd=HERE, env=env, limit=LIMIT)
    if None in codes:
        pytest.fail(f"the {world}-rank vLLM world did not finish within {LIMIT} s\n" + tails(out, world))
    assert codes == [0] * world, f"exit codes {codes}\n" + tails(out, world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def tails(out: Path, world: int, chars: int = 3000) -> str:
    return "\n".join(f"--- rank {r}\n" + (out / f"rank{r}.log").read_text()[-chars:] for r in range(world))
