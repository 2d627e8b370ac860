"""The destination ("engine") models of the transfer tests: a tiny transformers Qwen3-MoE's weights with fused,
rope-permuted ``qkv_proj`` and a merged ``gate_up_proj``, its rules and tensor-parallel placements."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from loader import Convert

# hf_models' qwen3_moe: hidden 32, 4 heads of 8 (2 kv heads), 4 experts of 16, 2 layers, vocab 64
H, HEADS, KV, D, E, I, LAYERS, V = 32, 4, 2, 8, 4, 16, 2, 64


def rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved halves per head (Llama's permute for rotary embeddings)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([rope_permute(q, HEADS), rope_permute(k, KV), v])


def gate_up(gates: list[torch.Tensor], ups: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)


def stack(ws: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ws)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(H, (HEADS + 2 * KV) * D, bias=False)
        self.o_proj = nn.Linear(HEADS * D, H, bias=False)
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.empty(D))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.empty(D))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = _MLP()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.empty(H))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.empty(H))


class _Inner(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, H)
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(H))


class Engine(nn.Module):
    """The inference engine's layout of the tiny Qwen3-MoE (another ``vocab``: a model that does not match)."""

    def __init__(self, vocab: int = V) -> None:
        super().__init__()
        self.model = _Inner(vocab)
        self.lm_head = nn.Linear(H, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(-1.0)


def rules() -> list:
    """Checkpoint (transformers' Qwen3-MoE layout) -> Engine."""
    return [
        Convert(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                "self_attn.qkv_proj.weight", qkv),
        Convert(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.gate_up_proj", gate_up),
        Convert("mlp.experts.*.down_proj.weight", "mlp.down_proj", stack),
    ]  # fmt: skip


def doubled(w: torch.Tensor) -> torch.Tensor:
    return torch.stack([w, w]).sum(0)  # `sum`: not traceable, moved whole and run on the destination


def rules_with_fallback() -> list:
    """:func:`rules`, and the final norm through a conversion that does not trace."""
    return [Convert("model.norm.weight", "model.norm.weight", doubled), *rules()]


def tp_placements(model: nn.Module, two_dims: bool = False) -> dict[str, list]:
    """Tensor parallel over the last mesh dim (experts over the first one of a 2-D mesh: EP x TP)."""
    out: dict[str, list] = {}
    for name, _ in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "lm_head.weight")):
            p = [Shard(0)]
        elif name.endswith("o_proj.weight"):
            p = [Shard(1)]
        elif name.endswith("gate_up_proj"):
            p = [Shard(1)]
        elif name.endswith("down_proj"):
            p = [Shard(2)]
        elif name.endswith("embed_tokens.weight"):
            p = [Shard(1)]
        else:
            p = [Replicate()]
        if two_dims:
            p = ([Shard(0)] if name.endswith(("gate_up_proj", "down_proj")) else [Replicate()]) + p
        out[name] = p
    return out


def fsdp_placements(model: nn.Module) -> dict[str, list]:
    """FSDP-style: every parameter ``Shard(0)``."""
    return {name: [Shard(0)] for name, _ in model.named_parameters()}


def ep_tp_source_placements(model: nn.Module) -> dict[str, list]:
    """A transformers Qwen3-MoE on a 2 x 2 mesh: experts over the first dim, TP over the second (gate_up as
    ``_StridedShard``: cells not contiguous in the local shard), everything else replicated on both."""
    from torch.distributed.tensor.placement_types import _StridedShard

    out: dict[str, list] = {}
    for name, _ in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[name] = [Replicate(), Shard(0)]
        elif name.endswith("o_proj.weight"):
            out[name] = [Replicate(), Shard(1)]
        elif name.endswith("experts.gate_up_proj"):
            out[name] = [Shard(0), _StridedShard(1, split_factor=2)]
        elif name.endswith("experts.down_proj"):
            out[name] = [Shard(0), Shard(2)]
        else:
            out[name] = [Replicate(), Replicate()]
    return out


class Pair(nn.Module):
    """Two [8, 8] tensors (the memory and agreement checks); ``values``: ``a`` counts from 0, ``b`` from 100, else
    -1 everywhere."""

    def __init__(self, values: bool = True) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(64.0).view(8, 8) if values else torch.full((8, 8), -1.0))
        self.b = nn.Parameter(torch.arange(64.0).view(8, 8) + 100 if values else torch.full((8, 8), -1.0))


def crossed() -> list:
    """``a`` from ``b``'s key and ``b`` from ``a``'s."""
    return [Convert("b", "a", lambda w: w), Convert("a", "b", lambda w: w)]


def transposed() -> list:
    """``a`` from ``a``'s key transposed, ``b`` as it is."""
    return [Convert("a", "a", lambda w: w.t()), Convert("b", "b", lambda w: w)]


class Empty(nn.Module):
    """Two zero-element [2, 0] tensors beside a [3]."""

    def __init__(self, values: bool = True) -> None:
        super().__init__()
        self.e1 = nn.Parameter(torch.empty(2, 0))
        self.e2 = nn.Parameter(torch.empty(2, 0))
        self.w = nn.Parameter(torch.arange(3.0) + 1 if values else torch.full((3,), -1.0))
