"""vLLM engines started with ``load_format="regiontrace"`` (three starts in all, tensor parallel 2): docs/vllm.md's
example on a tiny Llama generates the default loader's greedy tokens, every worker's parameters (before
``process_weights_after_loading``) are the default loader's bit for bit, and a checkpoint with 64 rows too many
in a q_proj (which vLLM's default loader narrows silently) fails the start naming the checkpoint tensor and the
parameter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_checkpoints import add_rows, write_checkpoint
from vllm_digest_plugin import install

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: seconds an engine start and its generation may take (a TP 2 start takes about a minute on 2 shared cores)
LIMIT = int(os.environ.get("VLLM_ENGINE_LIMIT", 600))
PROMPTS = [[1, 2, 3, 4], [17, 99, 5]]
#: a docs block that starts an engine: fenced ```python vllm (tests/test_docs.py leaves these to this file)
ENGINE_BLOCK = re.compile(r"^```python vllm[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama: 2 KV heads, a vocabulary of 1000 that vLLM pads."""
    return write_checkpoint("llama", tmp_path_factory.mktemp("engine") / "llama")


def run_engine(argv: list[str], tmp: Path) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """Run one engine script (two workers on two cores) with the digests plugin; its output and each worker's
    parameter digests (rank -> name -> digest)."""
    tmp.mkdir(parents=True, exist_ok=True)
    digests = tmp / "digests"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_TEST_DIGESTS": str(digests),
        # the project comes installed (its entry point is the plugin); the source tree stays off the path, where
        # a stale *.egg-info beside it would shadow the installed metadata
        "PYTHONPATH": os.pathsep.join([str(install(tmp / "plugins")), str(HERE)]),
    }
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=LIMIT)
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(digests.glob("rank*.json"))}
    return done, found


def default_engine(llama: Path, tmp: Path) -> tuple[list[list[int]], dict[int, dict]]:
    ctx = {"model": str(llama), "load_format": "safetensors", "tp": 2, "prompts": PROMPTS, "out": str(tmp / "o.json")}
    done, digests = run_engine([sys.executable, str(HERE / "vllm_engine.py"), json.dumps(ctx)], tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((tmp / "o.json").read_text())["tokens"], digests


def test_the_docs_example_loads_each_worker_as_the_default_loader_and_generates_its_tokens(llama, tmp_path):
    [code] = [m["code"] for m in ENGINE_BLOCK.finditer((REPO / "docs" / "vllm.md").read_text())]
    (tmp_path / "example.py").write_text(code)
    prompts = json.dumps(PROMPTS)
    example = [sys.executable, str(tmp_path / "example.py"), str(llama), prompts]
    ours, ours_digests = run_engine(example, tmp_path / "ours")
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-6000:]
    tokens = [json.loads(line[len("tokens ") :]) for line in ours.stdout.splitlines() if line.startswith("tokens ")]
    expected, default_digests = default_engine(llama, tmp_path / "default")
    assert sorted(ours_digests) == sorted(default_digests) == [0, 1]
    for rank in (0, 1):
        differ = sorted(n for n in default_digests[rank] if ours_digests[rank].get(n) != default_digests[rank][n])
        assert ours_digests[rank].keys() == default_digests[rank].keys() and not differ, (rank, differ)
    assert tokens == expected
    assert "LoadReport(rank 1 of 2" in ours.stdout + ours.stderr  # each worker logs its report


def test_a_checkpoint_with_64_rows_too_many_fails_the_engine_start_naming_tensor_and_parameter(tmp_path):
    folder = tmp_path / "grown"
    write_checkpoint("llama", folder)
    key = add_rows(folder, "layers.0.self_attn.q_proj.weight")
    ctx = {"model": str(folder), "load_format": "regiontrace", "tp": 2, "prompts": PROMPTS, "out": "o.json"}
    done, digests = run_engine([sys.executable, str(HERE / "vllm_engine.py"), json.dumps(ctx)], tmp_path)
    assert done.returncode != 0 and not (tmp_path / "o.json").exists()
    parameter = "model.layers.0.self_attn.qkv_proj.weight"
    errors = [line for line in (done.stdout + done.stderr).splitlines() if key in line and parameter in line]
    assert errors and "does not fit" in errors[0], (done.stdout + done.stderr)[-6000:]
    assert not digests  # no worker got as far as process_weights_after_loading
