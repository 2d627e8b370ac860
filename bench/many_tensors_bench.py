"""Loading N small tensors into N parameters: ours (plan, execute, report) against ``load_file`` + ``load_state_dict``.

    python bench/many_tensors_bench.py --tensors 200000 [--experts 128] [--per-expert 3] [--repeat 3] [--out DIR]
                                       [--markdown] [--profile]

The checkpoint is one ``model.safetensors`` of N float32 tensors of 16 elements (``[4, 4]``), named like a
large MoE model's (``layers.<i>.experts.<j>.w<k>``, ``--per-expert`` an expert: 3 by default, ``--experts``
a layer: 128 by default, as in Qwen3-30B-A3B), with random values; the model is a plain ``nn.Module`` holding
exactly those parameters (``layers`` and ``experts`` are ``ModuleList``s), so every key is a rename-only load.
Each method runs in a fresh process (imports and building the model are not timed), the methods alternating,
``--repeat`` processes each; page cache warm (the file is read once first). What each method's time includes:

- **ours, one call**: ``load_hf_checkpoint(model, path)`` (what a user runs; the verdict uses it): opening the
  file, reading its header, planning, reading every tensor into its parameter, the report;
- **ours**: the same as its parts, timed apart — plan (``SafetensorsCheckpoint.open``: the file opened, the
  header read; ``HFLoadPlanner.build_plan``: rules, traces, blocks), execute (``execute_plan`` with a
  ``FileReader``), report (``record_on_model`` + ``load_report``);
- **peer**: ``safetensors.torch.load_file(path)`` (opening the file, reading its header, reading every tensor
  into a new CPU tensor) then ``model.load_state_dict(state_dict)`` (strict: the key check, and each tensor
  copied into its parameter). torch's ``load_state_dict`` filters the keys below a module once per child of it
  (``startswith``), so its cost grows with the module tree: about keys x (layers + experts a layer) tests.

Each process reports its peak RSS (``VmHWM``) and its growth over the RSS after building the model, and a
digest of every parameter's bytes: every method must load the same values (exit status 1 otherwise). The
verdict is ours (one call) / peer: wall time best against best and median against median, and CPU time.
``--profile`` runs ours once more under cProfile and prints the top functions of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (4, 4)
PER_EXPERT, EXPERTS = 3, 128


def key_of(i: int, experts: int = EXPERTS, per_expert: int = PER_EXPERT) -> str:
    return f"layers.{i // (per_expert * experts)}.experts.{(i // per_expert) % experts}.w{i % per_expert}"


def write_checkpoint(path: str, tensors: int, experts: int = EXPERTS, per_expert: int = PER_EXPERT) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    values = torch.randn(tensors, *SHAPE, generator=g)
    save_file({key_of(i, experts, per_expert): values[i].clone() for i in range(tensors)}, path)


def build_model(tensors: int, experts: int = EXPERTS, per_expert: int = PER_EXPERT):
    """A module whose parameters are exactly the checkpoint's keys (uninitialised values)."""
    import torch
    from torch import nn

    layers = nn.ModuleList()
    for i in range(tensors):
        layer, expert, w = i // (per_expert * experts), (i // per_expert) % experts, i % per_expert
        if layer == len(layers):
            layers.append(nn.Module())
            layers[layer].experts = nn.ModuleList()
        modules = layers[layer].experts
        if expert == len(modules):
            modules.append(nn.Module())
        modules[expert].register_parameter(f"w{w}", nn.Parameter(torch.empty(SHAPE), requires_grad=False))
    model = nn.Module()
    model.layers = layers
    return model


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _digest(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def child(method: str, path: str, tensors: int, experts: int, per_expert: int, profile: bool) -> dict:
    """One load in this (fresh) process: phase walls, CPU, peak RSS and the parameters' digest."""
    import torch

    torch.set_num_threads(1)
    from safetensors.torch import load_file

    import loader  # noqa: F401  (imports are not timed)

    model = build_model(tensors, experts, per_expert)
    base = _rss_kib("VmRSS")
    phases: dict[str, float] = {}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    c0 = time.process_time()
    if method == "ours":
        from loader import HFLoadPlanner, SafetensorsCheckpoint
        from loader.checkpoint import FileReader
        from loader.execute import execute_plan
        from loader.options import LoadOptions
        from loader.report import load_report

        def phase(name, fn):
            if prof:
                prof.enable()
            t = time.perf_counter()
            out = fn()
            phases[name] = time.perf_counter() - t
            if prof:
                prof.disable()
            return out

        planner = HFLoadPlanner(model)
        plan = phase("plan", lambda: planner.build_plan(SafetensorsCheckpoint.open(path)))

        def execute():
            with FileReader() as reader:
                execute_plan(plan, reader, LoadOptions(progress=False))
                return reader.bytes_read

        bytes_read = phase("execute", execute)

        def report():
            plan.keyplan.record_on_model(model)
            return load_report(plan, bytes_read)

        rep = phase("report", report)
        assert len(rep.loaded_keys) == tensors and not rep.missing_keys and not rep.unexpected_keys, rep
    elif method == "call":
        from loader import load_hf_checkpoint
        from loader.options import LoadOptions

        t = time.perf_counter()
        rep = load_hf_checkpoint(model, path, options=LoadOptions(progress=False))
        phases["load_hf_checkpoint"] = time.perf_counter() - t
        assert len(rep.loaded_keys) == tensors and not rep.missing_keys and not rep.unexpected_keys, rep
    else:
        t = time.perf_counter()
        sd = load_file(path)
        phases["load_file"] = time.perf_counter() - t
        t = time.perf_counter()
        result = model.load_state_dict(sd)
        phases["load_state_dict"] = time.perf_counter() - t
        assert not result.missing_keys and not result.unexpected_keys, result
        del sd
    cpu = time.process_time() - c0
    out = dict(
        method=method,
        phases=phases,
        total=sum(phases.values()),
        cpu=cpu,
        peak_rss=_rss_kib("VmHWM") * 1024,
        rss_growth=(_rss_kib("VmHWM") - base) * 1024,
        base_rss=base * 1024,
        digest=_digest(model),
    )
    if prof:
        import io
        import pstats

        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        out["profile"] = s.getvalue()
    return out


def run_child(method: str, path: str, tensors: int, experts: int, per_expert: int, profile: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--out", path, f"--tensors={tensors}"]
    cmd += [f"--experts={experts}", f"--per-expert={per_expert}"]
    cmd += ["--profile"] if profile else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{method} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200_000)
    parser.add_argument("--experts", type=int, default=EXPERTS, help="experts a layer")
    parser.add_argument("--per-expert", type=int, default=PER_EXPERT, help="tensors an expert")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per method (methods alternating)")
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a folder in the temp directory)")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    parser.add_argument("--profile", action="store_true", help="cProfile ours' phases once more, print the top")
    parser.add_argument("--child", choices=["ours", "call", "peer"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.out, args.tensors, args.experts, args.per_expert, args.profile)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch = mdtable.LoadWatch()
    folder = args.out or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"many_tensors_{args.tensors}_e{args.experts}_k{args.per_expert}"
    )
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):
        t = time.perf_counter()
        write_checkpoint(path, args.tensors, args.experts, args.per_expert)
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB) in {time.perf_counter() - t:.1f} s")
    with open(path, "rb") as f:  # page cache warm
        while f.read(1 << 24):
            pass
    runs: dict[str, list[dict]] = {"ours": [], "call": [], "peer": []}
    for n in range(args.repeat):
        for method in runs:
            r = run_child(method, path, args.tensors, args.experts, args.per_expert)
            runs[method].append(r)
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in r["phases"].items())
            print(
                f"[{n + 1}] {method}: {r['total']:.2f} s ({parts}), CPU {r['cpu']:.2f} s, peak RSS "
                f"{r['peak_rss'] / 2**20:.0f} MiB (+{r['rss_growth'] / 2**20:.0f} MiB over the built model)",
                flush=True,
            )
    digests = {r["digest"] for rs in runs.values() for r in rs}
    same = len(digests) <= 1
    if args.profile:
        print(run_child("ours", path, args.tensors, args.experts, args.per_expert, profile=True)["profile"])
    if args.markdown:
        print_markdown(args, runs, same, watch.stop(), os.path.getsize(path))
    else:
        print(verdict(runs, same))
    return 0 if same else 1


def verdict(runs: dict[str, list[dict]], same: bool) -> str:
    """Ours (one call) / peer: wall time best against best (the target, ≤ 1x) and median against median, and
    CPU time best against best (both single-threaded: on a busy machine, the figure other processes move least)."""
    import mdtable

    def ratio(field: str, pick: Any) -> float:
        return pick([r[field] for r in runs["call"]]) / pick([r[field] for r in runs["peer"]])

    best, median, cpu = ratio("total", min), ratio("total", mdtable.median), ratio("cpu", min)
    return (
        f"ours (one call) / peer: {best:.2f}x best against best (target ≤ 1x: {'met' if best <= 1 else '**missed**'}), "
        f"{median:.2f}x median against median; CPU time {cpu:.2f}x best against best; every parameter equal "
        f"across methods and runs: {same}."
    )


def print_markdown(args: argparse.Namespace, runs: dict[str, list[dict]], same: bool, load: str, size: int) -> None:
    import mdtable

    print(mdtable.run_line(load, packages=("torch", "safetensors")))
    print()
    print(
        f"{args.tensors:,} float32 tensors of {SHAPE[0]} x {SHAPE[1]} in one file ({size / 2**20:.1f} MiB), "
        f"{args.per_expert} an expert, {args.experts} experts a layer, into {args.tensors:,} parameters of a plain "
        f"module; best and median of {args.repeat} fresh processes per method (methods alternating), page cache "
        "warm; imports and the model build not timed; each time includes opening the file and reading its header; "
        "peak RSS growth: the process's peak RSS (VmHWM) over its RSS after building the model (best run):"
    )
    print()
    rows = []
    for method, label in (
        ("ours", "ours: `load_hf_checkpoint`'s parts, timed apart"),
        ("call", "ours: `load_hf_checkpoint(model, path)`, one call"),
        ("peer", "peer: `load_file(path)` + `model.load_state_dict(sd)`"),
    ):
        rs = runs[method]
        best = min(rs, key=lambda r: r["total"])
        parts = ", ".join(f"{n} {s:.2f} s" for n, s in best["phases"].items())
        per_key = best["phases"].get("plan", 0.0) / args.tensors * 1e6
        rows.append(
            [
                label,
                f"**{best['total']:.2f} s**",
                mdtable.spread([r["total"] for r in rs], "{:.2f}"),
                parts + (f" ({per_key:.1f} µs per key planned)" if method == "ours" else ""),
                f"{best['cpu']:.2f} s",
                f"{best['rss_growth'] / 2**20:.0f} MiB",
            ]
        )
    print(mdtable.table(["method", "best", "all runs", "phases (best run)", "CPU (best run)", "peak RSS growth"], rows))
    print()
    print(verdict(runs, same))


if __name__ == "__main__":
    sys.exit(main())
