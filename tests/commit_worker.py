"""A fork server for tests/test_save_atomic.py: imports torch and transformers once, then runs every save in a
forked child (a real process: killed with SIGKILL, its exit status read with ``waitpid``).

Reads JSON commands from stdin, one a line, answers one JSON line each:

- ``{"op": "start", "seed", "out", "shard", "control", "hook", "at", "swap"}``: fork a child that saves the
  llama model of ``seed`` (tests/hf_models.py) to ``out`` with ``max_shard_size=shard``; answers ``{"pid"}``.
  Every commit step the child reaches is appended to ``<control>/steps`` just before the step is taken; at step
  number ``at`` (or the step named ``at``) the hook ``"kill"`` sends the child SIGKILL, ``"error"`` raises an
  ``OSError`` (as if that step's rename failed), ``"stall"`` writes ``<control>/stalled`` and waits for
  ``<control>/go`` (at most 300 s). ``swap: false`` forces the two-rename fallback; ``timeout`` is the save's.
  The child exits 0 after a save, 3 after an error (its type and message in ``<control>/error``).
- ``{"op": "wait", "pid"}``: answers ``{"code"}``, the child's exit code (``-9``: killed by SIGKILL).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from hf_models import build

from loader import save_hf_checkpoint
from loader.options import SaveOptions
from loader.storage import local_commit as commit

MODELS: dict[int, torch.nn.Module] = {}


def hook_for(cmd: dict):
    control = cmd["control"]
    count = 0

    def hook(step: str) -> None:
        nonlocal count
        with open(os.path.join(control, "steps"), "a") as f:
            f.write(step + "\n")
        here = cmd["at"] == count if isinstance(cmd["at"], int) else step == cmd["at"]
        count += 1
        if not here:
            return
        if cmd["hook"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif cmd["hook"] == "error":
            raise OSError(errno.EIO, f"injected failure before commit step {step!r}")
        elif cmd["hook"] == "stall":
            open(os.path.join(control, "stalled"), "w").close()
            deadline = time.monotonic() + 300  # a failed test never says go: no process outlives it for long
            while not os.path.exists(os.path.join(control, "go")) and time.monotonic() < deadline:
                time.sleep(0.01)

    return hook


def child(cmd: dict) -> None:
    code = 0
    try:
        commit.STEP_HOOK = hook_for(cmd)
        commit.USE_SWAP = cmd.get("swap", True)
        save_hf_checkpoint(
            MODELS[cmd["seed"]],
            cmd["out"],
            options=SaveOptions(max_shard_size=cmd["shard"], progress=False, timeout=cmd.get("timeout")),
        )
    except BaseException as e:
        with open(os.path.join(cmd["control"], "error"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        code = 3
    os._exit(code)


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "start":
            if cmd["seed"] not in MODELS:
                MODELS[cmd["seed"]] = build("llama", cmd["seed"])[1]
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                child(cmd)
            answer = {"pid": pid}
        else:
            _, status = os.waitpid(cmd["pid"], 0)
            answer = {"code": os.waitstatus_to_exitcode(status)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
