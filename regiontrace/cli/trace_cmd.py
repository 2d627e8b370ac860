"""``regiontrace trace MODULE:FUNCTION --input NAME=SHAPE[:DTYPE] ...``: trace a conversion, show its map."""

from __future__ import annotations

import argparse
import math
from typing import Any

import regiontrace as rt

from .._torch import keystr, tree_flatten_with_path
from .common import (
    CLIError,
    add_function_arguments,
    dtype_name,
    flat_specs,
    format_box,
    load_function,
    parse_box,
    parse_inputs,
    parse_values,
    regroup,
)

HELP = "trace a conversion function: its index map, its RemapBlocks, or why it is not traceable"
DESCRIPTION = """\
Run FUNCTION on RegionTensor stand-ins for its inputs and print, for every output tensor, the index map
(regiontrace.explain) and the RemapBlocks that copy the whole output (or --box) from the inputs.
Exit status 1 when the function is not traceable (the message names the op)."""
EPILOG = """\
examples:
  regiontrace trace convert.py:gate_up --input 'gate[4]=8x16:bf16' --input 'up[4]=8x16:bf16'
  regiontrace trace mypkg.conv:permute_qk --input w=64x32 --box 0:8,0:32 --dot graph.dot

--input NAME[N]=SHAPE passes a list of N tensors (named NAME.0 ... NAME.N-1) as argument NAME;
--arg NAME=VALUE a plain Python value (a literal: heads=4, dims='(0, 1)', mode="'sum'"), not a tensor."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "trace", help=HELP, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_function_arguments(p)
    p.add_argument("--box", metavar="A:B,C:D", help="compile blocks for this box of each output (default: all)")
    p.add_argument("--dot", metavar="FILE", help="write the index-mapping graph as Graphviz dot")
    p.add_argument("--max-blocks", type=int, default=40, metavar="N", help="print at most N blocks per output")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_blocks < 0:
        raise CLIError("--max-blocks must be at least 0")
    inputs = parse_inputs(args.input)
    values = parse_values(args.arg, inputs)
    box = parse_box(args.box) if args.box else None
    fn = load_function(args.function)
    leaves = {n: rt.RegionTensor.leaf(n, s, d) for n, (s, d) in flat_specs(inputs).items()}
    try:
        out = rt.trace(fn, **regroup(inputs, leaves, values))
    except (rt.Untraceable, rt.TraceMismatch) as e:
        raise CLIError(f"not traceable: {type(e).__name__}: {e}", status=1) from e
    outputs = [
        (("out" + keystr(path)) if path else "out", t)
        for path, t in tree_flatten_with_path(out)[0]
        if isinstance(t, rt.RegionTensor)
    ]
    if not outputs:
        raise CLIError(f"{args.function} returned no tensors ({type(out).__name__})", status=1)
    print(f"traced {args.function}: {len(outputs)} output tensor(s) from {len(leaves)} input(s)")
    for name, t in outputs:
        print()
        print(f"{name}: {rt.explain(t)}")
        shown = box if box is not None else tuple((0, n) for n in t.shape)
        try:
            if t.is_index_map:
                print(describe_blocks(name, t.remap_blocks(box), shown, args.max_blocks))
                continue
            program = t.value_program(box)
        except ValueError as e:
            raise CLIError(f"{name}: {e}") from e
        for i, value_input in enumerate(program.inputs):  # each operand of the pointwise ops, for the box
            print(describe_blocks(f"v{i}", value_input.blocks, shown, args.max_blocks))
    if args.dot:
        with open(args.dot, "w") as f:
            f.write(to_dot([t for _, t in outputs], [n for n, _ in outputs]))
        print(f"\nwrote {args.dot}")
    return 0


def describe_blocks(name: str, blocks: tuple, box: tuple, limit: int) -> str:
    """Summary line and one line per block (source side, destination side)."""
    numel = math.prod(b - a for a, b in box)
    read = sum(b.read_numel for b in blocks)
    sources = sorted({b.source for b in blocks})
    lines = [
        f"  {len(blocks)} block(s) for {name}{format_box(box)} ({numel} elements), reading {read} "
        f"element(s) from {', '.join(sources) or 'nothing'}"
    ]
    for i, b in enumerate(blocks[:limit]):
        lines.append(f"  #{i:<3d} {_source_side(b)}  ->  {_dest_side(name, b, box)}")
    if len(blocks) > limit:
        lines.append(f"  ... {len(blocks) - limit} more (--max-blocks)")
    return "\n".join(lines)


def _source_side(b: Any) -> str:
    casts = f" as {'->'.join(dtype_name(c) for c in b.casts)}" if b.casts else ""
    sb = b.source_box()
    if sb is not None and len(set(sb[2])) == len(sb[2]):  # one box, each block dim walking its own dim
        offsets, lengths, dims = sb
        box = [(o, o + n) for o, n in zip(offsets, lengths)]
        order = "" if list(dims) == sorted(dims) else f" walked in dim order {tuple(dims)}"
        return f"{b.source}{format_box(box)}{order}{casts}"
    runs = b.source_runs()
    if sb is not None:  # one box, block dims splitting a source dim (a permutation inside the box)
        offsets, lengths, _ = sb
        box = [(o, o + n) for o, n in zip(offsets, lengths)]
        return f"{b.source}{format_box(box)} permuted: shape {_x(b.shape)}, strides {tuple(b.src_strides)}{casts}"
    return (
        f"{b.source} strided: offset {b.src_offset}, shape {_x(b.shape)}, strides {tuple(b.src_strides)} "
        f"({len(runs)} contiguous run{'s' if len(runs) != 1 else ''}){casts}"
    )


def _dest_side(name: str, b: Any, box: tuple) -> str:
    lo = list(b.dst_offset)
    hi = [o + 1 for o in b.dst_offset]
    for n, d, s in zip(b.shape, b.dst_dims, b.dst_steps):
        hi[d] += (n - 1) * s
    dense = all(math.prod(n for n, dd in zip(b.shape, b.dst_dims) if dd == d) == hi[d] - lo[d] for d in range(len(lo)))
    span = [(a + box[d][0], c + box[d][0]) for d, (a, c) in enumerate(zip(lo, hi))]
    how = "" if dense else f" every {tuple(b.dst_steps)} along dims {tuple(b.dst_dims)}"
    return f"{name}{format_box(span)}{how}"


def _x(shape: tuple) -> str:
    return "x".join(str(n) for n in shape) or "()"


def to_dot(tensors: list, names: list[str]) -> str:
    """The index-mapping graph of ``tensors`` (``regiontrace.to_networkx``) as Graphviz dot text."""
    import networkx as nx  # only for --dot

    g = nx.DiGraph()
    outs = {}
    for t, name in zip(tensors, names):
        sub = rt.to_networkx(t)
        g = nx.compose(g, sub)
        sink = next(n for n in sub.nodes if sub.out_degree(n) == 0)
        outs.setdefault(sink, []).append(name)
    lines = ["digraph regiontrace {", "  rankdir=LR;", '  node [fontname="Helvetica", fontsize=10];']
    ids = {n: f"n{i}" for i, n in enumerate(g.nodes)}
    for n, data in g.nodes(data=True):
        shape = "x".join(str(s) for s in data.get("shape", ())) or "()"
        dtype = str(data.get("dtype", "")).removeprefix("torch.")
        if data.get("op") == "leaf":
            label = f"{_clean(n)}\\n{shape} {dtype}"
            style = 'shape=box, style="rounded,filled", fillcolor="#dbeafe"'
        else:
            params = ", ".join(f"{k}={v}" for k, v in (data.get("params") or {}).items())
            label = _clean(f"{data.get('op')}" + (f"({params})" if params else "")) + f"\\n{shape} {dtype}"
            style = "shape=box"
        if n in outs:
            label = f"{_clean(' / '.join(outs[n]))}: {label}"
            style += ', peripheries=2, style="filled", fillcolor="#dcfce7"'
        lines.append(f'  {ids[n]} [label="{label}", {style}];')
    for a, b, data in g.edges(data=True):
        lines.append(f'  {ids[a]} -> {ids[b]} [label="{data.get("arg", "")}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _clean(text: str) -> str:
    """Text safe inside a dot string (no quotes, backslashes or newlines), at most 120 characters."""
    text = str(text).replace("\\", "/").replace('"', "'").replace("\n", " ")
    return text if len(text) <= 120 else text[:117] + "..."
