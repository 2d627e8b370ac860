"""One rank of the gloo world of tests/test_exchange_reads.py: loads of local files with ``exchange_reads=True``
compared with the same loads without, and the failures of exchanged reads (``python exchange_worker.py RANK WORLD
CTX_JSON``, run by ``gloo_world.run_world``). The last scenario kills rank 2 as it enters the exchange."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_worker import check_full, layout_placements, local_numel, moe_placements
from gloo_world import run_scenarios

from loader.placements import shard_module

TIMEOUT = 20.0  # seconds each rank waits for the others in the failure scenarios
FAILING = 2  # the rank that fails


def _moe(ctx: dict, mesh_shape: tuple[int, ...]) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx["moe"]))
    return shard_module(model, init_device_mesh("cpu", mesh_shape), moe_placements(model, mesh_shape))


def _layout(value: float | None = None) -> torch.nn.Module:
    import dist_models as dm
    from torch.distributed.device_mesh import init_device_mesh

    model = shard_module(dm.Layout(), init_device_mesh("cpu", (4,)), layout_placements((4,)))
    if value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    return model


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: getattr(t.data, "_local_tensor", t.data).clone() for n, t in model.state_dict(keep_vars=True).items()}


def _unequal(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names whose local shards differ bit for bit."""
    want, got = _shards(a), _shards(b)
    return [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))]


def _unchanged(model: torch.nn.Module, value: float = 7.0) -> bool:
    return all(bool((t == value).all()) for t in _shards(model).values())


def _describe(e: BaseException) -> dict:
    return {k: getattr(e, k, None) for k in ("path", "key", "stage", "ranks", "reason", "rank")} | {
        "type": type(e).__name__,
        "message": str(e),
    }


def scenario_moe(ctx: dict, mesh_shape: tuple[int, ...], *, dcp: bool = False) -> dict:
    """A qwen3_moe model sharded ``mesh_shape``, loaded with exchanged reads and without: equal bit for bit, and
    equal to the reference."""
    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    alone = _moe(ctx, mesh_shape)
    load_hf_checkpoint(alone, ctx["moe"], progress=False, exchange_reads=False)
    model = _moe(ctx, mesh_shape)
    if dcp:
        import torch.distributed.checkpoint as torch_dcp

        planner = HFLoadPlanner(model)
        reader = SafetensorsReader(ctx["moe"], exchange_reads=True)
        torch_dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
        report = planner.finish(ctx["moe"])
    else:
        report = load_hf_checkpoint(model, ctx["moe"], progress=False, exchange_reads=True)
    sd = model.state_dict(keep_vars=True)
    return {
        "unequal": _unequal(alone, model),
        "bad": check_full(model, torch.load(ctx["moe_ref"])),
        "bytes_read": report.bytes_read,
        "bytes_exchanged": report.bytes_exchanged,
        "planned_bytes": report.planned_bytes,
        "shard_bytes": sum(local_numel(sd[n]) * 2 for n in report.loaded_keys if n in sd),
    }


def scenario_layout(ctx: dict) -> dict:
    """Every layout of dist_models (row-permuted rows, column shards, strided shards, a deferred conversion) on 4
    ranks, with exchanged reads: equal to the load without them and to the expected state."""
    import dist_models as dm

    from loader import load_hf_checkpoint

    alone, model = _layout(), _layout()
    load_hf_checkpoint(alone, ctx["layout"], weights_mapping=dm.RULES, progress=False)
    report = load_hf_checkpoint(model, ctx["layout"], weights_mapping=dm.RULES, progress=False, exchange_reads=True)
    return {
        "unequal": _unequal(alone, model),
        "bad": check_full(model, torch.load(ctx["layout_ref"])),
        "bytes_exchanged": report.bytes_exchanged,
    }


def scenario_changed_on_one_rank(ctx: dict) -> dict:
    """Rank 2 reads the header, then the file's data is rewritten (same size, mtime put back) before the other
    ranks open it: rank 2's fetch of its chunks must fail, and every rank raise the CheckpointError naming the file,
    with its tensors restored (``rollback``)."""
    import dist_models as dm

    from loader import HFLoadPlanner, load_hf_checkpoint

    rank, path, marker = dist.get_rank(), ctx["changing"], os.path.join(ctx["out"], "changed")

    class RewritingPlanner(HFLoadPlanner):
        done = False

        def map_checkpoint_key(self, key: str) -> str | None:  # planning: after the header was read
            if rank == FAILING and not self.done:
                self.done = True
                _rewrite_data_in_place(path)
                open(marker, "w").close()
            return key

    model = _layout(7.0)
    if rank != FAILING:  # the others open the file once it changed: their identity is the new one
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
    planner = RewritingPlanner(model, weights_mapping=dm.RULES)
    try:
        load_hf_checkpoint(model, path, planner=planner, progress=False, rollback=True, timeout=TIMEOUT)
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, "unchanged": _unchanged(model)}


def _rewrite_data_in_place(path: str) -> None:
    """Overwrite the file's tensor bytes (not its header) with other bytes; size and mtime as they were."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
        f.seek(header)
        data = f.read()
        f.seek(header)
        f.write(bytes(b ^ 0x5A for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def scenario_fails_after_exchange(ctx: dict) -> dict:
    """Rank 2's deferred conversion fails after the exchanged column shards were written: every rank raises it
    and restores its tensors (``rollback``)."""
    from loader import load_hf_checkpoint

    rank = dist.get_rank()
    model = _layout(7.0)
    written = []

    def scaled(w):
        if w.device.type == "meta":  # planning traces it; it runs for real while reading
            return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred
        written.append(not bool((_shards(model)["down"] == 7.0).all()))  # a column shard: exchanged
        if rank == FAILING:
            raise RuntimeError("the conversion breaks on rank 2")
        return torch.stack([w, w]).sum(0)

    try:
        load_hf_checkpoint(
            model,
            ctx["layout"],
            weights_mapping=_rules_with_scaled(scaled),
            progress=False,
            rollback=True,
            timeout=TIMEOUT,
            exchange_reads=True,
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, "written": written, "unchanged": _unchanged(model)}


def _rules_with_scaled(fn) -> list:
    import dist_models as dm

    from loader import Convert

    return [r for r in dm.RULES if "scaled" not in repr(r)] + [Convert("scaled_src", "scaled", fn)]


def scenario_dies_at_the_exchange(ctx: dict) -> dict:
    """Rank 2 is killed as it enters the exchange (its chunks fetched, every fetch agreed): the others, in the
    ``all_to_all``, raise PeerFailure and restore their tensors."""
    import dist_models as dm

    from loader import load_hf_checkpoint

    model = _layout(7.0)
    if dist.get_rank() == FAILING:

        def die_entering_exchange(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "exchange" and "exchange_reads" in frame.f_code.co_filename:
                os.kill(os.getpid(), signal.SIGKILL)

        sys.setprofile(die_entering_exchange)
    try:
        load_hf_checkpoint(
            model,
            ctx["layout"],
            weights_mapping=dm.RULES,
            progress=False,
            rollback=True,
            timeout=TIMEOUT,
            exchange_reads=True,
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    finally:
        sys.setprofile(None)
    return {**outcome, "unchanged": _unchanged(model)}


SCENARIOS = [
    ("moe_tp4", lambda ctx: scenario_moe(ctx, (4,))),
    ("moe_ep_tp_2x2", lambda ctx: scenario_moe(ctx, (2, 2))),
    ("moe_dcp_tp4", lambda ctx: scenario_moe(ctx, (4,), dcp=True)),
    ("layout_tp4", scenario_layout),
    ("changed_on_one_rank", scenario_changed_on_one_rank),
    ("fails_after_exchange", scenario_fails_after_exchange),
    ("dies_at_the_exchange", scenario_dies_at_the_exchange),  # last: rank 2 dies
]


def run_rank(rank: int, world: int, ctx: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{ctx['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    run_scenarios(SCENARIOS, ctx, rank)


if __name__ == "__main__":  # run by tests/test_exchange_reads.py: exchange_worker.py RANK WORLD CTX_JSON
    import json

    run_rank(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the world lost a rank: skip process-group teardown
