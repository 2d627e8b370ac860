"""Reading a trace: ``explain`` (sympy index expressions) and ``to_networkx`` (the index-mapping graph)."""

from __future__ import annotations

import math

import networkx as nx
import sympy
import torch

from .radix import Axis
from .region import Piece
from .tensor import Node, RegionTensor
from .values import describe, input_regions


def _symbols(ndim: int) -> list[sympy.Symbol]:
    return [sympy.Symbol(f"i{d}", integer=True, nonnegative=True) for d in range(ndim)]


def _axis_terms(axis: Axis, i: sympy.Symbol) -> tuple[sympy.Expr, list[sympy.Expr]]:
    """Source-offset contribution of one axis and its coverage conditions."""
    z = i - axis.start
    conds = [sympy.Ge(i, axis.start), sympy.Lt(i, axis.start + axis.length)]
    expr, w = sympy.Integer(0), math.prod(axis.radices)
    for f in axis.factors:
        w //= f.radix
        digit = sympy.Mod(sympy.floor(z / w), f.radix) if w > 1 or f.radix < axis.length else z
        if f.lo != 0 or f.hi != f.radix:
            conds += [sympy.Ge(digit, f.lo), sympy.Lt(digit, f.hi)]
        expr += (digit - f.lo) * f.stride
    return expr, conds


def piece_expr(piece: Piece) -> tuple[sympy.Expr, sympy.Expr]:
    """The flat source index a piece reads at output index ``(i0, i1, ...)``, and where it applies."""
    syms = _symbols(len(piece.axes))
    expr, conds = sympy.Integer(piece.base), []
    for axis, i in zip(piece.axes, syms):
        e, c = _axis_terms(axis, i)
        expr += e
        conds += c
    return sympy.simplify(expr), sympy.And(*conds)


def source_index(piece: Piece) -> list[sympy.Expr]:
    """The source multi-index a piece reads, as expressions of the output index ``(i0, i1, ...)``."""
    shape = piece.source.shape
    strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
    index = []
    rem = piece.base
    for st, n in zip(strides, shape):
        index.append(sympy.Integer(rem // st if n else 0))
        rem = rem % st if n else rem
    spans = [[b, b] for b in index]
    for axis, i in zip(piece.axes, _symbols(len(piece.axes))):
        w = axis.length
        for f in axis.factors:
            w //= f.radix
            if f.stride == 0:
                continue
            z = i - axis.start
            digit = z if w == 1 and f.radix == axis.length else sympy.Mod(sympy.floor(z / w), f.radix)
            dims = [j for j, (st, n) in enumerate(zip(strides, shape)) if f.stride % st == 0 and abs(f.stride) < st * n]
            if not dims:
                return _flat_index(piece)
            j = dims[0]
            c = f.stride // strides[j]
            index[j] += (digit - f.lo) * c
            spans[j][0] += min(0, (f.hi - f.lo - 1) * c)
            spans[j][1] += max(0, (f.hi - f.lo - 1) * c)
    if any(lo < 0 or hi >= n for (lo, hi), n in zip(spans, shape)):
        return _flat_index(piece)
    return [sympy.simplify(e) for e in index]


def _flat_index(piece: Piece) -> list[sympy.Expr]:
    flat, _ = piece_expr(piece)
    out, acc = [], 1
    for n in reversed(piece.source.shape):
        out.append(sympy.Mod(sympy.floor(flat / acc), n) if n > 1 else sympy.Integer(0))
        acc *= n
    return out[::-1]


def explain(tensor: RegionTensor, *, as_sympy: bool = False) -> str | dict[str, sympy.Piecewise]:
    """Describe the index map of ``tensor``.

    Args:
        tensor: a RegionTensor.
        as_sympy: return ``{source: sympy.Piecewise}`` of the flat source index instead of text.

    Returns:
        Text with one line per piece (output box, source and source index), or the Piecewise per source.
        Values computed by pointwise ops: their expression over operands ``v0, v1, …``, then each operand's
        index map (as text, or ``{"v0": {source: Piecewise}, …}``).
    """
    if not tensor.is_index_map:
        return _explain_values(tensor, as_sympy)
    pieces = tensor.region.pieces
    if as_sympy:
        per_source: dict[str, list] = {}
        for p in pieces:
            expr, cond = piece_expr(p)
            per_source.setdefault(p.source.name, []).append((expr, cond))
        return {name: sympy.Piecewise(*parts, (-1, True)) for name, parts in per_source.items()}
    lines = [
        f"RegionTensor {tuple(tensor.shape)} {tensor.dtype}: {len(pieces)} piece(s) from "
        f"{len(tensor.sources())} source(s)"
    ]
    for p in pieces:
        box = ", ".join(f"{a.start}:{a.start + a.length}" for a in p.axes)
        idx = ", ".join(str(e) for e in source_index(p))
        _, cond = piece_expr(p)
        where = "" if cond in (sympy.true,) or all(_trivial(p.axes)) else f"  where {sympy.simplify(cond)}"
        cast = f" as {' -> '.join(str(c).replace('torch.', '') for c in p.casts)}" if p.casts else ""
        lines.append(f"  out[{box}] <- {p.source.name}[{idx}]{cast}{where}")
    return "\n".join(lines)


def _explain_values(tensor: RegionTensor, as_sympy: bool) -> str | dict:
    regions = [(r, d) for r, d, _ in input_regions(tensor.value, tensor.dtype)]
    names = {id(r): f"v{i}" for i, (r, _) in enumerate(regions)}
    operands = {
        f"v{i}": explain(RegionTensor(torch.empty(r.shape, dtype=d, device="meta"), r, tensor.node), as_sympy=as_sympy)
        for i, (r, d) in enumerate(regions)
    }
    if as_sympy:
        return operands
    expr = describe(tensor.value, lambda r: names[id(r)])
    head = f"RegionTensor {tuple(tensor.shape)} {tensor.dtype}: values {expr}"
    body = [f"  {k} = " + v.replace("\n", "\n  ") for k, v in operands.items()]
    return "\n".join([head, *body])


def _trivial(axes: tuple[Axis, ...]) -> list[bool]:
    return [all(f.lo == 0 and f.hi == f.radix for f in a.factors) for a in axes]


def to_networkx(tensor: RegionTensor) -> nx.DiGraph:
    """The index-mapping graph that produced ``tensor``.

    Returns:
        A DiGraph whose nodes carry ``op``, ``shape``, ``dtype`` and ``params`` (leaves: ``name``), with an
        edge ``parent -> child`` labelled ``arg`` (argument position).
    """
    g = nx.DiGraph()
    seen: dict[int, str] = {}

    def visit(node: Node) -> str:
        if id(node) in seen:
            return seen[id(node)]
        key = node.params["name"] if node.op == "leaf" else f"{node.op}#{len(seen)}"
        seen[id(node)] = key
        g.add_node(key, op=node.op, shape=node.shape, dtype=str(node.dtype), params=dict(node.params))
        for pos, parent in enumerate(node.parents):
            g.add_edge(visit(parent), key, arg=pos)
        return key

    visit(tensor.node)
    return g
