"""Benchmark: moving a model's weights between two shardings on 4 gloo ranks, against gather-then-load and
broadcast-then-cut, a prepared transfer replayed, and the plan time of simulated DeepSeek-V3 and Kimi-K2 pairs.

    python bench/transfer_bench.py [--repeat 3] [--bucket-mib 64,16] [--replays 4] [--ds-layers 4,5]
        [--kimi-layers 4] [--replay-only] [--markdown]

The source is transformers' Qwen3-MoE of bench/common.py (``QWEN3_MOE``: hidden 1024, 4 layers, 32 experts of
512, bf16, ~440 MiB), every tensor FSDP-style ``Shard(0)`` over the 4 ranks (each rank's shard filled with its
own random values). The destination, on the same 4 ranks (colocated, as a trainer and its rollout engine), is
an inference-engine layout of the same weights: q, k and v fused into ``qkv_proj`` (rows, ``Shard(0)``), the
experts' gate and up in ``mlp.gate_up_proj`` (``_StridedShard(1, split_factor=2)``: matching gate and up rows
on each rank), ``mlp.down_proj`` ``Shard(2)``, ``o_proj`` ``Shard(1)``, vocab-parallel head, column-parallel
embedding, norms and router replicated: tensor parallel over 4. Methods, same run, same shards:

* ``transfer_weights``: ``loader.transfer_weights(src, dst, dst_mapping=rules(),
  options=TransferOptions(bucket_bytes=B))`` for each
  ``--bucket-mib`` B (the plan composes the source's save mapping with the destination's load rules, through
  the per-expert checkpoint keys; its wall includes planning on every rank);
* ``gather + load`` (verl / OpenRLHF): per destination tensor, ``full_tensor()`` of each source tensor it is
  made of (an ``all_gather`` on every rank), fused in memory, then each rank copies its boxes out of it;
* ``broadcast + cut`` (checkpoint-engine): per source tensor, one owner (round robin) gathers it whole and
  broadcasts it; every rank fuses and cuts its boxes.

Per method and rank: payload bytes received (a rank's own bytes included) ÷ its destination shard bytes
(1.000: each element once), bytes sent ÷ what the destinations need from that rank (the plan's pairs,
from ``simulate_transfer`` on meta models: an independent count for the two other methods), peak extra memory
(peak RSS during the call above the RSS before it: ``/proc/self/clear_refs`` resets the peak; glibc's mmap
threshold is fixed at 64 KiB so that freed buffers leave RSS), wall (the slowest rank, best and median of
``--repeat``). Every method's destination shards are checked equal to ``transfer_weights``'s bit for bit.
Then, per bucket, ``prepare_transfer`` once and ``--replays`` runs of it, each after an in-place step of the
source (``mul_(2)``; the last run halves it back, exactly, and is checked against ``transfer_weights``' result):
the first run and the replayed ones (the slowest rank of each), the check and its agreement, the part of the wall
outside the exchange (``TransferRun``: wall minus the rounds' copies and collectives; waiting for the slowest
rank included), the part of it that is this rank's own work (``PreparedTransfer.cpu_outside_seconds``: the main
thread's CPU time outside the rounds, the highest rank of each run), the strided copies and the buffers each rank
holds. Then ``simulate_transfer`` plans DeepSeek-V3 (bench/plan_scale.py's meta model and
EP x TP placements) from FSDP over 64 ranks into EP8 x TP8 on 64 more: the plan time of one rank
(``plan_transfer(..., rank=r)``, what each rank of a transfer computes; a source rank and a destination rank,
best of 3) and of the whole world (the simulation's figures); and Kimi-K2 (``--kimi-layers``: DeepSeek-V3's
architecture with 384 experts) from FSDP over 256 ranks into EP16 x TP8 on 128 more: one source rank's and one
destination rank's plans (no world plan).

Pushes into a running vLLM engine (``loader.vllm.EngineSync``: the first push and replayed ones, against the verl
and checkpoint-engine ways, and delta pushes at 0.1, 1 and 10 % changed) need vLLM's environment: they are
bench/sync_bench.py's tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mdtable
from common import QWEN3_MOE

WORLD = 4
MIB = 1 << 20
OTHERS = ("gather + load", "broadcast + cut")


# ---------------------------------------------------------------------------------------------------
# the two models


def qkv(q, k, v):
    import torch

    return torch.cat([q, k, v])


def gate_up(gates, ups):
    import torch

    return torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)


def stack(ws):
    import torch

    return torch.stack(ws)


def rules() -> list:
    """Checkpoint (transformers' Qwen3-MoE keys) -> the engine layout."""
    from loader import Convert

    return [
        Convert(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                "self_attn.qkv_proj.weight", qkv),
        Convert(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.gate_up_proj", gate_up),
        Convert("mlp.experts.*.down_proj.weight", "mlp.down_proj", stack),
    ]  # fmt: skip


def hf_model(device: str = "meta"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **QWEN3_MOE), dtype=torch.bfloat16)


def engine_model():
    """The engine's layout on meta: the source's tensors renamed and fused."""
    import torch
    from torch import nn

    names = {}
    for name, t in hf_model().state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            continue
        shape = tuple(t.shape)
        if name.endswith("q_proj.weight"):
            name = name.replace("q_proj", "qkv_proj")
            shape = (shape[0] + 2 * QWEN3_MOE["num_key_value_heads"] * QWEN3_MOE["head_dim"], shape[1])
        names[name.replace("mlp.experts.", "mlp.")] = shape
    root = nn.Module()
    for name, shape in names.items():
        *path, leaf = name.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta")))
    return root


def sources_of(dest_name: str) -> list[str]:
    """The source tensors a destination tensor is fused from (in order)."""
    if dest_name.endswith("qkv_proj.weight"):
        return [dest_name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    if dest_name.endswith(("mlp.gate_up_proj", "mlp.down_proj")):
        return [dest_name.replace("mlp.", "mlp.experts.")]
    return [dest_name]


def fuse(tensors: list):
    import torch

    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def fsdp(name, shape):
    from torch.distributed.tensor import Shard

    return [Shard(0)]


def tp_placements(model) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {}
    for name, _ in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "lm_head.weight")):
            out[name] = [Shard(0)]
        elif name.endswith("o_proj.weight"):
            out[name] = [Shard(1)]
        elif name.endswith("gate_up_proj"):
            out[name] = [_StridedShard(1, split_factor=2)]
        elif name.endswith("down_proj"):
            out[name] = [Shard(2)]
        elif name.endswith("embed_tokens.weight"):
            out[name] = [Shard(1)]
    return out


# ---------------------------------------------------------------------------------------------------
# one rank


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _gather_load(src, dst) -> tuple[int, int]:
    """verl-style: every source tensor a destination tensor needs gathered whole on every rank, then cut."""
    import torch.distributed as dist

    from loader.placements import slot_for
    from loader.plan import box_view

    state, world = src.state_dict(), dist.get_world_size()
    received = sent = 0
    for name, t in dst.state_dict(keep_vars=True).items():
        parts = [state[s].full_tensor() for s in sources_of(name)]
        received += sum(p.numel() * p.element_size() for p in parts)
        sent += sum(state[s].to_local().numel() * state[s].element_size() * world for s in sources_of(name))
        full, slot = fuse(parts), slot_for(name, t)
        for g, lb in slot.boxes:
            box_view(slot.local, lb).copy_(box_view(full, g))
    return received, sent


def _broadcast_cut(src, dst) -> tuple[int, int]:
    """checkpoint-engine-style: each source tensor gathered whole on one owner and broadcast; every rank cuts."""
    import torch
    import torch.distributed as dist

    from loader.placements import slot_for
    from loader.plan import box_view

    state, world, rank = src.state_dict(), dist.get_world_size(), dist.get_rank()
    received = sent = 0
    for i, (name, t) in enumerate(dst.state_dict(keep_vars=True).items()):
        parts = []
        for s in sources_of(name):
            local, owner = state[s].to_local().contiguous(), i % world
            chunks = [torch.empty_like(local) for _ in range(world)] if rank == owner else None
            dist.gather(local, chunks, dst=owner)
            full = torch.cat(chunks) if rank == owner else torch.empty(state[s].shape, dtype=local.dtype)
            dist.broadcast(full, src=owner)
            nbytes = full.numel() * full.element_size()
            received += nbytes
            sent += local.numel() * local.element_size() + (nbytes * (world - 1) if rank == owner else 0)
            parts.append(full)
        full, slot = fuse(parts), slot_for(name, t)
        for g, lb in slot.boxes:
            box_view(slot.local, lb).copy_(box_view(full, g))
    return received, sent


def rank_main(rank: int, spec: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loader import transfer_weights
    from loader.options import TransferOptions
    from loader.placements import shard_module, slot_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    src = hf_model()
    shard_module(src, mesh, {n: fsdp(n, None) for n in src.state_dict()}, fill=None)
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for name, t in src.state_dict(keep_vars=True).items():
            local = slot_for(name, t).local
            local.copy_(torch.randn(local.shape, generator=gen))
    dst = engine_model()
    shard_module(dst, mesh, tp_placements(dst), fill=None)
    locals_ = {n: slot_for(n, t).local for n, t in dst.state_dict(keep_vars=True).items()}
    reference = None
    out = []
    for method, bucket in [("transfer_weights", b) for b in spec["buckets"]] + [(m, 0) for m in spec["others"]]:
        for rep in range(spec["repeat"]):
            with torch.no_grad():
                for t in locals_.values():
                    t.fill_(float("nan"))
            dist.barrier()
            rss = _vm("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            t0 = time.perf_counter()
            if method == "transfer_weights":
                r = transfer_weights(
                    src, dst, dst_mapping=rules(), options=TransferOptions(bucket_bytes=bucket, timeout=600)
                )
                received, sent, local, messages = r.bytes_received, r.bytes_sent, r.bytes_local, r.messages
            else:
                fn = _gather_load if method == "gather + load" else _broadcast_cut
                with torch.no_grad():
                    received, sent = fn(src, dst)
                local = messages = None
            wall = time.perf_counter() - t0
            peak = _vm("VmHWM") - rss
            if reference is None:
                reference = {n: t.clone() for n, t in locals_.items()}
            same = all(torch.equal(t, reference[n]) for n, t in locals_.items())
            out.append(dict(method=_label(method, bucket), rep=rep, wall=wall, peak=peak, received=received, sent=sent,
                            local=local, messages=messages, same=same))  # fmt: skip
    out += _replays(src, dst, locals_, reference, spec)
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _replays(src, dst, locals_, reference, spec: dict) -> list[dict]:
    """Per bucket: ``prepare_transfer`` timed, then ``--replays`` runs, each after an in-place step of the source
    (doubling it; the last one halves it back, exactly, and its result is checked against ``transfer_weights``')."""
    import torch
    import torch.distributed as dist

    from loader.options import TransferOptions
    from loader.transfer import prepare_transfer

    out = []
    for bucket in spec["buckets"]:
        options = TransferOptions(bucket_bytes=bucket, timeout=600)
        dist.barrier()
        t0 = time.perf_counter()
        prepared = prepare_transfer(src, dst, dst_mapping=rules(), options=options)
        prepare = time.perf_counter() - t0
        runs = spec["replays"]
        for i in range(runs):
            step = 2.0 if i < runs - 1 else 0.5 ** (runs - 2)  # the values of the first run again at the end
            with torch.no_grad():
                if i:
                    for t in src.parameters():
                        t.mul_(step)
                for t in locals_.values():
                    t.fill_(float("nan"))
            dist.barrier()
            r = prepared.run(src, dst)
            same = i < runs - 1 or all(torch.equal(t, reference[n]) for n, t in locals_.items())
            out.append(dict(method=f"replay {bucket // MIB}", rep=i, wall=r.seconds, check=r.run.check_seconds,
                            exchange=r.run.exchange_seconds, cpu=prepared.cpu_outside_seconds, planned=r.planned,
                            prepare=prepare,
                            copies=prepared.copies, buffers=prepared.buffer_bytes, same=same))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------
# the parent: simulations, the world, the tables


def simulate_bench_pair():
    from loader.transfer import TransferMeshes, simulate_transfer

    dst = engine_model()
    return simulate_transfer(
        hf_model(),
        dst,
        dst_mapping=rules(),
        meshes=TransferMeshes(
            src_mesh_shape=(WORLD,),
            src_placements=fsdp,
            dst_mesh_shape=(WORLD,),
            dst_placements=tp_placements(dst),
            colocated=True,
        ),
    )


def simulate_deepseek(layers: int) -> dict:
    import plan_scale

    from loader.transfer import TransferMeshes, dest_side, plan_transfer, simulate_transfer, source_side
    from loader.transfer.simulate import mesh_parts

    model = plan_scale.build_model(layers)
    f = simulate_transfer(
        model,
        model,
        timed_ranks=(0, 64),
        meshes=TransferMeshes(
            src_mesh_shape=(64,),
            src_placements=fsdp,
            dst_mesh_shape=plan_scale.MESH,
            dst_placements=plan_scale.placements_for(model),
        ),
    )
    # one rank's plan again, twice (best of 3): what each rank of a transfer computes
    src = mesh_parts(model, (64,), fsdp) + [{}] * 64
    dst_parts = [{}] * 64 + mesh_parts(model, plan_scale.MESH, plan_scale.placements_for(model))
    side = source_side(model)
    dest, _ = dest_side(model, None, side.keys)
    rank = {}
    for r in (0, 64):
        times = [f.rank_plan_seconds[r]]
        for _ in range(2):
            t = time.perf_counter()
            plan_transfer(side, dest, src, dst_parts, rank=r)
            times.append(time.perf_counter() - t)
        rank[r] = min(times)
    dst = [f.ranks[r] for r in f.dst_ranks]
    return dict(layers=layers, plan=f.plan_seconds, rank=rank, map=f.map_seconds, moves=f.moves,
                ratio=(min(r.received_ratio for r in dst), max(r.received_ratio for r in dst)),
                moved=f.bytes_moved, fallback=f.fallback)  # fmt: skip


KIMI_K2 = dict(n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64, first_k_dense_replace=1,
               vocab_size=163840)  # over bench/common.py's DEEPSEEK_V3: the same architecture  # fmt: skip
KIMI_MESH = (16, 8)  # the destination's (ep, tp): 128 ranks, after the source's 256


def simulate_kimi(layers: int) -> dict:
    """Kimi-K2 (DeepSeek-V3's architecture, 384 experts) from FSDP over 256 ranks into EP16 x TP8 on 128 more: the
    plan of a source rank and of a destination rank (``plan_transfer(..., rank=r)``, best of 2), no world plan."""
    import plan_scale
    import torch
    from common import DEEPSEEK_V3
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader.plan import TraceCache
    from loader.transfer import dest_side, plan_transfer, source_side
    from loader.transfer.simulate import mesh_parts, parts_bytes

    cfg = AutoConfig.for_model("deepseek_v3", **dict(DEEPSEEK_V3, **KIMI_K2, num_hidden_layers=layers))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    t = time.perf_counter()
    cache = TraceCache()
    side = source_side(model, cache=cache)
    dest, _ = dest_side(model, None, side.keys, cache)
    mapped = time.perf_counter() - t
    dst_parts = mesh_parts(model, KIMI_MESH, plan_scale.placements_for(model))
    src = mesh_parts(model, (256,), fsdp) + [{}] * len(dst_parts)
    dst = [{}] * 256 + dst_parts
    rank, moves, ratio = {}, {}, None
    for r in (0, 256):
        times = []
        for _ in range(2):
            t = time.perf_counter()
            plan = plan_transfer(side, dest, src, dst, rank=r)
            times.append(time.perf_counter() - t)
        rank[r], moves[r] = min(times), len(plan.moves)
        if r == 256:
            ratio = plan.bytes_received(r) / parts_bytes(dst[r])
    params = sum(math.prod(t.shape) for t in model.state_dict().values())
    return dict(layers=layers, rank=rank, moves=moves, map=mapped, ratio=ratio, params=params)


def run_world(spec: dict) -> list[list[dict]]:
    import torch.multiprocessing as mp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)  # freed buffers leave RSS (inherited by the ranks)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec["init"] = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.start_processes(rank_main, args=(spec,), nprocs=WORLD, join=True, start_method="spawn")
    return [json.load(open(os.path.join(spec["out"], f"rank{r}.json"))) for r in range(WORLD)]


def _label(method: str, bucket: int) -> str:
    return f"{method} ({bucket // MIB} MiB buckets)" if bucket else method


def _range(values, fmt="{:.3f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def tables(results: list[list[dict]], sim, ds: list[dict], buckets: list[int], kimi: list[dict]) -> str:
    shard = [r.dst_shard_bytes for r in sim.ranks]
    need = [r.sent for r in sim.ranks]
    rows = []
    methods = [_label("transfer_weights", b) for b in buckets] + list(OTHERS)
    for method in methods:
        per = [[x for x in rank if x["method"] == method] for rank in results]
        walls = [max(rep) for rep in zip(*[[x["wall"] for x in p] for p in per])]
        last = [p[-1] for p in per]
        rows.append([
            f"`{method}`",
            _range([x["received"] / s for x, s in zip(last, shard)]),
            _range([x["sent"] / n for x, n in zip(last, need)]),
            _range([max(x["peak"] for x in p) / MIB for p in per], "{:.0f}") + " MiB",
            mdtable.spread(walls),
            "yes" if all(x["same"] for p in per for x in p) else "**NO**",
        ])  # fmt: skip
    ours = [[x for x in rank if x["method"] == methods[0]][-1] for rank in results]
    sim_ok = all(x["received"] == r.received and x["sent"] == r.sent for x, r in zip(ours, sim.ranks))
    head = (
        f"Qwen3-MoE (`QWEN3_MOE`, bf16, {sum(shard) / MIB:.0f} MiB of destination shards in all), "
        f"4 gloo ranks colocated, source `Shard(0)` → fused TP destination; "
        f"each rank's destination shard {_range([s / MIB for s in shard], '{:.1f}')} MiB. The simulated plan "
        f"(`simulate_transfer` on meta models) {'equals' if sim_ok else '**differs from**'} the run's bytes "
        "sent and received on every rank."
    )
    t1 = mdtable.table(
        ["method", "received ÷ shard (per rank)", "sent ÷ needed from it", "peak extra memory", "wall",
         "= transfer_weights"], rows,
    )  # fmt: skip
    t2 = mdtable.table(
        ["DeepSeek-V3 layers", "plan time, one rank (source 0 / destination 64)", "whole world's plan (simulation)",
         "mapping both models (once)", "strided copies", "received ÷ shard", "moved between ranks"],
        [[d["layers"], f"{d['rank'][0]:.2f} s / {d['rank'][64]:.2f} s", f"{d['plan']:.2f} s", f"{d['map']:.2f} s",
          d["moves"], _range(d["ratio"]),
          f"{d['moved'] / (1 << 30):.1f} GiB"] for d in ds],
    )  # fmt: skip
    ds_head = (
        "`simulate_transfer`: DeepSeek-V3 (bench/plan_scale.py's meta model, first 3 layers dense, bf16) from "
        "FSDP `Shard(0)` over ranks 0–63 into EP8 x TP8 on ranks 64–127; one process, no data."
    )
    parts = [head, "", t1, "", replay_table(results, buckets), "", ds_head, "", t2]
    if kimi:
        parts += ["", kimi_table(kimi)]
    return "\n".join(parts)


def replay_table(results: list[list[dict]], buckets: list[int]) -> str:
    """``prepare_transfer`` once, then its runs, against ``transfer_weights`` (which plans on every call)."""
    rows = []
    for bucket in buckets:
        one = [[x for x in rank if x["method"] == _label("transfer_weights", bucket)] for rank in results]
        per = [[x for x in rank if x["method"] == f"replay {bucket // MIB}"] for rank in results]
        slowest = [max(rep, key=lambda x: x["wall"]) for rep in zip(*per)]  # per run, the slowest rank
        replays = slowest[1:]
        outside = [(x["wall"] - x["exchange"]) / x["wall"] for x in replays]
        cpu = [max(x["cpu"] / x["wall"] for x in rep) for rep in list(zip(*per))[1:]]  # per run, the highest rank
        rows.append([
            f"{bucket // MIB} MiB",
            mdtable.spread([max(rep) for rep in zip(*[[x["wall"] for x in p] for p in one])]),
            f"{max(p[0]['prepare'] for p in per):.3f} s",
            f"{slowest[0]['wall']:.3f} s",
            mdtable.spread([x["wall"] for x in replays]),
            _range([x["check"] * 1000 for x in replays], "{:.1f}") + " ms",
            _range([100 * o for o in outside], "{:.1f}") + " %",
            _range([100 * c for c in cpu], "{:.1f}") + " %",
            _range([p[0]["copies"] for p in per], "{}"),
            _range([p[0]["buffers"] / MIB for p in per], "{:.0f}") + " MiB",
            "yes" if all(x["same"] and not x["planned"] for p in per for x in p) else "**NO**",
        ])  # fmt: skip
    head = (
        "`prepare_transfer` once, then `PreparedTransfer.run` after each in-place step of the source (`mul_(2)`; "
        "the last run halves it back and is compared with `transfer_weights`' result); the slowest rank of each run."
    )
    return "\n".join([head, "", mdtable.table(
        ["bucket", "`transfer_weights` (plans)", "`prepare_transfer`", "first run", "replayed run",
         "check + agreement", "outside the exchange ÷ wall", "Python outside the exchange ÷ wall",
         "strided copies per rank", "buffers held per rank",
         "= transfer_weights, no re-plan"], rows,
    )])  # fmt: skip


def kimi_table(kimi: list[dict]) -> str:
    head = (
        "Kimi-K2 (DeepSeek-V3's architecture with 384 experts, 64 heads, a 163840 vocabulary, first layer dense; "
        "meta model) from FSDP `Shard(0)` over ranks 0–255 into EP16 x TP8 on ranks 256–383: one rank's plan "
        "(`plan_transfer(..., rank=r)`, best of 2); one process, no data."
    )
    return "\n".join([head, "", mdtable.table(
        ["layers", "parameters", "plan time, one rank (source 0 / destination 256)", "strided copies (0 / 256)",
         "mapping both models (once)", "received ÷ shard (rank 256)"],
        [[k["layers"], f"{k['params'] / 1e9:.0f} B", f"{k['rank'][0]:.2f} s / {k['rank'][256]:.2f} s",
          f"{k['moves'][0]} / {k['moves'][256]}", f"{k['map']:.2f} s", f"{k['ratio']:.3f}"] for k in kimi],
    )])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mib", default="64,16", help="transfer_weights' bucket_bytes in MiB (comma-separated)")
    ap.add_argument("--ds-layers", default="4,5", help="DeepSeek-V3 layer counts to simulate (comma-separated)")
    ap.add_argument("--replays", type=int, default=4, help="runs of one prepared transfer per bucket (2 or more)")
    ap.add_argument("--kimi-layers", default="", help="Kimi-K2 layer counts to simulate (comma-separated)")
    ap.add_argument(
        "--replay-only", action="store_true",
        help="only the prepared transfer's table (transfer_weights, then the replays; no other method, no simulation)",
    )  # fmt: skip
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    watch = mdtable.LoadWatch()
    sim = None if args.replay_only else simulate_bench_pair()
    with tempfile.TemporaryDirectory() as out:
        buckets = [int(b) * MIB for b in args.bucket_mib.split(",") if b]
        others = () if args.replay_only else OTHERS
        spec = dict(out=out, repeat=args.repeat, buckets=buckets, replays=max(2, args.replays), others=others)
        results = run_world(spec)
    if args.replay_only:
        load = watch.stop()
        text = replay_table(results, buckets)
    else:
        ds = [simulate_deepseek(int(n)) for n in args.ds_layers.split(",") if n]
        kimi = [simulate_kimi(int(n)) for n in args.kimi_layers.split(",") if n]
        load = watch.stop()
        text = tables(results, sim, ds, buckets, kimi)
    if args.markdown:
        print(mdtable.run_line(load))
        print()
    else:
        print(f"load average (1 min) during the run: {load}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
