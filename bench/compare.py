"""Run one bench against an older tree and this one, in one invocation, and print both outputs.

    python bench/compare.py --base OLD_TREE [--rounds 2] SCRIPT [ARGS ...]

``OLD_TREE`` is a checkout of the older commit (``git worktree add /tmp/old COMMIT``); ``SCRIPT`` is a bench
script's name (``load_bench.py``) and ``ARGS`` its own arguments (``--markdown`` for the tables
docs/benchmarks.md holds). Each tree runs its own copy of the script (so a bench whose calls changed with the
API still runs against the code it was written for), from the tree's root, with ``PYTHONPATH`` at the tree:
the import line printed before each run names the ``loader`` and ``regiontrace`` it uses. Runs alternate
base, this tree, this tree, base, ... (``--rounds`` runs of each), so that a machine whose load drifts during
the comparison moves both sides alike. Exit status: the first non-zero status of a run, else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHICH = "import loader, regiontrace; print(loader.__file__, regiontrace.__file__)"


def commit_of(tree: str) -> str:
    """The short commit of ``tree``, with ``+ local changes`` when its tracked files differ from it."""
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return (head.stdout.strip() or "?") + (" + local changes" if dirty.stdout.strip() else "")


def tree_env(tree: str) -> dict[str, str]:
    """The environment of a run in ``tree``: its root first on ``PYTHONPATH``."""
    rest = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=tree + (os.pathsep + rest if rest else ""))


def run_in(tree: str, label: str, script: str, args: list[str]) -> int:
    """Run ``tree``'s ``bench/<script>`` with ``args`` and print its output under a heading; its exit status."""
    env = tree_env(tree)
    which = subprocess.run([sys.executable, "-c", WHICH], cwd=tree, env=env, capture_output=True, text=True)
    print(f"### {label}: {commit_of(tree)} ({tree})\n", flush=True)
    print(f"imports: {which.stdout.strip() or which.stderr.strip()}\n", flush=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(tree, "bench", script), *args], cwd=tree, env=env)
    print(f"\n({label}: exit status {done.returncode}, {time.monotonic() - start:.0f} s)\n", flush=True)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a checkout of the older commit")
    parser.add_argument("--head", default=ROOT, help="the newer tree (default: this one)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree, alternating (default 1)")
    parser.add_argument("script", help="a bench script of bench/, e.g. load_bench.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    opts = parser.parse_args()
    trees = [("base", os.path.abspath(opts.base)), ("head", os.path.abspath(opts.head))]
    status = 0
    for i in range(opts.rounds):
        for label, tree in trees if i % 2 == 0 else trees[::-1]:
            rc = run_in(tree, label, opts.script, opts.args)
            status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
