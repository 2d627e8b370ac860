"""The engine's second trainer group: ``torchrun --nproc-per-node 2 vllm_sync_tp_trainer.py CTX_JSON``; each rank
writes ``work/tp-trainer{rank}.json``.

Runs docs/vllm.md's tensor-parallel trainer script (``CTX.tp_trainer``, its functions): builds the model (its
projections DTensors), waits until the first (FSDP2) group is over (both its ranks wrote their results), prepares
the sync at the same address and trains and pushes ``steps`` steps; after each push rank 0 saves the model's full
state dict to ``work/step-V`` (the engine's oracle). Each rank records the version the engine served at prepare,
its DTensors' placements and local bytes, and per push the bytes it put on the wire for each worker (counted at
the wire, packet by packet).
"""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import asdict
from pathlib import Path

from vllm_sync_trainer import read_when_there, save_full

#: bytes per element in the engine's dtype (bf16), what a push sends of each trainer element
ENGINE_ITEMSIZE = 2


def count_wire(sync, pushes: list) -> None:
    """Each push's packets of this rank: their bytes per worker appended to ``pushes`` as they go on the wire."""
    real = sync.wire.exchange

    def exchange(sends, recvs):
        sent = [0] * len(sync.wants)
        for tensor, member in sends:  # members T.. are the workers
            sent[member - sync.trainers] += tensor.numel() * tensor.element_size()
        pushes.append(sent)
        real(sends, recvs)

    sync.wire.exchange = exchange


def main(ctx: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from loader.vllm import EngineSync

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, work = dist.get_rank(), Path(ctx["work"])
    docs = runpy.run_path(ctx["tp_trainer"], run_name="docs_sync_tp_trainer")
    model = docs["build"](ctx["model"])
    address = read_when_there(Path(ctx["address"]), ctx["limit"])
    for r in (0, 1):  # the first group is over: the next arrival at the address is this group's
        read_when_there(work / f"trainer{r}.json", ctx["limit"])
    sync = EngineSync(address, model, timeout=ctx["timeout"])
    state = model.state_dict()
    dtensors = {k: t for k, t in state.items() if isinstance(t, DTensor)}
    out: dict = {
        "prepared_version": sync.version,
        "placements": {k: [repr(p) for p in t.placements] for k, t in dtensors.items()},
        "plain": sorted(k for k in state if k not in dtensors),
        "local_shard_bytes": sum(t.to_local().numel() for t in dtensors.values()) * ENGINE_ITEMSIZE,
        "reports": [],
        "wire": [],
    }
    count_wire(sync, out["wire"])

    def after(report) -> None:
        save_full(model, work / f"step-{report.version}", rank)
        out["reports"].append({**asdict(report), "ratios": report.ratios})

    docs["train"](model, sync, ctx["steps"], after)
    sync.close()
    (work / f"tp-trainer{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
