"""One rank of the 4-rank gloo world of tests/test_transfer.py: every transfer scenario, results to a file.

``python transfer_worker.py RANK WORLD CTX_JSON``. The source is the tiny transformers Qwen3-MoE of the test
(``hf_models.build``, same seed on every rank) sharded FSDP-style (``Shard(0)``); the destination is
``transfer_models.Engine`` (fused rope'd qkv, merged gate_up) under TP or EP x TP. Each scenario returns the
rank's report and which of its local shards differ from the oracle (the destination loaded with
``load_hf_checkpoint`` from the source's ``save_hf_checkpoint`` files, in the test process). The last scenario
kills rank 2.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import transfer_models as tm
from gloo_world import worker_main
from hf_models import build
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loader.options import TransferOptions
from loader.placements import shard_module, slot_for
from loader.plan import box_view

MESHES: dict = {}
KILLED = 2


def source_model(mesh, placements=tm.fsdp_placements) -> torch.nn.Module:
    """The source with its values, sharded over ``mesh`` (default: every parameter ``Shard(0)``)."""
    _, model = build("qwen3_moe", 0, tie_word_embeddings=False)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard_module(model, mesh, placements(model), fill=None)
    return _with_values(model, full)


def dest_model(mesh, ep: bool = False, model: torch.nn.Module | None = None) -> torch.nn.Module:
    model = model if model is not None else tm.Engine()
    placements = tm.tp_placements(model, two_dims=ep)
    if ep:
        placements = {
            n: [Shard(0), _StridedShard(1, split_factor=2)] if n.endswith("gate_up_proj") else p
            for n, p in placements.items()
        }
    return shard_module(model, mesh, placements, fill=-1.0)


def compare(model: torch.nn.Module | None, oracle: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """The tensors whose local shards differ from the oracle's boxes, and the local shard bytes."""
    if model is None:
        return [], 0
    bad, nbytes = [], 0
    for name, t in model.state_dict(keep_vars=True).items():
        slot = slot_for(name, t)
        nbytes += slot.local_numel * slot.dtype.itemsize
        if not all(torch.equal(box_view(slot.local, lb), box_view(oracle[name], g)) for g, lb in slot.boxes):
            bad.append(name)
    return bad, nbytes


def unchanged(model: torch.nn.Module | None) -> bool:
    return model is None or all(
        bool((slot_for(n, t).local == -1).all()) for n, t in model.state_dict(keep_vars=True).items()
    )


def report_dict(report) -> dict:
    keys = ("bytes_sent", "bytes_received", "bytes_local", "transferred", "fallback", "messages", "rounds")
    return {k: getattr(report, k) for k in keys} | {"text": str(report)}


def describe(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "reason": getattr(e, "reason", None),
            "ranks": getattr(e, "ranks", None), "stage": getattr(e, "stage", None)}  # fmt: skip


def _transfer(ctx: dict, src, dst, oracle: str, **kwargs) -> dict:
    from loader import transfer_weights

    options = TransferOptions(
        timeout=60, **({"bucket_bytes": kwargs.pop("bucket_bytes")} if "bucket_bytes" in kwargs else {})
    )
    report = transfer_weights(src, dst, dst_mapping=kwargs.pop("rules", tm.rules()), options=options, **kwargs)
    bad, nbytes = compare(dst, torch.load(ctx[oracle]))
    return {"report": report_dict(report), "mismatch": bad, "shard_bytes": nbytes}


# ---------------------------------------------------------------------------------------------------


def scenario_colocated_tp(ctx: dict) -> dict:
    mesh = MESHES["world"]
    return _transfer(ctx, source_model(mesh), dest_model(mesh), "oracle")


def scenario_colocated_ep_tp(ctx: dict) -> dict:
    return _transfer(ctx, source_model(MESHES["world"]), dest_model(MESHES["2x2"], ep=True), "oracle")


def scenario_ep_tp_source(ctx: dict) -> dict:
    src = source_model(MESHES["2x2"], tm.ep_tp_source_placements)
    return _transfer(ctx, src, dest_model(MESHES["world"]), "oracle", bucket_bytes=8192)


def scenario_disaggregated(ctx: dict) -> dict:
    half = MESHES["half"]
    rank = dist.get_rank()
    src = source_model(half) if rank < 2 else None
    dst = dest_model(half) if rank >= 2 else None
    return _transfer(ctx, src, dst, "oracle", bucket_bytes=8192)


def scenario_fallback(ctx: dict) -> dict:
    mesh = MESHES["world"]
    return _transfer(ctx, source_model(mesh), dest_model(mesh), "oracle_fallback", rules=tm.rules_with_fallback())


def scenario_shape_mismatch(ctx: dict) -> dict:
    from loader import transfer_weights

    mesh = MESHES["world"]
    dst = dest_model(mesh, model=tm.Engine(vocab=tm.V + 2))
    sent = []
    from loader.transfer import exchange

    original = exchange.Exchange.run
    exchange.Exchange.run = lambda self, *a, **k: sent.append(1) or original(self, *a, **k)
    try:
        transfer_weights(source_model(mesh), dst, dst_mapping=tm.rules(), options=TransferOptions(timeout=60))
        outcome = {"type": None}
    except BaseException as e:
        outcome = describe(e)
    finally:
        exchange.Exchange.run = original
    return {**outcome, "sent": bool(sent), "unchanged": unchanged(dst)}


def scenario_hung(ctx: dict) -> dict:
    """Rank 2 hangs in the second round until the others gave up (then dies): they raise PeerFailure within
    their timeout and put their shards back. Alone in its world: a collective that timed out leaves gloo's
    process group unusable."""
    import time

    from loader import transfer_weights
    from loader.transfer import exchange

    mesh, rank = MESHES["world"], dist.get_rank()
    src, dst = source_model(mesh), dest_model(mesh)
    gave_up = [os.path.join(ctx["out"], f"hung_gave_up_{r}") for r in range(dist.get_world_size()) if r != KILLED]
    calls = []
    original = exchange.Exchange._round

    def round_(self, moves):
        calls.append(1)
        if rank == KILLED and len(calls) == 2:
            deadline = time.monotonic() + 120
            while not all(map(os.path.exists, gave_up)) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, moves)

    exchange.Exchange._round = round_
    t0 = time.monotonic()
    try:
        transfer_weights(
            src, dst, dst_mapping=tm.rules(), options=TransferOptions(timeout=4, rollback=True, bucket_bytes=4096)
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = describe(e)
    finally:
        exchange.Exchange._round = original
        seconds = time.monotonic() - t0
        if rank != KILLED:
            open(os.path.join(ctx["out"], f"hung_gave_up_{rank}"), "w").close()
    return {**outcome, "seconds": seconds, "unchanged": unchanged(dst)}


def scenario_killed(ctx: dict) -> dict:
    """Rank 2 is SIGKILLed in the second round; the others raise PeerFailure and put their shards back."""
    from loader import transfer_weights
    from loader.transfer import exchange

    mesh = MESHES["world"]
    src, dst = source_model(mesh), dest_model(mesh)
    calls = []
    original = exchange.Exchange._round

    def round_(self, moves):
        calls.append(1)
        if dist.get_rank() == KILLED and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, moves)

    exchange.Exchange._round = round_
    try:
        transfer_weights(
            src, dst, dst_mapping=tm.rules(), options=TransferOptions(timeout=6, rollback=True, bucket_bytes=4096)
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = describe(e)
    finally:
        exchange.Exchange._round = original
    return {**outcome, "rounds_run": len(calls), "unchanged": unchanged(dst)}


# -- refused up front, or made to work (small models: tm.Pair, tm.Empty) -------------------------------------------


def sharded(model: torch.nn.Module, mesh, placement=None, fill=None) -> torch.nn.Module:
    """``model`` sharded over ``mesh`` (every tensor ``placement``, default ``Shard(0)``), its values kept (or
    ``fill``)."""
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard_module(model, mesh, {n: [placement or Shard(0)] for n, _ in model.named_parameters()}, fill=fill)
    return model if fill is not None else _with_values(model, full)


def _with_values(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` (sharded) with each rank's shards of the whole tensors ``full`` copied in."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            slot = slot_for(name, t)
            for g, lb in slot.boxes:
                box_view(slot.local, lb).copy_(box_view(full[name], g))
    return model


def _outcome(call) -> dict:
    try:
        call()
        return {"type": None}
    except BaseException as e:
        return describe(e)


def _untouched(model: torch.nn.Module) -> bool:
    return all(bool((slot_for(n, t).local == -1).all()) for n, t in model.state_dict(keep_vars=True).items())


def scenario_aliased_destination(ctx: dict) -> dict:
    """On rank 3 the destination's ``b`` shares ``a``'s memory (and the rules cross them): refused on every rank,
    nothing written; disjoint views of one flat buffer are fine."""
    from loader import transfer_weights

    src = sharded(tm.Pair(), MESHES["world"])
    dst = tm.Pair(values=False)
    if dist.get_rank() == 3:
        dst.b = torch.nn.Parameter(dst.a.data.view(8, 8))
    refused = _outcome(
        lambda: transfer_weights(src, dst, dst_mapping=tm.crossed(), options=TransferOptions(timeout=60))
    )
    flat = torch.full((128,), -1.0)
    buffer = tm.Pair(values=False)
    buffer.a, buffer.b = torch.nn.Parameter(flat[:64].view(8, 8)), torch.nn.Parameter(flat[64:].view(8, 8))
    transfer_weights(src, buffer, dst_mapping=tm.crossed(), options=TransferOptions(timeout=60))
    values = tm.Pair()
    crossed = torch.equal(buffer.a, values.b) and torch.equal(buffer.b, values.a)
    return {**refused, "unchanged": _untouched(dst), "flat_crossed": crossed and flat.data_ptr() == buffer.a.data_ptr()}


def scenario_mixed_source_dtypes(ctx: dict) -> dict:
    """Rank 1 holds its shard of the source's ``a`` in bfloat16, the others in float32 (``DTensor.from_local``,
    no check): refused on every rank before anything is sent."""
    from torch.distributed.tensor import DTensor

    from loader import transfer_weights

    mesh, rank = MESHES["world"], dist.get_rank()
    src = tm.Pair()
    for name in ("a", "b"):
        local = getattr(src, name).detach()[2 * rank : 2 * rank + 2].clone()
        if name == "a" and rank == 1:
            local = local.to(torch.bfloat16)
        setattr(src, name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)])))
    dst = sharded(tm.Pair(values=False), mesh, fill=-1.0)
    return {
        **_outcome(lambda: transfer_weights(src, dst, options=TransferOptions(timeout=60))),
        "unchanged": _untouched(dst),
    }


def scenario_absent_rank(ctx: dict) -> dict:
    """Rank 2 calls ``transfer_weights`` only after every other rank gave up waiting for it (5 s): they raise
    the transfer's PeerFailure naming rank 2, and rank 2, late, is told so."""
    import time

    from loader import transfer_weights

    rank = dist.get_rank()
    src, dst = sharded(tm.Pair(), MESHES["world"]), sharded(tm.Pair(values=False), MESHES["world"], fill=-1.0)
    gave_up = [os.path.join(ctx["out"], f"absent_gave_up_{r}") for r in range(dist.get_world_size()) if r != KILLED]
    if rank == KILLED:
        deadline = time.monotonic() + 120  # a hang guard only
        while not all(map(os.path.exists, gave_up)) and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        outcome = _outcome(lambda: transfer_weights(src, dst, options=TransferOptions(timeout=5)))
    finally:
        if rank != KILLED:
            open(os.path.join(ctx["out"], f"absent_gave_up_{rank}"), "w").close()
    return {**outcome, "unchanged": _untouched(dst)}


def scenario_meta_tensors(ctx: dict) -> dict:
    """Rank 1's shard of the source's ``a`` on the meta device, then rank 3's destination on it: each refused on
    every rank, naming the tensor."""
    from torch.distributed.tensor import DTensor

    from loader import transfer_weights

    mesh, rank = MESHES["world"], dist.get_rank()
    src = tm.Pair()
    local = src.a.detach()[2 * rank : 2 * rank + 2].clone()
    src.a = torch.nn.Parameter(DTensor.from_local(local.to("meta") if rank == 1 else local, mesh, [Shard(0)]))
    src.b = sharded(tm.Pair(), mesh).b
    dst = sharded(tm.Pair(values=False), mesh, fill=-1.0)
    source = _outcome(lambda: transfer_weights(src, dst, options=TransferOptions(timeout=60)))
    unchanged = _untouched(dst)
    meta_dst = tm.Pair(values=False).to("meta") if rank == 3 else tm.Pair(values=False)
    dest = _outcome(lambda: transfer_weights(sharded(tm.Pair(), mesh), meta_dst, options=TransferOptions(timeout=60)))
    return {"source": source, "dest": dest, "unchanged": unchanged and (rank == 3 or _untouched(meta_dst))}


def scenario_into_itself_transposed(ctx: dict) -> dict:
    """A model into itself with a rule transposing ``a``: refused on every rank, values untouched."""
    from loader import transfer_weights

    model = sharded(tm.Pair(), MESHES["world"])
    outcome = _outcome(
        lambda: transfer_weights(model, model, dst_mapping=tm.transposed(), options=TransferOptions(timeout=60))
    )
    return {**outcome, "unchanged": not compare(model, tm.Pair().state_dict())[0]}


def scenario_zero_elements(ctx: dict) -> dict:
    """Two [2, 0] tensors beside a [3], ``Shard(0)`` into ``Replicate()``: the [3] moved, the others empty."""
    from torch.distributed.tensor import Replicate

    from loader import transfer_weights

    src = sharded(tm.Empty(), MESHES["world"])
    dst = sharded(tm.Empty(values=False), MESHES["world"], Replicate(), fill=-1.0)
    report = transfer_weights(src, dst, options=TransferOptions(timeout=60))
    bad, _ = compare(dst, tm.Empty().state_dict())
    return {"report": report_dict(report), "mismatch": bad}


SCENARIOS = [
    ("colocated_tp", scenario_colocated_tp),
    ("colocated_ep_tp", scenario_colocated_ep_tp),
    ("ep_tp_source", scenario_ep_tp_source),
    ("disaggregated", scenario_disaggregated),
    ("fallback", scenario_fallback),
    ("shape_mismatch", scenario_shape_mismatch),
    ("aliased_destination", scenario_aliased_destination),
    ("mixed_source_dtypes", scenario_mixed_source_dtypes),
    ("absent_rank", scenario_absent_rank),  # no collective: the world stays usable
    ("meta_tensors", scenario_meta_tensors),
    ("into_itself_transposed", scenario_into_itself_transposed),
    ("zero_elements", scenario_zero_elements),
    ("killed", scenario_killed),  # last: rank 2 dies
]
HUNG_SCENARIOS = [("ready", lambda ctx: {}), ("hung", scenario_hung)]  # a world of its own: rank 2 hangs, dies


def _meshes(world: int) -> None:
    MESHES["world"] = init_device_mesh("cpu", (world,))
    MESHES["2x2"] = init_device_mesh("cpu", (2, 2))
    MESHES["half"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("side", "tp"))["tp"]


if __name__ == "__main__":  # run by tests/test_transfer.py: transfer_worker.py RANK WORLD CTX_JSON
    worker_main(lambda ctx: HUNG_SCENARIOS if ctx.get("hung") else SCENARIOS, setup=_meshes)
