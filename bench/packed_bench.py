"""Benchmark: a compressed-tensors int4 ``pack-quantized`` checkpoint loaded at TP 4 into a bf16 model.

    python bench/packed_bench.py [--out DIR] [--layers 2] [--group 128]

The checkpoint (generated in ``DIR``, default a temporary folder, on first use) holds ``--layers`` Llama-7B-shaped
decoder layers scaled by half (``q/k/v/o_proj`` ``[2048, 2048]``, ``gate/up_proj`` ``[5504, 2048]``, ``down_proj``
``[2048, 5504]``), each weight quantized by the ``compressed-tensors`` package itself (W4A16, symmetric groups of
``--group``: ``weight_packed`` int32 words of 8 codes, bf16 ``weight_scale``, ``weight_shape``) with its own config.
The model is a plain ``nn.Module`` of bf16 parameters named like the dense weights.

For 4 ranks, per-rank plans are built in this one process (``HFLoadPlanner(model).build_plan(checkpoint, slots)``
with ``TargetSlot``s of ``loader.placements.shard_boxes``) and executed with a ``FileReader``: ``TP Shard(0)``
(output rows of every weight) and ``TP Shard(1)`` (input columns). Per rank: bytes read, the exact expectation (per
row of its box, the int32 words and the bf16 scales of the groups its columns touch), the shard's own codes and
scales (half a byte per element, its share of a scale per ``--group`` elements), the ratio of bytes read to those,
and the walls of planning and of executing. A local shard that differs from compressed-tensors' own decompression
of the whole weight cut to the box, a deferred tensor, or bytes read other than the expectation exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn

BF16 = torch.bfloat16
SHAPES = {
    "self_attn.q_proj": (2048, 2048),
    "self_attn.k_proj": (2048, 2048),
    "self_attn.v_proj": (2048, 2048),
    "self_attn.o_proj": (2048, 2048),
    "mlp.gate_proj": (5504, 2048),
    "mlp.up_proj": (5504, 2048),
    "mlp.down_proj": (2048, 5504),
}
WORLD = 4


def names(layers: int) -> dict[str, tuple[int, int]]:
    """Every dense weight's name and shape."""
    return {f"layers.{i}.{m}.weight": s for i in range(layers) for m, s in SHAPES.items()}


class Dense(nn.Module):
    """bf16 parameters named like the checkpoint's dense weights (``layers.0.mlp.up_proj.weight`` …)."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.params = {}
        for name, shape in shapes.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=BF16), requires_grad=False))


def generate(folder: str, layers: int, group: int) -> None:
    """Write the checkpoint with compressed-tensors' own quantizer and packer (skipped when it is there)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    from packed_int4 import scheme_of, write_pack_quantized

    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=g) * 0.02).to(BF16) for k, s in names(layers).items()}
    write_pack_quantized(folder, tensors, scheme_of(4, group, True), quantize=lambda n, t: True)


def reference(folder: str, group: int) -> dict[str, torch.Tensor]:
    """compressed-tensors' decompression of every weight (the oracle)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from packed_int4 import scheme_of
    from safetensors.torch import load_file

    stored, scheme, out = load_file(os.path.join(folder, "model.safetensors")), scheme_of(4, group, True), {}
    for key in stored:
        if key.endswith("weight_packed"):
            stem = key[: -len("weight_packed")]
            state = {k[len(stem) :]: v for k, v in stored.items() if k.startswith(stem)}
            out[stem + "weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(BF16)
    return out


def run(folder: str, layers: int, group: int) -> int:
    from torch.distributed.tensor import Shard

    from loader import HFLoadPlanner
    from loader.checkpoint import FileReader, SafetensorsCheckpoint
    from loader.execute import execute_plan
    from loader.options import LoadOptions
    from loader.placements import shard_boxes
    from loader.plan import TargetSlot

    shapes, want = names(layers), reference(folder, group)
    checkpoint = SafetensorsCheckpoint.open(folder)
    total = sum(info.nbytes for info in checkpoint.tensors.values())
    status = 0
    print(f"checkpoint: {len(shapes)} int4 weights, group {group}, {total / 2**20:.1f} MiB of tensors")
    print("| layout | rank | bytes read | words + groups touched | shard codes + scales | ratio | plan s | execute s |")
    print("|---|---|---|---|---|---|---|---|")
    for dim in (0, 1):
        for rank in range(WORLD):
            model = Dense(shapes)
            slots, expected, own = {}, 0, 0
            for name, shape in shapes.items():
                boxes = shard_boxes(shape, (WORLD,), (rank,), [Shard(dim)])
                ((g, _),) = boxes
                local = torch.zeros(tuple(b - a for a, b in g), dtype=BF16)
                slots[name] = TargetSlot(name, shape, BF16, local, boxes)
                (r0, r1), (c0, c1) = g
                own += local.numel() // 2 + local.numel() * 2 // group  # its codes, and its share of bf16 scales
                expected += (r1 - r0) * (_touched(c0, c1, 8) * 4 + _touched(c0, c1, group) * 2)
            t0 = time.perf_counter()
            plan = HFLoadPlanner(model).build_plan(checkpoint, slots)
            t1 = time.perf_counter()
            with FileReader() as reader:
                execute_plan(plan, reader, LoadOptions(progress=False))
            t2 = time.perf_counter()
            bad = [n for n, s in slots.items() if not torch.equal(s.local, _cut(want[n], s.boxes[0][0]))]
            if bad or plan.deferred or reader.bytes_read != expected:
                print(f"MISMATCH rank {rank} Shard({dim}): {bad[:3]} deferred={len(plan.deferred)}", file=sys.stderr)
                status = 1
            ratio = reader.bytes_read / own
            print(
                f"| TP Shard({dim}) | {rank} | {reader.bytes_read:,} | {expected:,} | {own:,} | {ratio:.4f} | "
                f"{t1 - t0:.2f} | {t2 - t1:.2f} |"
            )
    return status


def _touched(lo: int, hi: int, per: int) -> int:
    """How many runs of ``per`` elements ``[lo, hi)`` touches."""
    return -(-hi // per) - lo // per if hi > lo else 0


def _cut(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="checkpoint folder (generated on first use)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "tests")]  # the loader, and the checkpoint writer of the tests
    folder = args.out or tempfile.mkdtemp(prefix="packed_bench_")
    generate(folder, args.layers, args.group)
    with open(os.path.join(folder, "config.json")) as f:
        print("quantization_config:", json.dumps(json.load(f)["quantization_config"]["config_groups"]))
    sys.exit(run(folder, args.layers, args.group))


if __name__ == "__main__":
    main()
