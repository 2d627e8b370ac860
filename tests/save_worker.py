"""One rank of the 4-rank gloo world of tests/test_save_distributed.py: every save scenario, results to a file.

``python save_worker.py RANK WORLD CTX_JSON``. Each scenario loads a checkpoint into a DTensor-sharded model,
saves it back with ``save_hf_checkpoint`` and returns plain data; the test process compares the files. The
last scenario kills rank 2, so the world ends with it.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import time
from datetime import timedelta

import dist_models as dm
import torch
import torch.distributed as dist
from gloo_world import run_scenarios
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loader.options import LoadOptions, Rules, SaveOptions

FAILING = 2


class NoScaled(dm.Layout):
    """``dist_models.Layout`` without the tensors a save cannot invert: ``scaled`` (computed, ``w * 2``) and
    ``gate_up_strided`` (a second copy of ``gate_up``'s sources)."""

    def __init__(self) -> None:
        super().__init__()
        del self.scaled, self.gate_up_strided


def layout_rules() -> list:
    from loader import Convert

    rules = [r for r in dm.RULES if "scaled" not in repr(r) and "gate_up_strided" not in repr(r)]
    return rules + [Convert(["experts.*.w1", "experts.*.w3"], "gate_up", dm.gate_up)]


def layout_placements(mesh_shape: tuple[int, ...]) -> dict[str, list]:
    """Shard(0/1/2), uneven rows (10 over 4), _StridedShard of a fused gate/up, Replicate, fused rope'd qkv."""
    if len(mesh_shape) == 1:
        return {
            "qkv.weight": [Shard(0)], "o_proj.weight": [Shard(1)], "gate_up": [_StridedShard(1, split_factor=2)],
            "down": [Shard(2)], "uneven": [Shard(0)],
        }  # fmt: skip
    return {
        "qkv.weight": [Shard(0), Shard(0)], "o_proj.weight": [Replicate(), Shard(1)],
        "gate_up": [Shard(0), _StridedShard(1, split_factor=2)], "down": [Shard(0), Shard(2)],
        "uneven": [Shard(0), Shard(0)],
    }  # fmt: skip


def moe_placements(model: nn.Module, mesh_shape: tuple[int, ...]) -> dict[str, list]:
    two = len(mesh_shape) == 2
    out = {}
    for name, _ in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[name] = [Replicate(), Shard(0)] if two else [Shard(0)]
        elif name.endswith("o_proj.weight"):
            out[name] = [Replicate(), Shard(1)] if two else [Shard(1)]
        elif name.endswith("experts.gate_up_proj"):
            out[name] = [Shard(0), _StridedShard(1, split_factor=2)] if two else [Shard(1)]
        elif name.endswith("experts.down_proj"):
            out[name] = [Shard(0), Shard(2)] if two else [Shard(2)]
        elif name.endswith("embed_tokens.weight"):
            out[name] = [Shard(0), Replicate()] if two else [Shard(0)]
    return out


def expected_bytes(model: nn.Module, itemsize: int) -> list[int]:
    """Per rank, the bytes it should write: its local shards of which it is the lowest rank holding equal
    values (replicas hold equal shards), found by hashing every rank's shards. Collective."""
    mine = []
    for name, t in model.state_dict(keep_vars=True).items():
        data = t.data
        local = data.to_local() if isinstance(data, DTensor) else data
        if local.numel():
            digest = hashlib.sha1(local.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            mine.append((name, digest, local.numel()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    owner: dict[tuple, int] = {}
    for rank, items in enumerate(every):
        for name, digest, _ in items:
            owner.setdefault((name, digest), rank)
    return [sum(n * itemsize for name, d, n in items if owner[name, d] == r) for r, items in enumerate(every)]


def gathered(value: object) -> list:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def report_dict(report) -> dict:
    return {k: getattr(report, k) for k in ("files", "keys", "total_size", "bytes_written", "header_bytes", "writes")}


# ---------------------------------------------------------------------------------------------------


def scenario_layout(ctx: dict, mesh_shape: tuple[int, ...], max_shard_size: str = "5GB") -> dict:
    from loader import load_hf_checkpoint, save_hf_checkpoint
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", mesh_shape)
    model = shard_module(NoScaled(), mesh, layout_placements(mesh_shape))
    load_hf_checkpoint(
        model, ctx["layout"], rules=Rules(weights_mapping=layout_rules()), options=LoadOptions(progress=False)
    )
    out = os.path.join(ctx["out"], f"layout_{'x'.join(map(str, mesh_shape))}")
    report = save_hf_checkpoint(
        model,
        out,
        source_shapes=ctx["layout"],
        rules=Rules(weights_mapping=layout_rules()),
        options=SaveOptions(max_shard_size=max_shard_size, progress=False),
    )
    return {
        "out": out,
        **report_dict(report),
        "expected": expected_bytes(model, 2),
        "all": gathered(report.bytes_written),
    }


def scenario_moe(ctx: dict, mesh_shape: tuple[int, ...], submesh: bool = False) -> dict:
    """A qwen3_moe model TP/EP-sharded on the mesh; ``submesh``: TP on ``mesh["tp"]`` of a (dp=2, tp=2) mesh, so
    that ranks 2 and 3 hold the same shards as ranks 0 and 1 (written once, by 0 and 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import load_hf_checkpoint, save_hf_checkpoint
    from loader.placements import shard_module

    cfg = AutoConfig.from_pretrained(ctx["moe"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if submesh:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        mesh_shape = (2,)
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
    model = shard_module(model, mesh, moe_placements(model, mesh_shape))
    load_hf_checkpoint(model, ctx["moe"], options=LoadOptions(progress=False))
    out = os.path.join(ctx["out"], f"moe_{'x'.join(map(str, mesh_shape))}{'_sub' if submesh else ''}")
    report = save_hf_checkpoint(model, out, options=SaveOptions(max_shard_size=ctx["moe_shard_size"], progress=False))
    return {
        "out": out,
        **report_dict(report),
        "expected": expected_bytes(model, 2),
        "all": gathered(report.bytes_written),
    }


def _describe(e: BaseException) -> dict:
    return {
        "type": type(e).__name__, "message": str(e), "stage": getattr(e, "stage", None),
        "ranks": getattr(e, "ranks", None), "reason": getattr(e, "reason", None),
    }  # fmt: skip


def _layout_model(mesh_shape: tuple[int, ...] = (4,)) -> nn.Module:
    """The sharded layout model, not loaded (its values do not matter to a failing save; a loaded one would
    record the load's rules, and the save would then skip the failing rules these scenarios pass)."""
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", mesh_shape)
    return shard_module(NoScaled(), mesh, layout_placements(mesh_shape))


def scenario_fail_writing(ctx: dict) -> dict:
    """Rank 2's writes hit the file size limit (EFBIG): a real I/O error in the middle of writing."""
    from loader import save_hf_checkpoint

    model = _layout_model()
    out = os.path.join(ctx["out"], "fail_writing")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if dist.get_rank() == FAILING:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, hard))
    try:
        save_hf_checkpoint(
            model,
            out,
            source_shapes=ctx["layout"],
            rules=Rules(weights_mapping=layout_rules()),
            options=SaveOptions(progress=False),
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    dist.barrier()
    return {**outcome, "out": out, "left": sorted(n for n in os.listdir(ctx["out"]) if n.startswith("fail_writing"))}


def _rules_failing_on(rank: int, kill: bool = False) -> list:
    from loader import Convert

    me = dist.get_rank()

    def norm(w):
        if me == rank:
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"this rule only breaks on rank {rank}")
        return w

    return [r for r in layout_rules() if "norm" not in repr(r)] + [Convert("norm_src", "norm", norm)]


def scenario_fail_preparing(ctx: dict) -> dict:
    """Rank 2 fails while planning, after rank 0 has created the files: every rank raises, nothing is left."""
    from loader import save_hf_checkpoint

    model = _layout_model()
    out = os.path.join(ctx["out"], "fail_preparing")
    try:
        save_hf_checkpoint(
            model, out, source_shapes=ctx["layout"], rules=Rules(weights_mapping=_rules_failing_on(FAILING))
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    dist.barrier()
    return {**outcome, "left": sorted(n for n in os.listdir(ctx["out"]) if n.startswith("fail_preparing"))}


def scenario_killed(ctx: dict) -> dict:
    """Rank 2 is SIGKILLed while the save is prepared: the others raise PeerFailure (died), rank 0 cleans up."""
    from loader import save_hf_checkpoint

    model = _layout_model()
    out = os.path.join(ctx["out"], "killed")
    try:
        save_hf_checkpoint(
            model,
            out,
            source_shapes=ctx["layout"],
            rules=Rules(weights_mapping=_rules_failing_on(FAILING, kill=True)),
            options=SaveOptions(timeout=6),
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, "left": sorted(n for n in os.listdir(ctx["out"]) if n.startswith("killed"))}


DISAGREE = 1  # the rank that holds a tensor differently from the others


def _disagreeing_placements(how: str) -> dict[str, list]:
    placements = layout_placements((4,))
    if dist.get_rank() == DISAGREE:
        if how == "placement":
            placements["o_proj.weight"] = [Shard(0)]  # the others: Shard(1)
        else:
            del placements["uneven"]  # a plain tensor here, Shard(0) on the others
    return placements


def scenario_disagree(ctx: dict, how: str) -> dict:
    """Rank 1 holds one tensor differently (another placement, a plain tensor instead of a DTensor, another
    dtype): every rank must refuse before anything is written, naming the tensor and both views."""
    from loader import save_hf_checkpoint
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", (4,))
    model = NoScaled()
    if how == "dtype" and dist.get_rank() == DISAGREE:
        model.down.data = model.down.data.to(torch.float64)
    model = shard_module(model, mesh, _disagreeing_placements(how))  # no load: the save must refuse
    out = os.path.join(ctx["out"], f"disagree_{how}")
    try:
        save_hf_checkpoint(
            model,
            out,
            source_shapes=ctx["layout"],
            rules=Rules(weights_mapping=layout_rules()),
            options=SaveOptions(progress=False),
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    dist.barrier()  # rank 0 has removed its files: every rank looks
    return {**outcome, "left": sorted(n for n in os.listdir(ctx["out"]) if n.startswith(f"disagree_{how}"))}


SCENARIOS = [
    ("layout_1d", lambda ctx: scenario_layout(ctx, (4,))),
    ("layout_2d", lambda ctx: scenario_layout(ctx, (2, 2), max_shard_size="1KB")),
    ("moe_1d", lambda ctx: scenario_moe(ctx, (4,))),
    ("moe_2d", lambda ctx: scenario_moe(ctx, (2, 2))),
    ("moe_submesh", lambda ctx: scenario_moe(ctx, (2,), submesh=True)),
    ("fail_writing", scenario_fail_writing),
    ("fail_preparing", scenario_fail_preparing),
    ("disagree_placement", lambda ctx: scenario_disagree(ctx, "placement")),
    ("disagree_plain", lambda ctx: scenario_disagree(ctx, "plain")),
    ("disagree_dtype", lambda ctx: scenario_disagree(ctx, "dtype")),
    ("killed", scenario_killed),  # last: rank 2 dies
]

ctx_global: dict = {}


def run_rank(rank: int, world: int, ctx: dict) -> None:
    torch.set_num_threads(1)
    ctx_global.update(ctx)
    # a TCP store: rank 2's file size limit (scenario_fail_writing) must hit its checkpoint writes only
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ctx['port']}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    run_scenarios(SCENARIOS, ctx, rank)
    # rank 0 hosts the TCP store: it stays until the other survivors are done with it (rank 2 is dead)
    store = dist.distributed_c10d._get_default_store()
    store.add("finished", 1)
    deadline = time.monotonic() + 30
    while rank == 0 and store.add("finished", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    import json
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run_rank(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the world lost a rank: skip process-group teardown
