"""The tiny transformers model the demo and the tests build, written down once.

Vocabulary: a model's **config** is its transformers config keywords (a dict such as :data:`TINY_QWEN3_MOE`, given
to ``AutoConfig.for_model``); a variant is the same dict with a few keywords overridden
(``hf_config("qwen3_moe", TINY_QWEN3_MOE, vocab_size=70)``).

:data:`TINY_QWEN3_MOE` is a two-layer Qwen3-MoE of hidden size 32 and 4 experts: the demo's checkpoint, the
distributed and simulated loads of the tests and the tests' ``qwen3_moe`` family (tests/hf_models.py) are it or
a variant of it. The benches' models (larger, and the same whichever checkout of the loader a bench compares) are
bench/common.py's. transformers is imported when a model is built, not with this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

TINY_QWEN3_MOE: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=96,
    tie_word_embeddings=False,
)


def hf_config(model_type: str, config: Mapping[str, Any], **overrides: Any) -> Any:
    """The transformers config of ``model_type`` built from ``config`` with ``overrides`` replacing its keywords."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**config, **overrides})


def seeded_model(config: Any, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A causal LM of transformers ``config``, initialized after ``torch.manual_seed(seed)`` in float32, then cast
    to ``dtype`` (the same values for the same seed, run after run)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype)
