"""The save half of ``plan --save`` and ``demo``: the per-rank write plan (:func:`loader.save.plan_writes`), its
table, and the byte-for-byte check of a saved checkpoint against the original."""

from __future__ import annotations

import filecmp
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ..options import Rules
from ..save import WriteFigures, plan_writes
from .common import human_bytes, table


def write_plan(
    model: Any,
    mesh_shape: Sequence[int],
    placements: dict,
    ranks: Sequence[int],
    rules: Rules | None = None,
    source_shapes: Any = None,
) -> list[WriteFigures]:
    """Every listed rank's write plan for ``save_hf_checkpoint`` of ``model`` sharded by ``placements``, with
    ``rules`` and ``source_shapes`` (as the save's)."""
    return plan_writes(
        model,
        mesh_shape=tuple(mesh_shape),
        placements=placements,
        ranks=list(ranks),
        rules=rules,
        source_shapes=source_shapes,
    )


def ratio(a: int, b: int) -> str:
    """``a / b`` with two decimals, ``-`` when ``b`` is 0."""
    return f"{a / b:.2f}" if b else "-"


def write_plan_text(figures: Sequence[WriteFigures]) -> str:
    """The write plan as a table: bytes each rank writes, its shard bytes (the shards it is the lowest holder
    of), all its local bytes, positional writes and files."""
    rows = [
        [
            f.rank,
            "(" + ",".join(map(str, f.coordinate)) + ")",
            f.tensors,
            human_bytes(f.bytes_written),
            human_bytes(f.shard_bytes),
            ratio(f.bytes_written, f.shard_bytes),
            human_bytes(f.local_bytes),
            f.writes,
            len(f.files),
        ]
        for f in figures
    ]
    header = ["rank", "coord", "tensors", "bytes written", "shard bytes", "written/shard", "local bytes", "writes"]
    total = sum(f.bytes_written for f in figures)
    lines = [
        "write plan (save_hf_checkpoint on every rank; a replicated shard is written by its lowest holder):",
        table([*header, "files"], rows, right=[True] * 9),
        SHARD_BYTES_NOTE,
        f"{len(figures)} rank(s) write {human_bytes(total)} of tensor data, each byte by one rank",
    ]
    return "\n".join(lines)


def write_plan_json(figures: Sequence[WriteFigures]) -> list[dict[str, Any]]:
    """The write plan as JSON-ready dicts."""
    return [asdict(f) | {"coordinate": list(f.coordinate), "files": list(f.files)} for f in figures]


def compare_checkpoints(original: str, saved: str, skip: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """``(compared, differ)``: the files of ``original`` (but ``skip``), and those missing from ``saved`` or
    differing from it byte for byte (names, sorted)."""
    compared, bad = [], []
    for name in sorted(os.listdir(original)):
        a, b = os.path.join(original, name), os.path.join(saved, name)
        if name in skip or not os.path.isfile(a):
            continue
        compared.append(name)
        if not (os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)):
            bad.append(name)
    return compared, bad


def save_table(results: Sequence[dict], figures: Sequence[WriteFigures]) -> tuple[str, list[str]]:
    """The demo's per-rank save table (what each rank wrote against its shard bytes and the write plan), and
    the failures: a rank whose writes differ from its simulated plan."""
    sim = {f.rank: f for f in figures}
    rows, failures = [], []
    for res in results:
        r, save = res["rank"], res.get("save")
        if save is None:
            rows.append([r, "-", "-", "-", "-", "-", "-", "not saved"])
            continue
        f = sim[r]
        verdict = "= plan"
        if (save["bytes_written"], save["writes"]) != (f.bytes_written, f.writes):
            verdict = "differs from plan"
            failures.append(
                f"rank {r}: the save wrote {save['bytes_written']} B in {save['writes']} writes; the write plan "
                f"says {f.bytes_written} B in {f.writes}"
            )
        rows.append(
            [
                r,
                save["written"],
                human_bytes(save["bytes_written"]),
                human_bytes(f.shard_bytes),
                ratio(save["bytes_written"], f.shard_bytes),
                save["writes"],
                human_bytes(save["header_bytes"]),
                verdict,
            ]
        )
    header = ["rank", "tensors", "bytes written", "shard bytes", "written/shard", "writes", "headers", "vs plan"]
    text = table(header, rows, right=[True] * 7 + [False])
    return text + "\n" + SHARD_BYTES_NOTE, failures


SHARD_BYTES_NOTE = "shard bytes: the local shards a rank is the lowest holder of (a replicated shard is written once)"
