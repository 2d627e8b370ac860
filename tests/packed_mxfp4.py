"""Tiny gpt-oss MXFP4 checkpoints, stored as openai and transformers store them: each expert projection
``<x>`` as ``<x>_blocks`` (uint8, two E2M1 codes a byte along the input dim, low nibble first, ``[E, out, K/32, 16]``)
and ``<x>_scales`` (uint8 E8M0 exponents, one per 32 inputs, ``[E, out, K/32]``); the config's
``quantization_config`` is ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

#: the projections gpt-oss stores packed
PROJECTIONS = ("gate_up_proj", "down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_config():
    """A tiny ``GptOssConfig``: 2 layers of 4 experts, hidden 64, intermediate 32 (K a multiple of 32)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip


def random_mxfp4(shape, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(blocks, scales)`` for a dense ``[..., out, K]``: every code, and exponents around 2 ** 0."""
    *lead, out, k = shape
    blocks = torch.randint(0, 256, (*lead, out, k // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 134, (*lead, out, k // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def write_mxfp4(folder, model, seed: int = 0, edge_scales: bool = False) -> dict[str, torch.Tensor]:
    """Save ``model`` (a GptOss) with every expert projection as random MXFP4 blocks and scales, and its config."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(folder, exist_ok=True)
    stored = {}
    for name, t in model.state_dict().items():
        stem = name.rsplit(".", 1)[-1]
        if stem in PROJECTIONS:
            blocks, scales = random_mxfp4(t.transpose(1, 2).shape, g)
            if edge_scales:  # the extreme exponents: 2 ** -127 (subnormal in float32) and 255 (inf, as transformers)
                scales.view(-1)[:4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        else:
            stored[name] = t.detach().to(torch.bfloat16).contiguous()
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return stored
