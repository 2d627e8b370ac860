"""GPTQ and AWQ checkpoints dequantize on load into dense models, bit for bit as GPTQModel's ``dequantize_weight``
and AutoAWQ's ``dequantize_gemm`` (ported in :mod:`packed_linears`: neither package installs here), each rank
reading the words, zero points and scale groups its box touches."""

from __future__ import annotations

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

from hf_models import build, read_checkpoint, save
from packed_linears import dequantized, quant_config, random_linear, write_linears

BF16, F16 = torch.bfloat16, torch.float16
QUIET = LoadOptions(progress=False)


class Proj(nn.Module):
    def __init__(self, out: int, cols: int, dtype=F16):
        super().__init__()
        self.proj = nn.Linear(cols, out, bias=False, dtype=dtype)
        nn.init.zeros_(self.proj.weight)


def read_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if not k.endswith("g_idx"))


CASES = [("gptq", 4, 32), ("gptq", 8, 16), ("gptq", 2, 32), ("awq", 4, 32), ("awq", 4, 16)]


@pytest.mark.parametrize(("method", "bits", "group_size"), CASES)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_linears_dequantize_like_the_reference(tmp_path, method, bits, group_size, dtype):
    t = random_linear(method, 48, 128, bits, group_size, torch.Generator().manual_seed(1))
    write_linears(tmp_path, {"proj": t}, quant_config(method, bits, group_size))
    model = Proj(48, 128, dtype)
    report = load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    want = dequantized(method, t, bits, group_size).to(dtype)
    assert torch.equal(model.proj.weight.data.view(torch.int16), want.contiguous().view(torch.int16))
    assert report.traced == ("proj.weight",) and report.deferred == ()
    assert report.bytes_read == read_bytes(t)  # words, zero points and scales once; g_idx is not read


def _touched(lo: int, hi: int, per: int) -> int:
    return math.ceil(hi / per) - lo // per


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_shards_read_the_words_and_groups_they_touch(tmp_path, method, dim):
    """``[out 64, in 256]`` four ways: output shards (16 rows) and input shards (64 inputs, 2 groups of 32)."""
    out, cols, gs = 64, 256, 32
    t = random_linear(method, out, cols, 4, gs, torch.Generator().manual_seed(2))
    write_linears(tmp_path, {"proj": t}, quant_config(method, 4, gs))
    want = dequantized(method, t, 4, gs)
    checkpoint, shape = SafetensorsCheckpoint.open(str(tmp_path)), (out, cols)
    planner = HFLoadPlanner(Proj(out, cols))
    for rank in range(4):
        boxes = shard_boxes(shape, (4,), (rank,), [Shard(dim)])
        ((g, _),) = boxes
        local = torch.zeros(tuple(b - a for a, b in g), dtype=F16)
        plan = planner.build_plan(checkpoint, {"proj.weight": TargetSlot("proj.weight", shape, F16, local, boxes)})
        assert plan.deferred == () and plan.reads == ()
        with FileReader() as reader:
            execute_plan(plan, reader, QUIET)
        (r0, r1), (c0, c1) = g
        assert torch.equal(local, want[r0:r1, c0:c1]), rank
        groups = _touched(c0, c1, gs)
        if method == "gptq":  # words along the input, zero points along the output
            words = _touched(c0, c1, 8) * (r1 - r0)
            zeros = groups * _touched(r0, r1, 8)
        else:  # both along the output
            words = (c1 - c0) * _touched(r0, r1, 8)
            zeros = groups * _touched(r0, r1, 8)
        expected = 4 * words + 4 * zeros + 2 * groups * (r1 - r0)
        assert reader.bytes_read == plan.planned_bytes() == expected, rank
        numel = (r1 - r0) * (c1 - c0)  # every cut here is on words and groups: a quarter of each tensor
        assert expected == numel // 2 + numel // gs * 2 + numel // gs // 2, rank


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"bits": 3}, "bits 3"),
        ({"checkpoint_format": "marlin"}, "'marlin'"),
        ({"group_size": 64}, "not one per 64"),
    ],
)
def test_gptq_layouts_not_decoded_are_refused_by_name(tmp_path, edit, says):
    t = random_linear("gptq", 16, 96, 4, 32, torch.Generator().manual_seed(3))
    write_linears(tmp_path, {"proj": t}, {**quant_config("gptq", 4, 32), **edit})
    model = Proj(16, 96)
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    assert says in str(e.value) and ("config.json" in str(e.value) or "proj.qweight" in str(e.value))
    assert not model.proj.weight.detach().any()


@pytest.mark.parametrize(("edit", "says"), [({"version": "gemv"}, "'gemv'"), ({"zero_point": False}, "zero_point")])
def test_awq_layouts_not_decoded_are_refused_by_name(tmp_path, edit, says):
    t = random_linear("awq", 16, 96, 4, 32, torch.Generator().manual_seed(4))
    write_linears(tmp_path, {"proj": t}, {**quant_config("awq", 4, 32), **edit})
    with pytest.raises(CheckpointError, match=says):
        load_hf_checkpoint(Proj(16, 96), str(tmp_path), options=QUIET)


@pytest.mark.dist
def test_four_gloo_ranks_load_gptq_and_awq_shards(tmp_path):
    """A 4-rank gloo world: a row-sharded and a column-sharded linear of each format equal the reference on every
    rank, each rank reading a quarter of every word, zero point and scale (the cuts fall on words and groups)."""
    import pair_worker
    from gloo_world import WORLD, ok, run_world

    g = torch.Generator().manual_seed(5)
    totals = {}
    for method in ("gptq", "awq"):
        linears = {"rows": random_linear(method, 64, 128, 4, 32, g), "cols": random_linear(method, 32, 256, 4, 32, g)}
        write_linears(tmp_path / method, linears, quant_config(method, 4, 32))
        ref = {f"{k}.weight": dequantized(method, t, 4, 32) for k, t in linears.items()}
        torch.save(ref, tmp_path / f"{method}.pt")
        totals[method] = sum(read_bytes(t) for t in linears.values())
    methods = ("gptq", "awq")
    loads = [{"folder": str(tmp_path / m), "ref": str(tmp_path / f"{m}.pt"), "dtype": "float16"} for m in methods]
    ctx = {"store": str(tmp_path / "store"), "out": str(tmp_path), "loads": loads}
    results = run_world(pair_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    for r, res in enumerate(ok(results, "pair_shards")):
        for method, got in zip(methods, res["loads"]):
            assert got["bad"] == [] and got["deferred"] == (), f"rank {r} {method}: {got}"
            assert got["bytes_read"] == totals[method] // 4, (r, method, got["bytes_read"], totals[method])


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_llama_loads_every_projection_dequantized(tmp_path, method):
    """A transformers Llama whose every ``*_proj`` is packed (the rest stored plain): each projection equals the
    reference dequantization, every other tensor the stored one, every tensor traced and each byte read once."""
    auto, model = build("llama", seed=6)
    save(model, tmp_path, dtype=F16)
    plain = read_checkpoint(tmp_path)
    os.remove(os.path.join(tmp_path, "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    linears, extra = {}, {}
    for k, t in plain.items():
        if k.endswith("proj.weight") and t.shape[1] % 32 == 0 and t.shape[0] % 8 == 0:
            linears[k[: -len(".weight")]] = random_linear(method, t.shape[0], t.shape[1], 4, 32, g)
        else:
            extra[k] = t
    assert linears
    stored = write_linears(tmp_path, linears, quant_config(method, 4, 32), extra)
    with torch.device("meta"):
        target = auto.from_config(model.config, dtype=F16)
    report = load_hf_checkpoint(target, str(tmp_path), device="cpu", options=QUIET)
    assert report.deferred == () and report.missing_keys == () and report.unexpected_keys == ()
    ours = target.state_dict()
    for stem, t in linears.items():
        assert torch.equal(ours[stem + ".weight"], dequantized(method, t, 4, 32)), stem
    for k, t in extra.items():
        assert torch.equal(ours[k], t), k
    assert report.bytes_read == read_bytes(stored)


def test_gptq_activation_order_gathers_by_g_idx_deferred_and_exact(tmp_path):
    """``desc_act: true``: each input's group is ``g_idx[i]`` (here a shuffle of the groups). The gather does not
    trace: the conversion is deferred, named in the report, its tensors read whole, and its values exact."""
    g = torch.Generator().manual_seed(8)
    t = random_linear("gptq", 48, 128, 4, 32, g)
    t["g_idx"] = t["g_idx"][torch.randperm(128, generator=g)].contiguous()
    write_linears(tmp_path, {"proj": t}, {**quant_config("gptq", 4, 32), "desc_act": True})
    model = Proj(48, 128)
    report = load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    want = dequantized("gptq", t, 4, 32)
    assert not torch.equal(want, dequantized("gptq", {**t, "g_idx": torch.arange(128) // 32}, 4, 32))
    assert torch.equal(model.proj.weight.data, want)
    assert report.deferred == ("proj.weight",) and report.traced == ()
    assert report.bytes_read == read_bytes(t) + t["g_idx"].numel() * 4  # g_idx read too


def test_gptq_activation_order_without_g_idx_is_refused_by_name(tmp_path):
    t = random_linear("gptq", 16, 96, 4, 32, torch.Generator().manual_seed(9))
    del t["g_idx"]
    write_linears(tmp_path, {"proj": t}, {**quant_config("gptq", 4, 32), "desc_act": True})
    with pytest.raises(CheckpointError, match="'proj.qweight'.*'proj.g_idx': missing"):
        load_hf_checkpoint(Proj(16, 96), str(tmp_path), options=QUIET)


def test_gptq_v2_zero_points_are_stored_as_they_are(tmp_path):
    """``checkpoint_format: gptq_v2`` stores each zero point itself (v1: minus one): the same words decode one
    zero point apart, each as GPTQModel dequantizes it."""
    from packed_linears import gptq_dequantize

    t = random_linear("gptq", 16, 64, 4, 32, torch.Generator().manual_seed(10))
    write_linears(tmp_path, {"proj": t}, {**quant_config("gptq", 4, 32), "checkpoint_format": "gptq_v2"})
    model = Proj(16, 64)
    load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    want = gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, v1=False)
    assert torch.equal(model.proj.weight.data, want)
    assert not torch.equal(want, dequantized("gptq", t, 4, 32))
