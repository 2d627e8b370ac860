"""Hypothesis strategies: random programs of movement ops (:func:`programs`), ending in pointwise ops
(:func:`value_programs`), random boxes and leaves."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ..tensor import RegionTensor
from .checks import DTYPES, Spec

# ---------------------------------------------------------------------------------------------------
# random programs


@dataclass(frozen=True)
class Op:
    """One step of a program: ``out = f(pool[args[0]], pool[args[1]], ...)``, appended to the pool."""

    name: str
    args: tuple[int, ...]
    fn: Callable[..., torch.Tensor]

    def __repr__(self) -> str:
        return f"{self.name}{self.args}"


@dataclass(frozen=True)
class Program:
    """A random chain of movement ops over named leaves; callable on real, meta or Region tensors."""

    leaves: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    ops: tuple[Op, ...]

    @property
    def specs(self) -> dict[str, Spec]:
        return {n: (s, d) for n, s, d in self.leaves}

    def __call__(self, **tensors: torch.Tensor) -> torch.Tensor:
        pool = [tensors[n] for n, _, _ in self.leaves]
        for op in self.ops:
            pool.append(op.fn(*(pool[i] for i in op.args)))
        return pool[-1]

    def __repr__(self) -> str:
        leaves = ", ".join(f"{n}{tuple(s)}:{str(d).replace('torch.', '')}" for n, s, d in self.leaves)
        return f"Program([{leaves}] -> {' ; '.join(op.name for op in self.ops)})"


def _factorizations(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            out.append((a, n // a))
    return out


def _unary_ops(draw: Any, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[str, Callable, tuple[int, ...], Any]:
    """Draw one unary movement op valid for ``shape``: (description, fn, new shape, new dtype)."""
    nd = len(shape)
    kinds = ["reshape", "unsqueeze", "flip", "contiguous", "cast", "getitem", "chunk", "repeat"]
    if nd >= 1:
        kinds += ["narrow", "select", "split", "tensor_split", "unbind", "flatten", "unflatten", "movedim"]
    if nd >= 2:
        kinds += ["transpose", "permute", "t", "mT", "swapaxes", "T"]
    if 1 in shape:
        kinds += ["squeeze", "expand"]
    kind = draw(st.sampled_from(kinds))
    d = draw(st.integers(0, nd - 1)) if nd else 0
    neg = draw(st.booleans())
    dd = d - nd if neg and nd else d  # negative-dim spelling of the same dim
    meta = torch.empty(shape, device="meta", dtype=dtype)

    def result(desc: str, fn: Callable) -> tuple:
        out = fn(meta)
        return desc, fn, tuple(out.shape), out.dtype

    if kind == "reshape":
        numel = math.prod(shape)
        if numel == 0:
            return result("reshape(-1)", lambda x: x.reshape(-1))
        dims = []
        rest = numel
        while rest > 1 and len(dims) < 4:
            f = draw(st.sampled_from([a for a in range(1, rest + 1) if rest % a == 0]))
            dims.append(f)
            rest //= f
        dims.append(rest)
        target = tuple(dims)
        if draw(st.booleans()) and len(target) > 1:
            i = draw(st.integers(0, len(target) - 1))
            target = target[:i] + (-1,) + target[i + 1 :]
        how = draw(st.sampled_from(["reshape", "view"]))
        if how == "view":
            return result(f"contiguous().view{target}", lambda x, t=target: x.contiguous().view(t))
        return result(f"reshape{target}", lambda x, t=target: x.reshape(t))
    if kind == "unsqueeze":
        p = draw(st.integers(-nd - 1, nd))
        if draw(st.booleans()):
            return result(f"[..., None] at {p}", lambda x, p=p: x.unsqueeze(p))
        return result(f"unsqueeze({p})", lambda x, p=p: torch.unsqueeze(x, dim=p))
    if kind == "flip":
        dims = tuple(sorted(draw(st.sets(st.integers(0, max(nd - 1, 0)), max_size=nd)))) if nd else ()
        return result(f"flip{dims}", lambda x, dims=dims: x.flip(dims))
    if kind == "contiguous":
        which = draw(st.sampled_from(["contiguous", "clone", "detach"]))
        return result(f"{which}()", lambda x, w=which: getattr(x, w)())
    if kind == "cast":
        to = draw(st.sampled_from(DTYPES))
        spelled = draw(st.sampled_from(["to", "method", "type_as"]))
        method = {
            torch.float32: "float",
            torch.bfloat16: "bfloat16",
            torch.float16: "half",
            torch.float64: "double",
            torch.int32: "int",
            torch.int64: "long",
        }[to]
        if spelled == "to":
            return result(f"to({to})", lambda x, to=to: x.to(to))
        if spelled == "type_as":
            return result(f"type_as({to})", lambda x, to=to: x.type_as(torch.empty(0, dtype=to, device=x.device)))
        return result(f".{method}()", lambda x, m=method: getattr(x, m)())
    if kind == "getitem":
        idx: list[Any] = []
        for n in shape:
            c = draw(st.sampled_from(["all", "int", "slice", "none"]))
            if c == "int" and n > 0:
                idx.append(draw(st.integers(-n, n - 1)))
            elif c == "slice":
                a = draw(st.integers(-n - 2, n + 2) | st.none())
                b = draw(st.integers(-n - 2, n + 2) | st.none())
                s = draw(st.integers(1, 3) | st.none())
                idx.append(slice(a, b, s))
            elif c == "none":
                idx.extend([None, slice(None)])
            else:
                idx.append(slice(None))
        if idx and draw(st.booleans()):
            cut = draw(st.integers(0, len(idx)))
            idx = idx[:cut] + [Ellipsis]
        key = tuple(idx)
        return result(f"[{key}]", lambda x, k=key: x[k])
    if kind == "chunk":
        if nd == 0:
            return result("reshape(1)", lambda x: x.reshape(1))
        c = draw(st.integers(1, 4))
        outs = len(meta.chunk(c, dd))
        i = draw(st.integers(0, outs - 1))
        return result(f"chunk({c}, {dd})[{i}]", lambda x, c=c, dd=dd, i=i: torch.chunk(x, c, dim=dd)[i])
    if kind == "repeat":
        reps = tuple(draw(st.integers(1, 2)) for _ in range(max(nd, 1) + draw(st.integers(0, 1))))
        return result(f"repeat{reps}", lambda x, r=reps: x.repeat(*r))
    if kind == "narrow":
        n = shape[d]
        a = draw(st.integers(0, n))
        ln = draw(st.integers(0, n - a))
        return result(f"narrow({dd}, {a}, {ln})", lambda x, dd=dd, a=a, ln=ln: x.narrow(dd, a, ln))
    if kind == "select":
        n = shape[d]
        if n == 0:
            return result("contiguous()", lambda x: x.contiguous())
        i = draw(st.integers(-n, n - 1))
        return result(f"select({dd}, {i})", lambda x, dd=dd, i=i: torch.select(x, dd, i))
    if kind == "split":
        n = shape[d]
        if draw(st.booleans()) or n == 0:
            s = draw(st.integers(1, max(n, 1)))
            outs = len(meta.split(s, dd))
            i = draw(st.integers(0, outs - 1))
            return result(f"split({s}, {dd})[{i}]", lambda x, s=s, dd=dd, i=i: torch.split(x, s, dim=dd)[i])
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        i = draw(st.integers(0, len(sizes) - 1))
        return result(f"split({sizes}, {dd})[{i}]", lambda x, s=sizes, dd=dd, i=i: x.split(s, dd)[i])
    if kind == "tensor_split":
        sections = draw(st.integers(1, 4))
        i = draw(st.integers(0, sections - 1))
        return result(
            f"tensor_split({sections}, {dd})[{i}]",
            lambda x, s=sections, dd=dd, i=i: torch.tensor_split(x, s, dim=dd)[i],
        )
    if kind == "unbind":
        n = shape[d]
        if n == 0:
            return result("contiguous()", lambda x: x.contiguous())
        i = draw(st.integers(0, n - 1))
        return result(f"unbind({dd})[{i}]", lambda x, dd=dd, i=i: x.unbind(dd)[i])
    if kind == "flatten":
        a = draw(st.integers(0, nd - 1))
        b = draw(st.integers(a, nd - 1))
        return result(f"flatten({a}, {b})", lambda x, a=a, b=b: torch.flatten(x, a, b))
    if kind == "unflatten":
        n = shape[d]
        sizes = draw(st.sampled_from(_factorizations(n))) if n > 1 else (n,)
        return result(f"unflatten({dd}, {sizes})", lambda x, dd=dd, s=sizes: x.unflatten(dd, s))
    if kind == "movedim":
        e = draw(st.integers(0, nd - 1))
        fn = draw(st.sampled_from(["movedim", "moveaxis"]))
        return result(f"{fn}({dd}, {e})", lambda x, dd=dd, e=e, fn=fn: getattr(torch, fn)(x, dd, e))
    if kind in ("transpose", "swapaxes"):
        e = draw(st.integers(0, nd - 1))
        name = draw(st.sampled_from(["transpose", "swapaxes", "swapdims"]))
        return result(f"{name}({dd}, {e})", lambda x, dd=dd, e=e, n=name: getattr(x, n)(dd, e))
    if kind == "permute":
        perm = tuple(draw(st.permutations(range(nd))))
        return result(f"permute{perm}", lambda x, p=perm: x.permute(*p))
    if kind == "t":
        if nd == 2:
            return result("t()", lambda x: x.t())
        return result("mT", lambda x: x.mT)
    if kind == "mT":
        return result("mT", lambda x: x.mT)
    if kind == "T":
        if nd == 2:
            return result("T", lambda x: x.T)
        return result("permute(rev)", lambda x: x.permute(*reversed(range(x.ndim))))
    if kind == "squeeze":
        ones = [i for i, n in enumerate(shape) if n == 1]
        if draw(st.booleans()):
            return result("squeeze()", lambda x: x.squeeze())
        i = draw(st.sampled_from(ones))
        return result(f"squeeze({i})", lambda x, i=i: x.squeeze(i))
    if kind == "expand":
        target = tuple(draw(st.integers(1, 3)) if n == 1 else n for n in shape)
        lead = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
        if draw(st.booleans()):
            return result(f"expand{lead + target}", lambda x, t=lead + target: x.expand(*t))
        tgt = lead + target
        return result(f"expand_as{tgt}", lambda x, t=tgt: x.expand_as(torch.empty(t, device="meta")))
    raise AssertionError(kind)


@st.composite
def programs(draw: Any, max_leaves: int = 4, max_depth: int = 8, max_dims: int = 4, max_size: int = 6) -> Program:
    """Random programs: 1-``max_leaves`` leaves and up to ``max_depth`` movement ops, incl. cat/stack."""
    nleaves = draw(st.integers(1, max_leaves))
    shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_dims)))
    if draw(st.integers(0, 9)) == 0:
        shape = shape[:-1] + (0,)
    leaves = tuple(
        (f"s{i}", shape, draw(st.sampled_from(DTYPES[:4]) if i else st.sampled_from(DTYPES))) for i in range(nleaves)
    )
    pool = [(s, d) for _, s, d in leaves]
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, max_depth))):
        cur = len(pool) - 1
        shape_c, dtype_c = pool[cur]
        partners = [i for i, (s, _) in enumerate(pool) if len(s) == len(shape_c)]
        if len(pool) > 1 and draw(st.integers(0, 3)) == 0 and len(shape_c) > 0:
            d = draw(st.integers(0, len(shape_c) - 1))
            cand = [i for i in partners if all(a == b for j, (a, b) in enumerate(zip(pool[i][0], shape_c)) if j != d)]
            other = draw(st.sampled_from(cand))
            first = draw(st.booleans())
            args = (cur, other) if first else (other, cur)
            if draw(st.booleans()):
                name = draw(st.sampled_from(["cat", "concat", "concatenate"]))

                def fn(a, b, d=d, n=name):
                    return getattr(torch, n)([a, b], dim=d)

                desc = f"{name}(dim={d})"
            else:
                same = [i for i in partners if pool[i][0] == shape_c]
                other = draw(st.sampled_from(same))
                args = (cur, other)
                sd = draw(st.integers(-len(shape_c) - 1, len(shape_c)))

                def fn(a, b, d=sd):
                    return torch.stack((a, b), d)

                desc = f"stack({sd})"
            metas = [torch.empty(pool[i][0], dtype=pool[i][1], device="meta") for i in args]
            out = fn(*metas)
            ops.append(Op(desc, args, fn))
            pool.append((tuple(out.shape), out.dtype))
            continue
        desc, fn, new_shape, new_dtype = _unary_ops(draw, shape_c, dtype_c)
        if math.prod(new_shape) > 4096:
            continue
        ops.append(Op(desc, (cur,), fn))
        pool.append((new_shape, new_dtype))
    if not ops:
        ops.append(Op("contiguous()", (len(pool) - 1,), lambda x: x.contiguous()))
    return Program(leaves, tuple(ops))


#: pointwise ops :func:`value_programs` draws: ``(name, fn(x, s))`` with ``s`` the broadcast leaf
VALUE_OPS: tuple[tuple[str, Callable[..., torch.Tensor]], ...] = (
    ("mul", lambda x, s: x * s),
    ("float-mul-cast", lambda x, s: (x.float() * s.float()).to(x.dtype)),
    ("sub-scalar-add", lambda x, s: (x - 3) + s),
    ("where-gt", lambda x, s: torch.where(s > 0, x, -x)),
    ("div-sqrt-abs", lambda x, s: x / torch.sqrt(s.abs().double() + 1)),
)


@st.composite
def value_programs(draw: Any, max_after: int = 3) -> Program:
    """Random programs that end in pointwise ops: a :func:`programs` chain, a pointwise op with a leaf ``s``
    broadcast against its result, then up to ``max_after`` movement ops (pushed down through the op)."""
    base = draw(programs(max_depth=5))
    meta = base(**{n: torch.empty(sh, dtype=d, device="meta") for n, sh, d in base.leaves})
    shape = tuple(meta.shape)
    s_shape = tuple(draw(st.sampled_from([n, 1])) for n in shape)[draw(st.integers(0, len(shape))) :]
    leaves = (("s", s_shape, draw(st.sampled_from(DTYPES[:4]))), *base.leaves)
    ops = [Op(o.name, tuple(i + 1 for i in o.args), o.fn) for o in base.ops]  # pool index 0 is now ``s``
    name, fn = draw(st.sampled_from(VALUE_OPS))
    ops.append(Op(name, (len(leaves) + len(ops) - 1, 0), fn))
    out = fn(meta, torch.empty(s_shape, dtype=leaves[0][2], device="meta"))
    for _ in range(draw(st.integers(0, max_after))):
        desc, unary, new_shape, new_dtype = _unary_ops(draw, tuple(out.shape), out.dtype)
        ops.append(Op(desc, (len(leaves) + len(ops) - 1,), unary))
        out = torch.empty(new_shape, dtype=new_dtype, device="meta")
    return Program(leaves, tuple(ops))


@st.composite
def boxes(draw: Any, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A random box (half-open ``(start, stop)`` per dim) inside ``shape``."""
    box = []
    for n in shape:
        a = draw(st.integers(0, n))
        box.append((a, draw(st.integers(a, n))))
    return tuple(box)


def leaves(max_dims: int = 4, max_size: int = 8) -> st.SearchStrategy[RegionTensor]:
    """Random RegionTensor leaves (name ``"x"``)."""
    return st.builds(
        lambda shape, dtype: RegionTensor.leaf("x", shape, dtype),
        st.lists(st.integers(0, max_size), min_size=0, max_size=max_dims).map(tuple),
        st.sampled_from(DTYPES),
    )
