"""What the bench scripts' ``--markdown`` output shares: the run line and the tables docs/benchmarks.md holds.

Each script prints, with ``--markdown``, one line naming the command, the commit, the machine, the versions
and the load average during the run, then its table(s): docs/benchmarks.md pastes them as printed, one run
per table.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LoadWatch:
    """Samples the 1-minute load average in a daemon thread from its creation to :meth:`stop`."""

    def __init__(self, every: float = 2.0) -> None:
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> str:
        """Stop sampling; return the range seen, e.g. ``"3.1–5.6"``."""
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        lo, hi = min(self.samples), max(self.samples)
        return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"


def machine() -> str:
    """e.g. ``2-CPU AMD EPYC, 23 GiB RAM``."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        memory = f", {kib / (1 << 20):.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    pinned = ""
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < (os.cpu_count() or 0):
        pinned = f", run on CPU {','.join(map(str, sorted(os.sched_getaffinity(0))))} only"
    return f"{os.cpu_count()}-CPU {model}{memory}{pinned}"


def versions(packages: Sequence[str] = ("torch", "transformers")) -> str:
    """e.g. ``torch 2.13.0+cpu, transformers 5.24.0, Python 3.11.7`` (installed versions, nothing imported)."""
    out = []
    for name in packages:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} not installed")
    return ", ".join([*out, f"Python {platform.python_version()}"])


def commit() -> str:
    """The checkout's commit, ``+ local changes`` when the tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no git checkout"
    return f"{head} + local changes" if dirty else head


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that ran this script, with the script's path relative to the repository."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else "?"
    return shlex.join(["python", script, *argv[1:]])


def run_line(load: str, packages: Sequence[str] = ("torch", "transformers"), argv: Sequence[str] | None = None) -> str:
    """The line above a script's tables: command, date, commit, machine, versions, load average."""
    today = datetime.date.today().isoformat()
    return (
        f"`{command(argv)}` — {today}, commit {commit()}; {machine()}; {versions(packages)}; "
        f"load average (1 min) {load} during the run."
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; cells are printed with ``str``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(
    markdown: bool,
    load: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    packages: Sequence[str] = ("torch", "transformers"),
    width: int = 16,
) -> None:
    """Print one table: with ``markdown`` the run line and the table docs/benchmarks.md holds, else plain columns
    ``width`` wide and the load average."""
    if markdown:
        print(run_line(load, packages))
        print()
        print(table(headers, rows))
        return
    for row in rows:
        print("  ".join(str(c).strip("`").ljust(width) for c in row))
    print(f"load average (1 min) during the run: {load}")


def spread(values: Sequence[float], fmt: str = "{:.3f}", unit: str = " s") -> str:
    """One value (or several that print the same), else ``best–worst [median]`` (of an even count, the lower
    middle one)."""
    values = sorted(values)
    if fmt.format(values[0]) == fmt.format(values[-1]):
        return fmt.format(values[0]) + unit
    median = values[(len(values) - 1) // 2]
    return f"{fmt.format(values[0])}–{fmt.format(values[-1])} [{fmt.format(median)}]{unit}"


def median(values: Sequence[float]) -> float:
    """The median (of an even count, the lower middle one, as :func:`spread` prints it)."""
    values = sorted(values)
    return values[(len(values) - 1) // 2]


def side_by_side(columns: Sequence[str], rows: Sequence[dict], ours: str, peers: Sequence[str]) -> str:
    """The side-by-side table: one row per method, then ``ours / fastest peer`` per column.

    Each row is a dict: ``method`` (its key), ``label``, ``threads`` (text), and either ``cells`` — one
    ``(value or None, text)`` per column, lower is better — or ``error``, why the method could not run here.
    The last row divides ours' value by the least value among ``peers`` in each column, naming that peer
    (bold where ours is at or below it).
    """
    body = []
    for row in rows:
        if row.get("error"):
            body.append(
                [row["label"], row.get("threads", "–"), f"could not run: {row['error']}"] + ["–"] * (len(columns) - 1)
            )
        else:
            body.append([row["label"], row.get("threads", ""), *(text for _, text in row["cells"])])
    by = {row["method"]: row for row in rows if not row.get("error")}
    ratios = []
    for i in range(len(columns)):
        mine = by[ours]["cells"][i][0] if ours in by else None
        theirs = [(by[p]["cells"][i][0], p) for p in peers if p in by and by[p]["cells"][i][0] is not None]
        if mine is None or not theirs:
            ratios.append("–")
            continue
        best, peer = min(theirs)
        ratio = mine / best if best else float("inf")
        ratios.append(f"**{ratio:.2f}x** ({peer})" if ratio <= 1 else f"{ratio:.2f}x ({peer})")
    body.append([f"{ours} / fastest peer", "", *ratios])
    return table(["method", "torch threads", *columns], body)
