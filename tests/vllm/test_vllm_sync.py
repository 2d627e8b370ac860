"""Weight sync into a running vLLM engine (``loader.vllm.EngineSync``) at tensor parallel 2, two engine starts.

The first start (:mod:`vllm_sync`) serves a Llama checkpoint; a float32 transformers trainer loaded from it takes
three steps, each pushed: every worker's rebuilt parameters are bit for bit what vLLM's own ``load_weights``
writes from the trainer's saved weights, the greedy tokens change, each worker is sent its shard's bytes (the
vocabulary's padding rows are zeros, not sent), and a trainer of another shape is refused naming its tensor while
the engine serves on. The second start loads the last step's saved trainer with vLLM's default loader: its tokens
are the synced engine's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_checkpoints import write_checkpoint

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: seconds an engine start and its work may take (a TP 2 start takes about a minute on 2 shared cores)
LIMIT = int(os.environ.get("VLLM_ENGINE_LIMIT", 600))
#: two prompts of token ids, eight greedy tokens each
PROMPTS = [[1, 2, 3, 4], [17, 99, 5]]
STEPS = 3


def run(script: str, ctx: dict, tmp: Path) -> dict:
    """Run ``script`` (in this folder) on ``ctx`` with two workers on two cores; what it wrote."""
    out = tmp / f"{Path(script).stem}.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]),
    }
    argv = [sys.executable, str(HERE / script), json.dumps({**ctx, "out": str(out)})]
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sync")
    model = write_checkpoint("llama", tmp / "model")
    ctx = {"model": str(model), "tp": 2, "prompts": PROMPTS, "steps": STEPS, "work": str(tmp)}
    return run("vllm_sync.py", ctx, tmp)


def test_every_push_writes_what_vllms_own_load_writes(synced):
    assert [s["version"] for s in synced["steps"]] == list(range(1, STEPS + 1))
    assert synced["version"] == [STEPS, STEPS]  # each worker serves the last push
    for s in synced["steps"]:
        assert len(s["digests"]) == len(s["oracle"]) == 2
        for ours, default in zip(s["digests"], s["oracle"]):
            assert len(ours) > 10 and ours == default  # every rebuilt parameter, bit for bit


def test_every_push_changes_the_tokens(synced):
    tokens = [synced["tokens"], *(s["tokens"] for s in synced["steps"])]
    assert all(len(t) == len(PROMPTS) and all(len(x) == 8 for x in t) for t in tokens)
    assert all(a != b for a, b in zip(tokens, tokens[1:])), tokens


def test_each_worker_is_sent_its_shard(synced):
    for s in synced["steps"]:
        assert len(s["bytes_sent"]) == len(s["shard_bytes"]) == 2
        # the vocabulary (1000 rows) padded to 1024: rank 1's last 24 rows of embed_tokens and lm_head are zeros
        padding = [0, 2 * 24 * 64 * 2]
        for sent, shard, ratio, pad in zip(s["bytes_sent"], s["shard_bytes"], s["ratios"], padding):
            assert shard > 0 and sent == shard - pad and ratio == sent / shard


def test_a_trainer_of_another_shape_is_refused_and_the_engine_serves_on(synced):
    assert "model.layers.0.mlp.gate_proj.weight" in synced["error"]
    assert synced["tokens_after_error"] == synced["steps"][-1]["tokens"]


def test_the_synced_engine_generates_what_the_saved_trainer_generates(synced, tmp_path):
    last = synced["steps"][-1]
    ctx = {"model": last["folder"], "load_format": "auto", "tp": 2, "prompts": PROMPTS}
    assert run("vllm_engine.py", ctx, tmp_path)["tokens"] == last["tokens"]
