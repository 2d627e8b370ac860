"""vLLM engines started with ``load_format="regiontrace"`` at tensor parallel 2, three starts in all.

A Llama start (docs/vllm.md's example) and a Qwen3-MoE start each generate greedy tokens, then swap every worker's
model for one vLLM's default loader builds in the same engine (:mod:`vllm_swap`) and generate again: the tokens are
the same, and every worker's parameters (before ``process_weights_after_loading``) are the default loader's bit for
bit. A checkpoint with 64 rows too many in a q_proj (which vLLM's default loader narrows silently) fails the start
naming the checkpoint tensor and the parameter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from vllm_checkpoints import add_rows, write_checkpoint
from vllm_digest_plugin import install, read

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: seconds an engine start and its generation may take (a TP 2 start takes about a minute on 2 shared cores)
LIMIT = int(os.environ.get("VLLM_ENGINE_LIMIT", 600))
#: two prompts of token ids, eight greedy tokens each
PROMPTS = [[1, 2, 3, 4], [17, 99, 5]]
#: a docs block that starts an engine: fenced ```python vllm (tests/test_docs.py leaves these to this file)
ENGINE_BLOCK = re.compile(r"^```python vllm[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


def run_engine(ctx: dict, tmp: Path) -> tuple[subprocess.CompletedProcess, dict, dict[int, dict[int, dict]]]:
    """Run ``vllm_engine.py`` on ``ctx`` (two workers on two cores) with the digests plugin; its process, what it
    wrote ({} where it failed) and the workers' digests (load -> rank -> name -> digest)."""
    tmp.mkdir(parents=True, exist_ok=True)
    digests, out = tmp / "digests", tmp / "out.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_TEST_DIGESTS": str(digests),
        # the project comes installed (its entry point is the plugin); the source tree stays off the path, where
        # a stale *.egg-info beside it would shadow the installed metadata
        "PYTHONPATH": os.pathsep.join([str(install(tmp / "plugins")), str(HERE)]),
    }
    argv = [sys.executable, str(HERE / "vllm_engine.py"), json.dumps({**ctx, "out": str(out)})]
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=LIMIT)
    return done, json.loads(out.read_text()) if out.exists() else {}, read(digests)


def assert_the_default_loaders(done: subprocess.CompletedProcess, out: dict, digests: dict, tokens: list) -> None:
    """``tokens`` (ours, non-trivial) are those the default loader's model generated after the swap, and each
    worker's parameters loaded at the start are those the default loader loaded."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert [len(t) for t in tokens] == [8] * len(PROMPTS) and len({t for ts in tokens for t in ts}) > 1, tokens
    assert sorted(s["rank"] for s in out["swapped"]) == [0, 1] and all(s["all_new"] for s in out["swapped"])
    assert sorted(digests) == [0, 1] and sorted(digests[0]) == sorted(digests[1]) == [0, 1]  # ours, the default's
    for rank in (0, 1):
        ours, default = digests[0][rank], digests[1][rank]
        differ = sorted(n for n in default if ours.get(n) != default[n])
        assert ours.keys() == default.keys() and not differ, (rank, differ)
    assert tokens == out["default_tokens"]
    assert "LoadReport(rank 1 of 2" in done.stdout + done.stderr  # each worker logs its report


def test_the_docs_example_loads_each_worker_as_the_default_loader_and_generates_its_tokens(tmp_path):
    llama = write_checkpoint("llama", tmp_path / "llama")  # 2 KV heads, a vocabulary of 1000 that vLLM pads
    [code] = [m["code"] for m in ENGINE_BLOCK.finditer((REPO / "docs" / "vllm.md").read_text())]
    (tmp_path / "example.py").write_text(code)
    ctx = {"example": str(tmp_path / "example.py"), "argv": [str(llama), json.dumps(PROMPTS)], "prompts": PROMPTS}
    done, out, digests = run_engine({**ctx, "swap": True}, tmp_path / "run")
    tokens = [json.loads(line[len("tokens ") :]) for line in done.stdout.splitlines() if line.startswith("tokens ")]
    assert_the_default_loaders(done, out, digests, tokens)
    assert {s["model"] for s in out["swapped"]} == {"LlamaForCausalLM"}


def test_a_qwen3_moe_engine_loads_each_worker_as_the_default_loader_and_generates_its_tokens(tmp_path):
    folder = write_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    ctx = {"model": str(folder), "load_format": "regiontrace", "tp": 2, "prompts": PROMPTS, "swap": True}
    done, out, digests = run_engine(ctx, tmp_path / "run")
    assert_the_default_loaders(done, out, digests, out.get("tokens"))
    assert {s["model"] for s in out["swapped"]} == {"Qwen3MoeForCausalLM"}


def test_a_checkpoint_with_64_rows_too_many_fails_the_engine_start_naming_tensor_and_parameter(tmp_path):
    folder = tmp_path / "grown"
    write_checkpoint("llama", folder)
    key = add_rows(folder, "layers.0.self_attn.q_proj.weight")
    ctx = {"model": str(folder), "load_format": "regiontrace", "tp": 2, "prompts": PROMPTS}
    done, out, digests = run_engine(ctx, tmp_path)
    assert done.returncode != 0 and not out
    parameter = "model.layers.0.self_attn.qkv_proj.weight"
    errors = [line for line in (done.stdout + done.stderr).splitlines() if key in line and parameter in line]
    assert errors and "does not fit" in errors[0], (done.stdout + done.stderr)[-6000:]
    assert not digests  # no worker got as far as process_weights_after_loading
