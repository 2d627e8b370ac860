"""Benchmark: bytes read per rank and wall time of a 4-rank tensor-parallel load (localhost gloo).

    python bench/tp_bench.py [--out DIR] [--methods ours,ours_random,ours_dcp,vllm,dcp_hf,runai,...]
                             [--layout tp|ep] [--strided] [--threads 1] [--profile METHOD] [--rounds N] [--markdown]
                             [--warm-fill own|whole]

A Qwen3-MoE-shaped checkpoint (~400 MB bf16: hidden 1024, 4 layers, 32 experts, moe_intermediate 512) is
written once to ``DIR`` in two layouts: ``hf/`` as ``save_pretrained`` writes it (per-expert tensors
``…experts.{e}.gate_proj.weight``, 4 shards + index) and ``flat/`` in the model's own layout (merged expert
tensors under the model's names, 3 shards + index: a rename-only layout). Four ranks (spawned, gloo) each
build the model on the meta device and materialise only their shards as DTensors on a 1-D mesh of 4:

* attention ``q/k/v_proj`` ``Shard(0)`` (rows), ``o_proj`` ``Shard(1)`` (columns: 512 B of every 2 KiB row);
* experts ``gate_up_proj`` ``Shard(1)`` (its fused rows; ``--strided``: ``_StridedShard(1, split_factor=2)``,
  gate and up rows on every rank — not supported by the ``dcp_hf`` method) and ``down_proj`` ``Shard(2)``
  (columns of each expert's ``down_proj``: 256 B of every 1 KiB row);
* embedding and ``lm_head`` ``Shard(0)`` (vocab-parallel); norms and router replicated (plain tensors).

``--layout ep`` shards the experts whole instead (``Shard(0)`` of both expert tensors: 8 experts per rank),
keeping the attention layout: only ``o_proj`` is then read in columns.

Methods, all loading the same shards:

* ``ours``: ``loader.load_hf_checkpoint`` from ``hf/`` (expert merge traced: each rank reads its regions);
* ``ours_random``: the same, with every descriptor the loader opens advised ``POSIX_FADV_RANDOM`` (no
  kernel readahead) — to show what readahead adds to the physical bytes;
* ``ours_dcp``: ``dcp.load`` with ``HFLoadPlanner`` + ``SafetensorsReader`` from ``hf/``;
* ``vllm``: what vLLM's loader does — every rank opens every file with ``safetensors.safe_open``, takes each
  tensor whole (``get_tensor``) and narrows it to its shard (``hf/``);
* ``dcp_hf``: ``torch.distributed.checkpoint.load`` of the DTensor state dict with torch's
  ``HuggingFaceStorageReader`` and ``DefaultLoadPlanner`` from ``flat/`` (box slices via ``get_slice``);
* ``runai``, ``fastsafetensors``: runai-model-streamer's ``SafetensorsStreamer`` and fastsafetensors'
  ``SafeTensorsFileLoader`` (``nogds=True``, ``"cpu"``, a group of one) over every file of ``hf/``, each tensor
  whole, this rank's shard cut out and copied into the DTensor's local tensor, as ``vllm`` does (bench/peers.py);
* ``floor``: the ``preadv`` floor — this rank's page-bound byte ranges read into one touched buffer, no
  planning, no model filled.

A peer that fails here is reported with its reason (on every rank the method is then skipped).

Each rank reads its own copy of the files (``DIR/r0`` … ``DIR/r3``), so that ranks do not share page-cache
pages (as on separate nodes) and ``read_bytes`` of ``/proc/self/io`` (block-device reads this process caused,
readahead included) is that rank's physical read. Per method, all four ranks load at once, three times: a
first unmeasured pass (lazy imports, page cache filled), warm, and cold (each rank first drops its files
from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``).
Reported per rank: logical bytes (what the method asked the OS or the mmap for; for ours, the bytes the shards
need — the gaps between a column shard's runs, read through on pages the runs touch anyway and discarded,
are reported apart as "gaps"), physical bytes of the cold
load, cached bytes (this rank's checkpoint pages in the page cache right after the cold load, by
``mincore``: what the cold load brought in from its files, readahead included, and nothing else), and both
times; wall = the slowest rank. Local shards are set to NaN before every load, and after each
method every rank checks that its shards equal those of the first method bit for bit, and that layer 0's
and the non-layer tensors' shards equal DTensor's own split of the full tensors (``Shard._split_tensor``
/ ``_StridedShard._split_tensor``, as ``distribute_tensor`` applies them, read from ``flat/`` with
``safetensors``: an oracle independent of ``loader``). The page bound is the
number of distinct 4 KiB file pages holding the bytes a rank's shards need, x 4 KiB: no reader going
through the page cache can physically read less. With 2 CPUs for 4 ranks, times are contended.
Each load's peak extra memory is the rank's peak RSS during it (reset before, ``/proc/self/clear_refs``) minus
its RSS before it. ``--threads`` sets torch's intra-op threads per rank (default 1: 4 ranks on 2 CPUs).
``--rounds N`` repeats the whole run N times with fresh ranks (walls then given as a range).
``--shared`` has every rank read the same copy (``DIR/r0``: one page cache, as ranks on one host do); a rank's
physical bytes are then the pages it happened to read first. ``--warm-fill whole`` drops each rank's files and
reads them whole just before every warm load, so that every method copies out of the same large page-cache folios
(by default a method's warm load reads the cache as its own first pass left it: ours' exact reads leave 4 KiB
folios, readahead leaves large ones; bench/folio_probe.py). The per-rank report also gives the CPU time of all
ranks (user and system) of each phase. And
``--markdown`` prints the tables docs/benchmarks.md holds instead of the per-rank report: bytes and checks per
method, then the side-by-side table (cold and warm medians, bytes read, peak extra memory, and
ours / the fastest peer in each column).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta

import peers
from common import QWEN3_MOE, drop_cache, ours_options, peak, read_bytes, reset_peak, resident_bytes

CONFIG = QWEN3_MOE
HIDDEN, LAYERS = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
EXPERTS, MOE_INTERMEDIATE = CONFIG["num_experts"], CONFIG["moe_intermediate_size"]
WORLD = 4
PAGE = 4096
MIB = 1 << 20
METHODS = ("ours", "ours_random", "ours_dcp", "vllm", "dcp_hf", "runai", "fastsafetensors", "floor")
NOT_LOADING = ("floor",)  # methods that fill no model: no shard checks


# ---------------------------------------------------------------------------------------------------
# checkpoints


def _write_shards(tensors: dict, directory: str, parts: int = 3) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    keys = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map, shard, size, index = {}, {}, 0, 0
    names = [f"model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    for key in keys:
        shard[key] = tensors[key].contiguous()
        weight_map[key] = names[index]
        size += tensors[key].numel() * tensors[key].element_size()
        if size >= total * (index + 1) / parts and index < parts - 1:
            save_file(shard, os.path.join(directory, names[index]), metadata={"format": "pt"})
            shard, index = {}, index + 1
    save_file(shard, os.path.join(directory, names[index]), metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def generate(out: str) -> None:
    """Both layouts in ``out/r0``, then a copy per other rank (``out/r1`` …): separate files, so that the
    ranks do not share page-cache pages (as on separate nodes) and each rank's physical reads are its own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = os.path.join(out, "r0")
    hf, flat = os.path.join(base, "hf"), os.path.join(base, "flat")
    if not (
        os.path.isfile(os.path.join(hf, "model.safetensors.index.json"))
        and os.path.isfile(os.path.join(flat, "model.safetensors.index.json"))
    ):
        config = AutoConfig.for_model("qwen3_moe", **CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(hf, max_shard_size=f"{total // 3 // 1_000_000 + 2}MB")
        _write_shards(dict(model.state_dict()), flat)
        del model
    for r in range(1, WORLD):
        for layout in ("hf", "flat"):
            src, dst = os.path.join(base, layout), os.path.join(out, f"r{r}", layout)
            os.makedirs(dst, exist_ok=True)
            for name in os.listdir(src):
                target = os.path.join(dst, name)
                if not os.path.isfile(target) or os.path.getsize(target) != os.path.getsize(os.path.join(src, name)):
                    shutil.copyfile(os.path.join(src, name), target)
    os.sync()  # dirty pages cannot be dropped from the page cache


def checkpoint_files(root: str) -> list[str]:
    """The .safetensors files under ``root`` (one rank's copy, both layouts)."""
    return sorted(
        os.path.join(root, d, n)
        for d in ("hf", "flat")
        for n in os.listdir(os.path.join(root, d))
        if n.endswith(".safetensors")
    )


# ---------------------------------------------------------------------------------------------------
# I/O accounting


def physical_reads_visible(files: list[str]) -> bool:
    """Whether read_bytes counts this process's reads here (it stays 0 in some containers)."""
    drop_cache(files[:1])
    before = read_bytes()
    with open(files[0], "rb", buffering=0) as f:
        f.read(MIB)
    return read_bytes() - before > 0


# ---------------------------------------------------------------------------------------------------
# the model on each rank


def placements_for(model, strided: bool, layout: str = "tp") -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from loader.placements import placements_matching

    gate_up = _StridedShard(1, split_factor=2) if strided else Shard(1)
    experts = {  # whole experts per rank (ep), or their rows/columns (tp)
        "*experts.gate_up_proj": [Shard(0) if layout == "ep" else gate_up],
        "*experts.down_proj": [Shard(0) if layout == "ep" else Shard(2)],
    }
    return placements_matching(
        model,
        {
            **experts,
            "*[qkv]_proj.weight": [Shard(0)],
            "*embed_tokens.weight": [Shard(0)],
            "*lm_head.weight": [Shard(0)],
            "*o_proj.weight": [Shard(1)],
        },
    )


def _read_whole(files: list[str]) -> None:
    """Read ``files`` whole, in order, with readahead (the page cache then holds them in large folios)."""
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def build_sharded_model(directory: str, mesh, strided: bool, layout: str = "tp"):
    """The model on meta, then each tensor materialised: DTensor shards or plain (replicated) tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader.placements import shard_module

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return shard_module(model, mesh, placements_for(model, strided, layout), fill=None)


def locals_of(model) -> dict:
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        data = t.data
        out[name] = getattr(data, "_local_tensor", data)
    return out


def shard_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in locals_of(model).values())


def needed_ranges(model, directory: str) -> dict[str, list[tuple[int, int]]]:
    """Per file, the byte ranges of the distinct 4 KiB pages holding the bytes this rank's shards need (from
    the plan of ``ours``), adjacent pages merged."""
    from loader import HFLoadPlanner, SafetensorsCheckpoint

    checkpoint = SafetensorsCheckpoint.open(directory)
    planner = HFLoadPlanner(model)
    plan = planner.build_plan(checkpoint)
    pages: dict[str, set[int]] = {}
    for r in plan.reads:
        info = checkpoint[r.block.source]
        for a, n in r.block.source_runs():
            lo = info.data_start + a * info.itemsize
            hi = lo + n * info.itemsize
            pages.setdefault(info.file, set()).update(range(lo // PAGE, (hi - 1) // PAGE + 1))
    out: dict[str, list[tuple[int, int]]] = {}
    for file, numbers in pages.items():
        ranges = out.setdefault(file, [])
        for p in sorted(numbers):
            if ranges and ranges[-1][1] == p * PAGE:
                ranges[-1] = (ranges[-1][0], (p + 1) * PAGE)
            else:
                ranges.append((p * PAGE, (p + 1) * PAGE))
    return out


# ---------------------------------------------------------------------------------------------------
# the methods (each returns the logical bytes it read)


_GAPS = [0]  # bytes the loader's readers read through between wanted runs (FileReader.gap_bytes), this phase


def _count_gaps() -> None:
    """Add each loader FileReader's ``gap_bytes`` to ``_GAPS`` when it is closed."""
    from loader.checkpoint import FileReader

    close = FileReader.close
    if getattr(close, "counts_gaps", False):
        return

    def counting_close(self) -> None:
        _GAPS[0] += getattr(self, "gap_bytes", 0)
        self.gap_bytes = 0
        close(self)

    counting_close.counts_gaps = True
    FileReader.close = counting_close


def load_ours(model, out: str) -> int:
    from loader import load_hf_checkpoint

    return load_hf_checkpoint(model, os.path.join(out, "hf"), **ours_options(progress=False)).bytes_read


def load_ours_random(model, out: str) -> int:
    """``ours`` with readahead off: every descriptor the loader opens is advised ``POSIX_FADV_RANDOM``."""
    from loader.checkpoint import FileReader

    original = FileReader.fd

    def fd(self, file: str) -> int:
        new = file not in self._fds
        descriptor = original(self, file)
        if new:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_RANDOM)
        return descriptor

    FileReader.fd = fd
    try:
        return load_ours(model, out)
    finally:
        FileReader.fd = original


def load_ours_dcp(model, out: str) -> int:
    import torch.distributed.checkpoint as dcp

    from loader import HFLoadPlanner, SafetensorsReader

    path = os.path.join(out, "hf")
    planner = HFLoadPlanner(model)
    reader = SafetensorsReader(path, **ours_options())
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
    return planner.finish(reader).bytes_read


def _peer(name: str):
    """A peer of bench/peers.py reading ``hf/`` (whole tensors, this rank's shard cut out and copied)."""

    def load(model, out: str) -> int:
        return peers.LOADERS[name](model, os.path.join(out, "hf"))

    load.__name__ = f"load_{name}"
    return load


_FLOOR: dict[str, list[tuple[int, int]]] = {}  # this rank's needed_ranges, set by rank_main


def load_floor(model, out: str) -> int:
    """The ``preadv`` floor: this rank's page-bound ranges (:func:`needed_ranges`) read into one touched buffer,
    no planning, nothing copied into the model — what any reader going through the page cache must pay."""
    import numpy as np

    size = max((hi - lo for ranges in _FLOOR.values() for lo, hi in ranges), default=0)
    buf = _FLOOR_BUFFER.get(size)
    if buf is None:
        buf = _FLOOR_BUFFER[size] = memoryview(np.ones(size, dtype=np.uint8))
    total = 0
    for file, ranges in _FLOOR.items():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as ours advises such files: no readahead past them
            end = os.fstat(fd).st_size
            for lo, hi in ranges:
                pos, hi = lo, min(hi, end)  # the last page may run past the end of the file
                while pos < hi:
                    n = os.preadv(fd, [buf[pos - lo : hi - lo]], pos)
                    if n <= 0:
                        raise OSError(f"{file}: short read at byte {pos}")
                    pos += n
                total += hi - lo
        finally:
            os.close(fd)
    return total


_FLOOR_BUFFER: dict[int, memoryview] = {}


def load_dcp_hf(model, out: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader

    counted = [0]

    class Counting(HuggingFaceStorageReader):
        def _process_read_request(self, f, req, planner) -> None:
            before = planner.resolve_tensor(req)
            counted[0] += before.numel() * before.element_size()
            super()._process_read_request(f, req, planner)

    state = model.state_dict()
    dcp.load(state, storage_reader=Counting(os.path.join(out, "flat")), planner=DefaultLoadPlanner())
    return counted[0]


LOADERS = {
    "ours": load_ours,
    "ours_random": load_ours_random,
    "ours_dcp": load_ours_dcp,
    "vllm": _peer("vllm"),
    "dcp_hf": load_dcp_hf,
    "runai": _peer("runai"),
    "fastsafetensors": _peer("fastsafetensors"),
    "floor": load_floor,
}


# ---------------------------------------------------------------------------------------------------
# one rank


def rank_main(rank: int, world: int, args: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args["threads"]:
        torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo", init_method=f"file://{args['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out = os.path.join(args["out"], "r0" if args.get("shared") else f"r{rank}")  # this rank's own copy of the files
    files = checkpoint_files(out)
    mesh = init_device_mesh("cpu", (world,))
    model = build_sharded_model(os.path.join(out, "hf"), mesh, args["strided"], args["layout"])
    _FLOOR.clear()
    _FLOOR.update(needed_ranges(model, os.path.join(out, "hf")))
    result: dict = {
        "rank": rank,
        "shard_bytes": shard_bytes(model),
        "page_bound": sum(hi - lo for ranges in _FLOOR.values() for lo, hi in ranges),
        "threads": torch.get_num_threads(),
        "methods": {},
    }
    reference = None
    for method in args["methods"]:
        fn = LOADERS[method]
        r: dict = {}
        # an unmeasured first pass (imports what the method imports lazily and fills the page cache), then
        # warm, then cold: library files read on first use would otherwise count as checkpoint reads
        for phase in ("first", "warm", "cold"):
            _poison(model)
            if phase == "cold":
                drop_cache(files)
            if phase == "warm" and args.get("warm_fill") == "whole":
                drop_cache(files)
                _read_whole(files)
            dist.barrier()
            profile = args.get("profile") == method and phase == "warm" and rank == 0
            if profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            _count_gaps()
            _GAPS[0] = 0
            rss = reset_peak()
            io, t, cpu = read_bytes(), time.perf_counter(), os.times()
            try:
                logical = fn(model, out)
            except Exception as e:  # a peer that cannot run here: its reason goes in the table
                r["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            r[f"{phase}_seconds"] = time.perf_counter() - t
            now = os.times()
            r[f"{phase}_user"], r[f"{phase}_sys"] = now.user - cpu.user, now.system - cpu.system
            r[f"{phase}_peak"] = peak() - rss
            failed = torch.tensor([int("error" in r)])
            dist.all_reduce(failed)
            if failed.item():
                r.setdefault("error", "failed on another rank")
                break
            if profile:
                import pstats

                prof.disable()
                order = os.environ.get("BENCH_PROFILE_SORT", "tottime")  # or "cumulative"
                pstats.Stats(prof).sort_stats(order).print_stats(int(os.environ.get("BENCH_PROFILE_LINES", "25")))
            r[f"{phase}_physical"] = read_bytes() - io
            if phase == "cold":
                r["resident"] = resident_bytes(files)
            r["logical"] = logical
            r["gaps"] = _GAPS[0]
            dist.barrier()
        if "error" not in r:
            r["physical"] = r["cold_physical"]
        if "error" in r or method in NOT_LOADING:
            result["methods"][method] = r
            continue
        r["oracle"] = oracle_check(model, out, rank, world)
        values = {n: v.clone() for n, v in locals_of(model).items()}
        if reference is None:
            reference = values
            r["equal"] = not any(bool(torch.isnan(v.float()).any()) for v in values.values())
        else:
            r["equal"] = all(torch.equal(values[n], reference[n]) for n in reference)
        result["methods"][method] = r
    dist.barrier()
    with open(os.path.join(args["results"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def oracle_check(model, out: str, rank: int, world: int) -> bool:
    """Layer 0's and the non-layer tensors' local shards against DTensor's own split (``_split_tensor``, as
    ``distribute_tensor`` applies it) of the full tensor read from ``flat/``: independent of ``loader``."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    directory = os.path.join(out, "flat")
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for name, t in model.state_dict(keep_vars=True).items():
        if ".layers." in name and ".layers.0." not in name:
            continue
        data = t.data
        with safe_open(os.path.join(directory, weight_map[name]), framework="pt") as f:
            want = f.get_tensor(name)
        for p in getattr(data, "placements", ()):
            if isinstance(p, (Shard, _StridedShard)):
                want = p._split_tensor(want, world, with_padding=False)[0][rank]
        if not torch.equal(getattr(data, "_local_tensor", data), want):
            return False
    return True


def _poison(model) -> None:
    import torch

    with torch.no_grad():
        for t in locals_of(model).values():
            t.fill_(float("nan"))


# ---------------------------------------------------------------------------------------------------


def print_plain(ranks: list[dict], methods: list[str], visible: bool) -> None:
    for res in ranks:
        print(
            f"rank {res['rank']}: shard bytes {res['shard_bytes'] / MIB:.2f} MiB, page bound "
            f"{res['page_bound'] / MIB:.2f} MiB ({res['page_bound'] / res['shard_bytes']:.3f} x)"
        )
    header = (
        f"{'method':>11} {'rank':>4} {'logical MiB':>11} {'/shard':>7} {'physical MiB':>12} {'/shard':>7} "
        f"{'cached MiB':>10} {'/shard':>7} {'cold s':>7} {'warm s':>7}"
    )
    print(header)
    ran = [m for m in methods if not _error([ranks], m)]
    for method in methods:
        if method not in ran:
            print(f"{method:>11}  could not run: {_error([ranks], method)}")
            continue
        for res in ranks:
            r, sb = res["methods"][method], res["shard_bytes"]
            phys = f"{r['physical'] / MIB:12.2f} {r['physical'] / sb:7.3f}" if visible else f"{'n/a':>12} {'':>7}"
            cached = (
                f"{r['resident'] / MIB:10.2f} {r['resident'] / sb:7.3f}"
                if r.get("resident") is not None
                else f"{'n/a':>10} {'':>7}"
            )
            print(
                f"{method:>11} {res['rank']:>4} {r['logical'] / MIB:11.2f} {r['logical'] / sb:7.3f} {phys} {cached} "
                f"{r['cold_seconds']:7.3f} {r['warm_seconds']:7.3f}"
            )
        rs = [res["methods"][method] for res in ranks]
        ok = all(r.get("equal", True) for r in rs)
        oracle = all(r.get("oracle", True) for r in rs)
        gaps = max(r.get("gaps", 0) for r in rs) / MIB
        print(
            f"{method:>11}  wall (slowest rank): cold {max(r['cold_seconds'] for r in rs):.3f} s, warm "
            f"{max(r['warm_seconds'] for r in rs):.3f} s; "
            + (f"gaps read through and discarded: up to {gaps:.2f} MiB per rank; " if gaps else "")
            + "CPU of all ranks, user + system: cold "
            + f"{sum(r['cold_user'] for r in rs):.3f} + {sum(r['cold_sys'] for r in rs):.3f} s, warm "
            + f"{sum(r['warm_user'] for r in rs):.3f} + {sum(r['warm_sys'] for r in rs):.3f} s; "
            + (
                "fills no model"
                if method in NOT_LOADING
                else f"shards {'equal' if ok else 'DIFFER'}"
                f"{' to ' + methods[0] + ' (bit for bit)' if method != methods[0] else ' (every element loaded)'}; "
                f"sampled shards {'match' if oracle else 'DO NOT match'} DTensor's own split"
            )
        )
    print()
    worst = {
        m: (
            max(res["methods"][m]["logical"] / res["shard_bytes"] for res in ranks),
            max(res["methods"][m]["physical"] / res["shard_bytes"] for res in ranks),
        )
        for m in ran
    }
    for m, (lg, ph) in worst.items():
        print(
            f"{m:>11}: worst rank logical {lg:.3f} x shard bytes (target <= 1.02), physical "
            + (f"{ph:.3f} x (target <= 1.10)" if visible else "n/a")
        )


def _error(rounds: list[list[dict]], method: str) -> str | None:
    """Why ``method`` could not run (the first rank's own reason), or None where it ran on every rank."""
    errors = [res["methods"][method].get("error") for ranks in rounds for res in ranks]
    own = [e for e in errors if e and e != "failed on another rank"]
    return (own or [e for e in errors if e] or [None])[0]


def _ratio_range(values: list[float]) -> str:
    """The worst (highest) ratio, with the range over ranks (and rounds) when they differ."""
    lo, hi = min(values), max(values)
    return f"{hi:.3f}" if f"{lo:.3f}" == f"{hi:.3f}" else f"{hi:.3f} ({lo:.3f}–{hi:.3f})"


def print_markdown(rounds: list[list[dict]], methods: list[str], visible: bool, load: str, layout: str) -> None:
    import mdtable

    print(mdtable.run_line(load, ("torch", "transformers", "safetensors", *peers.PACKAGES.values())))
    print()
    every = [res for ranks in rounds for res in ranks]
    shard = sorted({res["shard_bytes"] for res in every})
    n = len(rounds)
    print(
        f"{layout}; world {WORLD}; shard bytes per rank {' / '.join(f'{b / MIB:.2f}' for b in shard)} MiB; "
        + (f"{n} runs: walls best–worst [median] of the slowest rank per run, " if n > 1 else "walls: slowest rank, ")
        + "byte ratios: worst rank (range over ranks"
        + (" and runs" if n > 1 else "")
        + " in brackets)."
    )
    print()
    rows = []
    cached = {}  # method -> largest |cached pages - physical bytes| over ranks and runs
    ran = [m for m in methods if not _error(rounds, m)]
    for method in methods:
        if method not in ran:
            rows.append([method, f"could not run: {_error(rounds, method)}", "", "", "", "", ""])
            continue
        rs = [(res["methods"][method], res["shard_bytes"]) for res in every]
        logical = _ratio_range([r["logical"] / sb for r, sb in rs])
        gaps = "–"
        if method.startswith("ours"):
            worst = max(rs, key=lambda x: x[0].get("gaps", 0) / x[1])
            gaps = f"{worst[0].get('gaps', 0) / worst[1]:.3f} ({worst[0].get('gaps', 0) / MIB:.1f} MiB)"
        physical = _ratio_range([r["physical"] / sb for r, sb in rs]) if visible else "n/a"
        cached[method] = max(
            (abs(r["resident"] - r["physical"]) for r, _ in rs if r.get("resident") is not None), default=0
        )
        cold = [max(res["methods"][method]["cold_seconds"] for res in ranks) for ranks in rounds]
        warm = [max(res["methods"][method]["warm_seconds"] for res in ranks) for ranks in rounds]
        oracle = all(r.get("oracle", True) for r, _ in rs)
        equal = all(r.get("equal", True) for r, _ in rs)
        check = "= DTensor's split" if oracle else "**differ from DTensor's split**"
        if method != methods[0]:
            check += f", = {methods[0]}" if equal else f", **differ from {methods[0]}**"
        if method in NOT_LOADING:
            check = "fills no model"
        rows.append([method, logical, gaps, physical, mdtable.spread(cold), mdtable.spread(warm), check])
    bound = _ratio_range([res["page_bound"] / res["shard_bytes"] for res in every])
    rows.append(["page bound", "", "", bound, "", "", ""])
    print(
        mdtable.table(
            ["method", "logical / shard", "gaps / shard", "physical / shard", "cold wall", "warm wall", "shards"],
            rows,
        )
    )
    if visible:
        same = [m for m in ran if not cached[m]]
        differ = [f"{m} (by up to {cached[m] / MIB:.2f} MiB on a rank)" for m in ran if cached[m]]
        print()
        print(
            "Checkpoint pages in the page cache after each cold load (`mincore`) = the physical bytes on every rank"
            + (f" for {', '.join(same)}" if differ and same else "")
            + (f"; they differ for {', '.join(differ)}." if differ else ".")
        )
    print()
    print(
        "Side by side: cold and warm = median over runs of the slowest rank's wall; bytes read = the "
        "worst rank's physical read in the cold load (`/proc/self/io`); peak extra memory = the worst rank's peak "
        "RSS over its warm and cold loads minus its RSS before each (mmapped checkpoint pages count); ratio = ours "
        f"/ the least value among the peers ({', '.join(m for m in PEERS if m in methods)}) that load the right "
        "values, in each column."
    )
    print()
    print(side_by_side(rounds, methods, visible))


LABELS = {
    "vllm": "vllm-style (`safe_open`, whole tensors, shard cut and copied)",
    "dcp_hf": "dcp_hf (`dcp.load`, `HuggingFaceStorageReader`, `flat/`)",
    "runai": "runai-model-streamer (`SafetensorsStreamer`, shard cut and copied)",
    "fastsafetensors": "fastsafetensors (`SafeTensorsFileLoader`, `nogds`, shard cut and copied)",
    "floor": "`preadv` floor (the rank's page-bound ranges, no model)",
}
OWN_THREADS = ("runai", "fastsafetensors")  # peers that read with threads of their own
PEERS = ("vllm", "dcp_hf", *OWN_THREADS)  # what ours is compared with


def side_by_side(rounds: list[list[dict]], methods: list[str], visible: bool) -> str:
    """One row per method: cold and warm walls (medians), bytes read, peak extra memory; ours / fastest peer."""
    import mdtable

    every = [res for ranks in rounds for res in ranks]
    threads = str(every[0]["threads"])
    rows, wrong = [], []  # wrong: methods whose shards differ from DTensor's split, left out of the ratio
    for method in methods:
        label = LABELS.get(method, method)
        own = " + its own I/O threads" if method in OWN_THREADS else ""
        if _error(rounds, method):
            rows.append({"method": method, "label": label, "threads": threads + own, "error": _error(rounds, method)})
            continue
        cold = mdtable.median([max(res["methods"][method]["cold_seconds"] for res in ranks) for ranks in rounds])
        warm = mdtable.median([max(res["methods"][method]["warm_seconds"] for res in ranks) for ranks in rounds])
        worst = max(every, key=lambda res: res["methods"][method]["physical"])
        physical = worst["methods"][method]["physical"]
        memory = max(max(res["methods"][method]["warm_peak"], res["methods"][method]["cold_peak"]) for res in every)
        cells = [
            (cold, f"{cold:.3f} s"),
            (warm, f"{warm:.3f} s"),
            (physical, f"{physical / MIB:.1f} MiB ({physical / worst['shard_bytes']:.3f}x shard)")
            if visible
            else (None, "n/a"),
            (memory, f"{memory / MIB:.1f} MiB"),
        ]
        if not all(res["methods"][method].get("oracle", True) for res in every):
            label += " — **wrong values** (not DTensor's split): no peer"
            wrong.append(method)
        rows.append({"method": method, "label": label, "threads": threads + own, "cells": cells})
    columns = ["cold (median)", "warm (median)", "bytes read (physical, cold, worst rank)", "peak extra memory"]
    return mdtable.side_by_side(columns, rows, "ours", [m for m in PEERS if m in methods and m not in wrong])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="checkpoint folder (generated there if absent; default: a temp folder)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--strided",
        action="store_true",
        help="gate_up_proj as _StridedShard(1, split_factor=2) (dcp_hf cannot load it)",
    )
    parser.add_argument(
        "--layout",
        choices=("tp", "ep"),
        default="tp",
        help="tp: experts TP as above (default); ep: whole experts per rank (Shard(0))",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads per rank (0: torch's default); default 1"
    )
    parser.add_argument("--profile", metavar="METHOD", help="cProfile rank 0's warm load with METHOD")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="every rank reads the same copy of the files (DIR/r0: one page cache, as ranks on one host do); "
        "physical bytes are then whoever read a page first",
    )
    parser.add_argument(
        "--warm-fill",
        choices=("own", "whole"),
        default="own",
        help="own: the warm load reads the page cache as the method's own first pass left it (default); whole: "
        "each rank's files are dropped and read whole in order just before every warm load, so that every method "
        "copies out of the same large folios (bench/folio_probe.py)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of all methods (fresh ranks each time)")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    for m in methods:
        if m not in LOADERS:
            parser.error(f"unknown method {m!r} (choose from {', '.join(LOADERS)})")

    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch = mdtable.LoadWatch()
    out = args.out or tempfile.mkdtemp(prefix="tp_bench_")
    t0 = time.perf_counter()
    generate(out)
    files = checkpoint_files(os.path.join(out, "r0"))
    hf_size = sum(os.path.getsize(p) for p in files if os.sep + "hf" + os.sep in p)
    experts = (
        "EP (Shard(0))"
        if args.layout == "ep"
        else f"TP: gate_up_proj {'_StridedShard(1, 2)' if args.strided else 'Shard(1)'}, down_proj Shard(2)"
    )
    say = (lambda *a: None) if args.markdown else print
    say(
        f"checkpoint: {out} (hf/ and flat/, {hf_size / MIB:.1f} MiB each layout, ready in "
        f"{time.perf_counter() - t0:.1f} s); qwen3_moe hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts, "
        f"moe_intermediate {MOE_INTERMEDIATE}, bf16; world {WORLD} (gloo, torch threads per rank: "
        f"{args.threads or 'default'}), "
        f"{os.cpu_count()} CPUs; experts {experts}"
    )
    visible = physical_reads_visible(files)
    if not visible:
        print("NOTE: /proc/self/io read_bytes stays 0 here: physical bytes cannot be measured in this container")
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            spec = {
                "out": out,
                "methods": methods,
                "strided": args.strided,
                "profile": args.profile if i == 0 else None,
                "layout": args.layout,
                "threads": args.threads,
                "warm_fill": args.warm_fill,
                "shared": args.shared,
                "store": os.path.join(tmp, "store"),
                "results": tmp,
            }
            t0 = time.perf_counter()
            mp.start_processes(rank_main, args=(WORLD, spec), nprocs=WORLD, join=True, start_method="spawn")
            ranks = []
            for r in range(WORLD):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    ranks.append(json.load(f))
            say(f"{'run ' + str(i + 1) + ' ' if args.rounds > 1 else ''}ran in {time.perf_counter() - t0:.1f} s")
        rounds.append(ranks)
        if not args.markdown:
            print_plain(ranks, methods, visible)
    load = watch.stop()
    if args.markdown:
        whole = args.warm_fill == "whole"
        fill = "; every warm load after its rank's files were read whole (large folios)" if whole else ""
        if args.shared:
            fill += "; every rank reads one shared copy of the files (one page cache, as on one host)"
        print_markdown(rounds, methods, visible, load, f"experts {experts}{fill}")
    else:
        print(f"load average (1 min) during the run: {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
