"""Benchmark: simulate planning one rank of DeepSeek-V3 (671B) on an EP8 x TP8 mesh, from headers only.

    taskset -c 0 python bench/plan_scale.py [--layers 61] [--rank 0] [--compare 10] [--repeat 3] [--rounds 1]
        [--baseline DIR ...] [--profile] [--markdown]

The model is transformers' ``DeepseekV3ForCausalLM`` with the real sizes (61 layers, the first 3 dense,
256 routed experts + 1 shared, hidden 7168, moe_intermediate 2048, intermediate 18432, vocab 129280,
q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, 128 heads), built on the meta
device and sharded into DTensor parameters under torch's fake process group (64 ranks, this process is one
of them): routed experts EP over mesh dim 0 (``Shard(0)`` of the merged expert tensors) and TP over mesh
dim 1 on their inner dims (fused ``gate_up_proj`` as ``_StridedShard(1, split_factor=2)``, so that each TP
rank holds matching gate and up rows; ``down_proj`` ``Shard(2)``); attention, dense MLP and shared-expert
projections column-/row-parallel over mesh dim 1; vocab-parallel embedding and head; norms, router and
the low-rank ``q_a``/``kv_a`` projections replicated.

The checkpoint is header-only (:meth:`loader.SafetensorsCheckpoint.from_infos`, no data files): the
keys, shapes and bf16 dtype of the Hugging Face checkpoint layout (per-expert tensors
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` …), obtained from transformers' own
``revert_weight_conversion`` — what ``save_pretrained`` writes — applied to the meta model's state dict,
spread over 5 GB shard files in key order like the hub checkpoint. (The hub checkpoint is FP8 with
``weight_scale_inv`` tensors and has the multi-token-prediction layer 61; a bf16 conversion has neither.)

Timed: ``simulate_load(model, checkpoint, ranks=[rank])`` — rules, traces, validation and block
compilation for every model tensor of that rank, in a fresh planner (nothing cached across runs), best of
``--repeat`` plans by CPU time, every phase timed (:data:`PHASES`; the rest of the call is reported as
``rest``, so that the phases add up to the whole). ``--rounds N`` runs N fresh processes, and ``--baseline
DIR`` (repeatable) alternates them with processes running the loader of another checkout (a git worktree of
an older commit), so that old and new are compared in one run. Building the model and the header list is
reported separately. ``--compare N`` also times an N-layer model with the
same sizes, to show that planning cost follows the distinct conversion shapes, not the layer count.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time
from types import SimpleNamespace

from common import DEEPSEEK_V3

MESH = (8, 8)  # (ep, tp)
SHARD_BYTES = 5 * 10**9
GIB = 1 << 30


def build_model(layers: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = AutoConfig.for_model("deepseek_v3", **dict(DEEPSEEK_V3, num_hidden_layers=layers))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def header_only_checkpoint(model):
    """The HF checkpoint's keys/shapes/dtypes (what save_pretrained writes) as a header-only checkpoint."""
    from transformers.core_model_loading import revert_weight_conversion

    from loader import SafetensorsCheckpoint
    from loader.checkpoint import TensorInfo
    from loader.rules import dot_natural_key

    saved = revert_weight_conversion(model, dict(model.state_dict()))
    keys = sorted(saved, key=dot_natural_key)
    infos, offset, file_index = {}, 0, 0
    for key in keys:
        t = saved[key]
        size = math.prod(t.shape) * t.dtype.itemsize
        if offset + size > SHARD_BYTES and offset:
            file_index, offset = file_index + 1, 0
        name = f"/nonexistent/deepseek-v3/model-{file_index + 1:05d}.safetensors"
        infos[key] = TensorInfo(key, name, t.dtype, tuple(t.shape), 8 + offset, 8 + offset + size)
        offset += size
    return SafetensorsCheckpoint.from_infos(infos, root="/nonexistent/deepseek-v3")


def placements_for(model) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from loader.placements import placements_matching

    R = Replicate()
    column = [R, Shard(0)]  # column-parallel / vocab-parallel
    row = [R, Shard(1)]  # row-parallel
    columns = ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    return placements_matching(
        model,
        {
            "*experts.gate_up_proj": [Shard(0), _StridedShard(1, split_factor=2)],  # EP x TP, matching gate/up rows
            "*experts.down_proj": [Shard(0), Shard(2)],
            **{f"*{n}.weight": column for n in columns},
            "*o_proj.weight": row,
            "*down_proj.weight": row,
        },
    )  # everything else (norms, router, q_a / kv_a projections) is replicated


#: the planning phases, in the order simulate_load runs them: (name in the tables, module, attribute)
PHASES = (
    ("placements", "loader.simulate", "model_placements"),  # the model's DTensor placements
    ("rules", "loader.planner", "HFLoadPlanner.key_plan"),  # keys -> conversions (plan_keys + the FP8 rewrite)
    ("shard boxes", "loader.simulate", "shard_boxes"),  # each tensor's local boxes on the rank
    ("trace + compile", "loader.planner", "plan_rank"),  # trace per signature, validate, compile blocks
    ("figures", "loader.simulate", "rank_figures"),  # the rank's byte and block counts
)


class PhaseTimers:
    """CPU seconds (``process_time``: on a shared machine, steadier than the wall) spent in the planning phases
    (:data:`PHASES`), by wrapping the loader functions simulate_load calls; ``rest`` is the CPU time of the call
    outside them (loops, slot records), so that the phases and ``rest`` add up to the whole."""

    def __init__(self) -> None:
        import importlib

        self.seconds: dict[str, float] = {name: 0.0 for name, _, _ in PHASES}
        self._saved = []
        for phase, module, attr in PHASES:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            self._wrap(phase, owner, name)

    def _wrap(self, phase: str, owner, name: str) -> None:
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._saved.append((owner, name, fn))

        def timed(*args, **kwargs):
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.process_time() - t

        setattr(owner, name, timed)

    def close(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def run(layers: int, rank: int, mesh, profile: bool = False, all_ranks: bool = False, repeat: int = 1) -> dict:
    """Plan ``rank`` of a ``layers``-layer model ``repeat`` times (each with a fresh planner and nothing cached):
    the figures of the fastest run."""
    from loader.placements import shard_module

    t0 = time.perf_counter()
    model = build_model(layers)
    shard_module(model, mesh, placements_for(model), device="meta")
    t1 = time.perf_counter()
    checkpoint = header_only_checkpoint(model)
    t2 = time.perf_counter()
    runs = [_plan_once(model, checkpoint, rank, profile and i == repeat - 1) for i in range(repeat)]
    out, planner = min(runs, key=lambda r: r[0]["cpu"])
    out.update(
        layers=layers,
        runs=[r["cpu"] for r, _ in runs],
        build=t1 - t0,
        headers=t2 - t1,
        keys=len(checkpoint),
        checkpoint_bytes=checkpoint.total_bytes,
        targets=len(model.state_dict()),
        conversions=len(planner.key_plan(checkpoint).conversions),
        hits=planner.cache.hits,
        misses=planner.cache.misses,
        block_cache=len(getattr(planner.cache, "_traces", ())),  # traces kept (one per signature)
    )
    if all_ranks:
        from loader.simulate import simulate_load

        # every rank of the mesh with the same planner: the key plan and the traces are reused
        w = time.perf_counter()
        figures = simulate_load(model, checkpoint, planner=planner)
        out["all"] = dict(
            seconds=time.perf_counter() - w,
            ranks=len(figures),
            max_ratio=max(f.bytes_read / f.shard_bytes for f in figures),
            total=sum(f.bytes_read for f in figures),
            misses=planner.cache.misses,
        )
    return out


def _plan_once(model, checkpoint, rank: int, profile: bool):
    import dataclasses
    import gc

    from loader import HFLoadPlanner
    from loader.placements import _shard_boxes_cached
    from loader.simulate import simulate_load

    _shard_boxes_cached.cache_clear()  # nothing carried over from an earlier run
    gc.collect()
    planner = HFLoadPlanner(model)
    timers = PhaseTimers()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    w, c = time.perf_counter(), time.process_time()
    try:
        (fig,) = simulate_load(model, checkpoint, ranks=[rank], planner=planner)
    finally:
        timers.close()
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    if profile:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    phases = dict(timers.seconds, rest=cpu - sum(timers.seconds.values()))
    return dict(fig=dataclasses.asdict(fig), seconds=wall, cpu=cpu, phases=phases), planner


def _phase_text(ph: dict) -> str:
    return ", ".join(f"{name} {ph[name]:.3f} s" for name in [*(p for p, _, _ in PHASES), "rest"])


def report(r: dict) -> None:
    f, ph = r["fig"], r["phases"]
    print(
        f"{r['layers']} layers: {r['keys']} checkpoint keys ({r['checkpoint_bytes'] / GIB:.1f} GiB bf16) -> "
        f"{r['targets']} model tensors via {r['conversions']} conversions "
        f"(model on meta + DTensors {r['build']:.1f} s, headers {r['headers']:.1f} s, not timed)"
    )
    print(
        f"  rank {f.rank} {tuple(f.coordinate)}: planned in {r['cpu']:.3f} s CPU (best of {len(r['runs'])}: "
        f"{', '.join(f'{s:.3f}' for s in r['runs'])}), {r['seconds']:.3f} s wall: {_phase_text(ph)}"
    )
    print(
        f"  {f.blocks} blocks, {f.bytes_read / GIB:.3f} GiB to read = {f.bytes_read / f.shard_bytes:.4f} x its "
        f"shard bytes ({f.shard_bytes / GIB:.3f} GiB); whole source tensors would be "
        f"{f.whole_tensor_bytes / GIB:.2f} GiB; {f.traced} tensors traced, {f.deferred} deferred"
    )
    print(
        f"  trace cache: {r['misses']} misses (traces), {r['hits']} hits; {r['block_cache']} compiled "
        "(signature, box) entries"
    )
    if "all" in r:
        a = r["all"]
        print(
            f"  all {a['ranks']} ranks: {a['seconds']:.2f} s wall (key plan and traces reused; traces now "
            f"{a['misses']}); max bytes/shard ratio {a['max_ratio']:.4f}; summed over ranks "
            f"{a['total'] / GIB:.1f} GiB"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--compare", type=int, default=10, help="also time this many layers (0: skip)")
    parser.add_argument("--repeat", type=int, default=3, help="plans per layer count in one process (best kept)")
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per code version, alternating")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        action="append",
        default=[],
        help="also time the loader of this checkout (e.g. a git worktree of an older commit; may be repeated) in "
        "the same run, alternating fresh processes with the current code",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the timed planning")
    parser.add_argument("--all-ranks", action="store_true", help="then simulate all 64 ranks too")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one process's results, for --rounds
    args = parser.parse_args(argv)
    if args.json:
        with contextlib.redirect_stdout(sys.stderr):
            results = _main(args)
        print(json.dumps([dict(r, fig=vars(r["fig"])) for r in results]))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch, plain = mdtable.LoadWatch(), io.StringIO()
    with contextlib.redirect_stdout(plain if args.markdown else sys.stdout):
        if args.rounds == 1 and not args.baseline:
            versions = {"current": _main(args)}
        else:
            versions = _in_processes(args)
    if args.markdown:
        print_markdown(versions, plain.getvalue(), watch.stop(), args)
    return 0


def _in_processes(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Each version's best results over ``args.rounds`` fresh processes, the versions alternating."""
    import subprocess

    forwarded = [
        f"--layers={args.layers}",
        f"--rank={args.rank}",
        f"--compare={args.compare}",
        f"--repeat={args.repeat}",
    ]
    paths = {"current": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    paths = {f"baseline {_commit_of(b)}": os.path.abspath(b) for b in args.baseline} | paths
    best: dict[str, list[dict]] = {}
    for n in range(args.rounds):
        for version, root in paths.items():
            env = dict(os.environ, PYTHONPATH=root)
            cmd = [sys.executable, os.path.abspath(__file__), "--json", *forwarded]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results = [dict(r, fig=SimpleNamespace(**r["fig"])) for r in json.loads(proc.stdout)]
            print(f"[{version}, round {n + 1}]")
            for r in results:
                report(r)
            kept = best.setdefault(version, results)
            for i, r in enumerate(results):
                runs = kept[i]["runs"] + (r["runs"] if kept[i] is not r else [])
                if r["cpu"] < kept[i]["cpu"]:
                    kept[i] = r
                kept[i]["runs"] = runs
    return best


def _commit_of(root: str) -> str:
    import subprocess

    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or os.path.basename(os.path.abspath(root))


def print_markdown(versions: dict[str, list[dict]], plain: str, load: str, args: argparse.Namespace) -> None:
    """The table of docs/benchmarks.md: one row per code version and layer count, then the target line."""
    import mdtable

    print(mdtable.run_line(load))
    print()
    processes = f"{args.rounds} fresh process{'es' if args.rounds > 1 else ''} per version" + (
        ", the versions alternating" if len(versions) > 1 else ""
    )
    print(
        f"Best of {args.repeat * args.rounds} plans per row ({processes}, {args.repeat} plans each, a fresh planner "
        "and nothing cached per plan); CPU seconds (on this shared machine steadier than the wall, given too); "
        "the phases and the rest (the call outside them) add up to the planning CPU time:"
    )
    print()
    rows = []
    for version, results in versions.items():
        for r in results:
            f, ph = r["fig"], r["phases"]
            rows.append(
                [
                    version,
                    r["layers"],
                    f"{r['keys']:,}".replace(",", " "),
                    r["conversions"],
                    f"**{r['cpu']:.3f} s**",
                    f"{r['seconds']:.3f} s",
                    *(f"{ph.get(p, 0.0):.3f} s" for p, _, _ in PHASES),
                    f"{ph['rest']:.3f} s",
                    f"{r['misses']} / {r['hits']}",
                    f"{f.blocks:,}".replace(",", " "),
                ]
            )
    headers = [
        "code",
        "layers",
        "keys",
        "conversions",
        "planning, one rank (CPU)",
        "(wall)",
        "placements",
        "rules (`key_plan`)",
        "shard boxes",
        "trace + compile (`plan_rank`)",
        "figures (`rank_figures`)",
        "rest",
        "traces (misses / hits)",
        "blocks",
    ]
    print(mdtable.table(headers, rows))
    print()
    current = versions["current"][-1]
    f = current["fig"]
    print(
        f"Rank {f.rank} reads {f.bytes_read / GIB:.3f} GiB = {f.bytes_read / f.shard_bytes:.4f} x its shard bytes; "
        f"whole source tensors would be {f.whole_tensor_bytes / GIB:.2f} GiB."
    )
    if "all" in current:
        a = current["all"]
        print(
            f"All {a['ranks']} ranks with the same planner: {a['seconds']:.2f} s, max bytes/shard ratio "
            f"{a['max_ratio']:.4f}, summed over ranks {a['total'] / GIB:.1f} GiB."
        )
    target = current["cpu"]
    print(f"Target <= 0.6 s for one rank on one core: {'met' if target <= 0.6 else 'NOT met'} ({target:.3f} s).")


def _main(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    print(
        f"DeepSeek-V3 layout, EP{MESH[0]} x TP{MESH[1]} mesh, simulated rank {args.rank}; "
        f"CPUs available to this process: {cpus} (torch threads 1)"
    )
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=math.prod(MESH))
    try:
        mesh = init_device_mesh("cpu", MESH)
        results = []
        for layers in ([args.compare] if args.compare else []) + [args.layers]:
            last = layers == args.layers
            r = run(
                layers,
                args.rank,
                mesh,
                profile=args.profile and last,
                all_ranks=args.all_ranks and last,
                repeat=args.repeat,
            )
            r["fig"] = SimpleNamespace(**r["fig"])
            report(r)
            results.append(r)
        if len(results) == 2:
            a, b = results
            pa, pb = a["phases"]["trace + compile"], b["phases"]["trace + compile"]
            ka, kb = a["phases"]["rules"], b["phases"]["rules"]
            print(
                f"{b['layers']} vs {a['layers']} layers ({b['keys'] / a['keys']:.1f} x the keys, "
                f"{b['conversions'] / a['conversions']:.1f} x the conversions, "
                f"{b['fig'].blocks / a['fig'].blocks:.1f} x the blocks, traces {a['misses']} vs {b['misses']}): "
                f"trace + compile {pa:.3f} -> {pb:.3f} s ({pb / pa:.2f} x); rules {ka:.3f} -> {kb:.3f} s "
                f"({kb / ka:.2f} x); planning {a['cpu']:.3f} -> {b['cpu']:.3f} s CPU"
            )
        target = results[-1]["cpu"]
        print(f"target <= 0.6 s for one rank on one core: {'met' if target <= 0.6 else 'NOT met'} ({target:.3f} s)")
    finally:
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    sys.exit(main())
