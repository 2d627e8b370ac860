"""Weight sync from torchrun trainer ranks into an engine of another process: two trainer groups, one engine start.

docs/vllm.md's weight-sync scripts (its ``python vllm sync-engine``, ``sync-trainer`` and ``sync-tp-trainer``
blocks) are what runs: :mod:`vllm_sync_engine` starts the engine (TP 2) and its endpoint from the first; torchrun
starts :mod:`vllm_sync_trainer` on two ranks, each holding its FSDP2 shards of a float32 Llama loaded from the
engine's checkpoint (its embeddings frozen), taking three AdamW steps, each pushed (the first full, the others
deltas). After each push every worker's rebuilt parameters are bit for bit what vLLM's own ``load_weights`` writes
from the trainer's full state dict, and the greedy tokens change; a full push sends each worker its shard's bytes
once, a delta push fewer (the frozen embeddings not again). Then trainer rank 1 hangs mid-push: the engine and
trainer rank 0 raise PeerFailure, and the engine's tokens are the last good version's.

The same endpoint then takes a second group at the same address: :mod:`vllm_sync_tp_trainer` on two other torchrun
ranks, the same Llama tensor-parallel (each layer's projections DTensors, ``Shard(0)`` by output rows or
``Shard(1)`` by input columns), three steps pushed likewise: its versions follow the first group's last good one,
every push is bit for bit vLLM's own load of its full state dict, and each rank sends only what its local shards
(and, rank 0, the plain tensors) hold, counted at the wire.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_checkpoints import write_checkpoint

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: seconds the engine start and the whole sync may take (a TP 2 start takes 1-3 minutes on 2 shared cores)
LIMIT = int(os.environ.get("VLLM_ENGINE_LIMIT", 600))
#: seconds a sync's collective may wait for a peer (the hung rank's push fails after it)
TIMEOUT = 60
STEPS = 3
#: per worker, the bytes of its shard no trainer sends: worker 1's 24 padding rows of embed_tokens and lm_head (bf16)
PADDING = [0, 2 * 24 * 64 * 2]
#: per worker, the bf16 bytes of the Llama's plain tensors it takes: its rows of embed_tokens and lm_head (vLLM pads
#: the 1000 to 1024 and splits them 512 a worker) and the five 64-element norms whole
PLAIN = [(2 * 512 * 64 + 5 * 64) * 2, (2 * 488 * 64 + 5 * 64) * 2]
#: docs/vllm.md's weight-sync scripts, by the word after ```python vllm
BLOCK = re.compile(r"^```python vllm (?P<name>sync-[\w-]+)[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


def docs_scripts(tmp: Path) -> dict[str, Path]:
    blocks = {m["name"]: m["code"] for m in BLOCK.finditer((REPO / "docs" / "vllm.md").read_text())}
    assert sorted(blocks) == ["sync-engine", "sync-tp-trainer", "sync-trainer"], sorted(blocks)
    paths = {}
    for name, code in blocks.items():
        paths[name] = tmp / f"{name}.py"
        paths[name].write_text(code)
    return paths


def wait_all(procs: list, seconds: float) -> list:
    """Each process's exit code once all exited, or as soon as one failed (None: still running, killed after)."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break  # the others would only wait for it
        time.sleep(0.5)
    return [p.poll() for p in procs]


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ranks")
    model = write_checkpoint("llama", tmp / "model")
    scripts = docs_scripts(tmp)
    ctx = {"model": str(model), "work": str(tmp), "address": str(tmp / "address"), "timeout": TIMEOUT}
    ctx.update(engine=str(scripts["sync-engine"]), trainer=str(scripts["sync-trainer"]), limit=LIMIT)
    ctx.update(tp_trainer=str(scripts["sync-tp-trainer"]))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]),
    }
    engine_ctx = {**ctx, "pushes": STEPS, "out": str(tmp / "engine.json")}
    engine = [sys.executable, str(HERE / "vllm_sync_engine.py"), json.dumps(engine_ctx)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    trainers = [*torchrun, str(HERE / "vllm_sync_trainer.py"), json.dumps({**ctx, "steps": STEPS})]
    tp_trainers = [*torchrun, str(HERE / "vllm_sync_tp_trainer.py"), json.dumps({**ctx, "steps": STEPS})]
    names = ("engine", "trainers", "tp-trainers")
    logs = [open(tmp / f"{n}.log", "w") for n in names]
    procs = [subprocess.Popen(argv, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
             for argv, log in zip([engine, trainers, tp_trainers], logs)]  # fmt: skip
    try:
        codes = wait_all(procs, LIMIT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join((tmp / f"{n}.log").read_text()[-6000:] for n in names)
    assert codes == [0, 0, 0] and (tmp / "engine.json").exists(), text
    out = {"engine": json.loads((tmp / "engine.json").read_text())}
    for r in (0, 1):
        out[f"trainer{r}"] = json.loads((tmp / f"trainer{r}.json").read_text())
        out[f"tp-trainer{r}"] = json.loads((tmp / f"tp-trainer{r}.json").read_text())
    return out


def test_every_push_writes_what_vllms_own_load_writes_from_the_trainers_full_state(synced):
    steps = synced["engine"]["steps"]
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert len(s["digests"]) == len(s["oracle"]) == 2
        for ours, default in zip(s["digests"], s["oracle"]):
            assert len(ours) > 10 and ours == default  # every rebuilt parameter, bit for bit


def test_every_push_changes_the_tokens(synced):
    tokens = [synced["engine"]["tokens"], *(s["tokens"] for s in synced["engine"]["steps"])]
    assert all(len(t) == 2 and all(len(x) == 8 for x in t) for t in tokens)
    assert all(a != b for a, b in zip(tokens, tokens[1:])), tokens


def test_a_full_push_sends_each_worker_its_shard_once_and_a_delta_push_fewer_bytes(synced):
    engine, reports = synced["engine"]["steps"], synced["trainer0"]["reports"]
    other = synced["trainer1"]["reports"]
    assert [r["bytes_sent"] for r in other] == [r["bytes_sent"] for r in reports]  # both ranks report the totals
    full = engine[0]
    padding = PADDING
    assert not full["delta"] and not reports[0]["delta"]
    for sent, shard, pad in zip(full["bytes_sent"], full["shard_bytes"], padding):
        assert shard > 0 and sent == shard - pad  # every wanted byte, once, in bf16 (half the trainer's float32)
    for trainer, got in zip(reports, engine):
        assert tuple(trainer["bytes_sent"]) == tuple(got["bytes_sent"])  # the trainers' wire bytes, received
        assert trainer["changed_bytes"] == got["changed_bytes"]
    for delta in engine[1:]:
        assert delta["delta"]
        for sent, changed, whole in zip(delta["bytes_sent"], delta["changed_bytes"], full["bytes_sent"]):
            assert 0 < changed < whole and sent < whole  # the frozen embeddings do not travel again


def test_a_hung_trainer_rank_is_a_peer_failure_and_the_engine_serves_the_last_good_version(synced):
    engine = synced["engine"]
    assert engine["failure"]["type"] == "PeerFailure", engine["failure"]
    assert synced["trainer0"]["failure"]["type"] == "PeerFailure", synced["trainer0"]
    assert engine["failure"]["reason"] == synced["trainer0"]["failure"]["reason"] == "timeout"
    assert "while agreeing on a push" in synced["trainer0"]["failure"]["message"]  # its packets had gone
    assert synced["trainer1"].get("hung")
    assert engine["versions"] == [STEPS, STEPS]
    assert engine["tokens_after_failure"] == engine["steps"][-1]["tokens"]


def test_a_second_group_of_tp_dtensor_trainers_pushes_what_vllms_own_load_writes_its_versions_following(synced):
    tp, engine = synced["tp-trainer0"], synced["engine"]
    placements = tp["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == ["Shard(dim=0)"]  # ColwiseParallel: rows
    assert placements["model.layers.1.mlp.down_proj.weight"] == ["Shard(dim=1)"]  # RowwiseParallel: columns
    assert len(placements) == 2 * 7 and "model.embed_tokens.weight" in tp["plain"]
    assert tp["prepared_version"] == synced["tp-trainer1"]["prepared_version"] == STEPS  # the last good version
    steps = engine["tp"]["steps"]
    versions = list(range(STEPS + 1, 2 * STEPS + 1))  # following the first group's last good version
    assert [s["version"] for s in steps] == [r["version"] for r in tp["reports"]] == versions
    for s in steps:
        assert len(s["digests"]) == len(s["oracle"]) == 2
        for ours, default in zip(s["digests"], s["oracle"]):
            assert len(ours) > 10 and ours == default  # every rebuilt parameter, bit for bit
    assert engine["tp"]["versions"] == [2 * STEPS, 2 * STEPS]
    tokens = [engine["tokens_after_failure"], *(s["tokens"] for s in steps)]
    assert all(len(t) == 2 and all(len(x) == 8 for x in t) for t in tokens)
    assert all(a != b for a, b in zip(tokens, tokens[1:])), tokens


def test_each_tp_trainer_rank_sends_only_what_its_local_shards_hold_and_together_each_workers_shard_once(synced):
    ranks = [synced["tp-trainer0"], synced["tp-trainer1"]]
    engine = synced["engine"]["tp"]["steps"]
    wire = [r["wire"] for r in ranks]  # per rank, per push, per worker: the bytes counted at its wire
    assert [len(w) for w in wire] == [STEPS, STEPS]
    for push, got in enumerate(engine):
        together = [wire[0][push][w] + wire[1][push][w] for w in (0, 1)]
        assert together == got["bytes_sent"]  # what the workers received is what the two ranks sent
        assert ranks[0]["reports"][push]["bytes_sent"] == ranks[1]["reports"][push]["bytes_sent"] == together
        assert ranks[0]["reports"][push]["changed_bytes"] == got["changed_bytes"]
    full = engine[0]
    assert not full["delta"] and all(e["delta"] for e in engine[1:])
    for sent, shard, pad in zip(full["bytes_sent"], full["shard_bytes"], PADDING):
        assert shard > 0 and sent == shard - pad  # every wanted byte, once
    local = [r["local_shard_bytes"] for r in ranks]
    assert local[0] == local[1] > 0
    # the trainer's split is the engine's (both TP 2): rank r's shards go to worker r, whole, the plain tensors
    # come from rank 0, and nothing else travels (no rank sends another rank's part, nothing was gathered)
    assert wire[1][0] == [0, local[1]]
    assert wire[0][0] == [local[0] + PLAIN[0], PLAIN[1]]
    for push in range(1, STEPS):
        for sent, whole in zip(engine[push]["bytes_sent"], full["bytes_sent"]):
            assert 0 < sent < whole  # the frozen embeddings do not travel again
        assert wire[1][push][0] == 0  # a delta too: rank 1 holds nothing worker 0 wants
