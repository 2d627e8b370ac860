"""Conversions that compute (a norm's ``+ 1``) round like ``from_pretrained``: transformers casts every source to
the model tensor's dtype before its ops run, so the arithmetic rounds in the model's dtype, not the checkpoint's.
The traced (value read) and the deferred path of one rule give the same bits, for every dtype pair.
"""

from __future__ import annotations

import json

import hf_models
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter

from loader import HFLoadPlanner, load_hf_checkpoint
from loader.hooks import PlanHooks
from loader.options import LoadOptions

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class AddOne(ConversionOps):
    """``weight = delta + 1``: a norm stored as its offset from one (Gemma-style), computed on load."""

    @torch.no_grad
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor + 1}


class AddOneLlama(LlamaForCausalLM):
    """A Llama whose checkpoint stores each input norm as ``input_layernorm.delta`` (its class name selects the
    conversion mapping registered below, so other Llama tests are untouched)."""


register_checkpoint_conversion_mapping(
    "AddOneLlama",
    [WeightConverter("input_layernorm.delta", "input_layernorm.weight", operations=[AddOne()])],
    overwrite=True,
)


class NoTracing(PlanHooks):
    """Every conversion but a rename is read whole and run for real (the deferred path)."""

    def supports_symbolic(self, conversion):
        return conversion.is_rename


def write_checkpoint(folder, dtype: torch.dtype) -> None:
    """A tiny Llama's state in ``dtype``, each input norm stored as ``delta`` with values that need all of
    ``dtype``'s mantissa (adding one in a narrower dtype would round them)."""
    model = hf_models.build("llama", seed=0)[1]
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied
        if k.endswith("input_layernorm.weight"):
            k, v = k.replace(".weight", ".delta"), v * 0.37
        tensors[k] = v.to(dtype).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["AddOneLlama"]
    (folder / "config.json").write_text(json.dumps(config))


def fresh(dtype: torch.dtype) -> AddOneLlama:
    return AddOneLlama(hf_models.config_of("llama")).to(dtype).eval()


@pytest.mark.parametrize("checkpoint_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model_dtype", DTYPES, ids=str)
def test_computing_rules_round_like_from_pretrained_on_both_paths(tmp_path, checkpoint_dtype, model_dtype):
    write_checkpoint(tmp_path, checkpoint_dtype)
    reference = AddOneLlama.from_pretrained(tmp_path, dtype=model_dtype).state_dict()
    traced, deferred = fresh(model_dtype), fresh(model_dtype)
    traced_report = load_hf_checkpoint(traced, str(tmp_path), options=LoadOptions(progress=False))
    deferred_report = load_hf_checkpoint(
        deferred, str(tmp_path), planner=HFLoadPlanner(deferred, hooks=NoTracing()), options=LoadOptions(progress=False)
    )
    norms = [k for k in reference if k.endswith("input_layernorm.weight")]
    assert len(norms) == 2
    assert not any(k in traced_report.deferred for k in norms), traced_report.deferred  # value reads
    assert all(k in deferred_report.deferred for k in norms)
    for name, want in reference.items():
        for path, model in (("traced", traced), ("deferred", deferred)):
            got = model.state_dict()[name]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                path,
                name,
            )


def test_the_cast_is_visible_in_the_bits(tmp_path):
    """The case the issue reproduced: bf16 checkpoint, float32 model; rounding ``+ 1`` in bf16 differs."""
    write_checkpoint(tmp_path, torch.bfloat16)
    model = fresh(torch.float32)
    load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        delta = f.get_tensor("model.layers.0.input_layernorm.delta")
    got = model.model.layers[0].input_layernorm.weight.data
    assert torch.equal(got, delta.float() + 1)
    assert not torch.equal(got, (delta + 1).float())  # what rounding in the checkpoint's dtype would give
