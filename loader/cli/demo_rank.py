"""One rank of ``regiontrace demo``: load the checkpoint into DTensor shards, check each against the reference,
then save the sharded model back (``save_hf_checkpoint``, every rank writing its own shards).

Spawned by :mod:`loader.cli.demo` (gloo, file store). Results go to ``rank<R>.json``; no tensors cross
processes except the reference the main process writes (``reference.pt``), which each rank waits for after
its own load (so the single-process reference load runs while the ranks start up).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .. import load_hf_checkpoint, save_hf_checkpoint
from ..options import LoadOptions, SaveOptions
from ..placements import shard_boxes, shard_module
from .demo_models import build_model, load_rules


def run_rank(rank: int, ctx: dict[str, Any]) -> None:
    """Entry point of a spawned rank (``torch.multiprocessing`` passes the rank first)."""
    torch.set_num_threads(1)
    t0 = time.time()
    world = math.prod(ctx["mesh_shape"])
    result: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{ctx['store']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=_seconds_left(ctx)),
        )
        model, checked = _load_and_check(rank, ctx)
        result.update(checked)
        result.update(_save(model, ctx))
        result["ok"] = not result["bad"] and not result["uncovered"]
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        result["seconds"] = time.time() - t0
        tmp = os.path.join(ctx["out"], f".rank{rank}.json")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(ctx["out"], f"rank{rank}.json"))
        if dist.is_initialized():
            dist.destroy_process_group()


def _save(model: torch.nn.Module, ctx: dict[str, Any]) -> dict[str, Any]:
    """Save the sharded model back into ``ctx["saved"]`` (the rules of the load; a ``Convert`` needs the
    checkpoint's keys and shapes)."""
    source_shapes = ctx["checkpoint"] if ctx["kind"] != "transformers" else None
    t0 = time.time()
    options = SaveOptions(progress=False, timeout=_seconds_left(ctx))
    report = save_hf_checkpoint(
        model, ctx["saved"], rules=load_rules(ctx["kind"]), options=options, source_shapes=source_shapes
    )
    return {
        "save": {
            "bytes_written": report.bytes_written,
            "header_bytes": report.header_bytes,
            "writes": report.writes,
            "written": len(report.written),
            "files": list(report.files),
            "seconds": time.time() - t0,
        }
    }


def _load_and_check(rank: int, ctx: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    mesh_shape = tuple(ctx["mesh_shape"])
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = ctx["placements"]
    model = shard_module(build_model(ctx["kind"], ctx["checkpoint"]), mesh, placements)
    t_load = time.time()
    report = load_hf_checkpoint(
        model, ctx["checkpoint"], rules=load_rules(ctx["kind"]), options=LoadOptions(progress=False)
    )
    load_seconds = time.time() - t_load
    reference = _wait_for_reference(ctx)
    coord = tuple(mesh.get_coordinate())
    bad, uncovered, checked, shard_bytes, elements = [], [], 0, 0, 0
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in reference:
            continue
        data = t.data if isinstance(t, torch.nn.Parameter) else t
        ref = reference[name]
        if name in placements:
            local = data.to_local()
            pairs = shard_boxes(tuple(ref.shape), mesh_shape, coord, placements[name])
        else:
            local = data
            full = tuple((0, n) for n in ref.shape)
            pairs = ((full, full),)
        covered = 0
        for g, lb in pairs:
            got = local[tuple(slice(a, b) for a, b in lb)]
            want = ref[tuple(slice(a, b) for a, b in g)]
            covered += got.numel()
            if not torch.equal(got, want.to(got.dtype)):
                bad.append(name)
                break
        if covered != local.numel():
            uncovered.append(name)
        checked += 1
        elements += local.numel()
        shard_bytes += local.numel() * ref.element_size()
    return model, {
        "coordinate": list(coord),
        "checked": checked,
        "bad": bad,
        "uncovered": uncovered,
        "elements": elements,
        "shard_bytes": shard_bytes,
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "blocks": report.blocks,
        "traced": len(report.traced),
        "deferred": len(report.deferred),
        "load_seconds": load_seconds,
    }


def _seconds_left(ctx: dict[str, Any]) -> float:
    """Seconds until the demo's deadline (``ctx["deadline"]``, wall-clock time; at least one)."""
    return max(1.0, ctx["deadline"] - time.time())


def _wait_for_reference(ctx: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = ctx["reference"]
    while not os.path.exists(path):
        if os.path.exists(ctx["reference"] + ".failed"):
            raise RuntimeError("the single-process reference load failed (see the main process)")
        if time.time() > ctx["deadline"]:
            raise TimeoutError(f"no reference at {path} by the deadline (--timeout)")
        time.sleep(0.05)
    return torch.load(path)
