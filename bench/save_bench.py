"""Benchmark: saving a model as a Hugging Face checkpoint, one process and 4 gloo ranks.

    python bench/save_bench.py [--dir DIR] [--hidden 1024] [--layers 4] [--experts 32] [--repeat 3]
                               [--mesh 2x2] [--skip-single] [--skip-dist] [--markdown]

The model is a Qwen3-MoE (bf16; hidden 1024, 4 layers, 32 experts of moe_intermediate 512, vocab 32000: about
460 MB) with fused expert tensors; its Hugging Face layout has one tensor per expert (``save_pretrained``
unfuses them: 3 x 32 per layer).

One process: one unmeasured round, then ``--repeat`` rounds of every method in turn, each run into a fresh folder
(the previous run's files deleted first); the median wall per method:

* ``ours``: ``loader.save_hf_checkpoint`` (the original layout, through the traced inverse);
* ``save_pretrained``: transformers' ``model.save_pretrained`` (same ``max_shard_size``; same files, checked
  byte for byte);
* ``save_file``: ``safetensors.torch.save_file`` of the model's own state dict, unconverted, in one file: the
  write floor (it writes the same bytes, just without the layout conversion or the sharding).

Distributed (``--mesh 2x2``: experts EP over mesh dim 0 and TP over dim 1 (``_StridedShard`` gate_up, ``Shard``
down), attention TP (q/k/v rows, o_proj columns), embedding vocab-parallel on dim 0; norms, router and lm_head
replicated; ``--mesh 4``: a 1-D TP layout), four ranks spawned on localhost with gloo, each holding its
DTensor shards (``distribute_tensor(..., src_data_rank=None)``, no communication):

* ``ours``: every rank calls ``save_hf_checkpoint``; per rank, bytes written vs its shard bytes (the local
  shards it is the lowest holder of: replicas write once) and vs all its local bytes;
* ``gather``: what a gather-then-save does: every DTensor ``full_tensor()``-ed (all-gathered), rank 0 loads the
  full tensors into a plain model and calls ``save_pretrained``.

Wall = the slowest rank, from a barrier to the end of the call. The files of both are compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import mdtable

from loader.options import SaveOptions

MIB = 1 << 20


def build(args: argparse.Namespace, device: str = "cpu"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=32000,
        num_experts=args.experts, num_experts_per_tok=4, moe_intermediate_size=args.hidden // 2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if device != "meta":
        with torch.no_grad():
            for i, t in enumerate(model.state_dict().values()):
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype))
    return model


def folder_equal(a: str, b: str) -> bool:
    names = sorted(n for n in os.listdir(a) if n.endswith((".safetensors", ".json")))
    if names != sorted(n for n in os.listdir(b) if n.endswith((".safetensors", ".json"))):
        return False
    for n in names:
        with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
            while True:
                x, y = fa.read(64 * MIB), fb.read(64 * MIB)
                if x != y:
                    return False
                if not x:
                    break
    return True


def timed(methods: dict, repeat: int, root: str) -> dict[str, float]:
    """Median wall per method: one unmeasured round, then ``repeat`` rounds, the methods interleaved in each (so
    that page-cache and writeback state weigh on all alike); each run writes into a fresh folder."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(repeat + 1):
        for name, fn in methods.items():
            folder = os.path.join(root, name)
            shutil.rmtree(folder, ignore_errors=True)
            t0 = time.perf_counter()
            fn(folder)
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def single(args: argparse.Namespace) -> str:
    """Time the one-process saves; returns the markdown table (printed as plain text too)."""
    from safetensors.torch import save_file

    from loader import save_hf_checkpoint

    model = build(args)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"one process: Qwen3-MoE bf16, {nbytes / MIB:.0f} MiB of tensors, {args.repeat} interleaved runs (median)")
    shard = "5GB"
    methods = {
        "ours": lambda d: save_hf_checkpoint(model, d, options=SaveOptions(max_shard_size=shard, progress=False)),
        "save_pretrained": lambda d: model.save_pretrained(d, max_shard_size=shard),
        "save_file": lambda d: (os.makedirs(d), save_file(model.state_dict(), os.path.join(d, "m.safetensors"))),
    }
    walls = timed(methods, args.repeat, args.dir)
    same = folder_equal(os.path.join(args.dir, "ours"), os.path.join(args.dir, "save_pretrained"))
    for name, wall in walls.items():
        print(f"  {name:16s} {wall:7.3f} s  {nbytes / MIB / wall:7.0f} MiB/s  {wall / walls['save_file']:5.2f}x floor")
    print(f"  ours / save_pretrained: {walls['ours'] / walls['save_pretrained']:.2f}x; files identical: {same}")
    shutil.rmtree(args.dir, ignore_errors=True)
    labels = {
        "ours": "ours (`save_hf_checkpoint`)",
        "save_pretrained": "`save_pretrained`",
        "save_file": "`safetensors.torch.save_file` of the state dict (the floor)",
    }
    rows = [
        [labels[n], f"{w:.3f} s", f"{nbytes / MIB / w:.0f}", f"{w / walls['save_file']:.2f}x"] for n, w in walls.items()
    ]
    return (
        f"One process, Qwen3-MoE bf16, {nbytes / MIB:.0f} MiB of tensors; median of {args.repeat} interleaved runs, "
        "each into a fresh folder:\n\n"
        + mdtable.table(["method", "wall", "MiB/s", "vs the `save_file` floor"], rows)
        + f"\n\nours / save_pretrained {walls['ours'] / walls['save_pretrained']:.2f}x; files identical to "
        f"`save_pretrained`'s: {same}."
    )


# ---------------------------------------------------------------------------------------------------
# distributed


def placements(model, mesh_shape: tuple[int, ...]) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    two = len(mesh_shape) == 2
    out = {}
    for name, _ in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[name] = [Replicate(), Shard(0)] if two else [Shard(0)]
        elif name.endswith("o_proj.weight"):
            out[name] = [Replicate(), Shard(1)] if two else [Shard(1)]
        elif name.endswith("experts.gate_up_proj"):
            out[name] = [Shard(0), _StridedShard(1, split_factor=2)] if two else [_StridedShard(1, split_factor=2)]
        elif name.endswith("experts.down_proj"):
            out[name] = [Shard(0), Shard(2)] if two else [Shard(2)]
        elif name.endswith("embed_tokens.weight"):
            out[name] = [Shard(0), Replicate()] if two else [Shard(0)]
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from loader import save_hf_checkpoint
    from loader.placements import slot_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    mesh_shape = tuple(int(n) for n in args.mesh.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape)
    model = build(args)
    with torch.no_grad():
        for name, pl in placements(model, mesh_shape).items():
            mod, _, leaf = name.rpartition(".")
            p = getattr(model.get_submodule(mod), leaf)
            setattr(model.get_submodule(mod), leaf, nn.Parameter(distribute_tensor(p, mesh, pl, src_data_rank=None),
                                                                 requires_grad=False))  # fmt: skip
    local = sum(slot_for(n, t).local_numel * t.element_size() for n, t in model.state_dict(keep_vars=True).items())
    ours_dir, gather_dir = os.path.join(args.dir, "ours"), os.path.join(args.dir, "gather")
    full = build(args, device="meta").to_empty(device="cpu") if rank == 0 else None

    dist.barrier()
    t0 = time.perf_counter()
    report = save_hf_checkpoint(model, ours_dir, options=SaveOptions(progress=False))
    ours_wall = time.perf_counter() - t0

    dist.barrier()
    t0 = time.perf_counter()
    state = {}
    for name, t in model.state_dict().items():
        state[name] = t.full_tensor() if isinstance(t, DTensor) else t
    if rank == 0:
        full.load_state_dict(state)
        full.save_pretrained(gather_dir, max_shard_size="5GB")
    dist.barrier()
    gather_wall = time.perf_counter() - t0
    owned = _owned_bytes(model)
    row = dict(rank=rank, local=local, owned=owned, written=report.bytes_written, writes=report.writes,
               ours=ours_wall, gather=gather_wall, total=report.total_size)  # fmt: skip
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"{world} gloo ranks, mesh {args.mesh}: checkpoint {rows[0]['total'] / MIB:.0f} MiB")
        print("  rank  local MiB  shard MiB  written MiB  written/shard  written/local  writes")
        for r in rows:
            mib = [r["local"] / MIB, r["owned"] / MIB, r["written"] / MIB]
            ratios = [r["written"] / r["owned"], r["written"] / r["local"]]
            print(f"  {r['rank']:4d}  {mib[0]:9.1f}  {mib[1]:9.1f}  {mib[2]:11.1f}  {ratios[0]:13.3f}  "
                  f"{ratios[1]:13.3f}  {r['writes']:6d}")  # fmt: skip
        ours, gather = max(r["ours"] for r in rows), max(r["gather"] for r in rows)
        print(f"  sum written / checkpoint bytes: {sum(r['written'] for r in rows) / rows[0]['total']:.3f}")
        print(f"  wall: ours {ours:.3f} s, gather to rank 0 + save_pretrained {gather:.3f} s ({gather / ours:.2f}x)")
        same = folder_equal(ours_dir, gather_dir)
        print(f"  files identical: {same}")
        if args.markdown:
            rows_md = [
                [r["rank"], f"{r['local'] / MIB:.1f}", f"{r['owned'] / MIB:.1f}", f"{r['written'] / MIB:.1f}",
                 f"{r['written'] / r['owned']:.3f}", f"{r['written'] / r['local']:.3f}", r["writes"]]
                for r in rows
            ]  # fmt: skip
            md = (
                f"{world} gloo ranks, mesh {args.mesh}, checkpoint {rows[0]['total'] / MIB:.0f} MiB:\n\n"
                + mdtable.table(
                    ["rank", "local MiB", "shard MiB", "written MiB", "written/shard", "written/local", "writes"],
                    rows_md,
                )
                + f"\n\nsum written / checkpoint bytes {sum(r['written'] for r in rows) / rows[0]['total']:.3f}; "
                f"wall (slowest rank, from a barrier): ours {ours:.3f} s, gather to rank 0 + `save_pretrained` "
                f"{gather:.3f} s ({gather / ours:.2f}x); files identical: {same}."
            )
            with open(os.path.join(args.dir, "table.md"), "w") as f:
                f.write(md)
    dist.barrier()
    dist.destroy_process_group()


def _owned_bytes(model) -> int:
    """Bytes of the local shards this rank is the lowest holder of (replicas compared by their boxes)."""
    import torch.distributed as dist

    from loader.placements import slot_for

    mine = {n: (slot_for(n, t).boxes, slot_for(n, t).local_numel * t.element_size())
            for n, t in model.state_dict(keep_vars=True).items()}  # fmt: skip
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: b for n, (b, _) in mine.items()})
    rank = dist.get_rank()
    return sum(size for n, (boxes, size) in mine.items() if boxes and min(r for r, e in enumerate(every)
                                                                             if e[n] == boxes) == rank)  # fmt: skip


def distributed(args: argparse.Namespace) -> str:
    """Run the ranks; returns rank 0's markdown table (with ``--markdown``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 1
    for n in args.mesh.split("x"):
        world *= int(n)
    cmd = [sys.executable, __file__, "--worker", "--port", str(port), "--world", str(world)]
    cmd += ["--dir", args.dir, "--hidden", str(args.hidden), "--layers", str(args.layers)]
    cmd += ["--experts", str(args.experts), "--mesh", args.mesh] + (["--markdown"] if args.markdown else [])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(world)]
    codes = [p.wait() for p in procs]
    md_path = os.path.join(args.dir, "table.md")
    md = open(md_path).read() if os.path.exists(md_path) else ""
    shutil.rmtree(args.dir, ignore_errors=True)
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")
    return md


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--mesh", default="2x2")
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--skip-dist", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.rank, args.world, args.port, args)
        return
    base = args.dir or tempfile.mkdtemp(prefix="save_bench-")
    watch = mdtable.LoadWatch()
    tables = []
    if not args.skip_single:
        args.dir = os.path.join(base, "single")
        tables.append(single(args))
    if not args.skip_dist:
        args.dir = os.path.join(base, "dist")
        tables.append(distributed(args))
    load = watch.stop()
    if args.markdown:
        print()
        print(mdtable.run_line(load, ("torch", "transformers", "safetensors")))
        for t in tables:
            print()
            print(t)
    if not args.markdown:
        print(json.dumps({"hidden": args.hidden, "layers": args.layers, "experts": args.experts, "mesh": args.mesh}))


if __name__ == "__main__":
    main()
