"""Weight sync into a running vLLM engine (``loader.vllm.EngineSync``) at tensor parallel 2, two engine starts.

Each start (:mod:`vllm_sync`) serves a checkpoint, Llama or Qwen3-MoE (whose transformers trainer holds its
experts fused, ``mlp.experts.gate_up_proj``, where the checkpoint has them one by one); a float32 trainer loaded
from it takes three steps, each pushed (the second and third as deltas, where the sync has them): every worker's
rebuilt parameters are bit for bit what vLLM's own ``load_weights`` writes from the trainer's saved weights, the
greedy tokens change, each worker is sent its shard's bytes on a full push (the vocabulary's padding rows are
zeros, not sent) and under half of them on a delta push, and a trainer of another shape is refused
naming its tensor while the engine serves on. For Llama, vLLM's own ``reload_weights`` of the last step's saved
trainer then generates the synced engine's tokens (vLLM's reload of CPU experts fails). For both, a fresh model
vLLM's default loader loads from the trainer's saved bf16 checkpoint, swapped into the same engine
(:mod:`vllm_swap`), generates the synced engine's tokens.
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


#: family -> what its start does beyond the steps: the trainer config changes refused, whether vLLM reloads
FAMILIES = {
    "llama": {"bad": {"intermediate_size": 128}, "reload": True},
    "qwen3_moe": {"bad": {"moe_intermediate_size": 48}, "reload": False},
}
#: what each family's refusal names (a trainer tensor; the first of an expert pair a rank traces)
REFUSED = {"llama": "model.layers.0.mlp.gate_proj.weight", "qwen3_moe": "model.layers.0.mlp.experts."}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def synced(request, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, tmp / "model")
    ctx = {"model": str(model), "tp": 2, "prompts": PROMPTS, "steps": STEPS, "work": str(tmp)}
    return {**run("vllm_sync.py", {**ctx, **FAMILIES[request.param]}, tmp), "family": request.param}


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
        if s.get("delta"):
            continue  # a delta push: below
        assert len(s["bytes_sent"]) == len(s["shard_bytes"]) == 2
        # the vocabulary (1000 rows) padded to 1024: rank 1's last 24 rows of embed_tokens and lm_head are zeros
        padding = [0, 2 * 24 * 64 * 2]
        for sent, shard, ratio, pad in zip(s["bytes_sent"], s["shard_bytes"], s["ratios"], padding):
            assert shard > 0 and sent == shard - pad and ratio == sent / shard


def test_the_later_pushes_send_deltas_smaller_than_a_full_push(synced):
    """Steps after the first change a tenth of each tensor's elements and push deltas (where the sync has
    ``push(delta=True)``): each worker gets under half the bytes the full first push sent it, its changed bytes
    about a tenth of them, and the digests above hold for these pushes too."""
    if not synced["delta"]:
        pytest.skip("this EngineSync has no push(delta=True)")
    full = synced["steps"][0]
    assert not full["delta"]
    for s in synced["steps"][1:]:
        assert s["delta"], s
        for sent, changed, whole in zip(s["bytes_sent"], s["changed_bytes"], full["bytes_sent"]):
            assert 0 < changed < whole / 5 and 0 < sent < whole / 2, (sent, changed, whole)


def test_a_trainer_of_another_shape_is_refused_and_the_engine_serves_on(synced):
    assert REFUSED[synced["family"]] in synced["error"]
    assert "'model.norm.weight'" in synced["push_error"] and "nothing was sent" in synced["push_error"]
    assert synced["tokens_after_error"] == synced["steps"][-1]["tokens"]


def test_a_failed_rebuild_puts_every_layer_back_as_it_was(tmp_path):
    """In-process, one rank, no engine (:mod:`vllm_sync_layers`): the rebuild fails at the third layer, and every
    module's attributes, parameters, buffers and quant method's attributes are the very objects they were."""
    model = write_checkpoint("llama", tmp_path / "model")
    out = run("vllm_sync_layers.py", {"model": str(model)}, tmp_path)
    assert out["rebuilt"] == 3 and out["error"] == "a write into layer 2 failed" and len(out["layers"]) > 10
    assert out["differ"] == [] and len(out["same"]) > 20


def test_the_synced_engine_generates_what_vllms_reload_of_the_saved_trainer_generates(synced):
    if not FAMILIES[synced["family"]]["reload"]:
        pytest.skip("vLLM's reload_weights fails on CPU experts (FusedMoE); the digests compare this family")
    assert synced["tokens_reloaded"] == synced["steps"][-1]["tokens"]


def test_the_synced_engine_generates_what_a_fresh_default_load_of_the_saved_trainer_generates(synced):
    """The oracle for both families (vLLM's CPU reload of experts is not its first load): every worker's model
    swapped for a fresh one vLLM's default loader loads from the trainer saved in bf16 after the last push."""
    swapped = synced["swapped"]
    assert sorted(s["rank"] for s in swapped) == [0, 1] and all(s["all_new"] for s in swapped), swapped
    assert Path(synced["saved"], "config.json").exists()
    assert synced["tokens_default"] == synced["steps"][-1]["tokens"] != synced["tokens"]
