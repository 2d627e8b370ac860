"""Time and peak memory of reading one safetensors header with N entries (``loader.checkpoint.read_header``).

Writes a synthetic file (8-byte length + JSON header + data section) of N small F32 tensors named like a
large MoE model's (``layers.<i>.experts.<j>.w<k>``), in file order as ``save_file`` writes them, then
reads its header with ``read_header`` and reports:

- wall and CPU time, best of ``--repeats`` reads (the CPU figure is steadier on a shared machine);
- the peak Python heap during one read (tracemalloc), as a multiple of the header's size;
- the peak RSS growth of a fresh process that only imports the loader and reads the header once.

The data section is sparse (a hole), so the file costs no disk.

Run: ``python bench/header_bench.py --entries 1000000`` (``--help`` for options; several sizes:
``--entries 100000,1000000``; ``--markdown`` prints the table docs/benchmarks.md holds). 1 M entries make an
85 MiB header, near the format's 100 MB header limit.
"""

from __future__ import annotations

import argparse
import gc
import os
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from loader.checkpoint import read_header
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, ROOT)
    from loader.checkpoint import read_header


def write_file(path: str, entries: int, numel: int = 4) -> int:
    """Write a safetensors file of ``entries`` F32 tensors of ``numel`` elements; return the header size."""
    nbytes = numel * 4
    parts = []
    for i in range(entries):
        key = f"layers.{i // 3000}.experts.{(i // 3) % 1000}.w{i % 3}"
        begin = i * nbytes
        parts.append(f'"{key}":{{"dtype":"F32","shape":[{numel}],"data_offsets":[{begin},{begin + nbytes}]}}')
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + entries * nbytes)
    return len(raw)


_CHILD = """
import resource, sys
sys.path.insert(0, sys.argv[2])
from loader.checkpoint import read_header

def peak_kib():  # VmHWM: this process's peak RSS (ru_maxrss would count the parent's, across fork + exec)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

before = peak_kib()
read_header(sys.argv[1])
print(peak_kib() - before)
"""


def _peak_rss_growth_mib(path: str) -> float:
    """Peak RSS growth (MiB) of a fresh process reading the header once, over its peak after the imports."""
    out = subprocess.run([sys.executable, "-c", _CHILD, path, ROOT], capture_output=True, text=True, check=True)
    return int(out.stdout) / 1024


def measure(tmp: str, entries: int, repeats: int) -> dict:
    """One header of ``entries`` tensors: its size, best wall and CPU time, peak heap and fresh-process RSS."""
    path = os.path.join(tmp, f"bench-{entries}.safetensors")
    header_len = write_file(path, entries)
    walls, cpus = [], []
    for _ in range(repeats):
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        tensors, _ = read_header(path)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
        assert len(tensors) == entries
        del tensors
    gc.collect()
    tracemalloc.start()
    tensors, _ = read_header(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del tensors
    rss = _peak_rss_growth_mib(path)
    os.unlink(path)
    return {"entries": entries, "header": header_len, "wall": min(walls), "cpu": min(cpus), "heap": peak, "rss": rss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--entries", default="1000000", help="tensors in the header; several, comma-separated (default 1000000)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed reads; the best is reported")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch = mdtable.LoadWatch()
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(tmp, int(n.replace("_", "")), args.repeats) for n in args.entries.split(",")]
    load = watch.stop()
    if not args.markdown:
        for r in results:
            header_len, peak, rss = r["header"], r["heap"], r["rss"]
            print(f"entries {r['entries']:,}  header {header_len / mib:.1f} MiB")
            print(f"read_header: wall best {r['wall']:.2f} s, cpu best {r['cpu']:.2f} s over {args.repeats} reads")
            print(f"peak Python heap (tracemalloc): {peak / mib:.0f} MiB = {peak / header_len:.1f}x the header")
            print(f"peak RSS growth, fresh process: {rss:.0f} MiB = {rss * mib / header_len:.1f}x the header")
        print(f"load average (1 min) during the run: {load}")
        return
    print(mdtable.run_line(load, ("torch",)))
    print()
    rows = [
        [
            f"{r['entries']:,}".replace(",", " "),
            f"{r['header'] / mib:.1f} MiB",
            f"{r['wall']:.2f} s",
            f"{r['cpu']:.2f} s",
            f"{r['cpu'] / r['entries'] * 1e6:.1f} µs",
            f"{r['heap'] / mib:.0f} MiB = {r['heap'] / r['header']:.1f}x",
            f"{r['rss']:.0f} MiB = {r['rss'] * mib / r['header']:.1f}x",
        ]
        for r in results
    ]
    print(
        mdtable.table(
            [
                "entries",
                "header",
                f"`read_header` wall (best of {args.repeats})",
                "CPU (best)",
                "CPU per entry",
                "peak Python heap (× header)",
                "peak RSS growth, fresh process (× header)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
