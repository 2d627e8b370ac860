"""Benchmark: the cost of the checksums of exchanged reads (``zlib.crc32`` of what one rank sends another of a file,
computed by the sender, checked by the receiver: loader/execute/exchange.py).

    python bench/exchange_checksum_bench.py [--mib N] [--repeats N] [--markdown]

Four gloo ranks (spawned, one torch thread each) exchange a column-sharded tensor of ``--mib`` MiB (rows of 8 KiB,
each rank wanting a quarter of every row: a TP ``o_proj``), as a load's round does: the plan of
:func:`~loader.execute.exchange_plan.plan_files`, each rank's chunk filled with random bytes, then
:func:`~loader.execute.exchange.exchange` (placing the pieces, the checksums, one ``all_to_all_single``,
checking what came in). Reported per rank, the median of ``--repeats``: the exchange's wall, and the time
``zlib.crc32`` takes over the bytes that exchange hashes (what it sent, and what it received), measured on its own in
the same process: the share of the exchange the checksums cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
ROW = 8 << 10


def rank_main(rank: int, world: int, spec: dict) -> None:
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist

    from loader.distributed.collectives import Collectives
    from loader.execute.exchange import exchange
    from loader.execute.exchange_plan import as_ranges, plan_files

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    peers = Collectives(timeout=600)
    rows, part = spec["mib"] * (1 << 20) // ROW, ROW // world
    wants = [
        {"f": as_ranges([(r * ROW + k * part, r * ROW + (k + 1) * part) for r in range(rows)])} for k in range(world)
    ]
    plans = plan_files(wants)
    mine = plans["f"].shares.of(rank)
    fetched = {"f": np.random.default_rng(rank).integers(0, 256, int((mine[:, 1] - mine[:, 0]).sum()), np.uint8)}
    walls, crcs = [], []
    for _ in range(spec["repeats"] + 1):  # the first: unmeasured
        dist.barrier()
        start = time.perf_counter()
        held, received = exchange(plans, ["f"], fetched, peers)
        walls.append(time.perf_counter() - start)
        sent = int(
            sum((r[:, 1] - r[:, 0]).sum() for j in range(world) if j != rank for r in [plans["f"].sends(rank, j)])
        )
        buffers = [np.zeros(sent, np.uint8), np.zeros(received, np.uint8)]
        start = time.perf_counter()
        for b in buffers:
            zlib.crc32(memoryview(b))
        crcs.append(time.perf_counter() - start)
        del held
    out = {"rank": rank, "wall": sorted(walls[1:])[len(walls[1:]) // 2], "crc": sorted(crcs[1:])[len(crcs[1:]) // 2]}
    out |= {"sent": sent, "received": received}
    with open(os.path.join(spec["results"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the tensor's MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="measured exchanges (default 5)")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    import mdtable
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        spec = {"store": os.path.join(tmp, "store"), "results": tmp, "mib": args.mib, "repeats": args.repeats}
        watch = mdtable.LoadWatch()
        mp.spawn(rank_main, args=(WORLD, spec), nprocs=WORLD, join=True)
        load = watch.stop()
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
    rows = [
        [
            r["rank"],
            f"{r['sent'] / 2**20:.1f} / {r['received'] / 2**20:.1f}",
            f"{r['wall'] * 1e3:.1f} ms",
            f"{r['crc'] * 1e3:.1f} ms",
            f"{(r['sent'] + r['received']) / r['crc'] / 1e9:.2f} GB/s",
            f"{100 * r['crc'] / r['wall']:.1f}%",
        ]
        for r in ranks
    ]
    headers = ["rank", "MiB sent / received", "exchange (median)", "crc32 of both", "crc32 rate", "crc32 ÷ exchange"]
    mdtable.emit(args.markdown, load, headers, rows, packages=("torch",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
