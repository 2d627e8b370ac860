"""Benchmark: load a Qwen3-MoE-shaped bf16 checkpoint into a model on a device (``cuda``, or ``cpu`` in CI).

    python bench/gpu_bench.py [--device cuda|cpu] [--gb 8 | --size tiny|ci] [--repeat 3] [--warmup 1] [--out DIR]
                              [--markdown]

The checkpoint (random bf16 values, the original per-expert layout ``save_pretrained`` writes, sharded into
several files with ``model.safetensors.index.json`` and ``config.json``) is generated in ``DIR`` (default: a
temporary folder) on first use. ``--gb N`` makes a multi-GB one (hidden 2048, 64 experts of 768, vocab
32000, as many layers as make about N GiB; the default on ``cuda``: 8); ``--size ci`` (the default on
``cpu``) about 250 MB; ``--size tiny`` a few MB (the test that keeps this script working).

Methods, all in this one process, each run ``--warmup`` times untimed (one-time warm-ups: kernels, thread
pools, transformers' conversion tables), then ``--repeat`` times timed, the methods alternating (best and
median reported), page cache warm (every shard is read once before timing):

* ``floor``: every shard ``preadv``'d whole into one pinned host buffer (ordinary memory on ``cpu``), then one
  copy to a device buffer (both allocated and touched before timing): what any loader that reads the files
  and copies them to the device must pay.
* ``ours``: ``load_hf_checkpoint(model, DIR)`` into a model already on the device (built on ``meta``,
  ``to_empty``, touched; not timed).
* ``ours (meta)``: building the model on ``meta`` + ``load_hf_checkpoint(model, DIR, device=...)``: what
  ``from_pretrained`` does too.
* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(DIR, device_map=device, dtype=torch.bfloat16)``.
* ``load_file``: ``safetensors.torch.load_file(shard, device=device)`` of every shard (the checkpoint's own
  tensors, not a model).

Every time is also printed as a ratio to the floor. Afterwards both of ours' models are compared with
``from_pretrained``'s state dict, every tensor bit for bit; a difference exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

from common import pread_all, safetensors_files

from loader.options import LoadOptions

MIB = 1 << 20
SIZES = {  # qwen3_moe config fields (head_dim, kv heads, ...) per size; "gb" gets its layers from --gb
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_experts=8, moe_intermediate_size=64, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "ci": dict(hidden_size=768, num_hidden_layers=4, num_experts=32, moe_intermediate_size=384, head_dim=64,
               num_attention_heads=8, num_key_value_heads=4, vocab_size=8192),
    "gb": dict(hidden_size=2048, num_hidden_layers=1, num_experts=64, moe_intermediate_size=768, head_dim=128,
               num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip
COMMON = dict(num_experts_per_tok=4, intermediate_size=2048, tie_word_embeddings=False, decoder_sparse_step=1)
TARGETS = {"floor": 1.3, "from_pretrained": 5.0}  # ours <= 1.3x the floor, >= 5x faster than from_pretrained


def layout(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors (per-expert layout, as ``save_pretrained`` writes Qwen3-MoE) and shapes."""
    h, i, e, hd = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += [(p + f"self_attn.{k}_proj.weight", (rows, h)) for k, rows in (("q", q), ("k", kv), ("v", kv))]
        out += [(p + "self_attn.o_proj.weight", (h, q))]
        out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out += [(p + "mlp.gate.weight", (e, h))]
        for x in range(e):
            out += [(p + f"mlp.experts.{x}.{k}_proj.weight", (i, h)) for k in ("gate", "up")]
            out += [(p + f"mlp.experts.{x}.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def config_for(size: str, gb: float | None) -> dict:
    c = dict(SIZES["gb" if gb else size], **COMMON)
    if gb:
        per_layer = sum(2 * n for name, s in layout(c) if ".layers.0." in name for n in [_numel(s)])
        c["num_hidden_layers"] = max(1, round(gb * (1 << 30) / per_layer))
    return c


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def generate(out: str, c: dict, shards: int = 4) -> None:
    """Write the checkpoint (random bf16 values, every tensor different) into ``out`` unless it is there."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    stamp = os.path.join(out, "gpu_bench.json")
    if os.path.isfile(stamp) and json.load(open(stamp)) == c:
        return
    tensors = layout(c)
    total = sum(2 * _numel(s) for _, s in tensors)
    g = torch.Generator().manual_seed(0)
    biggest = max(_numel(s) for _, s in tensors)
    pool = torch.randn(biggest + (1 << 20), generator=g).to(torch.bfloat16)  # tensors are windows of it
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if groups[-1] and size >= total * len(groups) / shards:
            groups.append([])
        groups[-1].append((name, shape))
        size += 2 * _numel(shape)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {}
        for name, shape in group:
            at = int(torch.randint(0, pool.numel() - _numel(shape) + 1, (1,), generator=g))
            part[name] = pool[at : at + _numel(shape)].view(shape).clone()
            weight_map[name] = file
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    AutoConfig.for_model("qwen3_moe", **c).save_pretrained(out)
    with open(stamp, "w") as f:
        json.dump(c, f)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def methods(directory: str, device, config) -> dict:
    """``{name: run}``: each ``run()`` loads once and returns what it loaded."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from loader import load_hf_checkpoint

    cuda = device.type == "cuda"
    files = [(f, os.path.getsize(f)) for f in safetensors_files(directory)]
    biggest = max(n for _, n in files)
    host = torch.zeros(biggest, dtype=torch.uint8, pin_memory=cuda)  # allocated and touched before timing
    target = torch.zeros(biggest, dtype=torch.uint8, device=device)
    view = memoryview(host.numpy())

    def floor():
        for f, n in files:
            pread_all(f, view, n)
            target[:n].copy_(host[:n], non_blocking=True)
            if cuda:
                torch.cuda.synchronize(device)  # the one buffer is read into again next
        return None

    def meta_model():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)

    built = meta_model().to_empty(device=device)
    with torch.no_grad():
        for t in built.state_dict().values():
            t.zero_()  # touched: the load writes into memory that exists

    def ours():
        load_hf_checkpoint(built, directory, options=LoadOptions(progress=False))
        return built

    def ours_meta():
        model = meta_model()
        load_hf_checkpoint(model, directory, device=device, options=LoadOptions(progress=False))
        return model

    # device_map needs accelerate; without it a model on the CPU is what from_pretrained loads anyway
    mapped = {} if device.type == "cpu" and not _has("accelerate") else {"device_map": str(device)}

    def from_pretrained():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **mapped)

    def safetensors_load_file():
        out = {}
        for f, _ in files:
            out.update(load_file(f, device=str(device)))
        return out

    return {
        "floor": floor,
        "ours": ours,
        "ours (meta)": ours_meta,
        "from_pretrained": from_pretrained,
        "load_file": safetensors_load_file,
    }


LABELS = {
    "floor": "floor: `preadv` of every shard into one {buf} buffer + one copy to the device",
    "ours": "ours: `load_hf_checkpoint` into a model on the device",
    "ours (meta)": "ours: model built on meta + `load_hf_checkpoint(..., device=)`",
    "from_pretrained": "`from_pretrained(..., device_map=)`{nomap}",
    "load_file": "`safetensors.torch.load_file(..., device=)` of every shard",
}


def check(reference, models: dict) -> list[str]:
    """Names of the tensors of ``models`` that differ (bit for bit) from ``reference``'s state dict."""
    import torch

    want = reference.state_dict()
    bad = []
    for label, model in models.items():
        got = model.state_dict()
        if set(got) != set(want):
            bad.append(f"{label}: other names ({sorted(set(got) ^ set(want))[:5]})")
        for name in set(got) & set(want):
            a, b = got[name].detach(), want[name].detach()
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
                bad.append(f"{label}: {name}")
    return bad


def _bits(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--gb", type=float, default=None, help="a multi-GB checkpoint of about this many GiB")
    parser.add_argument("--size", choices=("tiny", "ci"), default="ci", help="the checkpoint size without --gb")
    parser.add_argument("--repeat", type=int, default=3, help="timed loads per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed loads per method first")
    parser.add_argument("--out", default=None, help="folder of the checkpoint (generated on first use)")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args(argv)
    if (args.device or "cuda").startswith("cuda") and not _has("accelerate"):
        print("from_pretrained(device_map=...) needs accelerate: pip install accelerate", file=sys.stderr)

    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gb = args.gb if args.gb is not None else (8.0 if device.type == "cuda" and "--size" not in sys.argv else None)
    c = config_for(args.size, gb)
    directory = args.out or tempfile.mkdtemp(prefix="gpu_bench_")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    generate(directory, c)
    made = time.perf_counter() - t0
    files = safetensors_files(directory)
    size = sum(os.path.getsize(f) for f in files)
    for f in files:  # warm the page cache
        pread_all(f, memoryview(bytearray(os.path.getsize(f))), os.path.getsize(f))
    watch = mdtable.LoadWatch()
    config = AutoConfig.from_pretrained(directory)
    runs = methods(directory, device, config)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {name: [] for name in runs}
    last: dict[str, object] = {}
    for round_ in range(args.warmup + args.repeat):
        for name, run in runs.items():
            last.pop(name, None)  # free the previous result first (device memory)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            sync()
            t0 = time.perf_counter()
            out = run()
            sync()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            if name in ("ours", "ours (meta)", "from_pretrained"):
                last[name] = out
            del out
    load = watch.stop()
    bad = check(last["from_pretrained"], {k: last[k] for k in ("ours", "ours (meta)")})
    n_tensors = len(last["from_pretrained"].state_dict())

    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median_low(v) for k, v in times.items()}
    floor = best["floor"]
    ratio_floor = best["ours"] / floor
    speedup = best["from_pretrained"] / best["ours"]
    verdict = {True: "met", False: "missed"}
    checked = (
        f"check: every tensor equals from_pretrained's ({n_tensors} tensors, bit for bit, both of ours)"
        if not bad
        else f"check FAILED: {len(bad)} tensors differ from from_pretrained's: {bad[:10]}"
    )
    shape = (
        f"qwen3_moe hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_experts']} experts of "
        f"{c['moe_intermediate_size']}, vocab {c['vocab_size']}, bf16: {len(files)} shards, {size / MIB:.1f} MiB"
    )
    buf = "pinned" if device.type == "cuda" else "ordinary"
    nomap = (
        " (no `device_map`: accelerate not installed; loads on the CPU)"
        if device.type == "cpu" and not _has("accelerate")
        else ""
    )
    if args.markdown:
        print(mdtable.run_line(load, ("torch", "transformers", "safetensors")))
        print()
        print(
            f"Device `{device}`; {shape}; page cache warm; after {args.warmup} untimed load(s) per method, best "
            f"and median of {args.repeat} loads per method (methods alternating):"
        )
        print()
        rows = []
        for k in runs:
            label = LABELS[k].format(buf=buf, nomap=nomap)
            rows.append(
                [
                    label,
                    f"{best[k]:.3f} s",
                    f"{median[k]:.3f} s",
                    f"{best[k] / floor:.2f}x",
                    f"{size / MIB / best[k]:.0f}",
                ]
            )
        print(mdtable.table(["method", "best", "median", "best / floor", "MiB/s (best)"], rows))
        print()
        print(
            f"ours / floor {ratio_floor:.2f}x (target ≤ {TARGETS['floor']}x: **{verdict[ratio_floor <= 1.3]}**); "
            f"from_pretrained / ours {speedup:.2f}x (target ≥ {TARGETS['from_pretrained']:.0f}x: "
            f"**{verdict[speedup >= 5]}**). {checked}."
        )
    else:
        print(f"checkpoint: {directory} ({shape}; ready in {made:.1f} s)")
        print(
            f"device {device}; page cache warm; after {args.warmup} untimed load(s), best / median of "
            f"{args.repeat} loads per method, alternating"
        )
        for k in runs:
            print(
                f"{k:>16}: best {best[k]:.3f} s  median {median[k]:.3f} s  {best[k] / floor:5.2f}x floor  "
                f"{size / MIB / best[k]:.0f} MiB/s"
            )
        print(f"ours / floor: {ratio_floor:.2f}x (target <= {TARGETS['floor']}x: {verdict[ratio_floor <= 1.3]})")
        print(f"from_pretrained / ours: {speedup:.2f}x (target >= 5x: {verdict[speedup >= 5]})")
        print(f"load average (1 min) during the run: {load}")
        print(checked)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
