"""Benchmark: load a ~400 MB Qwen3-MoE-shaped bf16 checkpoint (3 shards, per-expert HF layout).

    python bench/load_bench.py [--out DIR] [--repeat 3] [--rounds 1] [--methods ...] [--threads N]
                               [--profile-first] [--markdown]

Methods, each in its own fresh subprocess (so that peak-memory figures do not mix, and so that the first
load of each is the first in its process):

* ``ours``: ``loader.load_hf_checkpoint`` into an already-built bf16 ``Qwen3MoeForCausalLM`` (building the
  model is not timed; the load merges the per-expert tensors into the fused expert tensors).
* ``dcp_hf``: ``torch.distributed.checkpoint.load`` of the built model's state dict with torch's
  ``HuggingFaceStorageReader`` and ``DefaultLoadPlanner``, from ``DIR/flat/``: the same tensors saved in the
  model's own layout (merged experts under the model's names), since torch's reader cannot merge experts.
* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16)``.
* ``vllm``, ``runai``, ``fastsafetensors``: the peers of bench/peers.py (``safe_open``; runai-model-streamer's
  ``SafetensorsStreamer``; fastsafetensors' ``SafeTensorsFileLoader`` with ``nogds=True`` on ``"cpu"``), each
  reading every tensor of the same files whole and copying it into the built model (the per-expert tensors into
  the fused expert tensors), as vLLM's loaders do.
* ``copy``: the copy limit, ``safetensors.torch.load_file`` of every shard + ``clone()`` of every tensor.

In each subprocess: the imports are timed (``import torch`` + transformers' Qwen3-MoE modelling module,
then what the method imports), the page cache is warmed (every shard read once), the model is built (timed,
not part of any load), then the **first load** of the process is timed — what a user who starts a
program and loads once waits for, one-time warm-ups included (for ``ours``, split into planning:
``HFLoadPlanner.build_plan``, and reading: the rest) — then ``--repeat`` warm loads, of which the best is
reported. ``ours`` also times planning alone (``build_plan``: headers, rules, traces, blocks) and a *read
floor*: ``preadv`` of every shard whole into one already-touched buffer, what any loader that copies out of
the page cache must pay, with no planning at all. ``--rounds N`` runs every method's subprocess N times,
alternating the methods, and reports each figure's range over the rounds. ``--profile-first`` also runs
``ours``' first load under cProfile, in one more fresh process, and prints the profile.

Peak memory beyond the model's own tensors: before the first load the worker resets its peak RSS
(``/proc/self/clear_refs`` = 5, Linux) and notes its RSS; after it, ``VmHWM`` (peak RSS since the reset)
minus that RSS is the memory the load needed on top of what the process already held, and for
``from_pretrained``/``copy`` (which allocate the model's tensors during the load) the bytes of the model's
tensors are subtracted. RSS counts file pages mapped by ``safetensors``' mmap too (``copy``,
``from_pretrained``, ``dcp_hf``); ``ours`` reads with ``pread`` into anonymous memory only. After the loads,
``ours``, ``dcp_hf`` and ``from_pretrained`` checksum the model's state dict: the three must agree.

After the warm loads, ``--repeat`` cold loads: before each, the method's files are dropped from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``), and the bytes it then reads from the device are ``read_bytes`` of
``/proc/self/io``; ``ours`` also times the read floor cold. ``--threads N`` sets torch's intra-op threads in every
method's process (default: torch's own); each method's figure says how many it ran with. A peer whose package
is missing or that fails here is a row with its reason, not a failed run.

``--markdown`` prints the tables docs/benchmarks.md holds instead of the plain report, the first of them the
side-by-side table (cold and warm medians, bytes read, peak memory; ours / the fastest peer).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import peers
from common import QWEN3_MOE, drop_cache, ours_options, pread_all, read_bytes, resident_bytes, safetensors_files

CONFIG = QWEN3_MOE
HIDDEN, LAYERS = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
EXPERTS, MOE_INTERMEDIATE = CONFIG["num_experts"], CONFIG["moe_intermediate_size"]
MIB = 1 << 20
METHODS = ("copy", "ours", "dcp_hf", "vllm", "runai", "fastsafetensors", "from_pretrained")
PEERS = ("dcp_hf", "vllm", "runai", "fastsafetensors", "from_pretrained")  # what ours is compared with


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS; return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux / not permitted: the peak then includes earlier phases
        pass
    return _status()["VmRSS"]


def _peak() -> int:
    return _status()["VmHWM"]


def generate(out: str) -> None:
    """The HF layout in ``out`` (``save_pretrained``) and the model's own layout in ``out/flat`` (for dcp_hf)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        config = AutoConfig.for_model("qwen3_moe", **CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        # save_pretrained writes the original per-expert layout; 180 MB shards give 3 files (~108/174/179 MB)
        model.save_pretrained(out, max_shard_size="180MB")
        del model
    flat = os.path.join(out, "flat")
    if not os.path.isfile(os.path.join(flat, "model.safetensors.index.json")):
        from safetensors.torch import save_file
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        total = sum(t.numel() * t.element_size() for t in state.values())
        os.makedirs(flat, exist_ok=True)
        parts, shard, size, weight_map = 3, {}, 0, {}
        names = [f"model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
        for key, t in state.items():
            index = min(parts - 1, size * parts // total)
            if shard and names[index] != weight_map[next(iter(shard))]:
                save_file(shard, os.path.join(flat, weight_map[next(iter(shard))]), metadata={"format": "pt"})
                shard = {}
            shard[key], weight_map[key] = t, names[index]
            size += t.numel() * t.element_size()
        save_file(shard, os.path.join(flat, weight_map[next(iter(shard))]), metadata={"format": "pt"})
        with open(os.path.join(flat, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        del model, state


def _warm(directory: str) -> int:
    size = 0
    for name in safetensors_files(directory):
        with open(name, "rb", buffering=0) as f:
            while chunk := f.read(64 * MIB):
                size += len(chunk)
    return size


def _checksum(state: dict) -> int:
    """CRC32 of every tensor's bytes, in key order."""
    import torch

    crc = 0
    for key in sorted(state):
        t = state[key].detach().contiguous().reshape(-1)
        crc = zlib.crc32(key.encode(), crc)
        crc = zlib.crc32(t.view(torch.uint8).numpy() if t.numel() else b"", crc)
    return crc


class _PlanTimer:
    """Time spent in ``HFLoadPlanner.build_plan`` (planning) and, inside it, in transformers'
    ``get_model_conversion_mapping`` (its conversion table is built on the first call in a process), while
    installed. Either figure is None where the loader no longer calls that function."""

    def __init__(self) -> None:
        import transformers.conversion_mapping as cm

        from loader import HFLoadPlanner

        self.plan = self.table = 0.0
        self.plan_calls = self.table_calls = 0
        self._patched = []
        self._wrap(HFLoadPlanner, "build_plan", "plan")
        self._wrap(cm, "get_model_conversion_mapping", "table")

    def _wrap(self, owner, name: str, field: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
                setattr(self, field + "_calls", getattr(self, field + "_calls") + 1)

        setattr(owner, name, timed)
        self._patched.append((owner, name, original))

    def take(self) -> tuple[float | None, float | None]:
        out = (self.plan if self.plan_calls else None, self.table if self.table_calls else None)
        self.plan = self.table = 0.0
        self.plan_calls = self.table_calls = 0
        return out


def worker(method: str, directory: str, repeat: int, profile: bool, threads: int = 0) -> dict:
    """Run ``method`` in this fresh process: the imports, the build and the first load timed apart, the
    first load's peak memory, then ``repeat`` timed warm loads, then ``repeat`` cold loads (the method's
    files dropped from the page cache before each)."""
    t0 = time.perf_counter()
    import torch

    if threads:
        torch.set_num_threads(threads)
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 - what building the model imports
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    base_import = time.perf_counter() - t0
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    flat = os.path.join(directory, "flat")
    t0 = time.perf_counter()
    if method == "ours":
        from loader import load_hf_checkpoint
    elif method == "dcp_hf":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader
    elif method == "copy":
        from safetensors.torch import load_file
    elif method in peers.LOADERS:
        load_peer = peers.LOADERS[method]
        __import__({"vllm": "safetensors", "runai": "runai_model_streamer"}.get(method, method))
    elif method != "from_pretrained":
        raise ValueError(method)
    method_import = time.perf_counter() - t0
    files_bytes = _warm(directory if method != "dcp_hf" else flat)
    config = AutoConfig.from_pretrained(directory)
    result: dict = {
        "method": method,
        "files_bytes": files_bytes,
        "threads": torch.get_num_threads(),
        "import": base_import + method_import,
        "method_import": method_import,
        "build": None,
    }

    model = None
    if method in ("ours", "dcp_hf", *peers.LOADERS):  # built (and touched) before the load; not timed
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        result["build"] = time.perf_counter() - t0
    if method == "ours":
        timer = _PlanTimer()

        def run():
            return load_hf_checkpoint(model, directory, **ours_options(progress=False))

    elif method == "dcp_hf":

        def run():
            dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(flat), planner=DefaultLoadPlanner())
            return model

    elif method in peers.LOADERS:

        def run():
            load_peer(model, directory)
            return model

    elif method == "from_pretrained":

        def run():
            return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)

    else:
        files = safetensors_files(directory)

        def run():
            out = {}
            for f in files:
                out.update({k: v.clone() for k, v in load_file(f).items()})
            return out

    # the first load of this process: timed, and its peak memory
    gc.collect()
    rss = _reset_peak()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        result["profile"] = text.getvalue()
    peak = _peak() - rss
    result["first"] = first
    if method == "ours":
        result["first_plan"], result["first_table"] = timer.take()
        result.update(bytes_read=out.bytes_read, traced=len(out.traced), deferred=len(out.deferred), blocks=out.blocks)
    state = model.state_dict() if model is not None else out.state_dict() if method == "from_pretrained" else out
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    if method in ("from_pretrained", "copy"):  # the load allocated the model's tensors: not "beyond the model"
        peak -= model_bytes
    del out, state

    times, plans = [], []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        if method == "ours":
            plans.append(timer.take()[0])
        if method != "copy":
            result["checksum"] = _checksum((out if model is None else model).state_dict())
        del out
    best = min(range(repeat), key=times.__getitem__)
    result.update(times=times, best=times[best], peak_extra=peak, model_bytes=model_bytes)
    files = safetensors_files(directory if method != "dcp_hf" else flat)
    result.update(_cold(run, files, repeat))
    if method == "ours":
        result["best_plan"] = plans[best]
        result["plan"] = min(_timed(lambda: _plan_only(model, directory)) for _ in range(repeat))
        floors = [_read_floor(directory) for _ in range(repeat)]
        result["read_floor"], result["floor_times"] = min(floors), floors
        result.update({"floor_" + k: v for k, v in _cold(lambda: _read_floor(directory), files, repeat).items()})
    return result


def _cold(run, files: list[str], repeat: int) -> dict:
    """``repeat`` cold loads: ``files`` dropped from the page cache (``POSIX_FADV_DONTNEED``) before each; their
    times, the physical bytes each read (``/proc/self/io``) and the most of ``files`` still cached after a drop."""
    times, physical, left = [], [], []
    for _ in range(repeat):
        gc.collect()
        drop_cache(files)
        left.append(resident_bytes(files) or 0)
        io, t0 = read_bytes(), time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        physical.append(read_bytes() - io)
        del out
    return {"cold_times": times, "cold_physical": physical, "cold_left": max(left)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _plan_only(model, directory: str) -> None:
    """Open the headers and plan (rules, traces, blocks): everything ``load_hf_checkpoint`` does but read."""
    from loader import HFLoadPlanner, SafetensorsCheckpoint

    HFLoadPlanner(model).build_plan(SafetensorsCheckpoint.open(directory))


def _read_floor(directory: str) -> float:
    """``pread`` every shard whole into one already-touched buffer: what any copying reader must pay."""
    import torch

    files = safetensors_files(directory)
    sizes = [os.path.getsize(f) for f in files]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    view = memoryview(buf.numpy())
    t0 = time.perf_counter()
    for f, size in zip(files, sizes):
        pread_all(f, view, size)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------
# reports


def _median(values: list[float]) -> float:
    return statistics.median_low(values)


def print_plain(rounds: list[dict[str, dict]], repeat: int) -> None:
    for i, results in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1}:")
        for method, r in results.items():
            if "error" in r:
                print(f"{method:>16}: could not run: {r['error']}")
                continue
            cold = ", ".join(f"{t:.3f}" for t in r["cold_times"])
            print(f"{method:>16}: cold [{cold}] s, read {statistics.median(r['cold_physical']) / MIB:.1f} MiB")
            times = ", ".join(f"{t:.3f}" for t in r["times"])
            print(
                f"{method:>16}: best {r['best']:.3f} s of [{times}]  {r['model_bytes'] / MIB / r['best']:.0f} MiB/s  "
                f"peak beyond model {r['peak_extra'] / MIB:.1f} MiB"
            )
            build = f", build {r['build']:.2f} s" if r["build"] is not None else ""
            split = ""
            if method == "ours" and r.get("first_plan") is not None:
                split = f" = planning {r['first_plan']:.3f} s + reading {r['first'] - r['first_plan']:.3f} s"
                if r.get("first_table") is not None:
                    split += f" (planning includes transformers' conversion table: {r['first_table']:.3f} s)"
            print(
                f"{'':>16}  fresh process: imports {r['import']:.2f} s ({method} {r['method_import']:.2f} s)"
                f"{build}; first load {r['first']:.3f} s{split}"
            )
            if method == "ours":
                plan = f", of which planning {r['best_plan']:.3f} s" if r.get("best_plan") is not None else ""
                print(
                    f"{'':>16}  read {r['bytes_read'] / MIB:.1f} MiB, {r['traced']} tensors traced, "
                    f"{r['deferred']} deferred, {r['blocks']} blocks; best warm load{plan}; "
                    f"planning alone {r['plan']:.3f} s"
                )
                print(
                    f"{'read floor':>16}: {r['read_floor']:.3f} s  (pread of every shard whole into a touched "
                    "buffer, no planning, no model)"
                )
        for name, a, b, note in _ratios(results):
            print(f"{name}: {a / b:.2f}x ({'target ' if note.startswith(('<', '>')) else ''}{note})")
    sums = {r[m].get("checksum") for r in rounds for m in r if r[m].get("checksum") is not None}
    if sums:
        print("state dicts after loading: " + ("identical" if len(sums) == 1 else "DIFFER") + " across methods")


def _ratios(results: dict[str, dict]) -> list[tuple[str, float, float, str]]:
    """(name, numerator, denominator, target or a note) for the ratios the methods run allow."""
    out = []
    r = results
    if "ours" in r and "copy" in r:
        out.append(("ours / copy limit", r["ours"]["best"], r["copy"]["best"], "<= 3"))
    if "ours" in r and "from_pretrained" in r:
        out.append(("from_pretrained / ours", r["from_pretrained"]["best"], r["ours"]["best"], ">= 10"))
        out.append(
            (
                "from_pretrained / read floor",
                r["from_pretrained"]["best"],
                r["ours"]["read_floor"],
                "the most any loader copying out of the page cache could reach",
            )
        )
    if "ours" in r and "dcp_hf" in r:
        out.append(("dcp_hf / ours", r["dcp_hf"]["best"], r["ours"]["best"], "peer"))
    if "ours" in r and "from_pretrained" in r:
        out.append(("first load: from_pretrained / ours", r["from_pretrained"]["first"], r["ours"]["first"], ">= 10"))
        out.append(
            (
                "first load: from_pretrained / (build the model + ours)",
                r["from_pretrained"]["first"],
                r["ours"]["first"] + r["ours"]["build"],
                "what a fresh program waits for, past the imports",
            )
        )
    return out


def print_markdown(rounds: list[dict[str, dict]], repeat: int, load: str) -> None:
    import mdtable

    def over(method: str, key: str) -> list[float]:
        return [r[method][key] for r in rounds if method in r and r[method].get(key) is not None]

    def fig(values: list[float], fmt: str = "{:.3f}", unit: str = " s") -> str:
        return mdtable.spread(values, fmt, unit) if values else "–"

    methods = [m for m in rounds[0] if not any("error" in r[m] for r in rounds)]
    n = len(rounds)
    print(mdtable.run_line(load, ("torch", "transformers", "safetensors", *peers.PACKAGES.values())))
    print()
    per = f"best of {repeat} warm loads per process" + (f"; {n} processes: best–worst [median]" if n > 1 else "")
    names = {
        "ours": "ours (`load_hf_checkpoint`)",
        "copy": "copy limit (`load_file` + `clone`)",
        "dcp_hf": "dcp_hf (`dcp.load`, `HuggingFaceStorageReader`)",
        "from_pretrained": "`from_pretrained`",
        "vllm": "vllm-style (`safe_open`, whole tensors copied)",
        "runai": "runai-model-streamer (`SafetensorsStreamer`, copied)",
        "fastsafetensors": "fastsafetensors (`SafeTensorsFileLoader`, `nogds`, copied)",
    }
    print(side_by_side(rounds, names, repeat))
    print()
    rows = []
    for m in methods:
        best = over(m, "best")
        mib_s = statistics.median(rounds[0][m]["model_bytes"] / MIB / t for t in best)
        peaks = over(m, "peak_extra")
        rows.append([names.get(m, m), fig(best), f"{mib_s:.0f}", fig([p / MIB for p in peaks], "{:.1f}", " MiB")])
        if m == "ours":
            rows.append(["ours, planning part of that load", fig(over(m, "best_plan")), "", ""])
            rows.append(["planning alone (`build_plan`)", fig(over(m, "plan")), "", ""])
            rows.append(["read floor (`preadv` of every shard whole)", fig(over(m, "read_floor")), "", ""])
    print(f"Warm page cache ({per}):")
    print()
    print(mdtable.table(["method", "load", "MiB/s (median)", "peak memory beyond the model (first load)"], rows))
    print()

    # the verdicts compare the best figures of all processes (the least contended), like every "best of"
    keys = ("best", "first", "build", "read_floor")
    best = {
        m: {k: min((r[m][k] for r in rounds if r[m].get(k) is not None), default=None) for k in keys} for m in methods
    }
    ratio_rows = []
    for name, a, b, note in _ratios(best):
        values = [x / y for results in rounds for other, x, y, _note in _ratios(results) if other == name]
        if note.startswith(("<=", ">=")):
            bound = float(note.split()[1])
            met = a / b <= bound if note.startswith("<=") else a / b >= bound
            note = f"{note.replace('<=', '≤').replace('>=', '≥')}: **{'met' if met else 'missed'}**"
        ratio_rows.append([name, f"{a / b:.2f}x", fig(values, "{:.2f}", "x"), note])
    print(mdtable.table(["ratio", "best / best", "per process", "target (judged on best / best)"], ratio_rows))
    print()

    print(
        "First load in a fresh process (imports and building the model not part of it)"
        + (f"; {n} processes: best–worst [median]" if n > 1 else "")
        + ":"
    )
    print()
    rows = []
    for m in methods:
        first = over(m, "first")
        plan = over(m, "first_plan")
        reading = [r[m]["first"] - r[m]["first_plan"] for r in rounds if r[m].get("first_plan") is not None]
        table = over(m, "first_table")
        warm = over(m, "best")
        extra = [r[m]["first"] - r[m]["best"] for r in rounds]
        rows.append(
            [
                names.get(m, m),
                fig(over(m, "import"), "{:.2f}"),
                fig(over(m, "build"), "{:.2f}"),
                "**" + fig(first) + "**",
                fig(plan),
                fig(table),
                fig(reading),
                fig(warm),
                fig(extra),
            ]
        )
    print(
        mdtable.table(
            [
                "method",
                "imports",
                "build model",
                "first load",
                "planning",
                "of which transformers' conversion table",
                "reading",
                "warm load (best)",
                "first − warm",
            ],
            rows,
        )
    )
    sums = {r[m].get("checksum") for r in rounds for m in r if r[m].get("checksum") is not None}
    if sums:
        checked = ", ".join(m for m in methods if rounds[0][m].get("checksum") is not None)
        print()
        print(f"State dicts after loading ({checked}): {'identical' if len(sums) == 1 else '**DIFFER**'}.")


def side_by_side(rounds: list[dict[str, dict]], names: dict[str, str], repeat: int) -> str:
    """The side-by-side table: per method, cold and warm medians, bytes read cold, peak extra memory; ours / fastest."""
    import mdtable

    def values(method: str, key: str) -> list[float]:
        return [v for r in rounds for v in r[method][key]]

    rows, left = [], 0
    for m in rounds[0]:
        own = " + its own I/O threads" if m in ("runai", "fastsafetensors") else ""
        error = next((r[m]["error"] for r in rounds if "error" in r[m]), None)
        threads = next((str(r[m]["threads"]) for r in rounds if "threads" in r[m]), "–") + own
        if error:
            rows.append({"method": m, "label": names.get(m, m), "threads": threads, "error": error})
            continue
        cold, warm, physical = (mdtable.median(values(m, k)) for k in ("cold_times", "times", "cold_physical"))
        memory = mdtable.median([r[m]["peak_extra"] for r in rounds])
        cells = [(cold, f"{cold:.3f} s"), (warm, f"{warm:.3f} s")]
        cells += [(physical, f"{physical / MIB:.1f} MiB"), (memory, f"{memory / MIB:.1f} MiB")]
        rows.append({"method": m, "label": names.get(m, m), "threads": threads, "cells": cells})
        left = max([left, *(r[m]["cold_left"] for r in rounds)])
        if m == "ours":
            cold, warm, physical = (
                mdtable.median(values(m, k)) for k in ("floor_cold_times", "floor_times", "floor_cold_physical")
            )
            cells = [(cold, f"{cold:.3f} s"), (warm, f"{warm:.3f} s"), (physical, f"{physical / MIB:.1f} MiB")]
            cells.append((None, "–"))
            label = "`preadv` floor (every shard whole, no model)"
            rows.append({"method": "floor", "label": label, "threads": threads, "cells": cells})
    columns = ["cold (median)", "warm (median)", "bytes read (physical, cold)", "peak extra memory (first load)"]
    head = (
        f"Side by side: medians over {len(rounds)} process(es) per method x {repeat} loads; cold = the "
        "method's files dropped from the page cache (`POSIX_FADV_DONTNEED`) before each load"
        + (f" (at most {left / MIB:.1f} MiB of them stayed cached after a drop)" if left else " (none stayed cached)")
        + "; ratio = ours / the least value among the peers "
        f"({', '.join(p for p in PEERS if p in rounds[0])}) in each column."
    )
    table = mdtable.side_by_side(columns, rows, "ours", [p for p in PEERS if p in rounds[0]])
    return head + "\n\n" + table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="checkpoint folder (generated there if absent; default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=3, help="warm loads per process (the best is reported)")
    parser.add_argument("--rounds", type=int, default=1, help="processes per method, alternating the methods")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--profile-first", action="store_true", help="also cProfile ours' first load, in one more fresh process"
    )
    parser.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads in every method's process (0: torch's default)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.out, args.repeat, args.profile, args.threads)))
        return 0
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r} (choose from {', '.join(METHODS)})")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch = mdtable.LoadWatch()
    directory = args.out or tempfile.mkdtemp(prefix="load_bench_")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    generate(directory)
    shards = safetensors_files(directory)
    size = sum(os.path.getsize(n) for n in shards)
    if not args.markdown:
        print(
            f"checkpoint: {directory} ({len(shards)} shards, {size / MIB:.1f} MiB, ready in "
            f"{time.perf_counter() - t0:.1f} s)"
        )
        print(
            f"  qwen3_moe hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts, moe_intermediate {MOE_INTERMEDIATE}, "
            f"bf16; {os.cpu_count()} CPUs; best of {args.repeat} warm-page-cache loads per process, "
            f"{args.rounds} process(es) per method"
        )

    def run(method: str, *extra: str) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--out", directory]
        cmd += ["--repeat", str(args.repeat), "--threads", str(args.threads), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            if method in peers.LOADERS:  # a peer that cannot run here: its reason goes in the table
                lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
                return {"method": method, "error": (lines[-1] if lines else f"exit status {proc.returncode}")[:200]}
            print(proc.stdout, proc.stderr, file=sys.stderr)
            raise SystemExit(f"{method} failed")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    rounds = [{method: run(method) for method in methods} for _ in range(args.rounds)]
    load = watch.stop()
    # the profiled first load runs in a process of its own, after the rounds: the profiler slows it down
    profile = run("ours", "--profile")["profile"].strip() if args.profile_first else ""
    if args.markdown:
        print_markdown(rounds, args.repeat, load)
    else:
        print_plain(rounds, args.repeat)
        print(f"load average (1 min) during the run: {load}")
    if profile:
        print("\ncProfile of ours' first load in a fresh process (an extra process, not in the figures above):")
        print("\n```text\n" + profile + "\n```" if args.markdown else profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
