"""Imported once by the demo's fork server, so that every rank forked from it starts with torch, the
loader and the model code already imported (spawning N fresh interpreters costs N full imports)."""

from __future__ import annotations

import torch.distributed
import torch.distributed.tensor  # noqa: F401

import regiontrace  # noqa: F401

from .. import distributed, placements  # noqa: F401
from . import demo_models, demo_rank  # noqa: F401

try:
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
except ImportError:  # the demo then uses its built-in model
    pass
