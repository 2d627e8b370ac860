"""Value safety of dtype changes: casts across value kinds are reported, FP8 codes never load as values."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from loader import CheckpointError, Convert, HFLoadPlanner, SafetensorsReader, load_hf_checkpoint
from loader.options import LoadOptions, Rules

F8 = torch.float8_e4m3fn
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def write(directory, tensors: dict[str, torch.Tensor]) -> str:
    path = os.path.join(directory, "model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def load_recording(model: nn.Module, directory, **kwargs):
    """``load_hf_checkpoint`` with every warning recorded: ``(report, [warning messages])``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = load_hf_checkpoint(model, str(directory), rules=Rules(**kwargs), options=LoadOptions(progress=False))
    return report, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(3, 4))  # float, the checkpoint holds int64
        self.mask = nn.Parameter(torch.zeros(4))  # float, the checkpoint holds bool
        self.register_buffer("ids", torch.zeros(5, dtype=torch.int64))  # int, the checkpoint holds float32
        self.weight = nn.Parameter(torch.zeros(2, 4))  # float32, the checkpoint holds bf16: a normal cast


def mixed_checkpoint() -> dict[str, torch.Tensor]:
    return {
        "counts": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "mask": torch.tensor([True, False, True, True]),
        "ids": torch.tensor([0.5, 1.5, 2.0, -3.7, 4.0]),
        "weight": torch.randn(2, 4).bfloat16(),
    }


def test_casts_across_value_kinds_are_reported_and_warned_once(tmp_path):
    ckpt = mixed_checkpoint()
    write(tmp_path, ckpt)
    model = Mixed()
    report, warned = load_recording(model, tmp_path)
    assert report.cast_keys == (
        ("counts", torch.int64, torch.float32),
        ("ids", torch.float32, torch.int64),
        ("mask", torch.bool, torch.float32),
    )
    mine = [w for w in warned if "LoadReport.cast_keys" in w]
    assert len(mine) == 1 and "3 model tensor(s)" in mine[0]
    assert "counts (int64 -> float32)" in mine[0] and "weight" not in mine[0]
    assert torch.equal(model.counts, ckpt["counts"].float()) and torch.equal(model.ids, ckpt["ids"].long())
    assert torch.equal(model.mask, ckpt["mask"].float()) and torch.equal(model.weight, ckpt["weight"].float())


def test_float_to_float_casts_are_not_reported(tmp_path):
    ckpt = mixed_checkpoint()
    ckpt.update(counts=ckpt["counts"].half(), mask=ckpt["mask"].double(), ids=ckpt["ids"].int())
    write(tmp_path, ckpt)
    report, warned = load_recording(Mixed(), tmp_path)
    assert report.cast_keys == () and not [w for w in warned if "cast_keys" in w]


def test_a_conversions_own_output_dtype_is_what_counts(tmp_path):
    """An explicit ``.float()`` in a conversion is deliberate (not reported); an untraceable (deferred) conversion
    of int values into a float tensor is reported like a rename."""
    write(
        tmp_path,
        {
            "c": torch.arange(12).reshape(3, 4),
            "m": torch.tensor([1, 0, 1, 1]),
            "i": torch.ones(5),
            "w": torch.zeros(2, 4),
        },
    )
    rules = [
        Convert("c", "counts", lambda c: c.float()),
        Convert("m", "mask", lambda m: m * 1),
        Convert("i", "ids", lambda i: i.long()),
        Convert("w", "weight", lambda w: w),
    ]
    model = Mixed()
    report, _ = load_recording(model, tmp_path, weights_mapping=rules)
    assert report.deferred == () and "mask" in report.traced  # `m * 1`: pointwise, a value read
    assert report.cast_keys == (("mask", torch.int64, torch.float32),)
    assert torch.equal(model.mask, torch.tensor([1.0, 0.0, 1.0, 1.0]))


def test_dcp_load_reports_casts_too(tmp_path):
    write(tmp_path, mixed_checkpoint())
    model = Mixed()
    planner = HFLoadPlanner(model)
    with pytest.warns(UserWarning, match="cast_keys"):
        reader = SafetensorsReader(str(tmp_path))
        dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
        report = planner.finish(reader)
    assert [name for name, _, _ in report.cast_keys] == ["counts", "ids", "mask"]


# ---------------------------------------------------------------------------------------------------------------
# FP8


def fp8_checkpoint() -> dict[str, torch.Tensor]:
    """A block-quantized FP8 linear as DeepSeek-V3 stores it: float8_e4m3fn codes and float32 inverse scales."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(4, 8, generator=g) * 100).to(F8)
    return {"proj.weight": weight, "proj.weight_scale_inv": torch.tensor([[0.01]]), "proj.bias": torch.zeros(4)}


class Proj(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        with torch.no_grad():
            self.proj.weight.fill_(7.0)
        self.proj.weight.data = self.proj.weight.data.to(dtype)


def test_fp8_codes_without_scales_into_a_non_fp8_model_are_refused_before_any_write(tmp_path):
    ckpt = fp8_checkpoint()
    del ckpt["proj.weight_scale_inv"]
    path = write(tmp_path, ckpt)
    model = Proj()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(model, str(tmp_path), rules=Rules(strict=False), options=LoadOptions(progress=False))
    e = err.value
    assert e.path == path and e.key == "proj.weight"
    assert path in str(e) and "'proj.weight'" in str(e) and "float8_e4m3fn" in str(e)
    assert "dequantize on load only with block scales stored beside them" in str(e)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_fp8_codes_with_scales_into_a_non_fp8_model_dequantize(tmp_path):
    """No config: the block is inferred from the scale grid (1 x 1 here: one block of 4 x 8), as transformers does."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    ckpt = fp8_checkpoint()
    write(tmp_path, ckpt)
    model = Proj()
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    want = Fp8Dequantize(None)._dequantize_one(ckpt["proj.weight"], ckpt["proj.weight_scale_inv"], torch.bfloat16)
    assert torch.equal(model.proj.weight.view(torch.int16), want.view(torch.int16))
    assert report.deferred == () and report.unexpected_keys == ()


def test_fp8_into_fp8_loads_the_codes_unchanged(tmp_path):
    ckpt = fp8_checkpoint()
    del ckpt["proj.weight_scale_inv"]
    write(tmp_path, ckpt)
    model = Proj(F8)
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert model.proj.weight.dtype == F8 and report.cast_keys == ()
    assert torch.equal(model.proj.weight.view(torch.uint8), ckpt["proj.weight"].view(torch.uint8))


def test_fp8_weight_whose_block_scales_load_nowhere_is_refused(tmp_path):
    """Codes into a float8 parameter are fine, unless the checkpoint's scales are then dropped."""
    path = write(tmp_path, fp8_checkpoint())
    model = Proj(F8)
    with pytest.raises(CheckpointError, match="'proj.weight_scale_inv', which no model tensor loads") as err:
        load_hf_checkpoint(model, str(tmp_path), rules=Rules(strict=False), options=LoadOptions(progress=False))
    assert err.value.path == path and err.value.key == "proj.weight"
    assert torch.equal(model.proj.weight.float(), torch.full((4, 8), 7.0))


class ProjWithScales(Proj):
    def __init__(self) -> None:
        super().__init__(F8)
        self.proj.register_buffer("weight_scale_inv", torch.zeros(1, 1))


def test_fp8_weight_and_its_scales_both_loaded_are_allowed(tmp_path):
    ckpt = fp8_checkpoint()
    write(tmp_path, ckpt)
    model = ProjWithScales()
    load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert torch.equal(model.proj.weight.view(torch.uint8), ckpt["proj.weight"].view(torch.uint8))
    assert torch.equal(model.proj.weight_scale_inv, ckpt["proj.weight_scale_inv"])


def test_a_converter_that_dequantizes_with_the_scales_is_allowed(tmp_path):
    ckpt = fp8_checkpoint()
    write(tmp_path, ckpt)
    rules = [
        Convert(["proj.weight", "proj.weight_scale_inv"], "proj.weight", lambda w, s: w.float() * s),
        Convert("proj.bias", "proj.bias", lambda b: b),
    ]
    model = Proj(torch.float32)
    load_hf_checkpoint(model, str(tmp_path), rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False))
    assert torch.equal(model.proj.weight, ckpt["proj.weight"].float() * 0.01)


def test_dcp_load_refuses_fp8_codes_while_planning(tmp_path):
    ckpt = fp8_checkpoint()
    del ckpt["proj.weight_scale_inv"]
    write(tmp_path, ckpt)
    model = Proj()
    planner = HFLoadPlanner(model, rules=Rules(strict=False))
    with pytest.raises(CheckpointException) as err:
        dcp.load(
            planner.state_dict_for_load(),
            storage_reader=SafetensorsReader(str(tmp_path)),
            planner=planner,
            no_dist=True,
        )
    assert "dequantize on load only with block scales" in str(err.value)
    assert torch.equal(model.proj.weight.float(), torch.full((4, 8), 7.0))
