"""The trainers' end of a torchrun weight sync: ``torchrun --nproc-per-node 2 vllm_sync_trainer.py CTX_JSON``;
each rank writes ``work/trainer{rank}.json``.

Runs docs/vllm.md's trainer script (``CTX.trainer``, its functions): builds the FSDP2 model, prepares the sync at
the address the engine wrote (``CTX.address``), trains and pushes ``steps`` steps; after each push rank 0 saves the
model's full state dict to ``work/step-V`` (the engine's oracle). Then every weight changes and one more (full)
push starts, in which rank 1 sends worker 0 its packet and hangs before worker 1's: rank 0 records the
failure; rank 0 exits and rank 1 resumes once the engine has written its failure too (every member timed out on
the hung rank, none on another's leaving).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from dataclasses import asdict
from pathlib import Path


def read_when_there(path: Path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.2)
    return path.read_text()


def save_full(model, folder: Path, rank: int) -> None:
    """The model's full state dict, saved by rank 0 as safetensors (every rank takes part)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
        (folder / "done").write_text("1")


def hang_mid_push(sync, release: list[Path], seconds: float) -> None:
    """Rank 1's next exchange sends its first packet (worker 0's), then waits for every file of ``release``."""
    real = sync.wire.exchange

    def exchange(sends, recvs):
        real(sends[:1], recvs)
        for path in release:
            read_when_there(path, seconds)
        raise SystemExit(0)

    sync.wire.exchange = exchange


def main(ctx: dict) -> None:
    import torch
    import torch.distributed as dist

    from loader.errors import PeerFailure
    from loader.vllm import EngineSync

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, work = dist.get_rank(), Path(ctx["work"])
    docs = runpy.run_path(ctx["trainer"], run_name="docs_sync_trainer")
    model = docs["build"](ctx["model"])
    address = read_when_there(Path(ctx["address"]), ctx["limit"])
    began = time.perf_counter()
    sync = EngineSync(address, model, timeout=ctx["timeout"])
    out: dict = {"prepare_seconds": time.perf_counter() - began, "reports": []}

    def after(report) -> None:
        save_full(model, work / f"step-{report.version}", rank)
        out["reports"].append({**asdict(report), "ratios": report.ratios})

    docs["train"](model, sync, ctx["steps"], after)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)  # weights that would change the tokens, had the push landed
    released = [work / "trainer0.json", work / "engine-failure.json"]  # both timed out: then it leaves
    if rank == 1:
        hang_mid_push(sync, released, 4 * ctx["timeout"])
    began = time.perf_counter()
    try:
        sync.push()
    except PeerFailure as e:
        out["failure"] = {"type": type(e).__name__, "message": str(e), "reason": e.reason}
        out["failure"]["seconds"] = time.perf_counter() - began
    except SystemExit:
        out["hung"] = True
    (work / f"trainer{rank}.json").write_text(json.dumps(out))
    if rank == 0:  # its end of the broken group stays open until the engine has timed out on the hung rank too
        read_when_there(work / "engine-failure.json", 4 * ctx["timeout"])
    sys.stdout.flush()
    os._exit(0)  # the sync's group is broken: no destructor waits on it


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
