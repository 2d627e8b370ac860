"""Benchmark: load an FP8 block-quantized checkpoint (DeepSeek-V3-shaped MoE experts) into a bf16 model.

    python bench/fp8_bench.py [--out DIR] [--experts 8] [--repeat 3] [--profile] [--markdown]

The checkpoint (generated in ``DIR``, default a temporary folder, on first use) stores what DeepSeek-V3 stores
for its routed experts: per expert ``gate_proj``/``up_proj`` ``[2048, 7168]`` and ``down_proj`` ``[7168, 2048]``
as ``float8_e4m3fn`` codes plus ``<weight>_scale_inv``, one float32 scale per 128 x 128 block (quantized the
way DeepSeek-V3's are: per-block amax / 448, from random normal weights), ``--experts N`` of them, and two
weights the block does not divide, so that the ceil-grid path is measured: ``kv_a_proj_with_mqa``
``[576, 7168]`` (DeepSeek-V3's own shape, a 5 x 56 scale grid) and a synthetic ``odd_proj`` ``[1000, 7168]``
(8 x 56). Files: ``--shards`` safetensors files (a weight and its scales in the same file) with
``model.safetensors.index.json`` and a ``config.json`` whose ``quantization_config`` is
``{"quant_method": "fp8", "weight_block_size": [128, 128]}``. The model is a plain ``nn.Module`` whose bf16
parameters are named like the checkpoint's weights (no conversion besides the dequantization).

Methods, all in this one process, page cache warm (every file read once before timing), one untimed run each
first, then ``--repeat`` timed runs, the methods alternating (best and median wall reported, and the fewest CPU
seconds of the process, all threads: steadier than the wall on a shared machine):

* ``floor``: ``preadv`` of every file whole into one already-touched buffer: raw bytes, no dequantization.
* ``ours``: ``load_hf_checkpoint(model, DIR)`` into the built bf16 model (dequantized on load, traced: value
  reads; ``report.deferred == ()`` is checked).
* ``plan``: ``HFLoadPlanner(model).build_plan(SafetensorsCheckpoint.open(DIR))`` alone: the part of ``ours``
  that reads no tensor data (headers, rules, traces, value programs).
* ``peer``: what a loader without region reads does: ``safetensors.torch.load_file`` of every file, then
  transformers' own dequantization, ``Fp8Dequantize(None)._dequantize_one(w, s, torch.bfloat16)``, per weight
  and a copy into the model. ``_dequantize_one`` infers the block from the scale grid, which is wrong or
  refused where the block does not divide the weight, so those two weights are padded with zero codes to
  whole blocks first and the result cut back (the padding is timed).
* ``from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))`` needs ``accelerate``
  (and a transformers model): not run where accelerate is not installed (said so in the output).

Each timed run also counts the minor page faults it caused (``getrusage``; memory touched for the first time:
fresh allocations above glibc's mmap threshold fault in page by page on every run).

The **first load** of ``ours`` and of ``peer`` is also timed in a fresh subprocess each (imports timed apart;
the model built before, not timed): what a user who starts a program and loads once waits for.

Every model tensor of ``ours`` is compared with ``peer``'s bit for bit; a difference exits with status 1.

Tensor / expert parallel: for 4 ranks, per-rank plans are built in this one process (``HFLoadPlanner(model)
.build_plan(SafetensorsCheckpoint.open(DIR), slots)`` with ``TargetSlot``s from
``loader.placements.shard_boxes``) and executed with a ``FileReader``; layouts ``TP Shard(0)`` (rows of every
weight), ``TP Shard(1)`` (columns) and ``EP`` (whole experts, ``E / 4`` per rank; the two non-expert weights
replicated). Per rank: bytes read, the exact expectation (codes of its weight regions, 1 byte each, plus
4 bytes per scale block those regions touch), the checkpoint's tensor bytes, the ratio, and the walls of
planning and of executing. ``bytes read != expectation`` or a local shard that differs from ``peer``'s full
tensor cut to the box exits with status 1.

``--profile`` prints a cProfile of one warm ``ours`` load (top 25 by cumulative time) after the report.
``--markdown`` prints the tables docs/benchmarks.md holds.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from common import ours_options, pread_all, safetensors_files

H, I = 7168, 2048  # DeepSeek-V3 hidden size and moe_intermediate_size
BLOCK = (128, 128)
WORLD = 4
MIB = 1 << 20
SCALE = "_scale_inv"
EXPERT = "model.layers.0.mlp.experts.{e}.{p}_proj.weight"
ODD = [("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, H)), ("model.layers.0.odd_proj.weight", (1000, H))]


def layout(experts: int) -> list[tuple[str, tuple[int, int]]]:
    """The checkpoint's weights (each stored as codes + scales) and their shapes, in file order."""
    out = list(ODD)
    for e in range(experts):
        out += [(EXPERT.format(e=e, p=p), (I, H)) for p in ("gate", "up")]
        out += [(EXPERT.format(e=e, p="down"), (H, I))]
    return out


def grid(shape: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / BLOCK[0]), math.ceil(shape[1] / BLOCK[1])


def quantize(w, block=BLOCK):
    """``(codes, scale_inv)`` as DeepSeek-V3 quantizes: per-block amax / 448, float8_e4m3fn codes."""
    import torch

    bm, bn = block
    rows, cols = w.shape
    gr, gc_ = grid((rows, cols))
    padded = torch.zeros(gr * bm, gc_ * bn)
    padded[:rows, :cols] = w
    blocks = padded.view(gr, bm, gc_, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).view(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return codes.contiguous(), scale.contiguous()


def generate(out: str, experts: int, shards: int) -> None:
    """Write the checkpoint into ``out`` unless the one there was made with the same settings."""
    import torch
    from safetensors.torch import save_file

    stamp = os.path.join(out, "fp8_bench.json")
    settings = {"experts": experts, "shards": shards, "block": list(BLOCK), "version": 1}
    if os.path.isfile(stamp) and json.load(open(stamp)) == settings:
        return
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(out, name))
    weights = layout(experts)
    total = sum(r * c for _, (r, c) in weights)
    g = torch.Generator().manual_seed(0)
    groups: list[list[tuple[str, tuple[int, int]]]] = [[]]
    size = 0
    for name, shape in weights:
        if groups[-1] and size >= total * len(groups) / shards:
            groups.append([])
        groups[-1].append((name, shape))
        size += shape[0] * shape[1]
    weight_map, total_size = {}, 0
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {}
        for name, shape in group:
            part[name], part[name + SCALE] = quantize(torch.randn(shape, generator=g) * 0.02)
            weight_map[name] = weight_map[name + SCALE] = file
            total_size += part[name].numel() + 4 * part[name + SCALE].numel()
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}}, f)
    with open(stamp, "w") as f:
        json.dump(settings, f)


def build_model(experts: int):
    """A plain module whose bf16 parameters are named like the checkpoint's weights (zeroed: touched)."""
    import torch
    from torch import nn

    root = nn.Module()
    for name, shape in layout(experts):
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False))
    return root


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------------
# the methods


def load_ours(model, directory: str):
    from loader import load_hf_checkpoint

    report = load_hf_checkpoint(model, directory, **ours_options(progress=False))
    assert report.deferred == (), report.deferred_reasons
    return report


def load_peer(model, directory: str) -> int:
    """``load_file`` of every file + transformers' ``_dequantize_one`` per weight + a copy into the model; returns
    the checkpoint bytes it took."""
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(None)._dequantize_one
    params = dict(model.named_parameters())
    taken = 0
    with torch.no_grad():
        for f in safetensors_files(directory):
            state = load_file(f)
            for key, w in state.items():
                taken += w.numel() * w.element_size()
                if key.endswith(SCALE):
                    continue
                s = state[key + SCALE]
                rows, cols = w.shape
                gr, gc_ = s.shape
                if rows % gr or cols % gc_ or rows // gr != BLOCK[0] or cols // gc_ != BLOCK[1]:
                    padded = torch.zeros(gr * BLOCK[0], gc_ * BLOCK[1], dtype=w.dtype)
                    padded[:rows, :cols] = w
                    out = dequantize(padded, s, torch.bfloat16)[:rows, :cols]
                else:
                    out = dequantize(w, s, torch.bfloat16)
                params[key].copy_(out)
    return taken


def transformers_unpadded(directory: str) -> list[str]:
    """What ``_dequantize_one`` makes of the two weights the block does not divide, unpadded (one line each)."""
    import torch
    from safetensors import safe_open
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from loader.rules.fp8 import dequantize_quant_blocks

    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))["weight_map"]
    lines = []
    for key, shape in ODD:
        with safe_open(os.path.join(directory, index[key]), "pt") as f:
            w, s = f.get_tensor(key), f.get_tensor(key + SCALE)
        try:
            theirs = Fp8Dequantize(None)._dequantize_one(w, s, torch.bfloat16)
        except ValueError as e:
            lines.append(f"`{list(shape)}` (scale grid {list(s.shape)}): refused (`ValueError: {e}`)")
            continue
        want = dequantize_quant_blocks(w, s, BLOCK, torch.bfloat16)
        bad = int((theirs.view(torch.int16) != want.view(torch.int16)).sum())
        bm, bn = shape[0] // s.shape[0], shape[1] // s.shape[1]
        lines.append(
            f"`{list(shape)}` (scale grid {list(s.shape)}): blocks of {bm} x {bn} inferred, "
            f"{bad} of {w.numel()} elements ({100 * bad / w.numel():.0f}%) differ from the 128 x 128 definition"
        )
    return lines


# ---------------------------------------------------------------------------------------------------
# the first load, in a fresh process


def first_worker(method: str, directory: str, experts: int) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401 - timed

    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    if method == "ours":
        import loader  # noqa: F401
    else:
        import safetensors.torch  # noqa: F401
        import transformers.integrations.finegrained_fp8  # noqa: F401
    method_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = build_model(experts)
    build = time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    (load_ours if method == "ours" else load_peer)(model, directory)
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"import": base + method_import, "build": build, "first": first, "first_cpu": first_cpu}


def first_load(method: str, directory: str, experts: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--first", method, "--out", directory, "--experts", str(experts)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# tensor / expert parallel ranks


def scale_blocks(box) -> int:
    (r0, r1), (c0, c1) = box
    return (math.ceil(r1 / BLOCK[0]) - r0 // BLOCK[0]) * (math.ceil(c1 / BLOCK[1]) - c0 // BLOCK[1])


def parallel(directory: str, experts: int, want: dict) -> tuple[list[dict], list[str]]:
    """Per-rank plans and reads for the three layouts; returns rows and the failures found."""
    import torch
    from torch.distributed.tensor import Shard

    from loader import HFLoadPlanner
    from loader.checkpoint import FileReader, SafetensorsCheckpoint
    from loader.execute import execute_plan
    from loader.options import LoadOptions
    from loader.placements import shard_boxes
    from loader.plan import TargetSlot

    checkpoint = SafetensorsCheckpoint.open(directory)
    weights = layout(experts)
    total = sum(info.nbytes for info in checkpoint.tensors.values())
    model = build_model(experts)  # its tensors are not written: the slots hold the ranks' local tensors
    planner = HFLoadPlanner(model)
    rows, failures = [], []
    for label in ("TP Shard(0)", "TP Shard(1)", "EP"):
        for rank in range(WORLD):
            slots, expect = {}, 0
            for name, shape in weights:
                if label == "EP":  # whole experts, E / 4 per rank; the other weights replicated
                    expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None
                    whole = ((0, shape[0]), (0, shape[1]))
                    mine = expert is None or expert * WORLD // experts == rank
                    boxes = ((whole, whole),) if mine else ()
                else:
                    boxes = shard_boxes(shape, (WORLD,), (rank,), [Shard(0 if "(0)" in label else 1)])
                local = None
                if boxes:
                    ((g, lb),) = boxes
                    local = torch.full(tuple(b - a for a, b in lb), float("nan"), dtype=torch.bfloat16)
                    expect += math.prod(b - a for a, b in g) + 4 * scale_blocks(g)
                slots[name] = TargetSlot(name, shape, torch.bfloat16, local, boxes)
            t0 = time.perf_counter()
            plan = planner.build_plan(checkpoint, slots)
            planned = time.perf_counter() - t0
            if plan.deferred:
                failures.append(f"{label} rank {rank}: deferred {[d.conversion.description for d in plan.deferred]}")
            t0 = time.perf_counter()
            with FileReader() as reader:
                execute_plan(plan, reader, LoadOptions(progress=False))
            executed = time.perf_counter() - t0
            for name, slot in slots.items():
                if slot.boxes:
                    ((g, _),) = slot.boxes
                    (r0, r1), (c0, c1) = g
                    if not torch.equal(slot.local.view(torch.int16), want[name][r0:r1, c0:c1].view(torch.int16)):
                        failures.append(f"{label} rank {rank}: {name} differs from peer's values")
            if reader.bytes_read != expect:
                failures.append(f"{label} rank {rank}: read {reader.bytes_read} B, expected {expect} B")
            rows.append(
                {
                    "layout": label,
                    "rank": rank,
                    "read": reader.bytes_read,
                    "expect": expect,
                    "total": total,
                    "plan": planned,
                    "execute": executed,
                    "values": len(plan.values),
                }
            )
            del slots, plan
            gc.collect()
    return rows, failures


# ---------------------------------------------------------------------------------------------------


LABELS = {
    "floor": "floor: `preadv` of every file into one buffer (raw bytes, no dequantization)",
    "ours": "ours: `load_hf_checkpoint` into the bf16 model (dequantized on load)",
    "plan": "of which planning: `HFLoadPlanner.build_plan` alone (headers, rules, traces; reads nothing)",
    "peer": "peer: `load_file` of every file + transformers' `Fp8Dequantize._dequantize_one` per weight + copy",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder of the checkpoint (generated on first use)")
    parser.add_argument("--experts", type=int, default=8, help="experts (3 weights each, 44 MB of codes)")
    parser.add_argument("--shards", type=int, default=3, help="safetensors files")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method")
    parser.add_argument("--profile", action="store_true", help="cProfile one warm ours load")
    parser.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    parser.add_argument("--first", choices=("ours", "peer"), help=argparse.SUPPRESS)  # the subprocess
    args = parser.parse_args(argv)
    if args.experts % WORLD:
        parser.error(f"--experts must be a multiple of {WORLD} (EP ranks)")
    if args.first:
        print(json.dumps(first_worker(args.first, args.out, args.experts)))
        return 0

    import torch
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    hf_logging.set_verbosity_error()
    say = (lambda *a: None) if args.markdown else print
    directory = args.out or tempfile.mkdtemp(prefix="fp8_bench_")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    generate(directory, args.experts, args.shards)
    made = time.perf_counter() - t0
    files = [(f, os.path.getsize(f)) for f in safetensors_files(directory)]
    size = sum(n for _, n in files)
    biggest = max(n for _, n in files)
    weights = layout(args.experts)
    codes = sum(r * c for _, (r, c) in weights)
    scales = sum(4 * math.prod(grid(s)) for _, s in weights)
    say(
        f"checkpoint: {directory} ({len(files)} files, {size / MIB:.1f} MiB: {codes / MIB:.1f} MiB codes, "
        f"{scales / 1024:.1f} KiB scales; ready in {made:.1f} s)"
    )
    watch = mdtable.LoadWatch()
    for f, n in files:  # warm the page cache
        pread_all(f, memoryview(bytearray(n)), n)

    buffer = torch.zeros(biggest, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    ours_model, peer_model = build_model(args.experts), build_model(args.experts)
    last: dict = {}

    def floor():
        for f, n in files:
            pread_all(f, view, n)
        return size

    def ours():
        last["report"] = load_ours(ours_model, directory)
        return last["report"].bytes_read

    def peer():
        return load_peer(peer_model, directory)

    def plan_only():
        from loader import HFLoadPlanner, SafetensorsCheckpoint

        plan = HFLoadPlanner(ours_model).build_plan(SafetensorsCheckpoint.open(directory))
        return plan.planned_bytes()

    runs = {"floor": floor, "ours": ours, "plan": plan_only, "peer": peer}
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    faults: dict[str, list[int]] = {k: [] for k in runs}
    bytes_of: dict[str, int] = {}
    for round_ in range(1 + args.repeat):
        for name, run in runs.items():
            gc.collect()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            bytes_of[name] = run()
            if round_:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if round_:
            say(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()))

    failures = []
    peer_state = dict(peer_model.named_parameters())
    for name, t in ours_model.named_parameters():
        if not torch.equal(t.data.view(torch.int16), peer_state[name].data.view(torch.int16)):
            failures.append(f"ours: {name} differs from peer's")
    if bytes_of["ours"] != codes + scales:
        failures.append(f"ours read {bytes_of['ours']} B, the checkpoint's tensors are {codes + scales} B")

    first = {m: first_load(m, directory, args.experts) for m in ("ours", "peer")}
    say("first loads (fresh processes):", first)
    want = {k: v.data for k, v in peer_state.items()}
    ranks, rank_failures = parallel(directory, args.experts, want)
    failures += rank_failures
    unpadded = transformers_unpadded(directory)
    load = watch.stop()

    page = os.sysconf("SC_PAGE_SIZE")
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median_low(v) for k, v in times.items()}
    fp = (
        "`from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))`: not run "
        + ("(needs a transformers model; not part of this script yet)" if _has("accelerate") else
           "(transformers requires `accelerate` for it, not installed here)")
    )  # fmt: skip
    checked = (
        f"check: every model tensor of ours equals peer's, bit for bit ({len(peer_state)} tensors); every rank's "
        "local shards equal peer's tensors cut to its boxes, and its bytes read equal the expectation"
        if not failures
        else f"check FAILED ({len(failures)}): {failures[:8]}"
    )
    if args.markdown:
        print(mdtable.run_line(load, ("torch", "transformers", "safetensors")))
        print()
        print(
            f"{args.experts} experts x (`gate_proj`, `up_proj` `[{I}, {H}]`, `down_proj` `[{H}, {I}]`) + "
            f"`[576, {H}]` + `[1000, {H}]`, float8_e4m3fn codes + float32 scales per 128 x 128 block: "
            f"{len(files)} files, {size / MIB:.1f} MiB ({codes / MIB:.1f} MiB codes, {scales / 1024:.1f} KiB "
            f"scales); into bf16 ({2 * codes / MIB:.1f} MiB); torch threads {torch.get_num_threads()}; page cache "
            f"warm; after 1 untimed run per method, best and median of {args.repeat} (methods alternating); first "
            "load: a fresh process, imports and model build not included:"
        )
        print()
        rows = []
        for k in runs:
            firsts = (
                f"{first[k]['first']:.3f} s, CPU {first[k]['first_cpu']:.3f} s (imports {first[k]['import']:.2f} s)"
                if k in first
                else ""
            )
            rows.append(
                [
                    LABELS[k],
                    f"{best[k]:.3f} s",
                    f"{median[k]:.3f} s",
                    f"{min(cpu[k]):.3f} s",
                    firsts,
                    f"{best[k] / best['floor']:.1f}x" if k != "plan" else "",
                    f"{size / MIB / best[k]:.0f}" if k != "plan" else "",
                    f"{min(faults[k]):,} ({min(faults[k]) * page / MIB:.0f} MiB)",
                ]
            )
        headers = ["method", "best", "median", "CPU (best)", "first load", "best / floor", "checkpoint MiB/s"]
        headers.append("page faults (fewest)")
        print(mdtable.table(headers, rows))
        print()
        print(f"{checked}. {fp}.")
        print()
        print(
            "transformers' `_dequantize_one` without the padding (it infers the block from the scale grid): "
            + "; ".join(unpadded)
            + "."
        )
        print()
        print(
            f"Per rank, {WORLD} ranks planned and read in this one process (one `HFLoadPlanner`, its trace cache "
            "shared: rank 0 of the first layout pays the tracing); expected = codes of the rank's weight regions "
            "(1 B each) + 4 B per scale block they touch; EP: experts split over the ranks, the two other weights "
            "replicated:"
        )
        print()
        table = []
        for r in ranks:
            table.append(
                [
                    r["layout"],
                    r["rank"],
                    f"{r['read']:,}",
                    f"{r['expect']:,}" + (" =" if r["read"] == r["expect"] else " **≠**"),
                    f"{r['read'] / r['total']:.3f}",
                    r["values"],
                    f"{r['plan']:.3f} s",
                    f"{r['execute']:.3f} s",
                ]
            )
        print(
            mdtable.table(
                ["layout", "rank", "bytes read", "expected (codes + scale blocks)", "read / checkpoint",
                 "value reads", "plan", "execute"],
                table,
            )
        )  # fmt: skip
        print()
        print(f"Checkpoint tensor bytes: {ranks[0]['total']:,} (files {size:,} B with headers).")
    else:
        for k in runs:
            print(
                f"{k:6s} best {best[k]:.3f} s, median {median[k]:.3f} s, CPU {min(cpu[k]):.3f} s, "
                f"{best[k] / best['floor']:.1f}x floor, "
                f"minor page faults {min(faults[k]):,}"
            )
        for r in ranks:
            print(r)
        print(checked)
        print(fp)
        print("\n".join(unpadded))
        print(f"load average (1 min) during the run: {load}")
    if args.profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        load_ours(ours_model, directory)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
        print("\n```text\n" + text.getvalue().strip() + "\n```" if args.markdown else text.getvalue())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
