"""The demo's checkpoint: a tiny MoE model saved in the original Hugging Face layout (per-expert tensors,
separate gate and up projections).

With transformers installed it is a real ``qwen3_moe`` model (:data:`~loader.cli.model_configs.TINY_QWEN3_MOE`)
written by ``save_pretrained`` (loading it goes through transformers' own conversion mapping); without it,
:class:`TinyMoE` and its :data:`RULES`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..options import Rules
from ..rules import Convert, Rename
from .common import quiet_transformers
from .model_configs import TINY_QWEN3_MOE, hf_config
from .models import build_meta_model, read_config

# ---------------------------------------------------------------------------------------------------
# the built-in model (no transformers)

H, HEADS, E, I, V, LAYERS = 32, 4, 4, 24, 96, 2


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(H, H, bias=False))


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = _Experts()


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = _MLP()
        self.input_layernorm = nn.Parameter(torch.empty(H))


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.empty(H))


class TinyMoE(nn.Module):
    """A two-layer MoE with fused expert tensors, and the tensor/expert-parallel plans transformers uses."""

    tp_plan = {
        "model.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.experts.down_proj": "rowwise",
    }
    _ep_plan = {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
    }

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = nn.Linear(H, V, bias=False)


def _gate_up(gates: list[torch.Tensor], ups: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)


def _stack(ws: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ws)


def rules() -> list[Any]:
    """Checkpoint → TinyMoE rules (the Mixtral layout: experts.N.w1/w3/w2)."""
    return [
        Convert(
            ["block_sparse_moe.experts.*.w1.weight", "block_sparse_moe.experts.*.w3.weight"],
            "mlp.experts.gate_up_proj",
            _gate_up,
        ),
        Convert("block_sparse_moe.experts.*.w2.weight", "mlp.experts.down_proj", _stack),
        Rename("block_sparse_moe.gate.weight", "mlp.gate.weight"),
        Rename("input_layernorm.weight", "input_layernorm"),
        Rename("model.norm.weight", "model.norm"),
    ]


def _builtin_checkpoint(path: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": rnd(H), "lm_head.weight": rnd(V, H)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}.self_attn.{name}.weight"] = rnd(H, H)
        t[f"{p}.input_layernorm.weight"] = rnd(H)
        t[f"{p}.block_sparse_moe.gate.weight"] = rnd(E, H)
        for e in range(E):
            t[f"{p}.block_sparse_moe.experts.{e}.w1.weight"] = rnd(I, H)
            t[f"{p}.block_sparse_moe.experts.{e}.w3.weight"] = rnd(I, H)
            t[f"{p}.block_sparse_moe.experts.{e}.w2.weight"] = rnd(H, I)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"regiontrace_demo": "builtin"}, f)
    return t


def builtin_expected(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TinyMoE state the checkpoint ``t`` must load to (computed directly, without the loader)."""
    out = {
        "model.embed_tokens.weight": t["model.embed_tokens.weight"],
        "model.norm": t["model.norm.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}.self_attn.{name}.weight"] = t[f"{p}.self_attn.{name}.weight"]
        out[f"{p}.input_layernorm"] = t[f"{p}.input_layernorm.weight"]
        out[f"{p}.mlp.gate.weight"] = t[f"{p}.block_sparse_moe.gate.weight"]
        ex = [f"{p}.block_sparse_moe.experts.{e}" for e in range(E)]
        out[f"{p}.mlp.experts.gate_up_proj"] = _gate_up(
            [t[f"{k}.w1.weight"] for k in ex], [t[f"{k}.w3.weight"] for k in ex]
        )
        out[f"{p}.mlp.experts.down_proj"] = _stack([t[f"{k}.w2.weight"] for k in ex])
    return out


# ---------------------------------------------------------------------------------------------------
# both kinds


def write_checkpoint(kind: str, path: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the demo checkpoint of ``kind`` ("transformers" or "builtin") into folder ``path``.

    Returns:
        The state every correct load must produce (model tensor name → tensor).
    """
    if kind == "builtin":
        return builtin_expected(_builtin_checkpoint(path, seed))
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    config = hf_config("qwen3_moe", TINY_QWEN3_MOE)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # distinct values everywhere (init leaves norms all ones)
        g = torch.Generator().manual_seed(seed)
        for t in model.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g))
    model.save_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_model(kind: str, path: str) -> nn.Module:
    """The model to load into, on the meta device."""
    if kind == "builtin":
        with torch.device("meta"):
            return TinyMoE().to(torch.bfloat16)
    quiet_transformers()
    return build_meta_model(read_config(path, None, None), dtype=torch.bfloat16)


def load_rules(kind: str) -> Rules | None:
    """The :class:`~loader.options.Rules` of a load (and a save) of the checkpoint of ``kind`` (None: the default)."""
    return Rules(weights_mapping=rules()) if kind == "builtin" else None
