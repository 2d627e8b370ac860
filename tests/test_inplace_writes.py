"""In-place writes into a destination stand-in: traced vs run on real tensors, bit for bit, and the coverage
certificate vs the real "written" counts (random write programs), plus vLLM-style weight loaders."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import regiontrace as rt
from regiontrace.constants import is_constant, with_constants
from regiontrace.testing import check_partition, random_tensor, same_values
from regiontrace.writes import Destination, prior_name

leaf = rt.RegionTensor.leaf


def evaluate(t: rt.RegionTensor, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """``t`` materialised on real sources (constants added), its blocks checked to partition it."""
    blocks = t.remap_blocks()
    check_partition(blocks, tuple((0, n) for n in t.shape))
    return rt.materialize(t, with_constants(sources, t.region))


def raster(shape: tuple[int, ...], boxes) -> torch.Tensor:
    """How many of ``boxes`` cover each element."""
    out = torch.zeros(shape, dtype=torch.int64)
    for box in boxes:
        out[tuple(slice(a, b) for a, b in box)] += 1
    return out


# ---------------------------------------------------------------------------------------------------
# random write programs


@dataclass(frozen=True)
class Step:
    """One view op, the same call on a real tensor and on a destination."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class WriteOp:
    """A view chain from the destination, then ``copy_`` of a source (``kind`` "leaf", maybe permuted or cast,
    or "row": broadcast from the last dim) or a constant (``kind`` "fill" or "zero")."""

    steps: tuple[Step, ...]
    kind: str
    value: float
    perm: tuple[int, ...] | None
    dtype: torch.dtype

    def view(self, base: torch.Tensor) -> torch.Tensor:
        for s in self.steps:
            base = s.fn(base)
        return base


@st.composite
def view_steps(draw, shape: tuple[int, ...]) -> tuple[tuple[Step, ...], tuple[int, ...]]:
    """A chain of view ops from ``shape``; each is checked on a real tensor (a ``view`` torch refuses is left out)."""
    probe = torch.empty(shape)
    steps: list[Step] = []
    for _ in range(draw(st.integers(0, 4))):
        nd = probe.ndim
        kinds = ["unsqueeze", "flatten"] + (["narrow", "slice", "select", "split", "unbind"] if nd else [])
        kinds += ["transpose", "merge"] if nd >= 2 else []
        kinds += ["unflatten"] if nd and any(n in (4, 6) for n in probe.shape) else []
        kind = draw(st.sampled_from(kinds))
        d = draw(st.integers(0, nd - 1)) if nd else 0
        n = probe.shape[d] if nd else 1
        if kind == "narrow":
            a = draw(st.integers(0, n))
            b = draw(st.integers(a, n))
            step = Step(f"narrow({d},{a},{b - a})", lambda x, d=d, a=a, b=b: x.narrow(d, a, b - a))
        elif kind == "slice":
            a, s = draw(st.integers(0, n)), draw(st.integers(1, 3))
            key = (slice(None),) * d + (slice(a, None, s),)
            step = Step(f"[{d}:{a}::{s}]", lambda x, key=key: x[key])
        elif kind == "select":
            if n == 0:
                continue
            i = draw(st.integers(-n, n - 1))
            step = Step(f"select({d},{i})", lambda x, d=d, i=i: x.select(d, i))
        elif kind == "split":
            size = draw(st.integers(1, max(n, 1)))
            i = draw(st.integers(0, max(-(-n // size) - 1, 0)))
            step = Step(f"split({size},{d})[{i}]", lambda x, d=d, size=size, i=i: x.split(size, d)[i])
            if n == 0:
                continue
        elif kind == "unbind":
            if n == 0:
                continue
            i = draw(st.integers(0, n - 1))
            step = Step(f"unbind({d})[{i}]", lambda x, d=d, i=i: x.unbind(d)[i])
        elif kind == "transpose":
            e = draw(st.integers(0, nd - 1))
            step = Step(f"transpose({d},{e})", lambda x, d=d, e=e: x.transpose(d, e))
        elif kind == "unsqueeze":
            e = draw(st.integers(0, nd))
            step = Step(f"unsqueeze({e})", lambda x, e=e: x.unsqueeze(e))
        elif kind == "flatten":
            step = Step("view(-1)", lambda x: x.view(-1))
        elif kind == "merge":
            d = min(d, nd - 2)
            new = tuple(probe.shape[:d]) + (probe.shape[d] * probe.shape[d + 1],) + tuple(probe.shape[d + 2 :])
            step = Step(f"view{new}", lambda x, new=new: x.view(new))
        else:
            d = next(k for k, m in enumerate(probe.shape) if m in (4, 6))
            m = probe.shape[d]
            new = tuple(probe.shape[:d]) + (2, m // 2) + tuple(probe.shape[d + 1 :])
            step = Step(f"view{new}", lambda x, new=new: x.view(new))
        try:
            probe = step.fn(probe)
        except RuntimeError:  # a view of strides torch cannot express
            continue
        steps.append(step)
    return tuple(steps), tuple(probe.shape)


@st.composite
def write_programs(draw) -> tuple[tuple[int, ...], tuple[WriteOp, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    writes = []
    for _ in range(draw(st.integers(1, 5))):
        steps, vshape = draw(view_steps(shape))
        kind = draw(st.sampled_from(["leaf", "leaf", "row", "fill", "zero"]))
        perm = tuple(draw(st.permutations(range(len(vshape))))) if kind == "leaf" and draw(st.booleans()) else None
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        value = draw(st.sampled_from([0.0, 1.5, -2.0]))
        writes.append(WriteOp(steps, kind, value, perm, dtype))
    return shape, tuple(writes)


def source_of(w: WriteOp, k: int, vshape: tuple[int, ...], make: Callable) -> torch.Tensor | None:
    """The tensor write ``k`` copies (``make(name, shape, dtype)`` builds a leaf), or None for a constant."""
    if w.kind == "row":
        return make(f"s{k}", vshape[-1:], w.dtype)
    if w.kind != "leaf":
        return None
    if w.perm is None:
        return make(f"s{k}", vshape, w.dtype)
    inverse = [w.perm.index(i) for i in range(len(vshape))]
    return make(f"s{k}", tuple(vshape[p] for p in w.perm), w.dtype).permute(inverse)


def run_write(view: torch.Tensor, w: WriteOp, src: torch.Tensor | None) -> None:
    if w.kind == "fill":
        view.fill_(w.value)
    elif w.kind == "zero":
        view.zero_()
    else:
        view.copy_(src)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(write_programs(), st.integers(0, 2**31 - 1))
def test_write_programs_trace_bit_for_bit_with_their_certificate(program, seed):
    shape, writes = program
    gen = torch.Generator().manual_seed(seed)
    prior = random_tensor(shape, torch.float32, gen)
    real, dest = prior.clone(), rt.destination("dest", shape)
    count, last, const = torch.zeros(shape, dtype=torch.int64), torch.full(shape, -1), torch.zeros(shape, dtype=bool)
    sources: dict[str, torch.Tensor] = {prior_name("dest"): prior}
    early = writes[0].view(dest)  # a view taken before any write reads what the writes put there

    def real_leaf(name, s, dtype):
        sources[name] = random_tensor(s, dtype, gen)
        return sources[name]

    for k, w in enumerate(writes):
        vshape = tuple(w.view(real).shape)
        run_write(w.view(real), w, source_of(w, k, vshape, real_leaf))
        run_write(w.view(dest), w, source_of(w, k, vshape, leaf))
        w.view(count).add_(1)
        w.view(last).fill_(k)
        w.view(const).fill_(w.kind in ("fill", "zero"))

    assert same_values(evaluate(dest, sources), real)
    assert same_values(evaluate(early, sources), writes[0].view(real))
    cov = rt.coverage(dest)
    assert [w.index for w in cov.writes] == list(range(len(writes)))
    assert torch.equal(raster(shape, cov.unwritten), (count == 0).long())
    assert torch.equal(raster(shape, cov.undefined), (count == 0).long())
    assert torch.equal(raster(shape, cov.overwritten), (count > 1).long())
    assert torch.equal(raster(shape, cov.constant), (const & (count > 0)).long())
    for k, boxes in enumerate(cov.written):
        assert torch.equal(raster(shape, boxes), (last == k).long()), k
    assert cov.complete == bool((count > 0).all()) and cov.exact == bool((count == 1).all())


# ---------------------------------------------------------------------------------------------------
# vLLM-style weight loaders


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


def test_certificate_names_unwritten_and_twice_written_elements():
    k = leaf("k", (8, 3))
    dest = rt.destination("kv", (8, 3))
    dest[0:4] = k[0:4]
    dest[2:6] = k[4:8]  # a loader bug: rows 2..4 written twice, rows 6..8 never
    cov = rt.coverage(dest)
    assert not cov.complete and not cov.exact
    assert cov.unwritten == cov.undefined == (((6, 8), (0, 3)),)
    assert cov.overwritten == (((2, 4), (0, 3)),)
    assert cov.written == ((((0, 2), (0, 3)),), (((2, 6), (0, 3)),))
    real = torch.randn(8, 3)
    prior = torch.randn(8, 3)
    expect = prior.clone()
    expect[0:4], expect[2:6] = real[0:4], real[4:8]
    assert torch.equal(evaluate(dest, {"k": real, prior_name("kv"): prior}), expect)


def test_index_writes_as_strided_and_new_destinations():
    dest = rt.destination("x", (6, 4))
    real = torch.zeros(6, 4)
    y, z = leaf("y", (3, 4)), leaf("z", (2, 4))
    yr, zr = torch.randn(3, 4), torch.randn(2, 4)
    idx, idx2 = torch.tensor([0, 2, 3]), torch.tensor([5, 4])
    for t, a, b in ((dest, y, z), (real, yr, zr)):
        t[idx] = a
        t.index_copy_(0, idx2, b)
        t.as_strided((2, 2), (1, 4), 1).fill_(3.0)  # column block rows 0..2, cols 1..3, transposed
        t[1, 2:] = 9.0
    assert torch.equal(evaluate(dest, {prior_name("x"): torch.zeros(6, 4), "y": yr, "z": zr}), real)
    assert [w.op for w in rt.coverage(dest).writes] == ["index_put_"] * 2 + ["index_copy_"] * 2 + ["fill_", "copy_"]
    fresh = dest.new_zeros(2, 4)
    assert isinstance(fresh, Destination) and rt.coverage(fresh).complete
    fresh[0] = z[1]
    assert torch.equal(evaluate(fresh, {"z": zr}), torch.stack([zr[1], torch.zeros(4)]))


REFUSED = {
    "expanded": (lambda d: d[0:1].expand(4, 3).copy_(leaf("a", (4, 3))), "broadcast"),
    "real": (lambda d: d.copy_(torch.ones(4, 3)), "real tensor"),
    "computed": (lambda d: d.copy_(leaf("a", (4, 3)) * 2), "computed by `mul`"),
    "mul_": (lambda d: d.mul_(2), "`mul_`"),
    "accumulate": (lambda d: d.index_put_([torch.tensor([0])], leaf("a", (3,)), accumulate=True), "accumulate"),
    "repeated": (lambda d: d.index_copy_(0, torch.tensor([1, 1]), leaf("a", (2, 3))), "repeated"),
    "copy-into-leaf": (lambda d: leaf("b", (4, 3)).copy_(d), "`copy_`"),
    "reshape-copy": (lambda d: d.t().reshape(12).copy_(leaf("a", (12,))), "`copy_`"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_writes_that_do_not_trace_say_why(name):
    fn, words = REFUSED[name]
    with pytest.raises(rt.Untraceable) as err:
        fn(rt.destination("d", (4, 3)))
    assert words in str(err.value)


def test_constant_pieces_and_reads_of_a_destination():
    dest = rt.destination("d", (4, 3), torch.bfloat16)
    dest.zero_()
    assert all(is_constant(p.source) for p in dest.region.pieces)
    dest[1:3] = leaf("a", (2, 3))
    snapshot = dest.float()  # a copy: later writes do not reach it
    dest[1] = 5
    a = torch.randn(2, 3).to(torch.bfloat16)
    assert torch.equal(evaluate(snapshot, {"a": a}), torch.cat([torch.zeros(1, 3), a.float(), torch.zeros(1, 3)]))
    assert evaluate(dest, {"a": a})[1].tolist() == [5.0] * 3
    assert math.prod(dest.shape) == 12 and rt.coverage(dest).overwritten == (((1, 3), (0, 3)),)


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
