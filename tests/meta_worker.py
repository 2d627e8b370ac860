"""One rank of the 4-rank gloo world of tests/test_meta_distributed.py: DTensor-sharded models on the meta device.

``python meta_worker.py RANK WORLD CTX_JSON``. Each scenario builds a tiny transformers model under
``torch.device("meta")``, shards it with DTensors whose local shards stay on meta (``shard_module(...,
device="meta")``), loads it with ``load_hf_checkpoint(..., device="cpu")`` and returns plain data about what
was allocated and loaded; the test process asserts on it. The last scenario kills rank 2, so the world ends
with it (tests/gloo_world.py).
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from gloo_world import run_scenarios
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from loader.placements import plan_placements, shard_module
from loader.plan.slots import storage_of

DYING = 2


def sharded_meta_model(family: str, mesh_shape: tuple[int, ...], placements_of=None, **overrides):
    """``(model, mesh, placements)``: a ``family`` model built on meta, its sharded tensors meta DTensors."""
    from hf_models import FAMILIES, config_of

    auto = FAMILIES[family][0]
    with torch.device("meta"):
        model = auto.from_config(config_of(family, **overrides)).eval()
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = placements_of(model, mesh_shape) if placements_of else plan_placements(model, mesh_shape)[0]
    shard_module(model, mesh, placements, device="meta")
    return model, mesh, placements


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones included) by name, tied aliases included."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def scenario_load(ctx: dict, family: str, mesh_shape: tuple[int, ...], placements_of=None, **overrides) -> dict:
    """Load a sharded meta model; report what each tensor allocated and whether its values are right."""
    from loader import load_hf_checkpoint

    model, mesh, placements = sharded_meta_model(family, mesh_shape, placements_of, **overrides)
    before = _tensors(model)
    dtensors = {n: t for n, t in before.items() if isinstance(t.data, DTensor)}
    layout = {n: (tuple(t.shape), tuple(t.placements), t.device_mesh) for n, t in dtensors.items()}
    on_meta = sorted(n for n, t in before.items() if storage_of(t).device.type == "meta")
    tied = family == "llama" and model.lm_head.weight is model.model.embed_tokens.weight

    report = load_hf_checkpoint(model, ctx[f"{family}_path"], device="cpu", progress=False)

    after = _tensors(model)
    ref = torch.load(ctx[f"{family}_ref"])
    expected = {**ref["state"], **ref["buffers"]}
    still_meta = sorted(n for n, t in after.items() if storage_of(t).device.type != "cpu")
    not_dtensor = sorted(n for n in dtensors if not isinstance(after[n].data, DTensor))
    bad_layout, bad_alloc, bad_local, bad_full = [], [], [], []
    local_bytes = global_bytes = 0
    seen: set[int] = set()
    for name in sorted(after):
        t = after[name]
        data = t.data
        if name in dtensors and isinstance(data, DTensor):
            shape, pl, old_mesh = layout[name]
            if (tuple(data.shape), tuple(data.placements)) != (shape, pl) or data.device_mesh is not old_mesh:
                bad_layout.append(name)
            local = data._local_tensor
            want_shape, _ = compute_local_shape_and_global_offset(shape, mesh, list(pl))
            want = _nbytes(want_shape, local.dtype)
            if (
                tuple(local.shape) != tuple(want_shape)
                or local.untyped_storage().nbytes() != want
                or local.storage_offset() != 0
                or not local.is_contiguous()
            ):
                bad_alloc.append((name, tuple(local.shape), local.untyped_storage().nbytes(), tuple(want_shape), want))
            if local.untyped_storage().data_ptr() not in seen:  # a tied tensor's storage once
                seen.add(local.untyped_storage().data_ptr())
                local_bytes += local.untyped_storage().nbytes()
                global_bytes += _nbytes(shape, local.dtype)
            # DTensor's own sharding of the reference gives this rank's shard (collective: every rank calls it)
            if not any(isinstance(p, _StridedShard) for p in pl):
                mine = distribute_tensor(expected[name].to(local.dtype), mesh, list(pl)).to_local()
                if not torch.equal(local, mine):
                    bad_local.append(name)
            full = data.full_tensor()  # collective
        else:
            full = data
        if name not in expected:
            bad_full.append((name, "not in the reference"))
        elif full.dtype != expected[name].dtype or not torch.equal(full, expected[name]):
            bad_full.append((name, "values differ"))
    missing_from_model = sorted(set(expected) - set(after))

    sd = model.state_dict(keep_vars=True)
    # the bytes of each distinct local tensor (by storage: tied names share one) the load filled, in checkpoint dtype
    distinct: dict[int, int] = {}
    for name in report.loaded_keys:
        local = storage_of(sd[name])
        distinct[local.untyped_storage().data_ptr()] = local.numel() * ctx[f"{family}_itemsize"]
    bytes_total = [None] * dist.get_world_size()
    dist.all_gather_object(bytes_total, report.bytes_read)
    return {
        "on_meta_before": on_meta,
        "n_tensors": len(after),
        "n_dtensors": len(dtensors),
        "n_placements": len(placements),
        "strided": sorted(n for n, (_, pl, _) in layout.items() if any(isinstance(p, _StridedShard) for p in pl)),
        "still_meta": still_meta,
        "not_dtensor": not_dtensor,
        "bad_layout": bad_layout,
        "bad_alloc": bad_alloc,
        "bad_local": bad_local,
        "bad_full": bad_full,
        "missing_from_model": missing_from_model,
        "local_bytes": local_bytes,
        "global_bytes": global_bytes,
        "tied_before": tied,
        "tied_after": family == "llama" and model.lm_head.weight is model.model.embed_tokens.weight,
        "tied_is_param": isinstance(model.get_output_embeddings().weight, nn.Parameter),
        "buffers": sorted(n for n, _ in model.named_buffers()),
        "missing_keys": report.missing_keys,
        "bytes_read": report.bytes_read,
        "shard_bytes": sum(distinct.values()),
        "bytes_all_ranks": bytes_total,
        "rank": report.rank,
        "world_size": report.world_size,
    }


def moe_placements(model: nn.Module, mesh_shape: tuple[int, ...]):
    """The sharding tests/test_distributed.py loads a qwen3_moe model with (attention, experts, embeddings)."""
    import dist_worker

    return dist_worker.moe_placements(model, mesh_shape)


def _describe(e: BaseException) -> dict:
    return {
        "type": type(e).__name__,
        "message": str(e),
        "stage": getattr(e, "stage", None),
        "ranks": getattr(e, "ranks", None),
        "reason": getattr(e, "reason", None),
    }


def scenario_without_device(ctx: dict) -> dict:
    """A sharded meta model loaded without ``device=``: every rank refuses it, and nothing is allocated."""
    from loader import load_hf_checkpoint

    model, _, _ = sharded_meta_model("llama", (4,), vocab_size=70)
    try:
        load_hf_checkpoint(model, ctx["llama_path"], progress=False)
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    left = sorted(n for n, t in _tensors(model).items() if storage_of(t).device.type != "meta")
    return {**outcome, "materialised": left}


def scenario_killed_planning(ctx: dict) -> dict:
    """A sharded meta llama loaded with ``device="cpu"``; rank 2 is SIGKILLed while planning (after its tensors
    were materialised): the others raise PeerFailure (died). Last: the world ends with it."""
    from loader import HFLoadPlanner, load_hf_checkpoint

    rank = dist.get_rank()
    model, _, _ = sharded_meta_model("llama", (4,), vocab_size=70)

    class DyingPlanner(HFLoadPlanner):
        def map_checkpoint_key(self, key: str) -> str | None:
            if rank == DYING:
                os.kill(os.getpid(), signal.SIGKILL)
            return key

    try:
        load_hf_checkpoint(
            model, ctx["llama_path"], planner=DyingPlanner(model), device="cpu", progress=False, timeout=6
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    left = sorted(n for n, t in _tensors(model).items() if storage_of(t).device.type != "cpu")
    return {**outcome, "still_meta": left}


SCENARIOS = [
    ("llama_tp4", lambda ctx: scenario_load(ctx, "llama", (4,), vocab_size=70)),
    ("llama_2x2", lambda ctx: scenario_load(ctx, "llama", (2, 2), vocab_size=70)),
    ("moe_tp4", lambda ctx: scenario_load(ctx, "qwen3_moe", (4,), moe_placements)),
    ("moe_2x2", lambda ctx: scenario_load(ctx, "qwen3_moe", (2, 2))),
    ("without_device", scenario_without_device),
    ("killed_planning", scenario_killed_planning),  # last: rank 2 dies
]


def run_rank(rank: int, world: int, ctx: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{ctx['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    run_scenarios(SCENARIOS, ctx, rank)


if __name__ == "__main__":  # run by tests/test_meta_distributed.py: meta_worker.py RANK WORLD CTX_JSON
    import json
    import sys

    run_rank(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the world lost a rank: skip process-group teardown
