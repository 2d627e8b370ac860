"""One rank of the shared gloo world used by tests/test_distributed.py: runs every scenario, saves results.

Each scenario returns plain data (no tensors cross processes except via the results file). The test
process writes the checkpoints and references first, then starts one subprocess per rank
(``python dist_worker.py RANK WORLD CTX_JSON``); every rank runs all scenarios in the same order, the fault
scenarios (a rank that hangs, a rank that is killed) last.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from gloo_world import worker_main
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loader.hooks import PlanHooks
from loader.options import LoadOptions, Rules
from loader.placements import Placements, placements_matching, shard_module


def layout_placements(mesh_shape: tuple[int, ...]) -> dict[str, list]:
    """Every layout of ``dist_models.Layout`` the loader must handle, on a 1-D or 2-D mesh."""
    if len(mesh_shape) == 1:
        return {
            "qkv.weight": [Shard(0)],
            "o_proj.weight": [Shard(1)],
            "gate_up": [Shard(0)],
            "gate_up_strided": [_StridedShard(1, split_factor=2)],
            "down": [Shard(2)],
            "uneven": [Shard(0)],
            "scaled": [Shard(0)],
        }
    return {
        "qkv.weight": [Shard(0), Shard(0)],
        "o_proj.weight": [Replicate(), Shard(1)],
        "gate_up": [Shard(0), Shard(1)],
        "gate_up_strided": [_StridedShard(1, split_factor=2), Shard(1)],
        "down": [Shard(0), Shard(2)],
        "uneven": [Shard(0), Shard(0)],
        "scaled": [Replicate(), Shard(0)],
    }


def moe_placements(model: nn.Module, mesh_shape: tuple[int, ...]) -> dict[str, Placements]:
    """A qwen3_moe model's attention and experts tensor-parallel (2-D: experts also over mesh dim 0)."""
    two = len(mesh_shape) == 2
    return placements_matching(
        model,
        {
            "*[qkv]_proj.weight": [Replicate(), Shard(0)] if two else [Shard(0)],
            "*o_proj.weight": [Replicate(), Shard(1)] if two else [Shard(1)],
            "*experts.gate_up_proj": [Shard(0), Shard(1)] if two else [Shard(1)],
            "*experts.down_proj": [Shard(0), Shard(2)] if two else [Shard(2)],
            "*embed_tokens.weight": [Shard(0), Replicate()] if two else [Shard(0)],
        },
    )


def check_full(model: nn.Module, expected: dict) -> list[str]:
    """Names whose full (gathered) value differs from the reference. Collective: all ranks call it."""
    bad = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in expected:
            continue
        data = t.data
        full = data.full_tensor() if hasattr(data, "full_tensor") else data
        if not torch.equal(full.to(expected[name].dtype), expected[name]):
            bad.append(name)
    return bad


def local_numel(t: torch.Tensor) -> int:
    data = t.data
    local = getattr(data, "_local_tensor", data)
    return local.numel()


# ---------------------------------------------------------------------------------------------------


def scenario_layout(ctx: dict, mesh_shape, use_dcp: bool = False, repo_id: bool = False) -> dict:
    import dist_models as dm
    from torch.distributed.device_mesh import init_device_mesh

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    mesh = init_device_mesh("cpu", mesh_shape)
    model = shard_module(dm.Layout(), mesh, layout_placements(mesh_shape))
    path = ctx["layout_path"]
    if repo_id:  # resolved from the fake Hub cache (offline): rank 0 first, then every rank
        os.environ.update(HF_HUB_CACHE=ctx["hub_cache"], HF_HUB_OFFLINE="1")
        path = "org/layout"
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        planner = HFLoadPlanner(model, rules=Rules(weights_mapping=dm.RULES))
        reader = SafetensorsReader(path)
        dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
        report = planner.finish(reader)
    else:
        report = load_hf_checkpoint(
            model, path, rules=Rules(weights_mapping=dm.RULES), options=LoadOptions(progress=False)
        )
    expected = torch.load(ctx["layout_ref"])
    bad = check_full(model, expected)
    sd = model.state_dict(keep_vars=True)
    traced_bytes = sum(local_numel(sd[n]) * 2 for n in report.traced)
    deferred_bytes = dm.ROWS * dm.H * 2 if local_numel(sd["scaled"]) else 0
    return {
        "bad": bad,
        "bytes_read": report.bytes_read,
        "traced_bytes": traced_bytes,
        "deferred_bytes": deferred_bytes,
        "deferred": report.deferred,
        "blocks": report.blocks,
        "planned_bytes": report.planned_bytes,
        "traced": report.traced,
    }


def scenario_moe(ctx: dict, mesh_shape, use_dcp: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    cfg = AutoConfig.from_pretrained(ctx["moe_path"])
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(cfg)
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = moe_placements(model, mesh_shape)
    model = shard_module(model, mesh, placements)
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        planner = HFLoadPlanner(model)
        reader = SafetensorsReader(ctx["moe_path"])
        dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
        report = planner.finish(reader)
    else:
        report = load_hf_checkpoint(model, ctx["moe_path"], options=LoadOptions(progress=False))
    expected = torch.load(ctx["moe_ref"])
    bad = check_full(model, expected)
    sd = model.state_dict(keep_vars=True)
    shard_bytes = sum(local_numel(sd[n]) * 2 for n in report.loaded_keys if n in sd)
    return {
        "bad": bad,
        "bytes_read": report.bytes_read,
        "shard_bytes": shard_bytes,
        "deferred": report.deferred,
        "placements": len(placements),
    }


def scenario_fail_on_rank2(ctx: dict) -> dict:
    import dist_models as dm

    from loader import Convert, load_hf_checkpoint

    rank = dist.get_rank()

    def norm(w):
        if rank == 2:
            raise RuntimeError("this rule only breaks on rank 2")
        return w

    model = dm.Layout()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    rules = [r for r in dm.RULES if "norm" not in repr(r)] + [Convert("norm_src", "norm", norm)]
    try:
        load_hf_checkpoint(
            model, ctx["layout_path"], rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False)
        )
        outcome = "no error"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {e}"
    unchanged = all(bool((p == 7.0).all()) for p in model.parameters())
    return {"outcome": outcome, "unchanged": unchanged}


def scenario_broadcast(ctx: dict, use_dcp: bool = False) -> dict:
    import dist_models as dm

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    model = dm.Layout()
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        planner = HFLoadPlanner(model, rules=Rules(weights_mapping=dm.RULES))
        reader = SafetensorsReader(ctx["layout_path"], options=LoadOptions(broadcast_replicated_tensors=True))
        dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
        report = planner.finish(reader)
    else:
        report = load_hf_checkpoint(
            model,
            ctx["layout_path"],
            rules=Rules(weights_mapping=dm.RULES),
            options=LoadOptions(progress=False, broadcast_replicated_tensors=True),
        )
    expected = torch.load(ctx["layout_ref"])
    bad = [n for n, t in model.state_dict().items() if not torch.equal(t, expected[n])]
    totals = [None] * dist.get_world_size()
    dist.all_gather_object(totals, report.bytes_read)
    return {"bad": bad, "bytes_read": report.bytes_read, "total": sum(totals)}


def scenario_simulation(ctx: dict, mesh_shape) -> dict:
    import dist_models as dm
    from torch.distributed.device_mesh import init_device_mesh

    from loader import load_hf_checkpoint
    from loader.simulate import simulate_load

    mesh = init_device_mesh("cpu", mesh_shape)
    model = shard_module(dm.Layout(), mesh, layout_placements(mesh_shape))
    figures = simulate_load(model, ctx["layout_path"], rules=Rules(weights_mapping=dm.RULES))
    report = load_hf_checkpoint(
        model, ctx["layout_path"], rules=Rules(weights_mapping=dm.RULES), options=LoadOptions(progress=False)
    )
    mine = figures[dist.get_rank()]
    return {
        "sim_blocks": mine.blocks,
        "sim_bytes": mine.bytes_read,
        "blocks": report.blocks,
        "bytes_read": report.bytes_read,
        "ranks": len(figures),
    }


def _filled_layout(value: float = 7.0) -> nn.Module:
    import dist_models as dm

    model = dm.Layout()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _unchanged(model: nn.Module, value: float = 7.0) -> bool:
    return all(bool((p == value).all()) for p in model.parameters())


def _rules_with_scaled(fn) -> list:
    """dm.RULES with the deferred ``scaled`` conversion (run for real while reading) replaced by ``fn``."""
    import dist_models as dm

    from loader import Convert

    return [r for r in dm.RULES if "scaled" not in repr(r)] + [Convert("scaled_src", "scaled", fn)]


def _describe(e: BaseException) -> dict:
    return {
        "type": type(e).__name__,
        "message": str(e),
        "path": getattr(e, "path", None),
        "key": getattr(e, "key", None),
        "stage": getattr(e, "stage", None),
        "ranks": getattr(e, "ranks", None),
        "reason": getattr(e, "reason", None),
    }


def scenario_read_fail_rollback(ctx: dict) -> dict:
    """A read-time failure on rank 2 with rollback=True: every rank raises, every rank's model is restored."""
    from loader import load_hf_checkpoint

    rank = dist.get_rank()
    model = _filled_layout()
    wrote = []

    def scaled(w):
        if w.device.type == "meta":  # planning traces it; it runs for real while reading
            return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred
        wrote.append(not _unchanged(model))  # block reads have been written by now
        if rank == 2:
            raise RuntimeError("reads break on rank 2")
        return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred

    try:
        load_hf_checkpoint(
            model,
            ctx["layout_path"],
            rules=Rules(weights_mapping=_rules_with_scaled(scaled)),
            options=LoadOptions(progress=False, rollback=True),
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, "wrote": wrote, "unchanged": _unchanged(model)}


def scenario_checkpoint_error_carried(ctx: dict) -> dict:
    """Rank 2 loads a truncated file: every rank raises a CheckpointError with rank 2's path and key."""
    import dist_models as dm

    from loader import load_hf_checkpoint

    path = ctx["bad_layout_path"] if dist.get_rank() == 2 else ctx["layout_path"]
    model = _filled_layout()
    try:
        load_hf_checkpoint(model, path, rules=Rules(weights_mapping=dm.RULES), options=LoadOptions(progress=False))
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, "unchanged": _unchanged(model)}


class ForeignFailure(Exception):
    """Neither a builtin nor one of the project's errors: the other ranks raise a RemoteError naming it."""


def _raise_on_rank_2(error: BaseException) -> None:
    """Raise ``error`` (called on rank 2 only): the other ranks' ``remote_traceback`` must name this function."""
    raise error


def _remote(e: BaseException) -> dict:
    return {
        **_describe(e),
        "rank": getattr(e, "rank", None),
        "remote_type": getattr(e, "remote_type", None),
        "remote_traceback": getattr(e, "remote_traceback", None),
        "notes": getattr(e, "__notes__", None),
    }


def scenario_remote_errors(ctx: dict) -> dict:
    """Rank 2 raises a KeyError, a ValueError, a CheckpointError and a foreign exception in a rule while
    planning, and a KeyError while reading: every rank raises it as its own type (a RemoteError for the foreign
    one) with rank 2's number, the stage and rank 2's traceback text."""
    import dist_models as dm

    from loader import CheckpointError, Convert, load_hf_checkpoint

    rank = dist.get_rank()
    errors = {
        "KeyError": lambda: KeyError("no such expert"),
        "ValueError": lambda: ValueError("a bad value"),
        "CheckpointError": lambda: CheckpointError("a bad file", path="/ckpt/x.safetensors", key="norm"),
        "ForeignFailure": lambda: ForeignFailure("not one of ours"),
    }
    out = {}
    for name, make in errors.items():

        def norm(w, make=make):
            if rank == 2:
                _raise_on_rank_2(make())
            return w

        rules = [r for r in dm.RULES if "norm" not in repr(r)] + [Convert("norm_src", "norm", norm)]
        try:
            load_hf_checkpoint(
                _filled_layout(),
                ctx["layout_path"],
                rules=Rules(weights_mapping=rules),
                options=LoadOptions(progress=False),
            )
            out[name] = {"type": None}
        except BaseException as e:
            out[name] = _remote(e)

    def scaled(w):
        if w.device.type != "meta" and rank == 2:  # it runs for real while reading
            _raise_on_rank_2(KeyError("no such block"))
        return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred

    try:
        load_hf_checkpoint(
            _filled_layout(),
            ctx["layout_path"],
            rules=Rules(weights_mapping=_rules_with_scaled(scaled)),
            options=LoadOptions(progress=False),
        )
        out["reading"] = {"type": None}
    except BaseException as e:
        out["reading"] = _remote(e)
    return {"errors": out}


def scenario_host_reads(ctx: dict) -> dict:
    """The four ranks of this host read one copy of the MoE checkpoint, each its tensor-parallel quarter: through
    ``read_on_every_rank`` (the distributed load's reading step, with a real reader and session) every rank reads the
    files ahead (none advised ``POSIX_FADV_RANDOM``) and loads the right values; when rank 0 alone reads, it reads as
    it would alone (sparse: advised random)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import HFLoadPlanner, SafetensorsCheckpoint
    from loader.load import read_on_every_rank
    from loader.options import LoadOptions

    cfg = AutoConfig.from_pretrained(ctx["moe_path"])
    model = AutoModelForCausalLM.from_config(cfg)
    model = shard_module(model, init_device_mesh("cpu", (4,)), moe_placements(model, (4,)))
    out = {}
    for case in ("all", "rank0"):
        plan = HFLoadPlanner(model).build_plan(SafetensorsCheckpoint.open(ctx["moe_path"]))
        reading = case == "all" or dist.get_rank() == 0
        reads, deferred = (plan.reads, plan.deferred) if reading else ((), ())
        with plan.checkpoint.reader() as reader:
            read_on_every_rank(plan, reader, reads, deferred, LoadOptions(progress=False, timeout=60))
            files = {plan.checkpoint[r.block.source].file for r in plan.reads}
            out[case] = {"files": len(files), "sparse": len(reader.sparse_files)}
        if case == "all":
            out[case]["bad"] = check_full(model, torch.load(ctx["moe_ref"]))
    return out


SCENARIOS = [
    ("layout_1d", lambda ctx: scenario_layout(ctx, (4,))),
    ("layout_2d", lambda ctx: scenario_layout(ctx, (2, 2))),
    ("layout_dcp_2d", lambda ctx: scenario_layout(ctx, (2, 2), use_dcp=True)),
    ("layout_repo_id", lambda ctx: scenario_layout(ctx, (2, 2), repo_id=True)),
    ("moe_1d", lambda ctx: scenario_moe(ctx, (4,))),
    ("moe_2d", lambda ctx: scenario_moe(ctx, (2, 2))),
    ("moe_dcp_1d", lambda ctx: scenario_moe(ctx, (4,), use_dcp=True)),
    ("fail_on_rank2", scenario_fail_on_rank2),
    ("broadcast", scenario_broadcast),
    ("broadcast_dcp", lambda ctx: scenario_broadcast(ctx, use_dcp=True)),
    ("simulation_2d", lambda ctx: scenario_simulation(ctx, (2, 2))),
    ("read_fail_rollback", scenario_read_fail_rollback),
    ("checkpoint_error_carried", scenario_checkpoint_error_carried),
    ("remote_errors", scenario_remote_errors),
    ("host_reads", scenario_host_reads),
]


# ---------------------------------------------------------------------------------------------------
# faults: ranks that hang or die (run last: the last scenario kills rank 2, so the world ends with it)

HUNG = 2


def _caught(ctx: dict, name: str) -> None:
    """Tell the hung rank this rank has given up on scenario ``name``."""
    with open(os.path.join(ctx["out"], f"{name}.caught.{dist.get_rank()}"), "w"):
        pass


def _hang_until_others_gave_up(ctx: dict, name: str, limit: float = 60.0) -> None:
    """Rank HUNG stops here until every other rank has given up waiting for it (at most ``limit`` seconds)."""
    others = [r for r in range(dist.get_world_size()) if r != HUNG]
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if all(os.path.exists(os.path.join(ctx["out"], f"{name}.caught.{r}")) for r in others):
            return
        time.sleep(0.01)


def scenario_hung_planning(ctx: dict) -> dict:
    """Rank 2 hangs in a planner hook; the others raise PeerFailure naming it, then rank 2 raises too."""
    import dist_models as dm

    from loader import HFLoadPlanner, load_hf_checkpoint

    rank = dist.get_rank()

    class HangingPlanner(PlanHooks):
        hung = False

        def map_checkpoint_key(self, key: str) -> str | None:
            if rank == HUNG and not self.hung:
                self.hung = True
                _hang_until_others_gave_up(ctx, "hung_planning")
            return key

    model = _filled_layout()
    planner = HFLoadPlanner(model, hooks=HangingPlanner(), rules=Rules(weights_mapping=dm.RULES))
    try:
        load_hf_checkpoint(model, ctx["layout_path"], planner=planner, options=LoadOptions(progress=False, timeout=2.5))
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    if rank != HUNG:
        _caught(ctx, "hung_planning")
    return {**outcome, "unchanged": _unchanged(model)}


def scenario_hung_reading_dcp(ctx: dict) -> dict:
    """Inside dcp.load, rank 2 hangs while reading; the reader's ``LoadOptions.timeout`` names it on every rank."""
    import torch.distributed.checkpoint as dcp

    from loader import HFLoadPlanner, SafetensorsReader

    rank = dist.get_rank()

    def scaled(w):
        if rank == HUNG and w.device.type != "meta":
            _hang_until_others_gave_up(ctx, "hung_reading_dcp")
        return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred

    class Reader(SafetensorsReader):
        def read_data(self, plan, planner):
            try:
                return super().read_data(plan, planner)
            except BaseException:
                if rank != HUNG:
                    _caught(ctx, "hung_reading_dcp")  # before dcp.load gathers every rank's outcome
                raise

    model = _filled_layout()
    planner = HFLoadPlanner(model, rules=Rules(weights_mapping=_rules_with_scaled(scaled)))
    try:
        dcp.load(
            planner.state_dict_for_load(),
            storage_reader=Reader(ctx["layout_path"], options=LoadOptions(timeout=2.5)),
            planner=planner,
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return outcome


def scenario_killed_reading(ctx: dict) -> dict:
    """Rank 2 is SIGKILLed while reading; the others raise PeerFailure ('died') and roll back."""
    import signal

    from loader import load_hf_checkpoint

    rank = dist.get_rank()
    model = _filled_layout()
    wrote = []

    def scaled(w):
        if w.device.type != "meta":
            wrote.append(not _unchanged(model))
            if rank == HUNG:
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred

    try:
        load_hf_checkpoint(
            model,
            ctx["layout_path"],
            rules=Rules(weights_mapping=_rules_with_scaled(scaled)),
            options=LoadOptions(progress=False, rollback=True, timeout=6),
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, "wrote": wrote, "unchanged": _unchanged(model)}


FAULT_SCENARIOS = [
    ("hung_planning", scenario_hung_planning),
    ("hung_reading_dcp", scenario_hung_reading_dcp),
    ("killed_reading", scenario_killed_reading),  # last: rank 2 dies
]


if __name__ == "__main__":  # run by tests/test_distributed.py: dist_worker.py RANK WORLD CTX_JSON
    worker_main(SCENARIOS + FAULT_SCENARIOS)  # rank 2 is killed in the last one
