"""One rank of the gloo world of tests/test_exchange_reads.py: loads of local files with ``exchange_reads=True``
compared with the same loads without, and the failures of exchanged reads (``python exchange_worker.py RANK WORLD
CTX_JSON``, run by ``gloo_world.run_world``). The last scenario kills rank 2 as it enters the exchange."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from dist_worker import check_full, layout_placements, local_numel, moe_placements
from gloo_world import worker_main

from loader.hooks import PlanHooks
from loader.options import EXCHANGE_ROUND_BYTES, LoadOptions, Rules
from loader.placements import shard_module

TIMEOUT = 20.0  # seconds each rank waits for the others in the failure scenarios
HUNG_TIMEOUT = 3.0  # seconds the others wait for a hung rank
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
    return model if value is None else _filled(model, value)


def _filled(model: torch.nn.Module, value: float = 7.0) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


#: rounds of one tensor each (``LoadOptions.exchange_round_bytes``, 1 GiB by default, set to 1 byte: every file over
#: it, cut at each tensor that holds exchanged bytes): a checkpoint of small shards is exchanged in many rounds, each
#: file in sections
TENSOR_PER_ROUND = 1


@contextlib.contextmanager
def counting_exchanges() -> Iterator[dict]:
    """``{"fetch_shares": n, "exchange": n, "files": [...]}``: how many rounds this rank fetched shares for, how many
    got past their agreement into the exchange, and the names of the files fetched for exchange, seen by a profile
    hook (nothing of the loader replaced)."""
    count: dict = {"fetch_shares": 0, "exchange": 0, "files": []}

    def hook(frame, event, arg):
        code = frame.f_code
        where = code.co_filename.replace(os.sep, "/")
        if (
            event == "call"
            and code.co_name in count
            and where.endswith(("execute/exchanged.py", "execute/exchange.py"))
        ):
            count[code.co_name] += 1
            if code.co_name == "fetch_shares":
                count["files"] = sorted({*count["files"], *(os.path.basename(f) for f in frame.f_locals["files"])})

    sys.setprofile(hook)
    try:
        yield count
    finally:
        sys.setprofile(None)


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: getattr(t.data, "_local_tensor", t.data).clone() for n, t in model.state_dict(keep_vars=True).items()}


def _unequal(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names whose local shards differ bit for bit."""
    want, got = _shards(a), _shards(b)
    return [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))]


def _unchanged(model: torch.nn.Module, value: float = 7.0) -> bool:
    return all(bool((getattr(p.data, "_local_tensor", p.data) == value).all()) for p in model.parameters())


def _describe(e: BaseException) -> dict:
    keys = ("path", "key", "stage", "ranks", "reason", "rank", "remote_traceback")
    return {k: getattr(e, k, None) for k in keys} | {
        "type": type(e).__name__,
        "message": str(e),
    }


def _failing_load(model, path: str, timeout: float, **kwargs) -> dict:
    """A load with ``LoadOptions(rollback=True)``: ``{"type": None}``, or its error, described."""
    from loader import load_hf_checkpoint

    try:
        exchange = kwargs.pop("exchange_reads", None)
        round_bytes = kwargs.pop("exchange_round_bytes", EXCHANGE_ROUND_BYTES)
        rules = Rules(weights_mapping=kwargs.pop("weights_mapping")) if "weights_mapping" in kwargs else None
        load_hf_checkpoint(
            model,
            path,
            rules=rules,
            options=LoadOptions(
                progress=False,
                rollback=True,
                timeout=timeout,
                exchange_reads=exchange,
                exchange_round_bytes=round_bytes,
            ),
            **kwargs,
        )
    except BaseException as e:
        return _describe(e)
    return {"type": None}


def scenario_moe(ctx: dict, mesh_shape: tuple[int, ...], *, dcp: bool = False, rounds: bool = False) -> dict:
    """A qwen3_moe model (2 shards) sharded ``mesh_shape``, loaded with exchanged reads and without: equal bit for
    bit, and equal to the reference; ``rounds``: one tensor per round."""
    from loader import load_hf_checkpoint

    alone = _moe(ctx, mesh_shape)
    load_hf_checkpoint(alone, ctx["moe"], options=LoadOptions(progress=False, exchange_reads=False))
    model = _moe(ctx, mesh_shape)
    with counting_exchanges() as exchanges:
        report = _load(ctx, model, dcp, TENSOR_PER_ROUND if rounds else EXCHANGE_ROUND_BYTES)
    sd = model.state_dict(keep_vars=True)
    return {
        "exchanges": exchanges["exchange"],
        "fetched_files": exchanges["files"],
        "unequal": _unequal(alone, model),
        "bad": check_full(model, torch.load(ctx["moe_ref"])),
        "bytes_read": report.bytes_read,
        "bytes_exchanged": report.bytes_exchanged,
        "planned_bytes": report.planned_bytes,
        "shard_bytes": sum(local_numel(sd[n]) * 2 for n in report.loaded_keys if n in sd),
    }


def _load(ctx: dict, model: torch.nn.Module, dcp: bool, round_bytes: int):
    """Load the moe checkpoint into ``model`` with exchanged reads (through ``dcp.load``), ``round_bytes`` a round."""
    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    if not dcp:
        options = LoadOptions(progress=False, exchange_reads=True, exchange_round_bytes=round_bytes)
        return load_hf_checkpoint(model, ctx["moe"], options=options)
    import torch.distributed.checkpoint as torch_dcp

    planner = HFLoadPlanner(model)
    reader = SafetensorsReader(ctx["moe"], options=LoadOptions(exchange_reads=True, exchange_round_bytes=round_bytes))
    torch_dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
    return planner.finish(reader)


def scenario_layout(ctx: dict) -> dict:
    """Every layout of dist_models (row-permuted rows, column shards, strided shards, a deferred conversion) on 4
    ranks, with exchanged reads: equal to the load without them and to the expected state."""
    import dist_models as dm

    from loader import load_hf_checkpoint

    alone, model = _layout(), _layout()
    load_hf_checkpoint(alone, ctx["layout"], rules=Rules(weights_mapping=dm.RULES), options=LoadOptions(progress=False))
    report = load_hf_checkpoint(
        model,
        ctx["layout"],
        rules=Rules(weights_mapping=dm.RULES),
        options=LoadOptions(progress=False, exchange_reads=True),
    )
    return {
        "unequal": _unequal(alone, model),
        "bad": check_full(model, torch.load(ctx["layout_ref"])),
        "bytes_exchanged": report.bytes_exchanged,
    }


def scenario_changed_on_one_rank(ctx: dict) -> dict:
    """Rank 2 reads the headers, then the second shard's data is rewritten (same size, mtime put back) before the
    other ranks open it; one tensor per round: the first file is exchanged and written everywhere; the second, known
    to the ranks by two identities, is not exchanged: each rank reads its own, rank 2's read fails, and every rank
    raises the CheckpointError naming it, with its tensors restored (``rollback``)."""
    from loader import HFLoadPlanner

    rank, marker = dist.get_rank(), os.path.join(ctx["out"], "changed")
    path = os.path.join(ctx["changing"], ctx["second_shard"])

    class RewritingPlanner(PlanHooks):
        done = False

        def map_checkpoint_key(self, key: str) -> str | None:  # planning: after the headers were read
            if rank == FAILING and not self.done:
                self.done = True
                _rewrite_data_in_place(path)
                open(marker, "w").close()
            return key

    model = _filled(_moe(ctx, (4,)))
    if rank != FAILING:  # the others open the files once it changed: their identity is the new one
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
    planner = HFLoadPlanner(model, hooks=RewritingPlanner())
    with counting_exchanges() as rounds:
        outcome = _failing_load(
            model, ctx["changing"], TIMEOUT, planner=planner, exchange_reads=True, exchange_round_bytes=TENSOR_PER_ROUND
        )
    fetched, exchanged = rounds["fetch_shares"], rounds["exchange"]
    return {**outcome, "unchanged": _unchanged(model), "fetched": fetched, "exchanged": exchanged} | {
        "fetched_files": rounds["files"]
    }


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

    rules = _rules_with_scaled(scaled)
    outcome = _failing_load(model, ctx["layout"], TIMEOUT, weights_mapping=rules, exchange_reads=True)
    return {**outcome, "written": written, "unchanged": _unchanged(model)}


def _rules_with_scaled(fn) -> list:
    import dist_models as dm

    from loader import Convert

    return [r for r in dm.RULES if "scaled" not in repr(r)] + [Convert("scaled_src", "scaled", fn)]


def scenario_ranks_disagree(ctx: dict) -> dict:
    """Ranks 0 and 1 exchange reads, ranks 2 and 3 do not (a misconfigured job): no rank hangs, every rank raises
    within the timeout and restores its tensors."""
    import dist_models as dm

    model = _layout(7.0)
    exchange = dist.get_rank() < 2
    outcome = _failing_load(model, ctx["layout"], HUNG_TIMEOUT, weights_mapping=dm.RULES, exchange_reads=exchange)
    return {**outcome, "unchanged": _unchanged(model)}


@contextlib.contextmanager
def corrupting_sends(altered: list) -> Iterator[None]:
    """This rank's exchange sends altered bytes: the first byte it sends the first peer it sends any to is flipped
    after its checksums were computed, then the real ``all_to_all_bytes`` of its peers runs (``altered``: that peer,
    appended)."""
    from loader.execute import exchange, exchanged

    real = exchanged.exchange

    class Altering:
        def __init__(self, peers):
            self.peers, self.rank, self.world, self.timeout = peers, peers.rank, peers.world, peers.timeout

        def all_to_all_bytes(self, sends, recv_sizes):
            peer = next((j for j, s in enumerate(sends) if len(s) > exchange.CHECKSUM_BYTES), None)
            if peer is not None:
                sends = list(sends)
                sends[peer] = sends[peer].copy()
                sends[peer][0] ^= 0xFF
                altered.append(peer)
            return self.peers.all_to_all_bytes(sends, recv_sizes)

    exchanged.exchange = lambda plans, files, fetched, peers: real(plans, files, fetched, Altering(peers))
    try:
        yield
    finally:
        exchanged.exchange = real


def scenario_altered_in_transit(ctx: dict) -> dict:
    """Rank 2's sent bytes are altered after their checksums were computed (a bad link): the receiving rank finds
    the mismatch, and every rank raises the CheckpointError naming the file and rank 2, its tensors restored."""
    import dist_models as dm

    model, altered = _layout(7.0), []
    with contextlib.ExitStack() as stack:
        if dist.get_rank() == FAILING:
            stack.enter_context(corrupting_sends(altered))
        outcome = _failing_load(model, ctx["layout"], TIMEOUT, weights_mapping=dm.RULES, exchange_reads=True)
    return {**outcome, "unchanged": _unchanged(model), "altered": altered}


def scenario_garbage_host_post(ctx: dict) -> dict:
    """Rank 2 posts garbage as its files for the host's ranks (``host_shared.pack`` replaced on it alone): every rank
    raises an error naming rank 2 and what it posted, before anything is read, its tensors unchanged."""
    import dist_models as dm

    from loader.execute import host_shared

    model, real = _layout(7.0), host_shared.pack
    if dist.get_rank() == FAILING:
        host_shared.pack = lambda files: "not base64 at all!"
    try:
        outcome = _failing_load(model, ctx["layout"], TIMEOUT, weights_mapping=dm.RULES, exchange_reads=False)
    finally:
        host_shared.pack = real
    return {**outcome, "unchanged": _unchanged(model)}


def scenario_stopped_at_the_exchange(ctx: dict, how: str) -> dict:
    """Rank 2 stops as it enters the exchange (its shares fetched, every fetch agreed): killed (``how="dies"``), or
    hung until the others gave up (``"hangs"``; then it resumes). The others, in the ``all_to_all``, raise
    PeerFailure within the timeout and restore their tensors; a hung rank raises PeerFailure when it resumes."""
    import dist_models as dm

    rank, name = dist.get_rank(), f"{how}_at_the_exchange"
    model = _layout(7.0)
    if rank == FAILING:

        def stop_entering_exchange(frame, event, arg):
            where = frame.f_code.co_filename.replace(os.sep, "/")
            if event == "call" and frame.f_code.co_name == "exchange" and where.endswith("execute/exchange.py"):
                if how == "dies":
                    os.kill(os.getpid(), signal.SIGKILL)
                sys.setprofile(None)
                _wait_for_the_others(ctx, name)

        sys.setprofile(stop_entering_exchange)
    started = time.monotonic()
    try:
        timeout = HUNG_TIMEOUT if how == "hangs" else TIMEOUT
        outcome = _failing_load(model, ctx["layout"], timeout, weights_mapping=dm.RULES, exchange_reads=True)
    finally:
        sys.setprofile(None)
    if rank != FAILING:  # tell the hung rank this one gave up
        open(os.path.join(ctx["out"], f"{name}.caught.{rank}"), "w").close()
    return {**outcome, "unchanged": _unchanged(model), "seconds": time.monotonic() - started}


def _wait_for_the_others(ctx: dict, name: str, limit: float = 60.0) -> None:
    others = [r for r in range(dist.get_world_size()) if r != FAILING]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(ctx["out"], f"{name}.caught.{r}")) for r in others):
            return
        time.sleep(0.01)


SCENARIOS = [
    ("moe_tp4", lambda ctx: scenario_moe(ctx, (4,))),
    ("moe_ep_tp_2x2", lambda ctx: scenario_moe(ctx, (2, 2))),
    ("moe_dcp_tp4", lambda ctx: scenario_moe(ctx, (4,), dcp=True)),
    ("moe_rounds_tp4", lambda ctx: scenario_moe(ctx, (4,), rounds=True)),
    ("layout_tp4", scenario_layout),
    ("changed_on_one_rank", scenario_changed_on_one_rank),
    ("fails_after_exchange", scenario_fails_after_exchange),
    ("ranks_disagree", scenario_ranks_disagree),
    ("altered_in_transit", scenario_altered_in_transit),
    ("garbage_host_post", scenario_garbage_host_post),
    ("hangs_at_the_exchange", lambda ctx: scenario_stopped_at_the_exchange(ctx, "hangs")),
    ("dies_at_the_exchange", lambda ctx: scenario_stopped_at_the_exchange(ctx, "dies")),  # last: rank 2 dies
]


if __name__ == "__main__":  # run by tests/test_exchange_reads.py: exchange_worker.py RANK WORLD CTX_JSON
    worker_main(SCENARIOS, timeout=60)  # rank 2 is killed in the last one
