"""``regiontrace demo``: the main job end to end on an embedded tiny MoE checkpoint.

1. write a small MoE checkpoint in the original Hugging Face layout (per-expert tensors, separate gate/up);
2. load it on N gloo ranks on localhost into tensor- and expert-parallel DTensor shards, and in this process
   into a plain model (the reference, itself checked against the saved model); check every shard;
3. save the sharded model back on every rank (``save_hf_checkpoint``: each rank writes its own shards) and
   check the files against the original checkpoint, byte for byte;
4. print per-rank tables and write the plan picture. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from multiprocessing import forkserver
from typing import Any

import torch
import torch.multiprocessing as mp

from regiontrace.cli.common import CLIError, HelpFormatter

from .. import SafetensorsCheckpoint, load_hf_checkpoint
from ..options import LoadOptions, Rules
from ..placements import placement_text, plan_placements
from .common import LOAD_COLUMNS, have_transformers, human_bytes, parse_mesh, table
from .demo_models import build_model, load_rules, write_checkpoint
from .demo_process import Stages, remove_tree, run_in_child
from .demo_rank import run_rank
from .plan_cmd import PlanOutputs, plan_model
from .save_plan import compare_checkpoints, save_table, write_plan

HELP = "load an embedded tiny MoE checkpoint on N gloo ranks, check every shard, save it back, draw the plan"
DESCRIPTION = """\
Generate a tiny MoE checkpoint in the original Hugging Face layout (per-expert tensors, separate gate and
up projections: a qwen3_moe model written by save_pretrained, or a built-in model without transformers),
load it with WORLD gloo ranks on localhost into tensor- and expert-parallel DTensor shards and once in this
process as the reference, check every shard against the reference, save the sharded model back with
save_hf_checkpoint on every rank (each writing only its own shards) into OUT/saved and check those files
against the original checkpoint byte for byte, then print per-rank tables (load; save: bytes written vs
shard bytes) and write the plan picture (plan.svg) into the output folder. Exit status 1 if any check fails,
a rank fails, or the command runs past --timeout. No network."""
EPILOG = """\
examples:
  regiontrace demo
  regiontrace demo --world-size 2 --out /tmp/demo
  regiontrace demo --mesh 2x2          # experts over mesh dim 0, tensor parallel over mesh dim 1"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help=HELP, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--world-size", "-w", type=int, metavar="N", help="ranks to spawn (default 4, or the mesh's)")
    p.add_argument("--mesh", metavar="AxB", help="mesh shape (default: 1-D of the world size)")
    p.add_argument(
        "--out", metavar="DIR", help="output folder, kept (default: a new temporary folder, removed at the end)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary output folder (and print where it is)")
    p.add_argument(
        "--model",
        choices=("auto", "transformers", "builtin"),
        default="auto",
        help="checkpoint kind (default: transformers when installed, else builtin)",
    )
    p.add_argument("--timeout", type=float, default=120, metavar="S", help="give up S seconds after the command starts")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        raise CLIError(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    if args.world_size is not None and args.world_size < 1:
        raise CLIError(f"--world-size must be at least 1, not {args.world_size}")
    mesh_shape = _mesh_shape(args)
    end = time.monotonic() + args.timeout
    temporary = None if args.out else tempfile.mkdtemp(prefix="regiontrace-demo-")
    kept = f" (output kept in {temporary})" if temporary and args.keep else ""
    try:  # the work runs in a child process, killed at the deadline: no exception is raised inside it
        outcome = run_in_child(functools.partial(_run, args, mesh_shape, temporary=temporary), end)
    finally:
        if temporary and not args.keep:  # whatever happened: leave nothing in the temporary directory
            remove_tree(temporary)
    if outcome.timed_out:
        raise CLIError(f"gave up after {args.timeout:g} s (--timeout) while {outcome.stage}{kept}", status=1)
    if outcome.interrupted:
        raise CLIError(f"interrupted while {outcome.stage}{kept}", status=130)
    if outcome.traceback and getattr(args, "verbose", False):
        print(outcome.traceback, file=sys.stderr, end="")
    if outcome.error:
        hint = " (-v for the traceback)" if outcome.traceback and not getattr(args, "verbose", False) else ""
        raise CLIError(f"{outcome.error}{kept}{hint}", status=outcome.status if outcome.status is not None else 2)
    return int(outcome.status or 0)


def _mesh_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """The mesh of ``--mesh`` / ``--world-size``, checked."""
    mesh_shape = parse_mesh(args.mesh) if args.mesh else (args.world_size or 4,)
    world = math.prod(mesh_shape)
    if args.world_size and args.world_size != world:
        raise CLIError(f"--world-size {args.world_size} differs from the mesh {args.mesh} ({world} ranks)")
    if world < 1 or world > 64:
        raise CLIError("use between 1 and 64 ranks")
    return mesh_shape


def _run(args: argparse.Namespace, mesh_shape: tuple[int, ...], stages: Stages, *, temporary: str | None) -> int:
    """The demo (in the child process), into ``args.out`` or the ``temporary`` folder (removed by the parent
    unless ``--keep``)."""
    t0 = time.time()
    stages.enter("starting the fork server")
    _start_fork_server()
    world = math.prod(mesh_shape)
    kind = args.model
    stages.enter("importing transformers")
    if kind == "auto":
        kind = "transformers" if have_transformers() else "builtin"
    elif kind == "transformers" and not have_transformers():
        raise CLIError("--model transformers needs transformers: pip install 'transformers>=5'")
    out = os.path.abspath(args.out or temporary)
    os.makedirs(out, exist_ok=True)
    work = os.path.join(out, ".work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    checkpoint = os.path.join(out, "checkpoint")
    saved = os.path.join(out, "saved")
    shutil.rmtree(saved, ignore_errors=True)

    # 1. the checkpoint, and the state a correct load produces
    stages.enter("writing the checkpoint")
    shutil.rmtree(checkpoint, ignore_errors=True)
    expected = write_checkpoint(kind, checkpoint)
    meta_model = build_model(kind, checkpoint)
    placements, _ = plan_placements(meta_model, mesh_shape, experts="ep")
    print(f"checkpoint: {checkpoint} ({_describe_checkpoint(checkpoint)})")
    print(
        f"loading on {world} gloo rank(s), mesh {'x'.join(map(str, mesh_shape))}; "
        f"{len(placements)} sharded tensors, e.g."
    )
    for name in _examples(placements):
        print(f"  {name}  {placement_text(placements[name])}")

    # 2. start the ranks, then load the reference here while they start up
    stages.enter("starting the ranks")
    ctx = {
        "mesh_shape": list(mesh_shape),
        "placements": placements,
        "kind": kind,
        "checkpoint": checkpoint,
        "saved": saved,
        "store": os.path.join(work, "store"),
        "out": work,
        "reference": os.path.join(work, "reference.pt"),
        "deadline": time.time() + stages.left(),
    }
    procs = None
    try:
        procs = mp.start_processes(run_rank, args=(ctx,), nprocs=world, join=False, start_method=START_METHOD)
        stages.enter("loading the reference")
        ref_ok, ref_msg = _reference(kind, checkpoint, expected, ctx["reference"], load_rules(kind))
        stages.enter("simulating the plan")
        svg = os.path.join(out, "plan.svg")
        sim = plan_model(
            meta_model,
            checkpoint,
            mesh_shape,
            ranks=list(range(world)),
            placements=placements,
            rules=load_rules(kind),
            outputs=PlanOutputs(svg=svg, title="regiontrace demo: load plan", model_type=_model_type(kind)),
        )
        stages.enter("planning the save")
        source_shapes = checkpoint if kind != "transformers" else None  # the built-in model's Convert rules need them
        writes = write_plan(meta_model, mesh_shape, placements, range(world), load_rules(kind), source_shapes)
        stages.enter("waiting for the ranks")
        _join(procs)
    finally:
        for p in procs.processes if procs is not None else ():
            if p.is_alive():
                p.terminate()
        for p in procs.processes if procs is not None else ():
            p.join(timeout=10)  # stopped before the output folder is removed
    results = []
    for r in range(world):
        path = os.path.join(work, f"rank{r}.json")
        if not os.path.exists(path):
            raise CLIError(f"rank {r} wrote no result (crashed?)", status=1)
        with open(path) as f:
            results.append(json.load(f))

    # 3. the tables and the verdict
    stages.enter("comparing the saved checkpoint")
    # the built-in model's config.json is the demo's marker, not a config the save writes
    skip = () if kind == "transformers" else ("config.json",)
    compared = compare_checkpoints(checkpoint, saved, skip) if os.path.isdir(saved) else None
    kept = "" if args.out else "  (a temporary folder, kept: --keep)" if args.keep else None
    return _report(results, sim["figures"], writes, compared, ref_ok, ref_msg, svg, out, kept, time.time() - t0)


START_METHOD = "forkserver"


def _start_fork_server() -> None:
    """Start the fork server now, importing torch, the loader and transformers once while this process
    writes the checkpoint; each rank is then a cheap fork of it (a clean process: no threads, no state)."""
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(["loader.cli.demo_preload"])
    forkserver.ensure_running()


def _describe_checkpoint(path: str) -> str:
    ck = SafetensorsCheckpoint.open(path)
    experts = sum(1 for k in ck.keys() if ".experts." in k)
    return f"{len(ck)} tensors, {experts} of them per-expert, {human_bytes(ck.total_bytes)}"


def _examples(placements: dict) -> list[str]:
    seen, out = set(), []
    for name in placements:
        key = name.rsplit(".", 2)[-2:][0] + "." + name.rsplit(".", 1)[-1]
        if ".layers.0." in name or ".layers." not in name:
            if key not in seen:
                seen.add(key)
                out.append(name)
    return out[:8]


def _model_type(kind: str) -> str:
    return "qwen3_moe (tiny, save_pretrained)" if kind == "transformers" else "built-in tiny MoE"


def _reference(kind: str, checkpoint: str, expected: dict, out_path: str, rules: Rules | None) -> tuple[bool, str]:
    """Single-process load into a plain model; checked against the saved model; written for the ranks."""
    try:
        model = build_model(kind, checkpoint).to_empty(device="cpu")
        with torch.no_grad():
            for t in model.state_dict().values():
                t.fill_(float("nan"))
        load_hf_checkpoint(model, checkpoint, rules=rules, options=LoadOptions(progress=False))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        bad = [k for k, v in expected.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
        torch.save(state, out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)
    except Exception as e:
        open(out_path + ".failed", "w").close()
        return False, f"single-process reference load failed: {type(e).__name__}: {e}"
    if bad:
        return False, f"single-process load differs from the saved model in {len(bad)} tensors: {bad[:3]}"
    return True, f"single-process load equals the saved model ({len(expected)} tensors)"


def _join(procs: Any) -> None:
    try:
        while not procs.join(timeout=0.5):
            pass
    except Exception as e:
        raise CLIError(f"a rank failed: {str(e).strip().splitlines()[-1]}", status=1) from e


def _report(
    results: list[dict],
    figures: list,
    writes: list,
    compared: tuple[list[str], list[str]] | None,
    ref_ok: bool,
    ref_msg: str,
    svg: str,
    out: str,
    kept: str | None,
    seconds: float,
) -> int:
    sim = {f.rank: f for f in figures}
    rows, failures = [], []
    if not ref_ok:
        failures.append(ref_msg)
    for res in results:
        r = res["rank"]
        if "error" in res:
            failures.append(f"rank {r}: {res['error']}")
            rows.append([r, "-", "-", "-", "-", "-", "-", "-", "ERROR"])
            continue
        f = sim[r]
        verdict = "ok" if res["ok"] else f"{len(res['bad']) + len(res['uncovered'])} differ"
        if not res["ok"]:
            failures.append(f"rank {r}: shards differ from the reference: {(res['bad'] + res['uncovered'])[:3]}")
        if (f.blocks, f.bytes_read) != (res["blocks"], res["bytes_read"]):
            failures.append(
                f"rank {r}: simulated plan ({f.blocks} blocks, {f.bytes_read} B) differs from the "
                f"real load ({res['blocks']} blocks, {res['bytes_read']} B)"
            )
            verdict += " (sim differs)"
        rows.append(
            [
                r,
                "(" + ",".join(map(str, res["coordinate"])) + ")",
                res["checked"],
                res["blocks"],
                human_bytes(res["bytes_read"]),
                human_bytes(f.shard_bytes),
                human_bytes(f.whole_tensor_bytes),
                f"{res['bytes_read'] / f.shard_bytes:.2f}" if f.shard_bytes else "-",
                f"{verdict} ({res['checked']} tensors)" if res["ok"] else verdict,
            ]
        )
    print()
    print(
        table(
            [*LOAD_COLUMNS, "check vs reference"],
            rows,
            right=[True] * 8 + [False],
        )
    )
    print()
    print(f"reference: {ref_msg}")
    total_read = sum(res.get("bytes_read", 0) for res in results)
    total_whole = sum(f.whole_tensor_bytes for f in figures)
    print(f"all ranks read {human_bytes(total_read)}; reading whole tensors would read {human_bytes(total_whole)}")
    text, save_failures = save_table(results, writes)
    failures += save_failures
    print()
    print("saved back with save_hf_checkpoint on every rank:")
    print(text)
    saved = os.path.join(out, "saved")
    if compared is None:
        failures.append("the sharded save left no checkpoint")
    elif compared[1]:
        failures.append(f"the saved checkpoint differs from the original in {compared[1]}")
    else:
        print(f"saved checkpoint: {saved}: {', '.join(compared[0])} equal to the original's, byte for byte")
    if kept is None:
        print("plan picture: not kept (in the temporary folder, removed at exit: pass --keep or --out DIR)")
        print(f"output: {out}  (a temporary folder, removed at exit: --keep keeps it)   ({seconds:.1f} s)")
    else:
        print(f"plan picture: {svg}")
        print(f"output: {out}{kept}   ({seconds:.1f} s)")
    if failures:
        print()
        for msg in failures:
            print(f"FAILED: {msg}")
        return 1
    print(
        "OK: every shard on every rank equals the single-process load, and the sharded save wrote the original "
        "checkpoint back"
    )
    return 0
