"""Tiny random transformers models of many families, shared by the loader tests.

``build(family, seed)`` makes a model from a small config and gives every floating-point element a distinct
value that depends on ``seed`` (init leaves biases/norms identical everywhere, which would hide mix-ups);
two seeds give models whose every tensor differs.
"""

from __future__ import annotations

import copy
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
)
from transformers.utils import logging as hf_logging

from loader.cli.model_configs import TINY_QWEN3_MOE

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
MIXTRAL = dict(TEXT, num_local_experts=4)

FAMILIES = {
    "mixtral": (AutoModelForCausalLM, "mixtral", MIXTRAL),
    "qwen2_moe": (
        AutoModelForCausalLM, "qwen2_moe",
        dict(
            TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
        ),
    ),
    "qwen3_moe": (  # the tiny Qwen3-MoE with TEXT's key/value heads and vocabulary, smaller experts
        AutoModelForCausalLM, "qwen3_moe",
        dict(TINY_QWEN3_MOE, num_key_value_heads=2, vocab_size=64, moe_intermediate_size=16),
    ),
    "deepseek_v3": (
        AutoModelForCausalLM, "deepseek_v3",
        dict(
            TEXT, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
        ),
    ),
    "olmoe": (AutoModelForCausalLM, "olmoe", dict(TEXT, num_experts=4, num_experts_per_tok=2)),
    "jamba": (
        AutoModelForCausalLM, "jamba",
        dict(
            TEXT, num_experts=4, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
            attn_layer_offset=1, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
        ),
    ),
    "ernie4_5_moe": (
        AutoModelForCausalLM, "ernie4_5_moe",
        dict(TEXT, moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1),
    ),
    "gpt_oss": (AutoModelForCausalLM, "gpt_oss", dict(TEXT, num_local_experts=4, head_dim=8)),
    "llama": (AutoModelForCausalLM, "llama", dict(TEXT, tie_word_embeddings=True)),
    # Transpose(1, 2, check_dims=True) on the fused expert tensors
    "qwen3_vl_moe": (
        AutoModel, "qwen3_vl_moe",
        dict(
            text_config=dict(
                TEXT, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=8,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
            ),
            vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
                spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
            ),
        ),
    ),
    # Chunk(dim=0): fused Wqkv -> q/k/v, plus many renames
    "nomic_bert": (AutoModel, "nomic_bert", dict(TEXT, num_key_value_heads=4)),
    # Chunk(dim=0) -> PermuteForRope(permute_layer_names=["q_proj", "k_proj"]) on a fused in_proj
    "gradium_phonon_tts": (
        AutoModel, "gradium_phonon_tts",
        dict(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            audio_prompt_dim=16,
            flow_head_config=dict(
                hidden_size=32, num_hidden_layers=1, condition_dim=32, frequency_embedding_size=16
            ),
        ),
    ),
    # scoped sub-model mappings (mixtral text model under `model.language_model`), llava renames and a
    # scoped PrefixChange for the CLIP vision tower
    "llava_mixtral": (
        AutoModelForImageTextToText, "llava",
        dict(
            text_config=dict(MIXTRAL, model_type="mixtral"),
            vision_config=dict(
                model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, image_size=16, patch_size=8, projection_dim=32,
            ),
            image_token_id=3,
        ),
    ),
}  # fmt: skip


def config_of(family: str, **overrides):
    _, model_type, kwargs = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every floating-point element of ``model`` a distinct random value drawn from ``seed``."""
    with torch.no_grad():
        for i, tensor in enumerate(model.state_dict(keep_vars=True).values()):
            if tensor.is_floating_point():
                g = torch.Generator().manual_seed(seed * 100_003 + i)
                tensor.copy_(torch.randn(tensor.shape, generator=g))
    return model


def build(family: str, seed: int = 0, *, auto=None, dtype: torch.dtype | None = None, **overrides):
    """``(auto class, model)``: a tiny random ``family`` model in eval mode (optionally of ``dtype``)."""
    auto = auto or FAMILIES[family][0]
    config = config_of(family, **overrides)
    torch.manual_seed(seed)
    model = auto.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    return auto, randomize(model, seed).eval()


def save(model: torch.nn.Module, directory, dtype: torch.dtype | None = None, **kwargs) -> None:
    """``save_pretrained`` (of a ``dtype`` copy when given): writes the original checkpoint layout."""
    if dtype is not None and dtype != next(iter(model.state_dict().values())).dtype:
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(directory, **kwargs)


def read_checkpoint(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (one file or shards), in file order."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    out = {}
    for name in names:
        with safe_open(os.path.join(directory, name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
