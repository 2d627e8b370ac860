"""Benchmark: packed checkpoints (compressed-tensors int4, GPTQ, AWQ, MXFP4) loaded at TP 4 into a bf16 model.

    python bench/packed_bench.py [--out DIR] [--layers 2] [--group 128] [--experts 8]
                                 [--formats int4,gptq,awq,mxfp4] [--markdown]

Checkpoints (generated in ``DIR``, default a temporary folder, on first use, one subfolder per format and sizes):

* ``int4``: compressed-tensors W4A16 ``pack-quantized``: ``--layers`` Llama-7B-shaped decoder layers scaled by
  half (``q/k/v/o_proj`` ``[2048, 2048]``, ``gate/up_proj`` ``[5504, 2048]``, ``down_proj`` ``[2048, 5504]``),
  each weight quantized by the ``compressed-tensors`` package itself (symmetric groups of ``--group``:
  ``weight_packed`` int32 words of 8 codes along the input, bf16 ``weight_scale``, ``weight_shape``) with its own
  config. Oracle: compressed-tensors' ``PackedQuantizationCompressor.decompress``.
* ``gptq``: the same linears as GPTQ (4 bits, groups of ``--group``, ``desc_act: false``, asymmetric, v1 zero
  points): random codes, zero points and fp16 scales packed as GPTQModel packs them (``qweight`` 8 codes a word
  along the input, ``qzeros`` 8 a word along the output, ``scales``, ``g_idx``; tests/packed_linears.py). Oracle:
  GPTQModel's ``dequantize_weight``, ported in tests/packed_linears.py (the package does not install here).
* ``awq``: the same linears as AWQ GEMM (4 bits, groups of ``--group``: ``qweight`` and ``qzeros`` 8 a word
  along the output in AWQ's order, fp16 ``scales``). Oracle: AutoAWQ's ``dequantize_gemm``, ported likewise.
* ``mxfp4``: gpt-oss-20b's expert projections with its sizes halved (hidden 1440, intermediate 1440),
  ``--experts`` experts in each of ``--layers`` layers: dense ``gate_up_proj`` ``[E, 1440, 2880]`` and
  ``down_proj`` ``[E, 1440, 1440]`` (``[E, K, out]``) stored as uint8 ``_blocks`` (two E2M1 codes a byte along K)
  and uint8 E8M0 ``_scales`` (one per 32 codes), random (tests/packed_mxfp4.py). Oracle: transformers'
  ``convert_moe_packed_tensors`` (its ``Mxfp4Config(dequantize=True)`` load).

The model is a plain ``nn.Module`` of bf16 parameters named like the dense weights. For 4 ranks and two layouts —
every weight split along its output (``Shard(0)`` of a linear's ``[out, in]``, ``Shard(2)`` of an expert weight's
``[E, K, out]``) or along its input (``Shard(1)``) — per-rank plans are built in this one process
(``HFLoadPlanner(model).build_plan(checkpoint, slots)``, a fresh model and planner per rank, with ``TargetSlot``s of
``loader.placements.shard_boxes``) and executed with a ``FileReader``, page cache warm. Per rank:

* ours: bytes read, and the exact expectation: the words (or MXFP4 bytes), the zero-point words and the scales of
  the groups (blocks) the rank's box touches;
* the shard's own codes and scales: half a byte per element, its share of a scale per group (2 B; MXFP4: 1 B per
  32), and for GPTQ/AWQ its share of the 4-bit zero points;
* peers' bytes, from the checkpoint's header: a vLLM-style whole-tensor read (every stored tensor of each weight
  the rank touches, read whole then cut: ``weight_packed``/``qweight``/``_blocks``, scales, zero points,
  ``weight_shape``, ``g_idx``), and the whole file;
* each read ÷ the shard's codes and scales, and the walls of planning and executing (one run each).

A local shard that differs from its format's own decompression of the whole weight cut to the box (bit for bit), a
deferred tensor, or bytes read (or planned) other than the expectation exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn

BF16 = torch.bfloat16
MIB = 1 << 20
WORLD = 4
SHAPES = {
    "self_attn.q_proj": (2048, 2048),
    "self_attn.k_proj": (2048, 2048),
    "self_attn.v_proj": (2048, 2048),
    "self_attn.o_proj": (2048, 2048),
    "mlp.gate_proj": (5504, 2048),
    "mlp.up_proj": (5504, 2048),
    "mlp.down_proj": (2048, 5504),
}
#: gpt-oss-20b's hidden and intermediate sizes (2880 each), halved
HIDDEN, INTERMEDIATE = 1440, 1440
FORMATS = ("int4", "gptq", "awq", "mxfp4")
#: a linear's stored tensors, by format (``<stem>`` is the dense ``<stem>.weight`` without ``weight``)
STORED = {
    "int4": ("weight_packed", "weight_scale", "weight_shape"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "mxfp4": ("_blocks", "_scales"),
}


def linears(layers: int) -> dict[str, tuple[int, ...]]:
    """Every dense linear weight's name and ``[out, in]`` shape."""
    return {f"layers.{i}.{m}.weight": s for i in range(layers) for m, s in SHAPES.items()}


def experts(layers: int, count: int) -> dict[str, tuple[int, ...]]:
    """Every dense MXFP4 expert weight's name and ``[E, K, out]`` shape."""
    out = {}
    for i in range(layers):
        out[f"layers.{i}.mlp.experts.gate_up_proj"] = (count, HIDDEN, 2 * INTERMEDIATE)
        out[f"layers.{i}.mlp.experts.down_proj"] = (count, INTERMEDIATE, HIDDEN)
    return out


def stored_keys(fmt: str, name: str) -> list[str]:
    """The checkpoint keys a dense weight ``name`` is stored as."""
    stem = name if fmt == "mxfp4" else name[: -len("weight")]
    return [stem + s for s in STORED[fmt]]


class Dense(nn.Module):
    """bf16 parameters named like the checkpoint's dense weights (``layers.0.mlp.up_proj.weight`` …)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=BF16), requires_grad=False))


# ---------------------------------------------------------------------------------------------------
# checkpoints and their oracles


def generate(fmt: str, folder: str, shapes: dict, group: int) -> None:
    """Write ``fmt``'s checkpoint in ``folder`` (skipped when its ``config.json`` is there: written last)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    if fmt == "int4":
        from packed_int4 import scheme_of, write_pack_quantized

        tensors = {k: (torch.randn(s, generator=g) * 0.02).to(BF16) for k, s in shapes.items()}
        write_pack_quantized(folder, tensors, scheme_of(4, group, True), quantize=lambda n, t: True)
    elif fmt in ("gptq", "awq"):
        from packed_linears import quant_config, random_linear, write_linears

        parts = {k[: -len(".weight")]: random_linear(fmt, *s, 4, group, g) for k, s in shapes.items()}
        write_linears(folder, parts, quant_config(fmt, 4, group))
    else:
        from packed_mxfp4 import random_mxfp4
        from safetensors.torch import save_file

        stored = {}
        for name, (e, k, o) in shapes.items():
            stored[name + "_blocks"], stored[name + "_scales"] = random_mxfp4((e, o, k), g)
        save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"quantization_config": {"quant_method": "mxfp4"}}, f)


def reference(fmt: str, folder: str, shapes: dict, group: int) -> dict[str, torch.Tensor]:
    """The format's own decompression of every weight, bf16 (the oracle)."""
    from safetensors.torch import load_file

    stored = load_file(os.path.join(folder, "model.safetensors"))
    parts = {name: {k: stored[k] for k in stored_keys(fmt, name)} for name in shapes}
    out = {}
    if fmt == "int4":
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from packed_int4 import scheme_of

        scheme = scheme_of(4, group, True)
        for name, t in parts.items():
            state = {k.rsplit(".", 1)[1]: v for k, v in t.items()}
            out[name] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(BF16)
    elif fmt in ("gptq", "awq"):
        from packed_linears import dequantized

        for name, t in parts.items():
            out[name] = dequantized(fmt, {k.rsplit(".", 1)[1]: v for k, v in t.items()}, 4, group).to(BF16)
    else:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        for name, t in parts.items():
            out[name] = convert_moe_packed_tensors(t[name + "_blocks"], t[name + "_scales"], dtype=BF16)
    for name, shape in shapes.items():
        assert tuple(out[name].shape) == shape, (fmt, name, out[name].shape, shape)
    return out


def _touched(lo: int, hi: int, per: int) -> int:
    """How many runs of ``per`` elements ``[lo, hi)`` touches."""
    return -(-hi // per) - lo // per if hi > lo else 0


def expected_bytes(fmt: str, box, group: int) -> int:
    """The bytes ours reads for one weight's box: the words (bytes) and zero-point words holding its codes, and the
    scales of the groups (blocks) it touches."""
    if fmt == "mxfp4":  # [E, K, out]; stored [E, out, K / 32, 16]: bytes of 2 codes along K, an exponent per 32
        (e0, e1), (k0, k1), (o0, o1) = box
        return (e1 - e0) * (o1 - o0) * (_touched(k0, k1, 2) + _touched(k0, k1, 32))
    (r0, r1), (c0, c1) = box
    rows, groups = r1 - r0, _touched(c0, c1, group)
    if fmt == "int4":  # words along the input, bf16 scales [out, groups]
        return rows * (_touched(c0, c1, 8) * 4 + groups * 2)
    zeros = 4 * groups * _touched(r0, r1, 8)  # zero points 8 a word along the output, [groups, out / 8]
    if fmt == "gptq":  # qweight [in / 8, out]: words along the input
        words = _touched(c0, c1, 8) * rows
    else:  # AWQ qweight [in, out / 8]: words along the output
        words = (c1 - c0) * _touched(r0, r1, 8)
    return 4 * words + zeros + 2 * groups * rows


def own_bytes(fmt: str, numel: int, group: int) -> int:
    """A shard's own codes and scales (and zero points): half a byte per element, its share of the rest."""
    if fmt == "mxfp4":
        return numel // 2 + numel // 32
    if fmt == "int4":
        return numel // 2 + numel * 2 // group
    return numel // 2 + numel * 2 // group + numel // group // 2


def _cut(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


# ---------------------------------------------------------------------------------------------------


@dataclass
class Format:
    key: str
    label: str
    shapes: dict
    layouts: tuple[tuple[str, int], ...]
    oracle: str
    stored: str


def formats(layers: int, group: int, count: int) -> dict[str, Format]:
    lin = linears(layers)
    tp = (("output: `Shard(0)`", 0), ("input: `Shard(1)`", 1))
    return {
        "int4": Format(
            "int4", f"compressed-tensors W4A16 (`pack-quantized`, symmetric, group {group})", lin, tp,
            "compressed-tensors' `PackedQuantizationCompressor.decompress`",
            "int32 `weight_packed` (8 codes a word along the input), bf16 `weight_scale`, `weight_shape`; "
            "quantized by compressed-tensors from random normal bf16",
        ),
        "gptq": Format(
            "gptq", f"GPTQ (4 bits, group {group}, `desc_act: false`, asymmetric, v1 zero points)", lin, tp,
            "GPTQModel's `dequantize_weight` (ported, tests/packed_linears.py)",
            "int32 `qweight` (8 codes a word along the input), `qzeros` (8 a word along the output), fp16 `scales`, "
            "int32 `g_idx`; random",
        ),
        "awq": Format(
            "awq", f"AWQ GEMM (4 bits, group {group}, zero points)", lin, tp,
            "AutoAWQ's `dequantize_gemm` (ported, tests/packed_linears.py)",
            "int32 `qweight` and `qzeros` (8 a word along the output, AWQ order), fp16 `scales`; random",
        ),
        "mxfp4": Format(
            "mxfp4", "MXFP4 (gpt-oss experts, blocks of 32)", experts(layers, count),
            (("output: `Shard(2)`", 2), ("input (K): `Shard(1)`", 1)),
            "transformers' `convert_moe_packed_tensors`",
            "uint8 `_blocks` (2 E2M1 codes a byte along K), uint8 E8M0 `_scales` (one per 32 codes); random",
        ),
    }  # fmt: skip


def run_format(fmt: Format, folder: str, group: int, failures: list[str]) -> tuple[dict, list[dict]]:
    """Every rank of both layouts: its rows, and the checkpoint's figures."""
    from torch.distributed.tensor import Shard

    from loader import HFLoadPlanner
    from loader.checkpoint import FileReader, SafetensorsCheckpoint
    from loader.execute import execute_plan
    from loader.options import LoadOptions
    from loader.placements import shard_boxes
    from loader.plan import TargetSlot

    want = reference(fmt.key, folder, fmt.shapes, group)
    checkpoint = SafetensorsCheckpoint.open(folder)
    infos = checkpoint.tensors
    tensors = sum(info.nbytes for info in infos.values())
    file_bytes = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))
    whole_of = {n: sum(infos[k].nbytes for k in stored_keys(fmt.key, n)) for n in fmt.shapes}
    rows = []
    for label, dim in fmt.layouts:
        for rank in range(WORLD):
            model = Dense(fmt.shapes)
            slots, expected, own, whole = {}, 0, 0, 0
            for name, shape in fmt.shapes.items():
                boxes = shard_boxes(shape, (WORLD,), (rank,), [Shard(dim)])
                ((g, _),) = boxes
                local = torch.zeros(tuple(b - a for a, b in g), dtype=BF16)
                slots[name] = TargetSlot(name, shape, BF16, local, boxes)
                own += own_bytes(fmt.key, local.numel(), group)
                expected += expected_bytes(fmt.key, g, group)
                whole += whole_of[name] if local.numel() else 0  # every stored tensor of a weight it touches
            t0 = time.perf_counter()
            plan = HFLoadPlanner(model).build_plan(checkpoint, slots)
            t1 = time.perf_counter()
            c0 = time.process_time()
            with FileReader() as reader:
                execute_plan(plan, reader, LoadOptions(progress=False))
            t2, c1 = time.perf_counter(), time.process_time()
            bad = [
                n for n, s in slots.items()
                if not torch.equal(s.local.view(torch.int16), _cut(want[n], s.boxes[0][0]).view(torch.int16))
            ]  # fmt: skip
            where = f"{fmt.key} {label} rank {rank}"
            if bad:
                failures.append(f"{where}: {len(bad)} shards differ from the oracle, e.g. {bad[:2]}")
            if plan.deferred:
                failures.append(f"{where}: {len(plan.deferred)} deferred")
            if reader.bytes_read != expected or plan.planned_bytes() != expected:
                failures.append(f"{where}: read {reader.bytes_read} B, planned {plan.planned_bytes()}, want {expected}")
            rows.append(
                {"layout": label, "rank": rank, "read": reader.bytes_read, "expected": expected, "own": own,
                 "whole": whole, "file": file_bytes, "plan": t1 - t0, "execute": t2 - t1, "cpu": c1 - c0}
            )  # fmt: skip
            del model, slots, plan
    figures = {"weights": len(fmt.shapes), "tensors": tensors, "file": file_bytes, "stored": len(infos)}
    return figures, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder of the checkpoints (generated on first use)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--group", type=int, default=128, help="int4, GPTQ and AWQ group size")
    parser.add_argument("--experts", type=int, default=8, help="MXFP4 experts per layer")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of " + ", ".join(FORMATS))
    parser.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    args = parser.parse_args(argv)
    chosen = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not chosen or any(f not in FORMATS for f in chosen):
        parser.error(f"--formats: choose among {', '.join(FORMATS)}")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here), os.path.join(os.path.dirname(here), "tests")]
    import mdtable

    say = (lambda *a: None) if args.markdown else print
    root = args.out or tempfile.mkdtemp(prefix="packed_bench_")
    table = formats(args.layers, args.group, args.experts)
    folders = {}
    for key in chosen:
        size = f"e{args.experts}" if key == "mxfp4" else f"g{args.group}"
        folders[key] = os.path.join(root, f"{key}-l{args.layers}-{size}")
        t0 = time.perf_counter()
        generate(key, folders[key], table[key].shapes, args.group)
        say(f"{key}: {folders[key]} ready in {time.perf_counter() - t0:.1f} s")

    watch = mdtable.LoadWatch()
    failures: list[str] = []
    results = {}
    for key in chosen:
        t0 = time.perf_counter()
        results[key] = run_format(table[key], folders[key], args.group, failures)
        say(f"{key}: 8 rank loads and the oracle in {time.perf_counter() - t0:.1f} s")
    load = watch.stop()

    checkpoints = []
    for key in chosen:
        fig, rows = results[key]
        checkpoints.append(
            [table[key].label, table[key].stored, f"{fig['weights']} ({fig['stored']} tensors)",
             f"{fig['tensors']:,} ({fig['tensors'] / MIB:.1f} MiB)", f"{fig['file']:,}",
             f"{rows[0]['whole']:,}", table[key].oracle]
        )  # fmt: skip
    ranks = []
    for key in chosen:
        for r in results[key][1]:
            ranks.append(
                [key, r["layout"], r["rank"], f"{r['read']:,}",
                 f"{r['expected']:,}" + (" =" if r["read"] == r["expected"] else " **≠**"), f"{r['own']:,}",
                 f"{r['read'] / r['own']:.4f}", f"{r['whole'] / r['own']:.4f}", f"{r['file'] / r['own']:.4f}",
                 f"{r['plan']:.2f}", f"{r['execute']:.2f}", f"{r['cpu']:.2f}"]
            )  # fmt: skip
    checked = (
        "check: on every rank of every layout, every local shard equals its format's own decompression of the "
        "whole weight cut to the box (bit for bit); nothing deferred; bytes read = planned = expected"
        if not failures
        else f"check FAILED ({len(failures)}): {failures[:8]}"
    )
    headers_c = ["format", "stored", "weights", "tensor bytes", "file bytes", "whole tensors (vLLM-style) per rank",
                 "values checked against"]  # fmt: skip
    headers_r = ["format", "layout", "rank", "ours: bytes read", "expected (words + groups touched)",
                 "shard codes + scales (+ zeros)", "ours ÷ shard", "whole tensors (vLLM-style) ÷ shard",
                 "whole file ÷ shard", "plan s", "execute s", "execute CPU s"]  # fmt: skip
    if args.markdown:
        print(mdtable.run_line(load, ("torch", "transformers", "safetensors", "compressed-tensors")))
        print()
        print(
            f"Checkpoints ({args.layers} layers; linears `[2048, 2048]` x4, `[5504, 2048]` x2, `[2048, 5504]` per "
            f"layer; MXFP4 {args.experts} experts of `[{HIDDEN}, {2 * INTERMEDIATE}]` + `[{INTERMEDIATE}, {HIDDEN}]` "
            "per layer), one safetensors file each, loaded into bf16:"
        )
        print()
        print(mdtable.table(headers_c, checkpoints))
        print()
        print(
            f"Per rank, {WORLD} ranks planned and executed in this one process (a fresh model and planner per rank, "
            "page cache warm). Bytes are exact; the walls are one run each on a shared machine (noisy: they vary "
            "run to run by more than the formats differ):"
        )
        print()
        print(mdtable.table(headers_r, ranks))
        print()
        print(checked + ".")
    else:
        print(mdtable.table(headers_c, checkpoints))
        print()
        print(mdtable.table(headers_r, ranks))
        print(checked)
        print(f"load average (1 min) during the run: {load}")
    if failures:
        print("\n".join(failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
