"""Trace + compile time of a DeepSeek-V3-sized MoE layer, against torch's own meta-tensor floor.

The layer: 256 experts, H=7168, I=2048, per-expert ``gate_proj``/``up_proj`` [I, H] and ``down_proj`` [H, I]
leaves (bf16). The conversion is transformers' MergeModulelist + Concatenate(dim=1) for gate/up and
MergeModulelist for down::

    gate_up = cat([stack(gate), stack(up)], dim=1)   # [256, 4096, 7168]
    down = stack(down)                               # [256, 7168, 2048]

Timed warm, best (and median) of ``--repeats`` runs; the machine may be shared, so best-of is the figure:

- trace: the conversion run on RegionTensors, and ``rt.trace`` (that run plus its meta-tensor check);
- peer: the same ops run by torch on meta tensors — a floor for any tracer that calls torch's shape logic;
- compile: ``remap_blocks`` for 8 shard boxes of each output, tensor-parallel (the intermediate dim in 8
  chunks, like DTensor ``Shard``) and expert-parallel (32 experts per box).

The first ``torch.stack`` on meta tensors imports ``torch._dynamo`` (~1.3 s, once per process); it is
measured and reported separately, before the warm timings.

Run: ``python bench/trace_bench.py`` (``--help`` for sizes); ``--markdown`` prints the tables
docs/benchmarks.md holds instead of the plain report.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

try:
    import torch

    import regiontrace as rt
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    import regiontrace as rt


def convert(gate, up, down):
    """MergeModulelist(dim=0) + Concatenate(dim=1) for gate/up, MergeModulelist(dim=0) for down."""
    return {"gate_up_proj": torch.cat([torch.stack(gate), torch.stack(up)], dim=1), "down_proj": torch.stack(down)}


def leaves(experts: int, hidden: int, inter: int, kind: str, dtype: torch.dtype):
    def make(name: str, shape: tuple[int, int]):
        if kind == "region":
            return rt.RegionTensor.leaf(name, shape, dtype)
        return torch.empty(shape, dtype=dtype, device="meta")

    prefix = "model.layers.3.mlp.experts"
    gate = [make(f"{prefix}.{e}.gate_proj.weight", (inter, hidden)) for e in range(experts)]
    up = [make(f"{prefix}.{e}.up_proj.weight", (inter, hidden)) for e in range(experts)]
    down = [make(f"{prefix}.{e}.down_proj.weight", (hidden, inter)) for e in range(experts)]
    return gate, up, down


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Best and median wall time of ``fn()`` over ``repeats`` runs, and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` boundaries of ``n`` in ``parts`` (the last ones may be short or empty)."""
    size = -(-n // parts)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def shard_boxes(shape: tuple[int, ...], dim: int, ranks: int) -> list[tuple[tuple[int, int], ...]]:
    return [tuple((a, b) if d == dim else (0, n) for d, n in enumerate(shape)) for a, b in chunks(shape[dim], ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch = mdtable.LoadWatch()
    say = (lambda *a: None) if args.markdown else print  # --markdown: only the tables, at the end
    E, H, I, ranks = args.experts, args.hidden, args.intermediate, args.ranks
    dtype = torch.bfloat16
    say(
        f"torch {torch.__version__}, regiontrace {rt.__version__}, python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    )
    say(
        f"MoE layer: {E} experts, H={H}, I={I}, bf16: {3 * E} leaves -> gate_up_proj [{E}, {2 * I}, {H}], "
        f"down_proj [{E}, {H}, {I}]"
    )

    # one-time cost: the first torch.stack on meta tensors imports torch._dynamo
    t0 = time.perf_counter()
    torch.stack([torch.empty(2, device="meta"), torch.empty(2, device="meta")])
    first_stack = time.perf_counter() - t0
    say(
        f"\none-time: first torch.stack on meta tensors (imports torch._dynamo): {first_stack * 1e3:.0f} ms "
        "(excluded below)"
    )

    # warm timings
    reps = args.repeats
    *t_leaves, region_inputs = timed(lambda: leaves(E, H, I, "region", dtype), reps)
    *t_meta_leaves, meta_inputs = timed(lambda: leaves(E, H, I, "meta", dtype), reps)
    *t_run, _ = timed(lambda: convert(*region_inputs), reps)
    *t_trace, out = timed(lambda: rt.trace(convert, *region_inputs), reps)
    *t_meta, meta_out = timed(lambda: convert(*meta_inputs), reps)
    assert all(out[k].shape == meta_out[k].shape for k in out)

    say(f"\ntrace (warm; best of {reps}, median in brackets):")
    rows = [
        (f"create {3 * E} leaves", t_leaves, t_meta_leaves),
        ("conversion on RegionTensors", t_run, t_meta),
        ("rt.trace (run + meta check)", t_trace, t_meta),
    ]
    md_names = [f"create {3 * E} leaves", "conversion on RegionTensors", "`rt.trace` (conversion + meta check)"]
    say(f"  {'':30s} {'regiontrace':>18s} {'torch on meta':>18s} {'ratio':>6s}")
    md_steps = []
    for md_name, (name, (a, a_med), (b, b_med)) in zip(md_names, rows):
        say(f"  {name:30s} {a * 1e3:6.1f} ms [{a_med * 1e3:5.1f}] {b * 1e3:6.1f} ms [{b_med * 1e3:5.1f}] {a / b:5.1f}x")
        md_steps.append(
            [md_name, f"{a * 1e3:.1f} ms [{a_med * 1e3:.1f}]", f"{b * 1e3:.1f} ms [{b_med * 1e3:.1f}]", f"{a / b:.1f}x"]
        )
    pieces = []
    for name, t in out.items():
        say(f"  {name}: shape {tuple(t.shape)}, {len(t.region.pieces)} pieces, {len(t.sources())} sources")
        pieces.append(f"`{name}` {len(t.region.pieces)} pieces ({len(t.sources())} source tensors)")

    say(f"\ncompile: remap_blocks for {ranks} shard boxes (warm, best of {reps} per box)")
    say(f"  {'tensor':13s} {'layout':28s} {'blocks/box':>12s} {'ms/box':>14s} {'us/block':>9s} {'MiB read/box':>13s}")
    layouts = {
        "gate_up_proj": [("TP: dim 1 (2I) in chunks", 1), ("EP: experts in chunks", 0)],
        "down_proj": [("TP: dim 2 (I) in chunks", 2), ("EP: experts in chunks", 0)],
    }
    md_layouts = []
    total_blocks = total_time = 0.0
    for name, specs in layouts.items():
        t = out[name]
        for label, dim in specs:
            counts, times = [], []
            for box in shard_boxes(tuple(t.shape), dim, ranks):
                sec, _, blocks = timed(lambda box=box, t=t: t.remap_blocks(box), reps)
                numel = math.prod(b - a for a, b in box)
                assert sum(b.numel for b in blocks) == numel
                assert sum(b.read_numel for b in blocks) == numel  # no over-read
                counts.append(len(blocks))
                times.append(sec)
                total_blocks += len(blocks)
                total_time += sec
            mib = numel * t.dtype.itemsize / 2**20
            per_block = sum(times) / max(sum(counts), 1) * 1e6
            say(
                f"  {name:13s} {label:28s} {min(counts):5d}-{max(counts):<6d} "
                f"{min(times) * 1e3:6.2f}-{max(times) * 1e3:<6.2f} {per_block:9.1f} {mib:13.0f}"
            )
            kind = "TP" if dim else "EP"
            what = f"dim {dim} ({t.shape[dim]}) in {ranks} chunks" if dim else f"{-(-E // ranks)} experts per box"
            md_layouts.append(
                [
                    f"`{name}`",
                    f"{kind}: {what}",
                    str(min(counts)) if min(counts) == max(counts) else f"{min(counts)}–{max(counts)}",
                    mdtable.spread([t * 1e3 for t in times], "{:.1f}", " ms").split(" [")[0].removesuffix(" ms")
                    + " ms",
                    f"{per_block:.0f} µs",
                    f"{mib:.0f} MiB",
                ]
            )
    say(
        f"  all {4 * ranks} boxes: {int(total_blocks)} blocks in {total_time * 1e3:.1f} ms "
        f"({total_time / total_blocks * 1e6:.1f} us per block)"
    )
    load = watch.stop()
    if not args.markdown:
        print(f"load average (1 min) during the run: {load}")
        return
    print(mdtable.run_line(load))
    print()
    print(f"Warm timings, best of {reps} (median in brackets):")
    print()
    print(mdtable.table(["step", "regiontrace", "torch on meta", "ratio"], md_steps))
    print()
    print(
        "One-time, excluded above: the first `torch.stack` on meta tensors in this process, "
        f"{first_stack * 1e3:.0f} ms. "
        f"Resulting maps: {', '.join(pieces)}."
    )
    print()
    print(
        mdtable.table(
            ["output", f"layout ({ranks} boxes)", "blocks per box", "compile per box", "per block", "read per box"],
            md_layouts,
        )
    )
    print()
    print(
        f"All {4 * ranks} boxes: {int(total_blocks)} blocks in {total_time * 1e3:.0f} ms "
        f"({total_time / total_blocks * 1e6:.0f} µs per block); every box checked: its blocks partition it and "
        "read exactly its elements."
    )


if __name__ == "__main__":
    main()
