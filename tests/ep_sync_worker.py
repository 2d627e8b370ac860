"""A rank of tests/test_sync_ep_trainers.py's world: ``python ep_sync_worker.py ROLE RANK PORT INIT OUT``.

``trainer``: one of two gloo ranks holding a tiny transformers Qwen3-MoE (float32) whose experts' 3-D
``gate_up_proj`` and ``down_proj`` are ``Shard(0)`` DTensors of a 2-rank mesh (expert parallel: rank r holds
experts 2r and 2r+1), every other tensor plain (replicated); a full push, then an in-place change (layer 0's
``gate_up_proj`` of expert 3 doubled, on rank 1; layer 1's ``down_proj`` of expert 0 halved, on rank 0; the final
norm's weight shifted, on both), then a delta push. Saved: the reports, the full state (``full_tensor()``) after
each push, and this rank's pieces per destination rank (what it sends: want key, global box).

``dest``: one of two gloo ranks holding a ``TensorDestination`` (rank 0 hosting the rendezvous at ``PORT``): the
experts' ``gate_up_proj`` ``Shard(1)`` and ``down_proj`` ``Replicate`` DTensors of its own mesh, every other
tensor a plain one, all bfloat16; the versions, reports and local values after each push saved.

Each saves ``{phase: ...}`` to ``OUT/ROLE{RANK}.pt`` at its end.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

TIMEOUT = 180.0  # arrival and collectives (long: a start on a busy machine)
EXPERTS = ("gate_up_proj", "down_proj")


def qwen3_moe() -> nn.Module:
    """The tiny Qwen3-MoE both sides describe: hidden 64, 2 layers, 4 experts (each a ``[4, ...]`` slice), vocab 128."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, vocab_size=128,
        max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def shapes() -> dict[str, tuple[int, ...]]:
    """:func:`qwen3_moe`'s state-dict shapes, by key (the destination's, without importing transformers)."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (128, 64)}
    for i in range(2):
        at = f"model.layers.{i}."
        out |= {
            at + "self_attn.q_proj.weight": (64, 64), at + "self_attn.k_proj.weight": (32, 64),
            at + "self_attn.v_proj.weight": (32, 64), at + "self_attn.o_proj.weight": (64, 64),
            at + "self_attn.q_norm.weight": (16,), at + "self_attn.k_norm.weight": (16,),
            at + "mlp.experts.gate_up_proj": (4, 64, 64), at + "mlp.experts.down_proj": (4, 64, 32),
            at + "mlp.gate.weight": (4, 64), at + "input_layernorm.weight": (64,),
            at + "post_attention_layernorm.weight": (64,),
        }  # fmt: skip
    return out | {"model.norm.weight": (64,), "lm_head.weight": (128, 64)}


def full_state(model: nn.Module) -> dict:
    """The trainer's full tensors (a DTensor gathered with ``full_tensor()``)."""
    state = model.state_dict()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone() for k, v in state.items()}


def trainer(rank: int, address: str, out: dict) -> None:
    from loader.vllm import EngineSync

    mesh = init_device_mesh("cpu", (2,))
    model = qwen3_moe()
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes()  # what the destination holds
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in EXPERTS:
            setattr(experts, name, nn.Parameter(distribute_tensor(getattr(experts, name).data, mesh, [Shard(0)])))
    dtensors = {k: v for k, v in model.state_dict().items() if hasattr(v, "placements")}
    out["held"] = {k: (repr(v.placements), tuple(v.to_local().shape)) for k, v in dtensors.items()}
    sync = EngineSync(address, model, timeout=TIMEOUT, rank=rank, trainers=2)
    out["pieces"] = [[(sync.wants[w][p.want].key, p.box, p.sender) for p in mine] for w, mine in enumerate(sync.mine)]
    out["reports"] = [sync.push()]
    out["full"] = [full_state(model)]
    with torch.no_grad():
        layers = model.model.layers
        if rank == 1:
            layers[0].mlp.experts.gate_up_proj.to_local()[1].mul_(2.0)  # global expert 3
        else:
            layers[1].mlp.experts.down_proj.to_local()[0].mul_(0.5)  # global expert 0
        model.model.norm.weight.add_(0.125)  # replicated: the same change on both ranks
    out["reports"].append(sync.push(delta=True))
    out["full"].append(full_state(model))
    sync.close()


def dest(rank: int, port: int, out: dict) -> None:
    from loader.transfer import TensorDestination

    mesh = init_device_mesh("cpu", (2,))
    tensors, locals_ = {}, {}
    for key, shape in shapes().items():
        zeros = torch.zeros(shape, dtype=torch.bfloat16)
        if key.endswith(".gate_up_proj"):
            tensors[key] = distribute_tensor(zeros, mesh, [Shard(1)])
        elif key.endswith(".down_proj"):
            tensors[key] = distribute_tensor(zeros, mesh, [Replicate()])
        else:
            tensors[key] = zeros
        locals_[key] = tensors[key].to_local() if hasattr(tensors[key], "to_local") else tensors[key]
    destination = TensorDestination(tensors, trainers=2, port=port, timeout=TIMEOUT)
    destination.accept()
    out["versions"], out["reports"], out["values"] = [], [], []
    for _ in range(2):
        out["versions"].append(destination.receive())
        out["reports"].append(destination.report)
        out["values"].append({k: t.clone() for k, t in locals_.items()})


def main() -> None:
    role, rank, port, init, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    out: dict = {}
    if role == "trainer":
        trainer(rank, f"127.0.0.1:{port}", out)
    else:
        dest(rank, port, out)
    path = os.path.join(folder, f"{role}{rank}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
