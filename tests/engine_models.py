"""vLLM-style modules for the engine loader's tests (no vLLM): parameters with ``weight_loader`` attributes that write
this rank's slot in place, and a ``load_weights`` walking ``(name, tensor)`` pairs through ``stacked_params_mapping``.

``TinyLlama`` loads a transformers ``LlamaForCausalLM`` checkpoint at any TP size: a padded vocabulary (embedding and
lm_head, the padding zeroed), fused qkv (KV heads replicated when fewer than ranks), merged gate_up, row-parallel
o_proj/down_proj (a column narrow), replicated norms. ``TinyMoE`` loads FusedMoE-like experts into ``w13``/``w2``.
"""

from __future__ import annotations

import torch
from torch import nn

PAD = 64  # vLLM pads the vocabulary to a multiple of 64


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """vLLM's default: the whole tensor, shapes equal."""
    assert param.size() == loaded.size(), (param.size(), loaded.size())
    param.data.copy_(loaded)


def _param(shape, dtype, loader=None, **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)
    if loader is not None:
        p.weight_loader = loader
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class Parallel(nn.Module):
    def __init__(self, tp_rank: int, tp: int) -> None:
        super().__init__()
        self.tp_rank, self.tp = tp_rank, tp


class VocabEmbedding(Parallel):
    """``VocabParallelEmbedding``: this rank's rows of the padded vocabulary, the padding zeroed."""

    def __init__(self, vocab: int, hidden: int, tp_rank: int, tp: int, dtype: torch.dtype) -> None:
        super().__init__(tp_rank, tp)
        self.vocab = vocab
        padded = -(-vocab // (PAD * tp)) * PAD * tp
        self.per = padded // tp
        self.weight = _param((self.per, hidden), dtype, self.weight_loader, output_dim=0)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        start = self.tp_rank * self.per
        n = max(0, min(self.vocab - start, self.per))
        # vLLM narrows to the model's vocabulary, silently
        param.data[:n].copy_(loaded.narrow(0, min(start, self.vocab), n))
        param.data[n:].fill_(0)


class QKV(Parallel):
    def __init__(self, hidden: int, heads: tuple[int, int, int], tp_rank: int, tp: int, dtype) -> None:
        super().__init__(tp_rank, tp)
        nq, nkv, hd = heads
        self.q_size, self.kv_size = nq * hd // tp, max(1, nkv // tp) * hd
        self.replicas = max(1, tp // nkv)
        self.weight = _param((self.q_size + 2 * self.kv_size, hidden), dtype, self.weight_loader, output_dim=0)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        offset, size, rank = {
            "q": (0, self.q_size, self.tp_rank),
            "k": (self.q_size, self.kv_size, self.tp_rank // self.replicas),
            "v": (self.q_size + self.kv_size, self.kv_size, self.tp_rank // self.replicas),
        }[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class Merged(Parallel):
    """``MergedColumnParallelLinear``: gate and up rows of this rank, one after the other."""

    def __init__(self, hidden: int, inter: int, tp_rank: int, tp: int, dtype) -> None:
        super().__init__(tp_rank, tp)
        self.part = inter // tp
        self.weight = _param((2 * self.part, hidden), dtype, self.weight_loader, output_dim=0)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        mine = loaded.narrow(0, self.tp_rank * self.part, self.part)
        param.data.narrow(0, shard_id * self.part, self.part).copy_(mine)


class Row(Parallel):
    """``RowParallelLinear``: this rank's columns."""

    def __init__(self, inputs: int, outputs: int, tp_rank: int, tp: int, dtype) -> None:
        super().__init__(tp_rank, tp)
        self.weight = _param((outputs, inputs // tp), dtype, self.weight_loader, input_dim=1)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))


class Norm(nn.Module):
    def __init__(self, hidden: int, dtype) -> None:
        super().__init__()
        self.weight = _param((hidden,), dtype)


class Layer(nn.Module):
    def __init__(self, config, tp_rank: int, tp: int, dtype) -> None:
        super().__init__()
        h, heads = config.hidden_size, (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKV(h, heads, tp_rank, tp, dtype)
        self.self_attn.o_proj = Row(heads[0] * heads[2], h, tp_rank, tp, dtype)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = Merged(h, config.intermediate_size, tp_rank, tp, dtype)
        self.mlp.down_proj = Row(config.intermediate_size, h, tp_rank, tp, dtype)
        self.input_layernorm, self.post_attention_layernorm = Norm(h, dtype), Norm(h, dtype)


class TinyLlama(nn.Module):
    """vLLM's ``LlamaForCausalLM`` loading, in miniature."""

    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config, tp_rank: int = 0, tp: int = 1, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp, dtype)
        self.model.layers = nn.ModuleList(Layer(config, tp_rank, tp, dtype) for _ in range(config.num_hidden_layers))
        self.model.norm = Norm(config.hidden_size, dtype)
        self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp, dtype)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params[name]
                param.weight_loader(param, tensor, shard_id)
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


class TinyMoE(nn.Module):
    """``FusedMoE``: expert ``e``'s gate (w1) and up (w3) rows into ``w13[e]``, its down (w2) columns into ``w2[e]``,
    each narrowed to this rank's share of the intermediate size."""

    def __init__(self, experts: int, hidden: int, inter: int, tp_rank: int, tp: int, dtype=torch.bfloat16) -> None:
        super().__init__()
        self.part, self.tp_rank = inter // tp, tp_rank
        self.w13_weight = _param((experts, 2 * self.part, hidden), dtype, self.weight_loader)
        self.w2_weight = _param((experts, hidden, self.part), dtype, self.weight_loader)

    def weight_loader(self, param, loaded, expert: int, shard_id: str) -> None:
        dim = 1 if shard_id == "w2" else 0
        offset = self.part if shard_id == "w3" else 0
        param.data[expert].narrow(dim, offset, self.part).copy_(loaded.narrow(dim, self.tp_rank * self.part, self.part))

    def load_weights(self, weights) -> None:
        for name, tensor in weights:  # experts.{e}.{w1,w2,w3}.weight
            _, e, shard_id, _ = name.split(".")
            param = self.w2_weight if shard_id == "w2" else self.w13_weight
            param.weight_loader(param, tensor, int(e), shard_id)


class ColumnParameter(nn.Parameter):
    """vLLM's ``ModelWeightParameter`` in miniature: a Parameter subclass whose attributes are private names behind
    properties and whose methods load this rank's rows."""

    def __new__(cls, data: torch.Tensor, **kwargs):
        return super().__new__(cls, data=data, requires_grad=False)

    def __init__(self, data: torch.Tensor, output_dim: int, tp_rank: int, weight_loader) -> None:
        self._output_dim, self.tp_rank, self._weight_loader = output_dim, tp_rank, weight_loader

    @property
    def output_dim(self) -> int:
        return self._output_dim

    @property
    def weight_loader(self):
        return self._weight_loader

    def load_column_parallel_weight(self, loaded: torch.Tensor) -> None:
        size = self.data.shape[self.output_dim]
        loaded = loaded.narrow(self.output_dim, self.tp_rank * size, size)
        assert self.data.shape == loaded.shape
        self.data.copy_(loaded)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class ColumnLinear(Parallel):
    """A linear layer whose weight is a :class:`ColumnParameter` (vLLM's ``weight_loader_v2`` path)."""

    def __init__(self, inputs: int, outputs: int, tp_rank: int, tp: int, dtype=torch.float32) -> None:
        super().__init__(tp_rank, tp)
        data = torch.full((outputs // tp, inputs), float("nan"), dtype=dtype)
        self.weight = ColumnParameter(data, output_dim=0, tp_rank=tp_rank, weight_loader=self.weight_loader_v2)

    def weight_loader_v2(self, param: ColumnParameter, loaded: torch.Tensor) -> None:
        assert isinstance(param, ColumnParameter)
        param.load_column_parallel_weight(loaded)

    def load_weights(self, weights) -> None:
        for _, tensor in weights:
            self.weight.weight_loader(self.weight, tensor)
