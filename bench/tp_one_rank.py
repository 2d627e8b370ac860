"""One tensor-parallel rank's warm load alone: where its time goes, without peers or contention.

    python bench/tp_one_rank.py [--out DIR] [--methods ours,dcp_hf,vllm,floor] [--rank 0] [--loads 30]
                                [--layout tp|ep] [--markdown]

bench/tp_bench.py runs four ranks on this machine's two CPUs, so its warm walls move with the scheduler by
10-30 % from run to run. This script loads rank ``--rank``'s shards of the same checkpoint (``DIR/r0``, made by
tp_bench.py) in one process under torch's fake process group (the rank plays its part of a world of 4 with no
peers: no collective, no wait), ``--loads`` times per method, and reports per load the wall (best and median)
and the CPU time in user space and in the kernel.

Each method is measured twice, on two states of the page cache:

- ``own``: the files dropped from the cache, then one load by the method itself (its cold read fills the cache its
  way: ours reads exactly the pages its shards need, which the kernel caches in 4 KiB folios; the memory-mapping
  peers' readahead leaves large folios), then the warm loads: what tp_bench.py's warm column measures;
- ``whole``: the files dropped, then read whole and in order (large folios, as a download or ``cat`` leaves them),
  then the warm loads: every method copying out of the same folios.

bench/folio_probe.py shows why the two differ: how each way of reading sizes the folios, and how fast a read
copies out of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import tp_bench
from common import drop_cache

METHODS = ("ours", "dcp_hf", "vllm", "floor")


def measure(model, out: str, method: str, fill: str, loads: int) -> dict:
    """``loads`` warm loads of ``method`` after the page cache was filled by ``fill`` (``own`` or ``whole``)."""
    load = tp_bench.LOADERS[method]
    files = tp_bench.checkpoint_files(out)
    drop_cache(files)
    if fill == "whole":
        tp_bench._read_whole(files)
        load(model, out)  # imports and plans, on the cache as filled
    else:
        load(model, out)  # the method's own cold read fills the cache
    walls, user, system = [], 0.0, 0.0
    for _ in range(loads):
        before, t = os.times(), time.perf_counter()
        load(model, out)
        walls.append(time.perf_counter() - t)
        after = os.times()
        user, system = user + after.user - before.user, system + after.system - before.system
    return {
        "method": method,
        "fill": fill,
        "best": min(walls),
        "median": statistics.median(walls),
        "user": user / loads,
        "system": system / loads,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="bench/tp_bench.py's checkpoint folder (its r0/ copy is read)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rank", type=int, default=0, help="the rank of the world of 4 whose shards are loaded")
    parser.add_argument("--loads", type=int, default=30, help="warm loads per method and fill (default 30)")
    parser.add_argument("--layout", choices=("tp", "ep"), default="tp")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    tp_bench.generate(args.out)
    out = os.path.join(args.out, "r0")
    dist.init_process_group("fake", rank=args.rank, world_size=tp_bench.WORLD, store=FakeStore())
    mesh = init_device_mesh("cpu", (tp_bench.WORLD,))
    model = tp_bench.build_sharded_model(os.path.join(out, "hf"), mesh, False, args.layout)
    tp_bench._FLOOR.update(tp_bench.needed_ranges(model, os.path.join(out, "hf")))
    watch = mdtable.LoadWatch()
    rows = [
        measure(model, out, method, fill, args.loads) for fill in ("own", "whole") for method in args.methods.split(",")
    ]
    load = watch.stop()
    dist.destroy_process_group()
    filled = {"own": "its own first load", "whole": "a whole-file read"}
    headers = ["method", "page cache filled by", "wall, best / median", "user CPU", "kernel CPU"]
    table = [
        [
            f"`{r['method']}`",
            filled[r["fill"]],
            f"{r['best'] * 1e3:.1f} / {r['median'] * 1e3:.1f} ms",
            f"{r['user'] * 1e3:.1f} ms",
            f"{r['system'] * 1e3:.1f} ms",
        ]
        for r in rows
    ]
    mdtable.emit(args.markdown, load, headers, table, width=22)
    return 0


if __name__ == "__main__":
    sys.exit(main())
