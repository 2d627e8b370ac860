"""One weight-sync world of subprocesses: destination ranks 0 and 1 and trainer ranks 0 and 1, each pair in a
gloo world of its own, meeting at a rendezvous port; each rank saves what it saw as ``{role}{rank}.pt``.

Shared by tests/test_transfer_destination.py and tests/test_sync_ep_trainers.py, whose workers take
``ROLE RANK PORT INIT_METHOD FOLDER``.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent
ROLES = (("dest", 0), ("dest", 1), ("trainer", 0), ("trainer", 1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sync_world(worker: str, folder: Path, *, limit: float, codes: Sequence[int], why: str = "") -> dict:
    """Run ``worker`` as the four ranks (at most ``limit`` seconds in all), assert their exit ``codes``, and
    return every rank's saved phases by ``"dest0"``, ``"dest1"``, ``"trainer0"``, ``"trainer1"``."""
    port, trainer_init, dest_init = free_port(), free_port(), free_port()
    argv = []
    for role, rank in ROLES:
        init = f"tcp://127.0.0.1:{trainer_init if role == 'trainer' else dest_init}"
        argv.append([sys.executable, worker, role, str(rank), str(port), init, str(folder)])
    logs = [folder / f"{role}{rank}.log" for role, rank in ROLES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    got = run_ranks(argv, logs, cwd=REPO, env=env, limit=limit)
    said = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert got == list(codes), f"exit codes {got}{why}\n{said}"
    return {f"{role}{rank}": torch.load(folder / f"{role}{rank}.pt", weights_only=False) for role, rank in ROLES}
