"""compressed-tensors ``pack-quantized`` checkpoints dequantize on load, exactly as compressed-tensors decompresses
them and transformers loads them, reading only the words and scale groups each rank's box touches.

Checkpoints are made here with the ``compressed-tensors`` package (:mod:`packed_int4`); the oracle is its own
``PackedQuantizationCompressor.decompress`` and transformers' ``from_pretrained`` with
``CompressedTensorsConfig(dequantize=True)``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from loader import CheckpointError, HFLoadPlanner, load_hf_checkpoint
from loader.checkpoint import FileReader, SafetensorsCheckpoint
from loader.execute import execute_plan
from loader.options import LoadOptions
from loader.placements import shard_boxes
from loader.plan import TargetSlot

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("compressed_tensors")

from hf_models import build, read_checkpoint, save
from packed_int4 import scheme_of, write_pack_quantized

BF16, F32 = torch.bfloat16, torch.float32
QUIET = LoadOptions(progress=False)


class Weight(nn.Module):
    def __init__(self, shape, dtype=BF16):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype))


def decompressed(stored: dict, scheme, dtype) -> torch.Tensor:
    """compressed-tensors' own decompression of ``weight``, cast as transformers casts it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {k: v for k, v in stored.items() if k.startswith("weight_")}
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(dtype)


def stored_bytes(stored: dict) -> int:
    """Bytes of the words, scales and zero points (``weight_shape`` is never read)."""
    return sum(t.numel() * t.element_size() for k, t in stored.items() if not k.endswith("_shape"))


SCHEMES = [
    (4, 32, True),  # W4A16 groups (the usual int4 checkpoint)
    (4, 32, False),  # asymmetric: zero points packed along the output dim
    (4, None, True),  # a scale per output row
    (8, 16, True),  # four 8-bit codes a word
    (2, 16, False),
]


@pytest.mark.parametrize(("num_bits", "group_size", "symmetric"), SCHEMES)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_packed_weights_dequantize_like_compressed_tensors(tmp_path, num_bits, group_size, symmetric, dtype):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).to(BF16)
    scheme = scheme_of(num_bits, group_size, symmetric)
    stored = write_pack_quantized(tmp_path, {"weight": w}, scheme, quantize=lambda n, t: True)
    model = Weight(w.shape, dtype)
    report = load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    assert torch.equal(model.weight.data, decompressed(stored, scheme, dtype))
    assert report.traced == ("weight",) and report.deferred == () and report.unexpected_keys == ()
    assert report.bytes_read == stored_bytes(stored)  # every word and scale once


def _touched(lo: int, hi: int, per: int) -> int:
    return math.ceil(hi / per) - lo // per if hi > lo else 0


@pytest.mark.parametrize(
    ("shape", "group_size"),
    [
        ((64, 128), 32),  # cuts on word and group boundaries: exactly the shard's codes and scales
        ((64, 160), 32),  # column cuts through groups
        ((36, 48), 16),  # column cuts through words (12 codes a rank), row cuts through zero-point words
    ],
)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_tp_shards_read_the_words_and_groups_they_touch(tmp_path, shape, group_size, dim, symmetric):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(BF16)
    scheme = scheme_of(4, group_size, symmetric)
    stored = write_pack_quantized(tmp_path, {"weight": w}, scheme, quantize=lambda n, t: True)
    want = decompressed(stored, scheme, BF16)
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    planner = HFLoadPlanner(Weight(shape))
    scale_size = stored["weight_scale"].element_size()
    for rank in range(4):
        boxes = shard_boxes(shape, (4,), (rank,), [Shard(dim)])
        ((g, _),) = boxes
        local = torch.zeros(tuple(b - a for a, b in g), dtype=BF16)
        plan = planner.build_plan(checkpoint, {"weight": TargetSlot("weight", shape, BF16, local, boxes)})
        assert plan.deferred == () and plan.reads == ()
        with FileReader() as reader:
            execute_plan(plan, reader, QUIET)
        (r0, r1), (c0, c1) = g
        assert torch.equal(local, want[r0:r1, c0:c1]), rank
        rows, words, groups = r1 - r0, _touched(c0, c1, 8), _touched(c0, c1, group_size)
        expected = rows * words * 4 + rows * groups * scale_size
        if not symmetric:
            expected += _touched(r0, r1, 8) * groups * 4
        assert reader.bytes_read == plan.planned_bytes() == expected, rank
        if shape[1] % (4 * group_size) == 0 and shape[0] % 32 == 0:  # aligned: the shard's own codes and scales
            numel = rows * (c1 - c0)
            assert expected == numel // 2 + numel // group_size * scale_size + (0 if symmetric else numel // 256 * 4)


def test_a_llama_loads_like_from_pretrained_dequantized(tmp_path):
    """A transformers Llama whose every projection is int4 groups: the loaded model equals ``from_pretrained``
    with ``CompressedTensorsConfig(dequantize=True)``, bit for bit, every tensor traced."""
    from transformers import CompressedTensorsConfig

    auto, model = build("llama", seed=3)
    plain = tmp_path / "plain"
    save(model, plain, dtype=BF16)
    quantized = tmp_path / "int4"
    os.makedirs(quantized)
    (quantized / "config.json").write_text((plain / "config.json").read_text())
    stored = write_pack_quantized(quantized, read_checkpoint(plain), scheme_of(4, 16, False))
    assert any(k.endswith("weight_packed") for k in stored)
    reference = auto.from_pretrained(
        quantized, dtype=BF16, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    with torch.device("meta"):
        target = auto.from_config(model.config, dtype=BF16)
    report = load_hf_checkpoint(target, str(quantized), device="cpu", options=QUIET)
    assert report.deferred == () and report.missing_keys == () and report.unexpected_keys == ()
    ours, theirs = target.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)), k
    assert report.bytes_read == stored_bytes(stored)


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _rewrite(folder, edit) -> None:
    config = _config(folder)
    edit(config["quantization_config"])
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder 'group'"),
        (lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"), "'nvfp4-pack-quantized'"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), "(3, 'int', 'group')"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=64), "do not hold 3 groups of 64"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "'weight_zero_point'"),
    ],
)
def test_layouts_not_decoded_are_refused_by_name_before_any_write(tmp_path, edit, says):
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(4)).to(BF16)
    write_pack_quantized(tmp_path, {"weight": w}, scheme_of(4, 32, True), quantize=lambda n, t: True)
    _rewrite(tmp_path, edit)
    model = Weight(w.shape)
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    assert says in str(e.value) and ("config.json" in str(e.value) or "weight_packed" in str(e.value))
    assert not model.weight.detach().any()  # nothing written


def test_activation_order_indices_are_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)).to(BF16)
    write_pack_quantized(tmp_path, {"weight": w}, scheme_of(4, 32, True), quantize=lambda n, t: True)
    path = os.path.join(tmp_path, "model.safetensors")
    save_file({**load_file(path), "weight_g_idx": torch.arange(64, dtype=torch.int32) // 32}, path)
    with pytest.raises(CheckpointError, match="'weight_packed'.*'weight_g_idx'"):
        load_hf_checkpoint(Weight(w.shape), str(tmp_path), options=QUIET)


@pytest.mark.dist
def test_four_gloo_ranks_load_packed_shards(tmp_path):
    """A 4-rank gloo world: a row-sharded and a column-sharded int4 weight (asymmetric groups) equal compressed-
    tensors' decompression on every rank, each rank reading its words, zero points and scale groups."""
    import pair_worker
    from gloo_world import WORLD, ok, run_world

    scheme = scheme_of(4, 16, False)
    g = torch.Generator().manual_seed(6)
    full = {"rows.weight": torch.randn(64, 96, generator=g), "cols.weight": torch.randn(40, 128, generator=g)}
    folder = tmp_path / "int4"
    stored = write_pack_quantized(folder, {k: v.to(BF16) for k, v in full.items()}, scheme, quantize=lambda n, t: True)
    ref = {}
    for name in full:
        stem = name[: -len("weight")]
        ref[name] = decompressed({k[len(stem) :]: v for k, v in stored.items() if k.startswith(stem)}, scheme, BF16)
    torch.save(ref, tmp_path / "ref.pt")
    ctx = {
        "store": str(tmp_path / "store"),
        "out": str(tmp_path),
        "loads": [{"folder": str(folder), "ref": str(tmp_path / "ref.pt"), "dtype": "bfloat16"}],
    }
    results = run_world(pair_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    total = stored_bytes(stored)
    for r, (res,) in enumerate(a["loads"] for a in ok(results, "pair_shards")):
        assert res["bad"] == [] and res["deferred"] == (), f"rank {r}: {res}"
        assert 0 < res["bytes_read"] < total / 2, r  # its quarter of each weight, and the groups it cuts through
