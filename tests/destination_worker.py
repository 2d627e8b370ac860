"""A rank of tests/test_transfer_destination.py's world: ``python destination_worker.py ROLE RANK PORT INIT OUT``.

``trainer``: one of two gloo ranks holding an FSDP2 (``fully_shard``) two-layer MLP in float32; group 1: a full
push, a changed element per shard, a delta push (the full state saved after each); group 2: the same MLP with a
second layer of 5 outputs (refused); group 3: a push during which rank 1 dies (``os._exit`` in ``state_dict``).

``dest``: one of two gloo ranks holding a ``TensorDestination`` (rank 0 hosting the rendezvous at ``PORT``, its
address broadcast over the destination's own world): the first layer's weight ``Shard(1)`` and bias ``Replicate``
DTensors in bfloat16, the second's weight as hand-described rows (rank 0 row 0, rank 1 rows 1-3, bfloat16) and its
bias a plain float32 tensor; each group's outcome and the tensors' values after it saved.

Each saves ``{phase: ...}`` to ``OUT/ROLE{RANK}.pt`` after every phase.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from loader.errors import PeerFailure

TIMEOUT = 180.0  # arrival and collectives (long: a start on a busy machine); a dead peer fails the others at once
ROWS = {0: (0, 1), 1: (1, 4)}  # the destination's hand-described rows of "1.weight", per rank


def mlp(outputs: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Linear(10, outputs))


def outcome(e: BaseException) -> dict:
    return {"raised": type(e).__name__, "message": str(e)}


def trainer(rank: int, address: str, out: dict, save) -> None:
    from torch.distributed.fsdp import fully_shard

    from loader.vllm import EngineSync

    mesh = init_device_mesh("cpu", (2,))
    model = mlp()
    fully_shard(model, mesh=mesh)
    sync = EngineSync(address, model, timeout=TIMEOUT, rank=rank, trainers=2)
    out["reports"] = [sync.push()]
    out["full"] = [{k: v.full_tensor() for k, v in model.state_dict().items()}]
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().view(-1)[0] += 0.25  # one element of each local shard changes
    out["reports"].append(sync.push(delta=True))
    out["full"].append({k: v.full_tensor() for k, v in model.state_dict().items()})
    sync.close()
    save()
    bad = mlp(outputs=5)
    fully_shard(bad, mesh=mesh)
    try:
        EngineSync(address, bad, timeout=TIMEOUT, rank=rank, trainers=2)
        out["bad"] = {"raised": None}
    except ValueError as e:
        out["bad"] = outcome(e)
    save()
    sync = EngineSync(address, model, timeout=TIMEOUT, rank=rank, trainers=2)
    if rank == 1:
        model.state_dict = lambda *a, **k: os._exit(1)  # killed mid-push, after rank 0 announced it
    try:
        sync.push()
        out["dying"] = {"raised": None}
    except (PeerFailure, RuntimeError) as e:
        out["dying"] = outcome(e)


def dest(rank: int, port: int, out: dict, save) -> None:
    from loader.transfer import TensorDestination

    mesh = init_device_mesh("cpu", (2,))
    a, b = ROWS[rank]
    tensors = {
        "0.weight": distribute_tensor(torch.zeros(10, 6, dtype=torch.bfloat16), mesh, [Shard(1)]),
        "0.bias": distribute_tensor(torch.zeros(10, dtype=torch.bfloat16), mesh, [Replicate()]),
        "1.weight": (torch.zeros(b - a, 10, dtype=torch.bfloat16), (4, 10), (a, 0)),
        "1.bias": torch.zeros(4),
    }
    locals_ = {k: v.to_local() if hasattr(v, "to_local") else v[0] if isinstance(v, tuple) else v
               for k, v in tensors.items()}  # fmt: skip

    def values() -> dict:
        return {k: t.clone() for k, t in locals_.items()}

    destination = TensorDestination(tensors, trainers=2, port=port, timeout=TIMEOUT)
    out["address"] = destination.address
    destination.accept()
    out["versions"], out["reports"], out["values"] = [], [], []
    for _ in range(2):
        out["versions"].append(destination.receive())
        out["reports"].append(destination.report)
        out["values"].append(values())
    save()
    try:
        destination.accept()
        out["bad"] = {"raised": None}
    except ValueError as e:
        out["bad"] = outcome(e)
    out["after_bad"] = values()
    save()
    destination.accept()
    try:
        destination.receive()
        out["dying"] = {"raised": None}
    except (PeerFailure, RuntimeError) as e:
        out["dying"] = outcome(e)
    out["after_dying"], out["version_after_dying"] = values(), destination.version


def main() -> None:
    role, rank, port, init, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    out: dict = {}
    path = os.path.join(folder, f"{role}{rank}.pt")

    def save() -> None:
        torch.save(out, path + ".tmp")
        os.replace(path + ".tmp", path)

    if role == "trainer":
        trainer(rank, f"127.0.0.1:{port}", out, save)
    else:
        dest(rank, port, out, save)
    save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
