"""vLLM-style weight loaders traced into destination stand-ins: fused qkv (KV heads replicated when fewer than
ranks), merged gate/up, padded vocabularies, FusedMoE experts and a module's own ``load_weights``, per rank, bit for
bit against the same loader run on real tensors, each parameter's coverage certificate exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_inplace_writes import evaluate

import regiontrace as rt
from regiontrace.testing import random_tensor
from regiontrace.writes import Destination

leaf = rt.RegionTensor.leaf


def qkv_loader(param, loaded, shard_id: str, tp_rank: int, tp: int, heads: tuple[int, int, int]) -> None:
    """``QKVParallelLinear.weight_loader``: this rank's heads of ``shard_id`` into the fused parameter (KV heads
    replicated when fewer than ranks)."""
    nq, nkv, hd = heads
    q_size, kv_heads = nq * hd // tp, max(1, nkv // tp)
    kv_size, replicas = kv_heads * hd, max(1, tp // nkv)
    offset, size, rank = {"q": (0, q_size, tp_rank), "k": (q_size, kv_size, tp_rank // replicas)}.get(
        shard_id, (q_size + kv_size, kv_size, tp_rank // replicas)
    )
    param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("nkv", [2, 4])
def test_fused_qkv_per_rank(tp, nkv):
    nq, hd, hidden = 4, 2, 3
    gen = torch.Generator().manual_seed(tp * 10 + nkv)
    shapes = {"q": (nq * hd, hidden), "k": (nkv * hd, hidden), "v": (nkv * hd, hidden)}
    real = {n: random_tensor(s, torch.bfloat16, gen) for n, s in shapes.items()}
    rows = nq * hd // tp + 2 * max(1, nkv // tp) * hd
    for rank in range(tp):
        param = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
        dest = rt.destination("qkv_proj.weight", (rows, hidden), torch.bfloat16)
        for shard in "qkv":
            qkv_loader(param, real[shard], shard, rank, tp, (nq, nkv, hd))
            qkv_loader(dest, leaf(shard, shapes[shard], torch.bfloat16), shard, rank, tp, (nq, nkv, hd))
        assert torch.equal(evaluate(dest, real), param)
        cov = rt.coverage(dest)
        assert cov.exact and not cov.unwritten and [w.op for w in cov.writes] == ["copy_"] * 3
        q_rows = nq * hd // tp
        assert cov.written[0] == (((0, q_rows), (0, hidden)),)
        assert {p.source.name for p in dest.region.pieces} == {"q", "k", "v"}


def test_merged_gate_up_and_a_parameter_written_through_data():
    gate, up = leaf("gate", (8, 3)), leaf("up", (8, 3))
    dest = rt.destination("gate_up_proj.weight", (8, 3))
    for shard_id, w in enumerate((gate, up)):  # MergedColumnParallelLinear at TP 2, rank 1
        dest.data.narrow(0, shard_id * 4, 4).copy_(w.narrow(0, 4, 4))
    g, u = torch.randn(8, 3), torch.randn(8, 3)
    assert torch.equal(evaluate(dest, {"gate": g, "up": u}), torch.cat([g[4:], u[4:]]))
    assert rt.coverage(dest).exact


def test_padded_vocab_written_by_a_constant():
    vocab, padded, hidden = 10, 16, 4
    w, real = leaf("embed", (vocab, hidden)), torch.randn(vocab, hidden)
    for tp in (1, 2):  # VocabParallelEmbedding: each rank's rows of the padded vocabulary, the padding zeroed
        per = padded // tp
        for rank in range(tp):
            start, n = rank * per, max(0, min(vocab - rank * per, per))
            dest, param = rt.destination("embed.weight", (per, hidden)), torch.full((per, hidden), float("nan"))
            for p, src in ((dest, w), (param, real)):
                p.data[:n].copy_(src.narrow(0, start, n))
                p.data[n:].fill_(0)
            assert torch.equal(evaluate(dest, {"embed": real}), param)
            cov = rt.coverage(dest)
            assert cov.exact and cov.constant == ((((n, per), (0, hidden)),) if n < per else ())
    padded_t = F.pad(w, (0, 0, 0, padded - vocab))  # F.pad, then copied into the parameter
    assert torch.equal(evaluate(padded_t, {"embed": real}), F.pad(real, (0, 0, 0, padded - vocab)))
    assert rt.coverage(padded_t).constant == (((vocab, padded), (0, hidden)),)
    dest = rt.destination("lm_head.weight", (padded, hidden), fill=0)  # zeros, then the vocabulary copied in
    dest[:vocab] = w
    cov = rt.coverage(dest)
    assert cov.complete and cov.exact and cov.unwritten == cov.constant == (((vocab, padded), (0, hidden)),)
    assert torch.equal(evaluate(dest, {"embed": real}), F.pad(real, (0, 0, 0, padded - vocab)))


class TinyAttention(torch.nn.Module):
    """A vLLM-style module: fused parameters with ``weight_loader`` attributes and a ``load_weights`` that walks
    ``(name, tensor)`` pairs through ``stacked_params_mapping``."""

    heads = (4, 2, 2)  # q heads, kv heads, head dim
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]

    def __init__(self, make: Callable, tp_rank: int, tp: int, hidden: int = 3):
        super().__init__()
        nq, nkv, hd = self.heads
        rows = nq * hd // tp + 2 * max(1, nkv // tp) * hd
        self.qkv_proj = torch.nn.Parameter(make("qkv_proj.weight", (rows, hidden)), requires_grad=False)
        self.o_proj = torch.nn.Parameter(make("o_proj.weight", (hidden, nq * hd // tp)), requires_grad=False)
        self.tp_rank, self.tp = tp_rank, tp

    def load_weights(self, weights) -> None:
        params = {f"{n}.weight": p for n, p in self.named_parameters()}
        for name, loaded in weights:
            for param_name, weight_name, shard_id in self.stacked:
                if weight_name in name:
                    param = params[name.replace(weight_name, param_name)]
                    qkv_loader(param, loaded, shard_id, self.tp_rank, self.tp, self.heads)
                    break
            else:  # RowParallelLinear: this rank's columns
                param = params[name]
                size = param.shape[1]
                param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_modules_own_load_weights_traced_per_rank(tp):
    nq, nkv, hd = TinyAttention.heads
    shapes = {"q_proj.weight": (nq * hd, 3), "k_proj.weight": (nkv * hd, 3), "v_proj.weight": (nkv * hd, 3)}
    shapes["o_proj.weight"] = (3, nq * hd)
    gen = torch.Generator().manual_seed(tp)
    real = {n: random_tensor(s, torch.float32, gen) for n, s in shapes.items()}
    for rank in range(tp):
        traced = TinyAttention(rt.destination, rank, tp)
        run = TinyAttention(lambda name, shape: torch.full(shape, float("nan")), rank, tp)
        traced.load_weights((n, leaf(n, s)) for n, s in shapes.items())
        run.load_weights(real.items())
        for name, param in traced.named_parameters():
            assert isinstance(param, Destination) and isinstance(param, torch.nn.Parameter)
            assert param.destination_name == f"{name}.weight"
            assert torch.equal(evaluate(param, real), getattr(run, name)), name
            assert rt.coverage(param).exact, name


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_moe_experts_per_rank(tp):
    """``FusedMoE.weight_loader``: expert ``e``'s gate (w1) and up (w3) rows into ``w13[e]``, its down (w2) columns
    into ``w2[e]``, each narrowed to this rank's shard of the intermediate size."""
    experts, inter, hidden = 3, 4, 2
    part = inter // tp
    gen = torch.Generator().manual_seed(tp)
    shapes = {
        f"{e}.{w}": ((inter, hidden) if w != "w2" else (hidden, inter))
        for e in range(experts)
        for w in "w1 w3 w2".split()
    }
    real = {n: random_tensor(s, torch.bfloat16, gen) for n, s in shapes.items()}
    for rank in range(tp):
        made = {}
        for make, loaded in (
            (rt.destination, {n: leaf(n, s, torch.bfloat16) for n, s in shapes.items()}),
            (lambda n, s, d: torch.full(s, float("nan"), dtype=d), real),
        ):
            w13, w2 = (
                make("w13", (experts, 2 * part, hidden), torch.bfloat16),
                make("w2", (experts, hidden, part), torch.bfloat16),
            )
            for name, tensor in loaded.items():
                e, kind = name.split(".")
                expert = (w2 if kind == "w2" else w13).data[int(e)]
                dim = 1 if kind == "w2" else 0
                offset = part if kind == "w3" else 0
                expert.narrow(dim, offset, part).copy_(tensor.narrow(dim, rank * part, part))
            made[make is rt.destination] = (w13, w2)
        for traced, run, count in zip(made[True], made[False], (2 * experts, experts)):
            assert torch.equal(evaluate(traced, real), run)
            cov = rt.coverage(traced)
            assert cov.exact and len(cov.writes) == count
