"""One rank of the 4-rank gloo world of tests/test_meta_distributed.py: DTensor-sharded models on the meta device.

``python meta_worker.py RANK WORLD CTX_JSON``. Each scenario builds a tiny transformers model under
``torch.device("meta")``, shards it with DTensors whose local shards stay on meta (``shard_module(...,
device="meta")``), loads it with ``load_hf_checkpoint(..., device="cpu")`` and returns plain data about what
was allocated and loaded; the test process asserts on it. FP8 scenarios load block-quantized checkpoints
into bf16 models and also report the exact bytes each rank should read. The last scenario kills rank 2, so
the world ends with it (tests/gloo_world.py).
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from gloo_world import worker_main
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from loader.hooks import PlanHooks
from loader.options import LoadOptions, Rules
from loader.placements import plan_placements, shard_module
from loader.plan.slots import storage_of

DYING = 2


def sharded_meta_model(
    family: str, mesh_shape: tuple[int, ...], placements_of=None, dtype: torch.dtype | None = None, **overrides
):
    """``(model, mesh, placements)``: a ``family`` model built on meta (of ``dtype`` when given), its sharded
    tensors meta DTensors."""
    from hf_models import FAMILIES, config_of

    auto = FAMILIES[family][0]
    with torch.device("meta"):
        model = auto.from_config(config_of(family, **overrides), **({"dtype": dtype} if dtype else {})).eval()
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


def scenario_load(
    ctx: dict,
    family: str,
    mesh_shape: tuple[int, ...],
    placements_of=None,
    *,
    checkpoint: str | None = None,
    dtype: torch.dtype | None = None,
    extra=None,
    **overrides,
) -> dict:
    """Load a sharded meta model; report what each tensor allocated and whether its values are right.

    ``checkpoint`` names the ctx entries ``<checkpoint>_path`` / ``_ref`` (default: ``family``'s); ``extra(model,
    report)`` adds more results (it may be collective: every rank calls it).
    """
    from loader import load_hf_checkpoint

    checkpoint = checkpoint or family
    model, mesh, placements = sharded_meta_model(family, mesh_shape, placements_of, dtype, **overrides)
    before = _tensors(model)
    dtensors = {n: t for n, t in before.items() if isinstance(t.data, DTensor)}
    layout = {n: (tuple(t.shape), tuple(t.placements), t.device_mesh) for n, t in dtensors.items()}
    on_meta = sorted(n for n, t in before.items() if storage_of(t).device.type == "meta")
    tied = family == "llama" and model.lm_head.weight is model.model.embed_tokens.weight

    report = load_hf_checkpoint(model, ctx[f"{checkpoint}_path"], device="cpu", options=LoadOptions(progress=False))

    after = _tensors(model)
    ref = torch.load(ctx[f"{checkpoint}_ref"])
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
        distinct[local.untyped_storage().data_ptr()] = local.numel() * ctx.get(f"{checkpoint}_itemsize", 0)
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
        "deferred": report.deferred,
        "traced": report.traced,
        "unexpected_keys": report.unexpected_keys,
        **(extra(model, report) if extra else {}),
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
        load_hf_checkpoint(model, ctx["llama_path"], options=LoadOptions(progress=False))
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    left = sorted(n for n, t in _tensors(model).items() if storage_of(t).device.type != "meta")
    return {**outcome, "materialised": left}


def _meta_state(model: nn.Module, before: dict[str, torch.Tensor]) -> dict:
    """What of ``model`` is no longer on meta, and which names no longer hold the very tensor of ``before``."""
    after = _tensors(model)
    return {
        "not_meta": sorted(n for n, t in after.items() if storage_of(t).device.type != "meta"),
        "replaced": sorted(n for n in before if after.get(n) is not before[n]),
    }


def scenario_strict_on_one_rank(ctx: dict) -> dict:
    """Rank 1's planner maps no key to ``model.norm.weight``: a strict error on rank 1 alone, which every rank
    raises; the other ranks had allocated their model (their ``target_slot`` saw allocated tensors) and put the
    meta tensors back, so every rank's model is on meta again, the very tensors it had."""
    from loader import HFLoadPlanner, load_hf_checkpoint

    rank = dist.get_rank()
    model, _, _ = sharded_meta_model("llama", (4,), vocab_size=70)
    before = _tensors(model)

    class Dropping(PlanHooks):
        allocated = False

        def map_checkpoint_key(self, key: str) -> str | None:
            return None if rank == 1 and key == "model.norm.weight" else key

        def target_slot(self, name, tensor):
            self.allocated |= storage_of(tensor).device.type != "meta"
            return super().target_slot(name, tensor)

    planner = HFLoadPlanner(model, hooks=Dropping())
    try:
        load_hf_checkpoint(
            model, ctx["llama_path"], planner=planner, device="cpu", options=LoadOptions(progress=False, timeout=60)
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, **_meta_state(model, before), "allocated": planner.hooks.allocated}


def scenario_missing_initialised(ctx: dict) -> dict:
    """``strict=False`` with the norms ``MISSING`` (sharded here) mapped from no key on every rank: the model's own
    init gives them ones (written in place into each local shard), nothing is reported uninitialised, the rest
    loads."""
    import logging

    from loader import HFLoadPlanner, load_hf_checkpoint

    def placements_of(model: nn.Module, mesh_shape: tuple[int, ...]) -> dict:
        return {**plan_placements(model, mesh_shape)[0], **{n: (Shard(0),) for n in MISSING}}

    model, _, _ = sharded_meta_model("llama", (4,), placements_of, vocab_size=70)

    class Dropping(PlanHooks):
        def map_checkpoint_key(self, key: str) -> str | None:
            return None if key in MISSING else key

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("loader").addHandler(handler)
    try:
        report = load_hf_checkpoint(
            model,
            ctx["llama_path"],
            planner=HFLoadPlanner(model, hooks=Dropping(), rules=Rules(strict=False)),
            device="cpu",
            options=LoadOptions(progress=False),
        )  # strict is the planner's
    finally:
        logging.getLogger("loader").removeHandler(handler)
    sd = model.state_dict()
    full = {n: sd[n].full_tensor() if isinstance(sd[n], DTensor) else sd[n] for n in sorted(sd)}  # collective
    ref = torch.load(ctx["llama_ref"])["state"]
    return {
        "missing_keys": report.missing_keys,
        "dtensors": sorted(n for n in MISSING if isinstance(sd[n], DTensor)),
        "not_ones": sorted(n for n in MISSING if not torch.equal(full[n], torch.ones_like(full[n]))),
        "bad_loaded": sorted(n for n in full if n not in MISSING and not torch.equal(full[n], ref[n])),
        "warned": [r.getMessage() for r in records if "neither loaded nor initialised" in r.getMessage()],
    }


#: the norms scenario_missing_initialised loads from no key
MISSING = ("model.norm.weight", "model.layers.0.input_layernorm.weight")


def scenario_killed_planning(ctx: dict) -> dict:
    """A sharded meta llama loaded with ``device="cpu"``; rank 2 is SIGKILLed while planning: the others (which
    had planned and allocated) raise PeerFailure (died), their model on meta again. Last: the world ends with it."""
    from loader import HFLoadPlanner, load_hf_checkpoint

    rank = dist.get_rank()
    model, _, _ = sharded_meta_model("llama", (4,), vocab_size=70)
    before = _tensors(model)

    class DyingPlanner(PlanHooks):
        def map_checkpoint_key(self, key: str) -> str | None:
            if rank == DYING:
                os.kill(os.getpid(), signal.SIGKILL)
            return key

    try:
        load_hf_checkpoint(
            model,
            ctx["llama_path"],
            planner=HFLoadPlanner(model, hooks=DyingPlanner()),
            device="cpu",
            options=LoadOptions(progress=False, timeout=6),
        )
        outcome = {"type": None}
    except BaseException as e:
        outcome = _describe(e)
    return {**outcome, **_meta_state(model, before)}


# --- FP8 block-quantized checkpoints: dequantized on load, each rank reading its codes and their scale blocks


def owned_mask(t: torch.Tensor) -> torch.Tensor:
    """The elements of the global tensor this rank holds: a bool tensor of ``t``'s global shape.

    From DTensor's own arithmetic, not the loader's: each rank's local shard is filled with a code of its
    coordinate on the mesh dims that shard (replicated mesh dims hold the same elements), and the gathered
    ``full_tensor()`` shows which elements carry this rank's code. Collective for a DTensor; a plain tensor is
    held whole.
    """
    data = t.data
    if not isinstance(data, DTensor):
        return torch.ones(data.shape, dtype=torch.bool)
    mesh, code, weight = data.device_mesh, 1, 1
    for d, p in enumerate(data.placements):
        if not p.is_replicate():  # Shard or _StridedShard (which is not ``is_shard()``)
            code += mesh.get_coordinate()[d] * weight
            weight *= mesh.size(d)
    local = torch.full(data._local_tensor.shape, float(code))
    codes = DTensor.from_local(local, mesh, data.placements, run_check=False, shape=data.shape, stride=data.stride())
    return codes.full_tensor() == code


def checkpoint_regions(model_masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per checkpoint key of a (qwen3_moe) checkpoint, the elements the model regions ``model_masks`` come from.

    Model tensors load from the key of the same name, except the fused experts: ``experts.gate_up_proj[e]`` is
    ``cat(experts.{e}.gate_proj.weight, experts.{e}.up_proj.weight)`` and ``experts.down_proj[e]`` is
    ``experts.{e}.down_proj.weight``. Regions several model tensors read (tied ones) count once.
    """
    out: dict[str, torch.Tensor] = {}

    def add(key: str, mask: torch.Tensor) -> None:
        out[key] = out[key] | mask if key in out else mask.clone()

    for name, mask in model_masks.items():
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".experts") and last == "gate_up_proj":
            half = mask.shape[1] // 2
            for e in range(mask.shape[0]):
                add(f"{prefix}.{e}.gate_proj.weight", mask[e, :half])
                add(f"{prefix}.{e}.up_proj.weight", mask[e, half:])
        elif prefix.endswith(".experts") and last == "down_proj":
            for e in range(mask.shape[0]):
                add(f"{prefix}.{e}.down_proj.weight", mask[e])
        else:
            add(name, mask)
    return out


def blocks_touched(mask: torch.Tensor, block: tuple[int, int]) -> int:
    """How many ``block`` cells of the scale grid of a 2-D weight the elements ``mask`` touch."""
    import math

    (rows, cols), (bm, bn) = mask.shape, block
    padded = torch.zeros(math.ceil(rows / bm) * bm, math.ceil(cols / bn) * bn, dtype=torch.bool)
    padded[:rows, :cols] = mask
    return int(padded.reshape(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn).any(3).any(1).sum())


def expected_fp8_bytes(path: str, block: tuple[int, int], regions: dict[str, torch.Tensor]) -> tuple[int, list]:
    """``(bytes, problems)``: the bytes reading ``regions`` of the checkpoint at ``path`` takes: per quantized key
    its codes (1 byte each) and 4 bytes per distinct scale block they touch; per other key its elements' bytes."""
    from safetensors import safe_open

    total, problems = 0, []
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for key, mask in sorted(regions.items()):
            if key not in keys:
                problems.append((key, "not in the checkpoint"))
                continue
            sl = f.get_slice(key)
            if tuple(sl.get_shape()) != tuple(mask.shape):
                problems.append((key, tuple(sl.get_shape()), tuple(mask.shape)))
                continue
            itemsize = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[sl.get_dtype()]
            total += int(mask.sum()) * itemsize
            if key + "_scale_inv" in keys:
                total += 4 * blocks_touched(mask, block)
    return total, problems


def fp8_bytes(ctx: dict, checkpoint: str):
    """The ``extra`` of a FP8 scenario: the exact bytes this rank should read (collective)."""

    def extra(model: nn.Module, report) -> dict:
        sd = model.state_dict(keep_vars=True)
        masks = {name: owned_mask(sd[name]) for name in report.loaded_keys}
        regions = checkpoint_regions(masks)
        want, problems = expected_fp8_bytes(ctx[f"{checkpoint}_path"], tuple(ctx[f"{checkpoint}_block"]), regions)
        return {"expected_bytes": want, "region_problems": problems, "regions": sorted(regions)}

    return extra


def fp8_moe(checkpoint: str, mesh_shape: tuple[int, ...], placements_of=None):
    def run(ctx: dict) -> dict:
        extra = fp8_bytes(ctx, checkpoint)
        return scenario_load(
            ctx, "qwen3_moe", mesh_shape, placements_of, checkpoint=checkpoint, dtype=torch.bfloat16, extra=extra
        )

    return run


class Weight(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))


#: (mesh shape, placements) of the one-weight FP8 loads: rows, columns, both, and twice over columns
WEIGHT_SHARDINGS = [
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Shard(1), Shard(1))),
]


def scenario_fp8_weights(ctx: dict) -> dict:
    """One FP8 weight (shapes the block does not divide), sharded over rows and/or columns of a 1-D or 2-D mesh:
    per load, this rank's values against the dequantized reference, and its bytes read against the expected
    ``local elements x 1 + 4 x scale blocks its box touches``."""
    from safetensors.torch import load_file

    from loader import load_hf_checkpoint
    from loader.rules.fp8 import dequantize_quant_blocks

    meshes = {shape: init_device_mesh("cpu", shape) for shape in sorted({s for s, _ in WEIGHT_SHARDINGS})}
    loads = []
    for case in ctx["fp8_weights"]:
        path, shape, block = case["path"], tuple(case["shape"]), tuple(case["block"])
        stored = load_file(os.path.join(path, "model.safetensors"))
        want = dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], block, torch.bfloat16)
        for mesh_shape, pl in WEIGHT_SHARDINGS:
            with torch.device("meta"):
                model = Weight(shape)
            shard_module(model, meshes[mesh_shape], {"weight": pl}, device="meta")
            report = load_hf_checkpoint(model, path, device="cpu", options=LoadOptions(progress=False))
            data = model.weight.data
            local = data._local_tensor
            mask = owned_mask(model.weight)
            rows, cols = mask.any(1).nonzero(), mask.any(0).nonzero()
            (r0, r1), (c0, c1) = (int(rows.min()), int(rows.max()) + 1), (int(cols.min()), int(cols.max()) + 1)
            loads.append(
                {
                    "case": (shape, block, mesh_shape, str(pl)),
                    "box": ((r0, r1), (c0, c1)),
                    "is_box": bool(mask[r0:r1, c0:c1].all()) and int(mask.sum()) == local.numel(),
                    "local_ok": torch.equal(local, want[r0:r1, c0:c1]),
                    "full_ok": torch.equal(data.full_tensor(), want),
                    "deferred": report.deferred,
                    "traced": report.traced,
                    "unexpected_keys": report.unexpected_keys,
                    "bytes_read": report.bytes_read,
                    "expected_bytes": local.numel() + 4 * blocks_touched(mask, block),
                    "scale_blocks": blocks_touched(mask, block),
                }
            )
    return {"loads": loads}


def scenario_fp8_broadcast(ctx: dict) -> dict:
    """A replicated FP8 weight with ``broadcast_replicated_tensors``: one rank reads and dequantizes it (a value
    read on its owner only), the others receive it."""
    from safetensors.torch import load_file

    from loader import load_hf_checkpoint
    from loader.rules.fp8 import dequantize_quant_blocks

    case = ctx["fp8_weights"][0]
    path, shape, block = case["path"], tuple(case["shape"]), tuple(case["block"])
    stored = load_file(os.path.join(path, "model.safetensors"))
    model = Weight(shape)
    report = load_hf_checkpoint(model, path, options=LoadOptions(progress=False, broadcast_replicated_tensors=True))
    want = dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], block, torch.bfloat16)
    return {
        "ok": torch.equal(model.weight.data, want),
        "deferred": report.deferred,
        "bytes_read": report.bytes_read,
        "whole": stored["weight"].numel() + 4 * stored["weight_scale_inv"].numel(),
    }


SCENARIOS = [
    ("llama_tp4", lambda ctx: scenario_load(ctx, "llama", (4,), vocab_size=70)),
    ("llama_2x2", lambda ctx: scenario_load(ctx, "llama", (2, 2), vocab_size=70)),
    ("moe_tp4", lambda ctx: scenario_load(ctx, "qwen3_moe", (4,), moe_placements)),
    ("moe_2x2", lambda ctx: scenario_load(ctx, "qwen3_moe", (2, 2))),
    ("fp8_moe_tp4", fp8_moe("qwen3_moe_fp8_tp4", (4,), moe_placements)),
    ("fp8_moe_2x2", fp8_moe("qwen3_moe_fp8_2x2", (2, 2))),
    ("fp8_weights", scenario_fp8_weights),
    ("fp8_broadcast", scenario_fp8_broadcast),
    ("without_device", scenario_without_device),
    ("strict_on_one_rank", scenario_strict_on_one_rank),
    ("missing_initialised", scenario_missing_initialised),
    ("killed_planning", scenario_killed_planning),  # last: rank 2 dies
]


if __name__ == "__main__":  # run by tests/test_meta_distributed.py: meta_worker.py RANK WORLD CTX_JSON
    worker_main(SCENARIOS)  # rank 2 is killed in the last one
