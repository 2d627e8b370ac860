"""Benchmark: checkpoints that are not safetensors — a ``torch.save`` ``.bin`` file and a DCP folder.

    python bench/formats_bench.py [--out DIR] [--part bin,dcp] [--markdown]

**bin**: a transformers Llama-shaped model (hidden 1024, 8 layers, intermediate 2816, vocab 32000, untied, bf16,
about 336 MiB) written once as ``pytorch_model.bin`` (``torch.save`` of its state dict, as
``save_pretrained(safe_serialization=False)`` wrote it) with its ``config.json``. Each method runs in a fresh
process, its first load counted: the file's pages dropped from the page cache first (``POSIX_FADV_DONTNEED``),
then, timed, ``from_pretrained`` (building the model included), ``torch.load(mmap=True)`` + ``load_state_dict``
into a model built from the config, ``torch.load(mmap=False)`` + ``load_state_dict``, and ours
(``load_hf_checkpoint``) into a model built from the config. Bytes: ``rchar`` of ``/proc/self/io`` (what
``read``/``pread`` calls asked for; an mmap's page faults are not in it) and ``read_bytes`` (read from the disk).
Each timed load ends by reading one byte of every 4 KiB page of every model tensor: ``from_pretrained`` leaves the
tensors of a ``.bin`` file as pages of its mmap, read on first use, and that first use is counted here.
Every method's tensors are checked bit-identical to ``torch.load``'s.

**dcp**: the same shape of model saved by ``dcp.save`` from 4 gloo ranks as DTensors ``Shard(0)`` (each key in 4
row chunks), then loaded by 4 ranks in two other shardings: ``Shard(1)`` over the 4 ranks (every rank needs a
quarter of each row of every chunk), and ``Shard(0)`` over a 2x2 mesh's first dim (half the rows: two chunks whole,
as resharding to 2 ranks). Norms and ``lm_head`` stay replicated. Each rank reads its own copy of the folder
(page caches apart), dropped before each load. ``dcp.load`` vs ours (``load_hf_checkpoint`` of the folder): wall,
bytes asked (``rchar``) and read from the disk (``read_bytes``) ÷ the rank's shard, and the *page bound* ÷ shard:
the 4 KiB pages holding the bytes the shard needs. A local shard that differs between the two, or from the saved
values, exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import drop_cache, read_bytes

MIB = 1 << 20
PAGE = 4096
WORLD = 4
CONFIG = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    tie_word_embeddings=False,
)
BIN_METHODS = ("from_pretrained", "torch_load_mmap", "torch_load", "ours")
LABELS = {
    "from_pretrained": "`from_pretrained` (build included)",
    "torch_load_mmap": "`torch.load(mmap=True)` + `load_state_dict`",
    "torch_load": "`torch.load(mmap=False)` + `load_state_dict`",
    "ours": "ours (`load_hf_checkpoint`)",
}


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)


def generate_bin(folder: str) -> str:
    """Write ``pytorch_model.bin`` and ``config.json`` in ``folder`` (once); return the file."""
    path = os.path.join(folder, "pytorch_model.bin")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        torch.manual_seed(0)
        model = _model()
        model.config.save_pretrained(folder)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        os.sync()  # dirty pages stay in the page cache: the first method's load would not be cold
    return path


def rchar() -> int:
    """``rchar`` of ``/proc/self/io``: bytes this process asked ``read``/``pread`` for (cached or not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _touch(model) -> None:
    """Read one byte of every 4 KiB page of every tensor (an mmap's pages are faulted in from the file)."""
    for t in model.state_dict().values():
        flat = t.detach().reshape(-1).view(torch.uint8)
        int(flat[::PAGE].sum())


def _digest(state: dict) -> dict[str, int]:
    return {k: int(v.detach().contiguous().view(-1).view(torch.uint8).sum()) for k, v in state.items()}


def bin_worker(method: str, folder: str) -> dict:
    """One method's first load in this fresh process."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions

    hf_logging.set_verbosity_error()
    path = os.path.join(folder, "pytorch_model.bin")
    model = None if method == "from_pretrained" else _model()
    drop_cache([path])
    io, asked, t0 = read_bytes(), rchar(), time.perf_counter()
    logical = os.path.getsize(path)
    if method == "from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    elif method in ("torch_load_mmap", "torch_load"):
        state = torch.load(path, mmap=method == "torch_load_mmap", weights_only=True)
        model.load_state_dict(state)
        del state
    else:
        logical = load_hf_checkpoint(model, folder, options=LoadOptions(progress=False)).bytes_read
    _touch(model)  # from_pretrained's tensors may still be pages of the file's mmap, not yet read
    wall = time.perf_counter() - t0
    physical, asked = read_bytes() - io, rchar() - asked
    return {
        "wall": wall,
        "physical": physical,
        "asked": asked,
        "logical": logical,
        "digest": _digest(model.state_dict()),
    }


def run_bin(folder: str, rounds: int) -> list[list]:
    path = generate_bin(folder)
    size = os.path.getsize(path)
    truth = _digest(torch.load(path, weights_only=True))
    results: dict[str, list[dict]] = {m: [] for m in BIN_METHODS}
    for _ in range(rounds):
        for method in BIN_METHODS:
            cmd = [sys.executable, os.path.abspath(__file__), "--bin-worker", method, "--out", folder]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise SystemExit(f"{method} failed:\n{proc.stderr[-4000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if r["digest"] != {k: v for k, v in truth.items() if k in r["digest"]} or len(r["digest"]) < len(truth):
                raise SystemExit(f"{method}: the loaded tensors differ from torch.load's")
            results[method].append(r)
    import mdtable

    ours = mdtable.median([r["wall"] for r in results["ours"]])
    ours_io = mdtable.median([r["physical"] for r in results["ours"]])
    rows = []
    for method in BIN_METHODS:
        walls = [r["wall"] for r in results[method]]
        physical = [r["physical"] for r in results[method]]
        asked = mdtable.median([r["asked"] for r in results[method]])
        rows.append(
            [
                LABELS[method],
                mdtable.spread(walls),
                f"{asked / MIB:.1f} MiB",
                f"{mdtable.median(physical) / MIB:.1f} MiB ({mdtable.median(physical) / size:.3f} of the file)",
                f"{mdtable.median(walls) / ours:.2f}x",
                f"{mdtable.median(physical) / ours_io:.2f}x" if ours_io else "–",
            ]
        )
    return rows


# --- dcp ----------------------------------------------------------------------------------------------------


def _targets(model, mesh, layout: str):
    from torch.distributed.tensor import Replicate, Shard

    from loader.placements import placements_matching, shard_module

    if layout == "shard1":
        pl = {"*_proj.weight": [Shard(1)], "*embed_tokens.weight": [Shard(1)], "*lm_head.weight": [Replicate()]}
    else:
        pl = {"*_proj.weight": [Shard(0), Replicate()], "*embed_tokens.weight": [Shard(0), Replicate()]}
        pl["*lm_head.weight"] = [Replicate(), Replicate()]
    return shard_module(model, mesh, placements_matching(model, pl))


def _locals(model) -> dict[str, torch.Tensor]:
    return {n: getattr(t, "_local_tensor", t) for n, t in model.state_dict().items()}


def _boxes(model) -> dict[str, tuple]:
    """Each tensor's box of the global index space this rank holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            out[name] = tuple((o, o + n) for o, n in zip(offset, shape))
        else:
            out[name] = tuple((0, n) for n in t.shape)
    return out


def page_bound(folder: str, boxes: dict[str, tuple]) -> int:
    """Bytes of the 4 KiB pages of ``folder``'s files that hold the elements of ``boxes`` (2-d and 1-d keys)."""
    from loader.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(folder)
    pages: dict[str, set[int]] = {}
    for key, box in boxes.items():
        info = checkpoint[key]
        size = info.dtype.itemsize
        for chunk in info.chunks:
            cbox = chunk.box
            lo = [max(a[0], b[0]) for a, b in zip(box, cbox)]
            hi = [min(a[1], b[1]) for a, b in zip(box, cbox)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            seen = pages.setdefault(chunk.location, set())
            if len(box) == 1:
                rows, cols, width, c0 = [(0, 1)], (lo[0] - cbox[0][0], hi[0] - cbox[0][0]), 0, 0
            else:
                width = cbox[1][1] - cbox[1][0]
                rows = [(r - cbox[0][0], r - cbox[0][0] + 1) for r in range(lo[0], hi[0])]
                c0 = lo[1] - cbox[1][0]
                cols = (c0, hi[1] - cbox[1][0])
            for r, _ in rows:
                start = chunk.offset + (r * width + cols[0]) * size
                end = chunk.offset + (r * width + cols[1]) * size
                seen.update(range(start // PAGE, (end - 1) // PAGE + 1))
    return PAGE * sum(len(s) for s in pages.values())


def rank_main(rank: int, world: int, spec: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.utils import logging as hf_logging

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    store = f"file://{spec['tmp']}/store"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    saved = os.path.join(spec["tmp"], "saved")
    torch.manual_seed(0)
    reference = _model().state_dict()
    dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in reference.items()}, checkpoint_id=saved)
    dist.barrier()
    own = os.path.join(spec["tmp"], f"r{rank}")
    shutil.copytree(saved, own)
    os.sync()  # the copies' dirty pages would otherwise stay cached through the drops
    files = [os.path.join(own, n) for n in os.listdir(own)]
    dist.barrier()
    result: dict = {}
    for layout in ("shard1", "shard0x2"):
        lmesh = mesh if layout == "shard1" else init_device_mesh("cpu", (2, 2))
        ours_m, theirs_m = _targets(_model(), lmesh, layout), _targets(_model(), lmesh, layout)
        shard = sum(t.nbytes for t in _locals(ours_m).values())
        row = {"shard": shard, "page_bound": page_bound(own, _boxes(ours_m))}
        for method, model in (("dcp.load", theirs_m), ("ours", ours_m)):
            drop_cache(files)
            dist.barrier()
            io, asked, t0 = read_bytes(), rchar(), time.perf_counter()
            if method == "ours":
                row["logical"] = load_hf_checkpoint(model, own, options=LoadOptions(progress=False)).bytes_read
            else:
                state = model.state_dict()
                dcp.load(state, checkpoint_id=own)
            wall = time.perf_counter() - t0
            row[method] = {"wall": wall, "physical": read_bytes() - io, "asked": rchar() - asked}
            dist.barrier()
        a, b = _locals(ours_m), _locals(theirs_m)
        row["equal"] = all(torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8)) for n in a)
        boxes = _boxes(ours_m)
        row["equal"] &= all(torch.equal(a[n], reference[n][tuple(slice(lo, hi) for lo, hi in boxes[n])]) for n in a)
        result[layout] = row
    with open(os.path.join(spec["tmp"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_dcp(rounds: int) -> list[list]:
    import mdtable
    import torch.multiprocessing as mp

    runs = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="formats_dcp_") as tmp:
            mp.start_processes(rank_main, args=(WORLD, {"tmp": tmp}), nprocs=WORLD, join=True, start_method="spawn")
            ranks = []
            for r in range(WORLD):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    ranks.append(json.load(f))
        runs.append(ranks)
    names = {"shard1": "`Shard(0)` x4 -> `Shard(1)` x4", "shard0x2": "`Shard(0)` x4 -> `Shard(0)` x2 (2x2 mesh)"}
    rows = []
    for layout, title in names.items():
        per = [rank[layout] for ranks in runs for rank in ranks]
        if not all(p["equal"] for p in per):
            raise SystemExit(f"{layout}: a local shard differs between dcp.load and ours, or from the saved values")
        bound = mdtable.spread([p["page_bound"] / p["shard"] for p in per], "{:.3f}", "")
        for method in ("dcp.load", "ours"):
            walls = [max(rank[layout][method]["wall"] for rank in ranks) for ranks in runs]
            ratio = [p[method]["physical"] / p["shard"] for p in per]
            asked = mdtable.spread([p[method]["asked"] / p["shard"] for p in per], "{:.3f}", "")
            planned = (
                mdtable.spread([p["logical"] / p["shard"] for p in per], "{:.3f}", "") if method == "ours" else "–"
            )
            mib = mdtable.median([p["shard"] for p in per]) / MIB
            rows.append([title, method, f"{mib:.1f} MiB", planned, asked, mdtable.spread(ratio, "{:.3f}", ""), bound,
                         mdtable.spread(walls)])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the .bin checkpoint's folder (generated there if absent; default: a temp one)")
    parser.add_argument("--part", default="bin,dcp", help="bin, dcp or both")
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes (worlds) per method")
    parser.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    parser.add_argument("--bin-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bin_worker:
        print(json.dumps(bin_worker(args.bin_worker, args.out)))
        return 0
    import mdtable

    parts = args.part.split(",")
    if "bin" in parts:
        watch = mdtable.LoadWatch()
        folder = args.out or tempfile.mkdtemp(prefix="formats_bin_")
        rows = run_bin(folder, args.rounds)
        headers = [
            "method (first load, fresh process, cold file)",
            "wall",
            "bytes asked (rchar)",
            "bytes read from disk",
            "wall / ours",
            "disk bytes / ours",
        ]
        mdtable.emit(args.markdown, watch.stop(), headers, rows, width=24)
        if not args.out:
            shutil.rmtree(folder)
    if "dcp" in parts:
        print()
        watch = mdtable.LoadWatch()
        rows = run_dcp(args.rounds)
        headers = ["resharding", "method", "shard / rank", "planned ÷ shard", "bytes asked (rchar) ÷ shard"]
        headers += ["bytes read from disk ÷ shard", "page bound ÷ shard", "wall (slowest rank)"]
        mdtable.emit(args.markdown, watch.stop(), headers, rows, width=18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
