"""FP8 block-quantized checkpoints dequantize on load, exactly, reading only each rank's weight region and the
scale blocks it touches (no deferred whole-tensor read).

Checkpoints are real safetensors files with a ``config.json`` whose ``quantization_config`` says ``fp8`` and
``weight_block_size``; weights are quantized here the way DeepSeek-V3's are (per-block amax / 448).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import Shard

from loader import CheckpointError, HFLoadPlanner, SafetensorsReader, load_hf_checkpoint
from loader.checkpoint import FileReader, SafetensorsCheckpoint
from loader.execute import execute_plan
from loader.options import LoadOptions, Rules
from loader.placements import shard_boxes
from loader.plan import TargetSlot, plain_slot
from loader.rules.fp8 import dequantize_quant_blocks

sys.path.insert(0, os.path.dirname(__file__))

from hf_models import FAMILIES, build, read_checkpoint, save

E4M3, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16


def quantize_blocks(w: torch.Tensor, quant_block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_inv)``: float8_e4m3fn codes and one float32 scale per block (amax / 448), any shape."""
    bm, bn = quant_block
    rows, cols = w.shape[-2:]
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    padded = torch.zeros(*w.shape[:-2], grid[0] * bm, grid[1] * bn)
    padded[..., :rows, :cols] = w.float()
    quant_blocks = padded.reshape(*w.shape[:-2], grid[0], bm, grid[1], bn)
    scale = quant_blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0
    codes = (quant_blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :rows, :cols].to(E4M3)
    return codes.contiguous(), scale.contiguous()


def write_fp8(folder, tensors: dict[str, torch.Tensor], quant_block, quantize=lambda name, t: t.dim() >= 2) -> dict:
    """Write ``tensors`` with the chosen ones quantized (``<name>`` codes + ``<name>_scale_inv``) and a config."""
    os.makedirs(folder, exist_ok=True)
    stored = {}
    for name, t in tensors.items():
        if quantize(name, t):
            stored[name], stored[name + "_scale_inv"] = quantize_blocks(t, quant_block)
        else:
            stored[name] = t.contiguous()
    save_file(stored, os.path.join(folder, "model.safetensors"))
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path)) if os.path.exists(config_path) else {}
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(quant_block), "fmt": "e4m3"}
    with open(config_path, "w") as f:
        json.dump(config, f)
    return stored


class Weight(nn.Module):
    def __init__(self, shape, dtype=BF16):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype))


SHAPES_AND_BLOCKS = [
    ((256, 384), (128, 128)),  # divisible, square (DeepSeek-V3's block)
    ((200, 300), (128, 128)),  # not divisible by the block
    ((96, 80), (64, 32)),  # non-square block, not divisible
    ((64, 96), (1, 32)),  # row-wise blocks (MXFP8-like grid)
    ((50, 70), (16, 48)),
]


@pytest.mark.parametrize(("shape", "quant_block"), SHAPES_AND_BLOCKS)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fp8_weights_dequantize_exactly(tmp_path, shape, quant_block, dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    stored = write_fp8(tmp_path, {"weight": w}, quant_block)
    model = Weight(shape, dtype)
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    want = dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], quant_block, dtype)
    assert torch.equal(model.weight.data, want)
    assert report.deferred == () and report.unexpected_keys == () and report.traced == ("weight",)
    # the checkpoint's bytes once: codes (1 byte each) and scales (4 bytes each)
    assert report.bytes_read == stored["weight"].numel() + 4 * stored["weight_scale_inv"].numel()
    if shape[0] % quant_block[0] == 0 and shape[1] % quant_block[1] == 0:  # where transformers' dequantization applies
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        theirs = Fp8Dequantize(None)._dequantize_one(stored["weight"], stored["weight_scale_inv"], dtype)
        assert torch.equal(model.weight.data.view(torch.uint8), theirs.view(torch.uint8))
    else:  # ours is the per-element definition: w[i, j] * scale[i // bm, j // bn]
        i, j = shape[0] - 1, shape[1] - 1
        s = stored["weight_scale_inv"][i // quant_block[0], j // quant_block[1]]
        assert model.weight.data[i, j] == (stored["weight"][i, j].float() * s).to(dtype)


def _scale_blocks(box, quant_block) -> int:
    (r0, r1), (c0, c1) = box
    return (math.ceil(r1 / quant_block[0]) - r0 // quant_block[0]) * (
        math.ceil(c1 / quant_block[1]) - c0 // quant_block[1]
    )


@pytest.mark.parametrize(("shape", "quant_block"), SHAPES_AND_BLOCKS)
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_shards_read_their_weight_region_and_its_scale_blocks(tmp_path, shape, quant_block, dim):
    """Four TP ranks (row or column shards, cutting through blocks): each reads its region's codes and the
    scale blocks that region touches, nothing else, and holds exactly its part of the dequantized weight."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    stored = write_fp8(tmp_path, {"weight": w}, quant_block)
    want = dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], quant_block, BF16)
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    model = Weight(shape)
    planner = HFLoadPlanner(model)
    for rank in range(4):
        boxes = shard_boxes(shape, (4,), (rank,), [Shard(dim)])
        ((g, _),) = boxes
        local = torch.zeros(tuple(b - a for a, b in g), dtype=BF16)
        slot = TargetSlot("weight", shape, BF16, local, boxes)
        plan = planner.build_plan(checkpoint, {"weight": slot})
        assert plan.deferred == () and plan.reads == () and len(plan.values) >= 1
        with FileReader() as reader:
            execute_plan(plan, reader, LoadOptions(progress=False))
        (r0, r1), (c0, c1) = g
        assert torch.equal(local, want[r0:r1, c0:c1]), rank
        assert reader.bytes_read == local.numel() + 4 * _scale_blocks(g, quant_block), rank
        assert plan.planned_bytes() == reader.bytes_read


def test_a_large_box_is_computed_in_bounded_parts(tmp_path):
    shape, quant_block = (300, 200), (128, 128)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    stored = write_fp8(tmp_path, {"weight": w}, quant_block)
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    model = Weight(shape)
    slots = {"weight": plain_slot("weight", model.weight)}
    plan = HFLoadPlanner(model).build_plan(checkpoint, slots)
    from loader.plan import plan_rank

    small = plan_rank(plan.keyplan, checkpoint, slots, value_bytes=128 * 200 * 8)  # two f32 inputs of 128 rows
    assert [v.local_box[0] for v in small.values] == [(0, 128), (128, 256), (256, 300)]
    with FileReader() as reader:
        execute_plan(small, reader, LoadOptions(progress=False))
    assert torch.equal(
        model.weight.data, dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], quant_block, BF16)
    )


def test_fp8_model_tensors_load_codes_and_scales_unchanged(tmp_path):
    shape, quant_block = (64, 96), (32, 32)
    stored = write_fp8(tmp_path, {"weight": torch.randn(shape)}, quant_block)

    class Fp8Weight(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(shape, dtype=E4M3), requires_grad=False)
            self.register_buffer("weight_scale_inv", torch.zeros(2, 3))

    model = Fp8Weight()
    load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert torch.equal(model.weight.view(torch.uint8), stored["weight"].view(torch.uint8))
    assert torch.equal(model.weight_scale_inv, stored["weight_scale_inv"])


def test_moe_experts_dequantize_then_merge_like_from_pretrained(tmp_path):
    """A transformers Qwen3-MoE whose checkpoint stores every linear (per-expert ones too) as FP8 blocks: the
    model's conversion (stack the experts, cat gate and up) runs on dequantized weights, traced — it equals
    ``from_pretrained`` of the dequantized checkpoint, bit for bit, with nothing deferred."""
    auto, model = build("qwen3_moe", seed=4)
    plain = tmp_path / "plain"
    save(model, plain, dtype=BF16)
    tensors = read_checkpoint(plain)
    quant_block = (16, 8)
    quantized = tmp_path / "fp8"
    os.makedirs(quantized)
    with open(plain / "config.json") as f:
        (quantized / "config.json").write_text(f.read())
    stored = write_fp8(quantized, tensors, quant_block, quantize=lambda n, t: t.dim() == 2 and "proj" in n)
    assert any(k.endswith("_scale_inv") for k in stored)
    # the reference: the same values, dequantized up front, loaded by transformers
    reference_dir = tmp_path / "reference"
    dequantized = {
        k: dequantize_quant_blocks(v, stored[k + "_scale_inv"], quant_block, BF16) if k + "_scale_inv" in stored else v
        for k, v in stored.items()
        if not k.endswith("_scale_inv")
    }
    save(model, reference_dir, dtype=BF16)
    save_file(dequantized, os.path.join(reference_dir, "model.safetensors"), metadata={"format": "pt"})
    reference = auto.from_pretrained(reference_dir, dtype=BF16)
    with torch.device("meta"):
        target = auto.from_config(reference.config, dtype=BF16)
    target.config.quantization_config = None
    report = load_hf_checkpoint(target, str(quantized), device="cpu", options=LoadOptions(progress=False))
    assert report.deferred == () and report.unexpected_keys == () and report.missing_keys == ()
    got, want = target.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_inside_dcp_load_values_are_value_reads_and_exact(tmp_path):
    shape, quant_block = (96, 80), (64, 32)
    stored = write_fp8(tmp_path, {"weight": torch.randn(shape)}, quant_block)
    model = Weight(shape)
    planner = HFLoadPlanner(model)
    reader = SafetensorsReader(str(tmp_path))
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
    report = planner.finish(reader)
    assert report.deferred == () and report.traced == ("weight",)  # as load_hf_checkpoint: a value read
    assert torch.equal(
        model.weight.data, dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], quant_block, BF16)
    )


def test_e8m0_exponent_scales_dequantize_as_transformers_does(tmp_path):
    """``uint8`` scales are E8M0 exponents (2 ** (b - 127)): ``exp2`` is not traced, so the conversion is
    deferred, and still equals transformers' dequantization."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(5)
    codes = (torch.randn(8, 64, generator=g) * 10).to(E4M3)
    exps = torch.randint(110, 140, (8, 2), generator=g, dtype=torch.uint8)
    save_file({"weight": codes, "weight_scale_inv": exps}, os.path.join(tmp_path, "model.safetensors"))
    model = Weight((8, 64))
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert report.deferred == ("weight",) and "exp2" in report.deferred_reasons["weight"]
    assert torch.equal(model.weight.data, Fp8Dequantize(None)._dequantize_one(codes, exps, BF16))


def test_float8_e8m0_scales_are_traced_and_match_transformers(tmp_path):
    """``float8_e8m0fnu`` scales (powers of two) are themselves float8: their cast to float32 is their value."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(7)
    codes = (torch.randn(64, 96, generator=g) * 10).to(E4M3)
    scales = (2.0 ** torch.randint(-5, 5, (2, 3), generator=g).float()).to(torch.float8_e8m0fnu)
    save_file({"weight": codes, "weight_scale_inv": scales}, os.path.join(tmp_path, "model.safetensors"))
    model = Weight((64, 96))
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert report.deferred == ()
    assert torch.equal(model.weight.data, Fp8Dequantize(None)._dequantize_one(codes, scales, BF16))


def _write_raw(tmp_path, tensors, quant):
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    if quant is not None:
        with open(os.path.join(tmp_path, "config.json"), "w") as f:
            f.write(quant if isinstance(quant, str) else json.dumps({"quantization_config": quant}))


CODES = (torch.randn(64, 64) * 10).to(E4M3)


@pytest.mark.parametrize(
    ("tensors", "quant", "says", "key"),
    [
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(2, 2)},
            {"quant_method": "bitsandbytes"},
            "quant_method",
            None,
        ),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(2, 2)},
            {"quant_method": "fp8", "weight_block_size": [0, 32]},
            "two positive integers",
            None,
        ),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(3, 2)},
            {"quant_method": "fp8", "weight_block_size": [32, 32]},
            "does not fit",
            "weight_scale_inv",
        ),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(3, 3)},
            None,
            "cannot infer the block size",
            "weight_scale_inv",
        ),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)},
            None,
            "not understood",
            "weight_scale_inv",
        ),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(1, 1)},
            {"quant_method": "fp8", "weight_block_size": [2**62, 2**62]},
            r"config.json: quantization_config.weight_block_size \[4611686018427387904, 4611686018427387904\] is "
            "unreasonable",
            None,
        ),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(1, 1)},
            {"quant_method": "fp8", "weight_block_size": [32, 2**31]},
            "unreasonable: each side must be at most 2147483647",
            None,
        ),
        ({"weight": CODES, "weight_scale_inv": torch.ones(2, 2)}, "[1, 2", "not valid UTF-8 JSON", None),
        (
            {"weight": CODES, "weight_scale_inv": torch.ones(2, 2)},
            '{"quantization_config": 7}',
            "must be an object",
            None,
        ),
    ],
)
def test_fp8_checkpoints_we_cannot_interpret_are_refused_before_any_write(tmp_path, tensors, quant, says, key):
    _write_raw(tmp_path, tensors, quant)
    model = Weight((64, 64))
    with pytest.raises(CheckpointError, match=says) as err:
        load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert err.value.key == key
    assert torch.equal(model.weight.data, torch.zeros(64, 64, dtype=BF16))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.uint8])  # traced; deferred (E8M0 exponents)
def test_a_block_larger_than_the_weight_is_one_block_of_the_weight(tmp_path, scale_dtype):
    """A ``weight_block_size`` past the weight's edges (up to 2**31 - 1, the largest accepted) puts the whole
    weight in one block: it loads with the one scale (the expanded grid is a view, never block-sized)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    scale = torch.full((1, 1), 2.0) if scale_dtype == torch.float32 else torch.full((1, 1), 129, dtype=torch.uint8)
    _write_raw(
        tmp_path,
        {"weight": CODES, "weight_scale_inv": scale},
        {"quant_method": "fp8", "weight_block_size": [2**31 - 1, 2**30]},
    )
    model = Weight((64, 64))
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert report.deferred == (() if scale_dtype == torch.float32 else ("weight",))
    assert torch.equal(
        model.weight.data, (CODES.float() * 4.0 if scale_dtype == torch.uint8 else CODES.float() * 2.0).to(BF16)
    )
    assert torch.equal(model.weight.data, Fp8Dequantize(None)._dequantize_one(CODES, scale, BF16))


@pytest.mark.parametrize("kind", ["fifo", "directory", "oversized"])
def test_a_hostile_config_json_is_refused_without_hanging(tmp_path, kind):
    save_file({"weight": CODES, "weight_scale_inv": torch.ones(2, 2)}, os.path.join(tmp_path, "model.safetensors"))
    path = os.path.join(tmp_path, "config.json")
    if kind == "fifo":
        os.mkfifo(path)  # nothing writes to it: a blocking open would hang the load
    elif kind == "directory":
        os.mkdir(path)
    else:
        with open(path, "w") as f:
            f.write('{"pad": "' + "x" * (5 << 20) + '"}')
    with pytest.raises(CheckpointError, match="config.json") as err:
        load_hf_checkpoint(Weight((64, 64)), str(tmp_path), options=LoadOptions(progress=False))
    assert err.value.path == path


def test_an_expert_stored_without_its_scales_fails_the_whole_merge(tmp_path):
    """Every float8 source of a conversion needs its own scales: one expert without them would load raw codes."""
    from loader import Convert

    g = torch.Generator().manual_seed(6)
    experts = [(torch.randn(8, 16, generator=g) * 10).to(E4M3) for _ in range(3)]
    tensors = {f"experts.{e}.w": w for e, w in enumerate(experts)}
    tensors.update({f"experts.{e}.w_scale_inv": torch.ones(1, 1) for e in range(2)})  # expert 2 has none
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    model = Weight((3, 8, 16))
    rules = [Convert("experts.*.w", "weight", lambda ws: torch.stack(ws))]
    with pytest.raises(CheckpointError, match="as the values of its torch.float8_e4m3fn codes") as err:
        load_hf_checkpoint(
            model, str(tmp_path), rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False)
        )
    assert err.value.key == "experts.2.w"
    assert torch.equal(model.weight.data, torch.zeros(3, 8, 16, dtype=BF16))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_an_fp8_checkpoint_like_from_pretrained(tmp_path, family):
    """Each transformers family of tests/hf_models.py, its 2-D weights quantized in blocks that cut through every
    dim: loaded on meta with ``device="cpu"``, nothing deferred, every tensor equal to ``from_pretrained`` of the
    checkpoint dequantized up front to float32 (which rounds it to bf16, or keeps float32 where the model keeps a
    router in float32: transformers' ``Fp8Dequantize`` dequantizes to the parameter's dtype, so do we)."""
    auto, model = build(family, seed=4)
    plain = tmp_path / "plain"
    save(model, plain, dtype=BF16)
    quantized = tmp_path / "fp8"
    os.makedirs(quantized)
    (quantized / "config.json").write_text((plain / "config.json").read_text())

    def quantize(name, t):
        return t.dim() >= 2 and t.is_floating_point() and not any(s in name for s in ("embed", "norm", "lm_head"))

    stored = write_fp8(quantized, read_checkpoint(plain), (16, 8), quantize=quantize)
    reference_dir = tmp_path / "reference"
    save(model, reference_dir, dtype=BF16)
    for name in os.listdir(reference_dir):
        if name.endswith((".safetensors", ".index.json")):
            os.remove(reference_dir / name)
    dequantized = {
        k: dequantize_quant_blocks(v, stored[k + "_scale_inv"], (16, 8), F32)  # from_pretrained rounds to bf16
        if k + "_scale_inv" in stored
        else v
        for k, v in stored.items()
        if not k.endswith("_scale_inv")
    }
    save_file(dequantized, os.path.join(reference_dir, "model.safetensors"), metadata={"format": "pt"})
    reference = auto.from_pretrained(reference_dir, dtype=BF16)
    with torch.device("meta"):
        target = auto.from_config(reference.config, dtype=BF16)
    report = load_hf_checkpoint(
        target, str(quantized), device="cpu", rules=Rules(strict=False), options=LoadOptions(progress=False)
    )
    assert report.deferred == () and report.unexpected_keys == ()
    got, want = target.state_dict(), reference.state_dict()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize("scale_name", ["proj.weight_scale_inv", "proj.scale", "proj.qscale_weight"])
def test_block_scales_under_the_names_transformers_renames(tmp_path, scale_name):
    """``x.scale`` (DeepSeek-V4-Flash) and ``x.qscale_weight`` (Mistral Large 4) are the block scales of
    ``x.weight``, as transformers' FP8 quantizer renames them."""
    codes, scales = quantize_blocks(torch.randn(40, 24), (16, 8))
    _write_raw(
        tmp_path, {"proj.weight": codes, scale_name: scales}, {"quant_method": "fp8", "weight_block_size": [16, 8]}
    )

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Weight((40, 24))

    model = Model()
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert report.deferred == () and report.unexpected_keys == ()
    assert torch.equal(model.proj.weight.data, dequantize_quant_blocks(codes, scales, (16, 8), BF16))


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_a_per_tensor_scale_dequantizes_like_transformers(tmp_path, scale_shape):
    """One scale for the whole weight (0-d or one element): one block of the whole weight, whatever the config's
    ``weight_block_size`` says — as transformers' ``Fp8Dequantize`` reads it."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    codes = (torch.randn(40, 24, generator=torch.Generator().manual_seed(8)) * 10).to(E4M3)
    scale = torch.full(scale_shape, 0.0123)
    quant = {"quant_method": "fp8", "weight_block_size": [16, 8]}
    _write_raw(tmp_path, {"weight": codes, "weight_scale_inv": scale}, quant)
    model = Weight((40, 24))
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert report.deferred == ()
    assert torch.equal(model.weight.data, Fp8Dequantize(None)._dequantize_one(codes, scale, BF16))


@pytest.mark.parametrize("numel", [1, 5, 10, 24, 70, 10_000])
def test_split_box_tiles_the_box_in_bounded_parts(numel):
    from loader.plan import split_box

    g, local = ((10, 13), (2, 6), (0, 6)), ((0, 3), (0, 4), (1, 7))
    parts = split_box(g, local, numel)
    covered = torch.zeros(3, 4, 6, dtype=torch.int32)
    for gp, lp in parts:
        assert math.prod(b - a for a, b in gp) <= max(numel, 1)
        assert [b - a for a, b in gp] == [b - a for a, b in lp]
        assert all(lo - l0 == go - g0 for (go, _), (lo, _), (g0, _), (l0, _) in zip(gp, lp, g, local))
        covered[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(gp, g))] += 1
    assert bool((covered == 1).all())
