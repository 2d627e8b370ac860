"""A torchtitan Llama 3 checkpoint and its conversion rules, as torchtitan's ``Llama3StateDictAdapter`` maps it.

torchtitan's names (``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.w1/w2/w3``, ``attention_norm``,
``ffn_norm``, ``norm``, ``output``) map one to one onto transformers' Llama names; ``to_hf`` also permutes the rows
of ``wq`` and ``wk`` per head (torchtitan's RoPE rotates interleaved pairs, transformers' the two halves):
``w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)``, and ``from_hf`` inverts it.
:func:`to_hf` / :func:`from_hf` follow the adapter; :func:`rules` are the same mapping as ``Rename`` / ``Convert``.
"""

from __future__ import annotations

import re

import torch

from loader import Convert, Rename

#: transformers' name -> torchtitan's ("{}" the layer), as the adapter's ``from_hf_map``
FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan -> transformers rows of ``wq`` / ``wk`` (the adapter's ``_permute``)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def reverse_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers -> torchtitan rows (the adapter's ``_reverse_permute``)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def abstract_key(key: str) -> tuple[str, str | None]:
    """``(key with its first number as "{}", that number)``."""
    found = re.search(r"\d+", key)
    return (re.sub(r"\d+", "{}", key, count=1), found.group(0)) if found else (key, None)


def from_hf(state: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """A transformers Llama state dict in torchtitan's names and layout."""
    out = {}
    for key, value in state.items():
        abstract, layer = abstract_key(key)
        if abstract.endswith("q_proj.weight"):
            value = reverse_permute(value, heads)
        elif abstract.endswith("k_proj.weight"):
            value = reverse_permute(value, kv_heads)
        out[FROM_HF[abstract].format(layer)] = value.contiguous()
    return out


def to_hf(state: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """torchtitan's state dict converted for real, as the adapter's ``to_hf``."""
    back = {v: k for k, v in FROM_HF.items()}
    out = {}
    for key, value in state.items():
        abstract, layer = abstract_key(key)
        if abstract == "layers.{}.attention.wq.weight":
            value = permute(value, heads)
        elif abstract == "layers.{}.attention.wk.weight":
            value = permute(value, kv_heads)
        out[back[abstract].format(layer)] = value.contiguous()
    return out


def rules(heads: int, kv_heads: int) -> list:
    """The adapter's ``to_hf`` as loader rules: renames, and the q/k row permutation traced into region reads."""
    renames = [
        (r"^tok_embeddings\.", "model.embed_tokens."),
        (r"^layers\.", "model.layers."),
        (r"attention\.wv\.", "self_attn.v_proj."),
        (r"attention\.wo\.", "self_attn.o_proj."),
        (r"feed_forward\.w1\.", "mlp.gate_proj."),
        (r"feed_forward\.w3\.", "mlp.up_proj."),
        (r"feed_forward\.w2\.", "mlp.down_proj."),
        (r"attention_norm\.", "input_layernorm."),
        (r"ffn_norm\.", "post_attention_layernorm."),
        (r"^norm\.", "model.norm."),
        (r"^output\.", "lm_head."),
    ]
    return [
        *(Rename(a, b) for a, b in renames),
        Convert("attention.wq.weight", "self_attn.q_proj.weight", lambda w: permute(w, heads)),
        Convert("attention.wk.weight", "self_attn.k_proj.weight", lambda w: permute(w, kv_heads)),
    ]
