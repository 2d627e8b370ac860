"""Tiny checkpoints of the families vLLM loads, written by transformers' own ``save_pretrained`` (bf16).

Every family has head_dim 64 (vLLM's CPU attention needs it; DeepSeek-V2's MLA: its rope and nope parts and its
values), a small hidden size, one or two layers and a vocabulary that is not a multiple of 64 (vLLM pads it);
``llama`` has 2 KV heads, fewer than 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: vocabulary size of every family: 1000 is not a multiple of 64, so vLLM pads the embedding to 1024 rows
VOCAB = 1000
#: what every family's config shares
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
#: family -> (transformers config class name, its settings beyond COMMON)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"num_hidden_layers": 1, "hidden_size": 256}),  # head_dim = hidden / heads
    "qwen3": ("Qwen3Config", {"num_hidden_layers": 1, "num_key_value_heads": 4}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": ("MixtralConfig", {"num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma": ("GemmaConfig", {"num_hidden_layers": 1, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "deepseek_v2": (  # MLA (its config's head_dim is the rope part), a dense first layer, then routed + shared experts
        "DeepseekV2Config",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 64,
            "q_lora_rank": None,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64,
            "v_head_dim": 64,
            "first_k_dense_replace": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "greedy",
        },
    ),
}


def write_checkpoint(family: str, folder: Path, *, seed: int = 0) -> Path:
    """``folder`` holding ``family``'s tiny model as ``save_pretrained`` writes it (config.json, safetensors)."""
    import transformers

    config_name, settings = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **settings})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # values far from the initialiser's zeros and ones: every element tells
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32).mul_(0.5).to(p.dtype))
    model.save_pretrained(folder)
    return folder


def add_rows(folder: Path, suffix: str = "embed_tokens.weight", rows: int = 64) -> str:
    """Grow the first tensor of ``folder``'s checkpoint whose key ends in ``suffix`` by ``rows`` rows the model
    does not have (a vocabulary 64 too large, by default); its key."""
    [file] = sorted(Path(folder).glob("*.safetensors"))
    tensors = load_file(file)
    key = next(k for k in sorted(tensors) if k.endswith(suffix))
    extra = torch.zeros(rows, *tensors[key].shape[1:], dtype=tensors[key].dtype)
    tensors[key] = torch.cat([tensors[key], extra])
    save_file(tensors, file, metadata={"format": "pt"})
    return key


def drop_tensor(folder: Path, suffix: str) -> str:
    """Remove the first tensor of ``folder``'s checkpoint whose key ends in ``suffix``; its key."""
    [file] = sorted(Path(folder).glob("*.safetensors"))
    tensors = load_file(file)
    key = next(k for k in sorted(tensors) if k.endswith(suffix))
    del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    return key
