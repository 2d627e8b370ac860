"""Simulated distributed planning: a 64-rank (8 x 8) mesh in one process, and ``shard_boxes`` vs DTensor.

The simulation runs under torch's fake process group (backend ``"fake"``) with models on the meta device;
the group is created by a module fixture and destroyed after the last test here, so it never leaks into
other tests of the same pytest worker. The ``shard_boxes`` tests need no process group.
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from loader import HFLoadPlanner, SafetensorsCheckpoint
from loader.checkpoint import FileReader, TensorInfo
from loader.cli.model_configs import TINY_QWEN3_MOE, hf_config, seeded_model
from loader.execute import BlockExecutor, run_deferred
from loader.options import Rules
from loader.placements import shard_boxes
from loader.plan.slots import TargetSlot
from loader.simulate import coordinate_of, simulate_load

sys.path.insert(0, os.path.dirname(__file__))

import dist_models as dm

MESH = (8, 8)
WORLD = 64
EXPERTS = 16  # two per EP rank


# ---------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def fake_mesh():
    """A 64-rank fake world (this process is rank 0) and its 8 x 8 CPU mesh; destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - another test leaked a process group
        pytest.fail("a default process group is already initialised in this pytest worker")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", MESH)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def layout_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sim") / "layout.safetensors")
    tensors = dm.write_checkpoint(path)
    return path, tensors


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    cfg = hf_config(
        "qwen3_moe", TINY_QWEN3_MOE, num_attention_heads=8, num_key_value_heads=8, num_experts=EXPERTS, vocab_size=72
    )
    model = seeded_model(cfg, seed=0)
    path = str(tmp_path_factory.mktemp("sim") / "moe")
    model.save_pretrained(path)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    return path, cfg, reference


def shard_meta(model: nn.Module, mesh, placements: dict) -> nn.Module:
    """Replace the named parameters by DTensor parameters on the meta device (like dist_worker.shard_model)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, pl in placements.items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = getattr(mod, leaf)
        local_shape, _ = compute_local_shape_and_global_offset(tuple(p.shape), mesh, pl)
        local = torch.empty(local_shape, dtype=p.dtype, device="meta")
        dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=p.shape, stride=p.stride())
        setattr(mod, leaf, nn.Parameter(dt, requires_grad=False))
    return model


def layout_on_meta(mesh) -> nn.Module:
    from dist_worker import layout_placements

    with torch.device("meta"):
        model = dm.Layout()
    return shard_meta(model, mesh, layout_placements(MESH))


def moe_on_meta(cfg, mesh, placements=None) -> nn.Module:
    from dist_worker import moe_placements
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return shard_meta(model, mesh, placements or moe_placements(model, MESH))


class RecordingPlanner(HFLoadPlanner):
    """Keeps each simulated rank's slots and plan."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple[dict[str, TargetSlot], object]] = []

    def build_plan(self, checkpoint, slots=None, *, check_devices=True):
        plan = super().build_plan(checkpoint, slots, check_devices=check_devices)
        self.recorded.append((dict(plan.slots), plan))
        return plan


def read_masks(plan, checkpoint: SafetensorsCheckpoint) -> dict[str, np.ndarray]:
    """Per source key, which elements the plan reads (region reads by element, deferred sources whole)."""
    masks: dict[str, np.ndarray] = {}

    def mask(key: str) -> np.ndarray:
        if key not in masks:
            masks[key] = np.zeros(checkpoint[key].numel, dtype=bool)
        return masks[key]

    for r in plan.reads:
        m = mask(r.block.source)
        for a, n in r.block.source_runs():
            m[a : a + n] = True
    for d in plan.deferred:
        if d.boxes:
            for k in d.conversion.sources:
                mask(k)[:] = True
    return masks


def mask_bytes(masks: dict[str, np.ndarray], checkpoint: SafetensorsCheckpoint, keys=None) -> int:
    return sum(int(m.sum()) * checkpoint[k].itemsize for k, m in masks.items() if keys is None or k in keys)


def local_bytes(slots: dict[str, TargetSlot], names, itemsize: int = 2) -> int:
    return sum(slots[n].local_numel for n in names) * itemsize


# ---------------------------------------------------------------------------------------------------
# (a) 64 ranks of the plain layout module (every placement kind, a deferred conversion)


def test_layout_64_ranks(fake_mesh, layout_ckpt):
    path, tensors = layout_ckpt
    model = layout_on_meta(fake_mesh)
    checkpoint = SafetensorsCheckpoint.open(path)
    planner = RecordingPlanner(model, rules=Rules(weights_mapping=dm.RULES))
    figures = simulate_load(model, checkpoint, planner=planner)

    assert len(figures) == WORLD == len(planner.recorded)
    assert [f.rank for f in figures] == list(range(WORLD))
    assert [f.coordinate for f in figures] == list(itertools.product(range(8), range(8)))
    covered = {k: np.zeros(checkpoint[k].numel, dtype=bool) for k in checkpoint.keys()}
    for f, (slots, plan) in zip(figures, planner.recorded):
        masks = read_masks(plan, checkpoint)
        assert f.bytes_read == mask_bytes(masks, checkpoint) == plan.planned_bytes()
        assert f.blocks == len(plan.reads)
        assert f.traced == 7 and f.deferred == 1  # "scaled" (a `sum`) is not traceable
        # traced targets read at most their shard bytes (+2 %): deferred sources are read whole
        traced = [t for t in slots if t != "scaled"]
        deferred_bytes = mask_bytes(masks, checkpoint, {"scaled_src"})
        assert deferred_bytes == (dm.ROWS * dm.H * 2 if slots["scaled"].local_numel else 0)
        assert f.deferred_conversions == (1 if slots["scaled"].local_numel else 0)
        assert f.bytes_read - deferred_bytes <= 1.02 * local_bytes(slots, traced), f
        # ... and never less than the distinct checkpoint elements their shards hold: gate_up and
        # gate_up_strided hold the same expert elements, so count the larger of the two
        need = local_bytes(slots, [t for t in traced if t != "gate_up_strided"])
        need -= local_bytes(slots, ["gate_up"]) - max(
            local_bytes(slots, ["gate_up"]), local_bytes(slots, ["gate_up_strided"])
        )
        assert f.bytes_read - deferred_bytes >= need, f
        assert f.shard_bytes == local_bytes(slots, slots)
        assert f.whole_tensor_bytes >= f.bytes_read - deferred_bytes
        for k, m in masks.items():
            covered[k] |= m
    # the union over ranks is the whole checkpoint
    for k, m in covered.items():
        assert m.all(), f"no rank reads all of {k!r}"
    # the norm is replicated: every rank reads all of it, and nothing else of norm_src
    for _, plan in planner.recorded:
        assert read_masks(plan, checkpoint)["norm_src"].all()


def test_layout_simulated_plans_load_the_right_values(fake_mesh, layout_ckpt):
    """Execute some simulated ranks' plans against the file: each local shard equals the slices it owns."""
    path, tensors = layout_ckpt
    model = layout_on_meta(fake_mesh)
    checkpoint = SafetensorsCheckpoint.open(path)
    expected = dm.expected_state(tensors)
    planner = RecordingPlanner(model, rules=Rules(weights_mapping=dm.RULES))
    ranks = [0, 9, 27, 38, 63]
    simulate_load(model, checkpoint, planner=planner, ranks=ranks)
    with FileReader() as reader:
        for rank, (slots, plan) in zip(ranks, planner.recorded):
            coord = coordinate_of(rank, MESH)
            real = {}
            for name, s in slots.items():
                pl = getattr(model.get_parameter(name).data, "placements", [Replicate()] * len(MESH))
                local_shape, _ = _compute_local_shape_and_global_offset(s.shape, MESH, list(coord), pl)
                real[name] = TargetSlot(name, s.shape, torch.float32, torch.full(local_shape, float("nan")), s.boxes)
            BlockExecutor(checkpoint, real, reader).run(plan.reads)
            for d in plan.deferred:
                if d.boxes:
                    run_deferred(d, checkpoint, real, reader)
            for name, s in real.items():
                want = torch.full_like(s.local, float("nan"))
                for g, lb in s.boxes:
                    src = expected[name][tuple(slice(a, b) for a, b in g)]
                    want[tuple(slice(a, b) for a, b in lb)] = src
                assert torch.equal(s.local, want), (rank, name)


# ---------------------------------------------------------------------------------------------------
# (a) 64 ranks of a transformers qwen3_moe (EP over mesh dim 0, TP over mesh dim 1)


def _expert_of(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def test_moe_64_ranks_ep_tp(fake_mesh, moe_ckpt):
    path, cfg, _ = moe_ckpt
    model = moe_on_meta(cfg, fake_mesh)
    checkpoint = SafetensorsCheckpoint.open(path)
    planner = RecordingPlanner(model)
    figures = simulate_load(model, path, planner=planner)
    assert len(figures) == WORLD
    misses = planner.cache.misses
    # traces are shared by rank and by layer: the distinct conversion shapes, not 64 x the conversions
    assert misses <= 12, misses
    assert planner.cache.hits >= WORLD * len(planner.recorded[0][1].conversions) - misses

    per_rank_experts = EXPERTS // MESH[0]
    expert_reads = np.zeros(WORLD, dtype=np.int64)
    counts = {k: np.zeros(checkpoint[k].numel, dtype=np.int32) for k in checkpoint.keys()}
    for f, (slots, plan) in zip(figures, planner.recorded):
        assert f.deferred == 0 and f.deferred_conversions == 0
        assert f.traced == len(slots)
        # renames and expert merges: the plan reads exactly the shard bytes, no more
        assert f.bytes_read == f.shard_bytes, f
        assert f.shard_bytes == local_bytes(slots, slots)
        assert f.whole_tensor_bytes > f.bytes_read
        masks = read_masks(plan, checkpoint)
        assert mask_bytes(masks, checkpoint) == f.bytes_read
        for k, m in masks.items():
            counts[k] += m
            e = _expert_of(k)
            if e is not None and m.any():
                # a rank reads only the experts of its EP group
                assert e // per_rank_experts == f.coordinate[0], (f.rank, k)
                expert_reads[f.rank] += int(m.sum()) * 2
    for k, c in counts.items():
        assert (c >= 1).all(), f"no rank reads all of {k!r}"
        if _expert_of(k) is not None:
            # experts are sharded on both mesh dims: each expert byte is read by exactly one rank
            assert (c == 1).all(), k
    # every rank reads the same amount of expert bytes (even EP x TP split)
    assert len(set(expert_reads.tolist())) == 1 and expert_reads[0] > 0


def test_moe_pure_ep_group_ranks_read_identical_bytes(fake_mesh, moe_ckpt):
    """Experts EP-only (Shard(0) on mesh dim 0, replicated on dim 1): the 8 ranks of a group read the same."""
    path, cfg, _ = moe_ckpt
    model = moe_on_meta(cfg, fake_mesh)
    checkpoint = SafetensorsCheckpoint.open(path)

    def placements(name: str, shape: tuple[int, ...]):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return [Shard(0), Replicate()]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            return [Replicate(), Shard(0)]
        return None  # replicated

    planner = RecordingPlanner(model)
    figures = simulate_load(model, checkpoint, placements=placements, planner=planner)
    expert_sets: dict[int, set[int]] = {}
    for f, (_, plan) in zip(figures, planner.recorded):
        masks = read_masks(plan, checkpoint)
        experts = {k: m for k, m in masks.items() if _expert_of(k) is not None and m.any()}
        assert all(m.all() for m in experts.values())  # whole expert tensors
        signature = {(k, int(m.sum())) for k, m in experts.items()}
        group = f.coordinate[0]
        if group in expert_sets:
            assert signature == expert_sets[group], f.rank
        expert_sets[group] = signature
        assert {_expert_of(k) // (EXPERTS // MESH[0]) for k in experts} == {group}
    for g in range(MESH[0]):
        same = [f for f in figures if f.coordinate[0] == g]
        assert len({(f.bytes_read, f.blocks, f.shard_bytes) for f in same}) == 1
        assert all(f.bytes_read == f.shard_bytes for f in same)
    # different groups read disjoint experts; together all of them
    assert sum(len(s) for s in expert_sets.values()) == 2 * 3 * EXPERTS  # 2 layers x (gate, up, down)


def test_subset_of_ranks_matches_full_run(fake_mesh, moe_ckpt):
    path, cfg, _ = moe_ckpt
    model = moe_on_meta(cfg, fake_mesh)
    full = simulate_load(model, path)
    some = simulate_load(model, path, ranks=[5, 40, 63])
    assert some == [full[5], full[40], full[63]]
    # this process is rank 0 of the fake world: its real slots (from the DTensors) plan the same as rank 0's
    planner = HFLoadPlanner(model)
    plan = planner.build_plan(SafetensorsCheckpoint.open(path), check_devices=False)
    assert plan.planned_bytes() == full[0].bytes_read
    assert len(plan.reads) == full[0].blocks


def test_dtensors_on_a_submesh_are_placed_on_the_root_mesh(fake_mesh, moe_ckpt):
    """Attention parallelised on ``mesh["tp"]`` (a submesh, as parallelize_module is usually given), experts
    on the whole 8 x 8 mesh: the simulation places the attention shards by the tp coordinate (mesh dim 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    path, cfg, _ = moe_ckpt
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("ep", "tp"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for layer in model.model.layers:
        parallelize_module(
            layer.self_attn,
            mesh["tp"],
            {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(),
            },
        )
        experts = layer.mlp.experts
        for name, inner in [("gate_up_proj", Shard(1)), ("down_proj", Shard(2))]:
            dt = distribute_tensor(getattr(experts, name), mesh, [Shard(0), inner], src_data_rank=None)
            setattr(experts, name, nn.Parameter(dt, requires_grad=False))
    q = model.model.layers[0].self_attn.q_proj.weight
    assert tuple(q.data.device_mesh.shape) == (8,)  # on the submesh

    def explicit(name: str, shape: tuple[int, ...]):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            return [Replicate(), Shard(0)]
        if name.endswith("o_proj.weight"):
            return [Replicate(), Shard(1)]
        if name.endswith("experts.gate_up_proj"):
            return [Shard(0), Shard(1)]
        if name.endswith("experts.down_proj"):
            return [Shard(0), Shard(2)]
        return None

    found = RecordingPlanner(model)
    given = RecordingPlanner(model)
    a = simulate_load(model, path, planner=found)
    b = simulate_load(model, path, mesh_shape=MESH, placements=explicit, planner=given)
    assert a == b
    for (slots_a, _), (slots_b, _) in zip(found.recorded, given.recorded):
        assert {n: s.boxes for n, s in slots_a.items()} == {n: s.boxes for n, s in slots_b.items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    rows = q.shape[0] // 8
    assert found.recorded[3][0][name].boxes[0][0][0] == (3 * rows, 4 * rows)  # rank 3 = (ep 0, tp 3)
    assert found.recorded[11][0][name].boxes == found.recorded[3][0][name].boxes  # (ep 1, tp 3)


# ---------------------------------------------------------------------------------------------------
# (b) a header-only checkpoint: no data files


def _header_only(entries) -> SafetensorsCheckpoint:
    infos, offset = {}, 0
    for key, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        infos[key] = TensorInfo(key, "/nonexistent/model.safetensors", dtype, tuple(shape), offset, offset + size)
        offset += size
    return SafetensorsCheckpoint.from_infos(infos, root="/nonexistent")


def test_header_only_checkpoint_layout(fake_mesh, layout_ckpt):
    path, _ = layout_ckpt
    H, I, E, R = dm.H, dm.I, dm.E, dm.ROWS
    entries = [(k, (H, H), torch.bfloat16) for k in ("q", "k", "v", "o_t")]
    entries += [
        ("uneven_src", (R, H), torch.bfloat16),
        ("norm_src", (H,), torch.bfloat16),
        ("scaled_src", (R, H), torch.bfloat16),
    ]
    for e in range(E):
        entries += [
            (f"experts.{e}.w1", (I, H), torch.bfloat16),
            (f"experts.{e}.w3", (I, H), torch.bfloat16),
            (f"experts.{e}.w2", (H, I), torch.bfloat16),
        ]
    header_only = _header_only(entries)
    assert not os.path.exists(header_only.files[0])
    model = layout_on_meta(fake_mesh)
    from_headers = simulate_load(model, header_only, rules=Rules(weights_mapping=dm.RULES))
    from_file = simulate_load(model, path, rules=Rules(weights_mapping=dm.RULES))
    assert from_headers == from_file


def test_header_only_checkpoint_moe(fake_mesh, moe_ckpt):
    path, cfg, _ = moe_ckpt
    real = SafetensorsCheckpoint.open(path)
    header_only = _header_only([(k, real[k].shape, real[k].dtype) for k in real.keys()])
    model = moe_on_meta(cfg, fake_mesh)
    assert simulate_load(model, header_only) == simulate_load(model, path)


# ---------------------------------------------------------------------------------------------------
# (c) shard_boxes vs DTensor's own sharding


def _oracle(shape, mesh_shape, coord, placements) -> torch.Tensor:
    """The local shard of arange(global) at ``coord``: DTensor's own splits, left to right, as
    ``distribute_tensor(..., src_data_rank=None)`` applies them."""
    t = torch.arange(math.prod(shape)).reshape(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh_shape[mesh_dim], with_padding=False)[0][coord[mesh_dim]]
    return t


def _assemble(shape, local_shape, boxes) -> torch.Tensor:
    """Place the global elements of each box at its local box; unset elements stay -1."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    out = torch.full(local_shape, -1, dtype=torch.long)
    for g, lb in boxes:
        dst = out[tuple(slice(a, b) for a, b in lb)]
        assert (dst == -1).all(), "local boxes overlap"
        dst.copy_(full[tuple(slice(a, b) for a, b in g)])
    return out


def _check(shape, mesh_shape, placements) -> list:
    """Check every coordinate; return the per-coordinate boxes."""
    out = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        boxes = shard_boxes(shape, mesh_shape, coord, placements)
        want = _oracle(shape, mesh_shape, coord, placements)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert tuple(want.shape) == tuple(local_shape), (coord, want.shape, local_shape)
        got = _assemble(shape, local_shape, boxes)
        assert torch.equal(got, want), (shape, mesh_shape, coord, placements, boxes)
        assert sum(math.prod(b - a for a, b in g) for g, _ in boxes) == want.numel()
        if boxes and not any(isinstance(p, _StridedShard) for p in placements):
            assert len(boxes) == 1
            assert tuple(a for a, _ in boxes[0][0]) == tuple(offset), (coord, boxes, offset)
        out.append(boxes)
    return out


def _rows(boxes) -> list:
    return [tuple(g[0] for g, _ in b) for b in boxes]


def test_shard_even_and_replicate():
    boxes = _check((8, 6), (4,), [Shard(0)])
    assert _rows(boxes) == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),)]
    assert shard_boxes((8, 6), (4,), (3,), [Replicate()]) == ((((0, 8), (0, 6)), ((0, 8), (0, 6))),)
    _check((8, 6), (2, 2), [Replicate(), Shard(1)])
    _check((4, 6, 10), (2, 4), [Shard(2), Shard(0)])


def test_shard_uneven_torch_chunk_sizes():
    # 10 over 4: torch.chunk gives 3, 3, 3, 1
    boxes = _check((10, 4), (4,), [Shard(0)])
    assert _rows(boxes) == [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)]
    # 10 over 8: five shards of 2, three empty (no boxes at all)
    boxes = _check((10, 4), (8,), [Shard(0)])
    assert _rows(boxes) == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),), ((8, 10),), (), (), ()]
    # 7 over 4: 2, 2, 2, 1; a dim smaller than the mesh
    _check((7,), (4,), [Shard(0)])
    _check((3, 5), (8,), [Shard(1)])
    assert shard_boxes((2, 5), (8,), (7,), [Shard(0)]) == ()


def test_several_mesh_dims_on_one_tensor_dim():
    _check((16, 3), (2, 4), [Shard(0), Shard(0)])
    _check((10, 3), (2, 4), [Shard(0), Shard(0)])  # uneven at both levels, some empty
    _check((10, 3), (4, 2), [Shard(0), Shard(0)])
    _check((6, 10), (2, 2, 2), [Shard(1), Shard(0), Shard(1)])
    boxes = _check((8,), (2, 2), [Shard(0), Shard(0)])
    assert _rows(boxes) == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),)]


def test_strided_shard_is_a_union_of_boxes():
    # FSDP2 + TP: the docstring example of _StridedShard (8 rows, mesh 2 x 2)
    boxes = _check((8, 4), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)])
    assert _rows(boxes) == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]
    # 1-D: two pieces per rank (fused gate_up sharded as if gate and up were sharded separately)
    boxes = _check((4, 16, 8), (4,), [_StridedShard(1, split_factor=2)])
    assert [[g[1] for g, _ in b] for b in boxes] == [
        [(0, 2), (8, 10)],
        [(2, 4), (10, 12)],
        [(4, 6), (12, 14)],
        [(6, 8), (14, 16)],
    ]
    assert [lb[1] for _, lb in boxes[1]] == [(0, 2), (2, 4)]
    _check((4, 16, 8), (2, 2), [_StridedShard(1, split_factor=2), Shard(1)])
    _check((12, 5), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)])
    _check((24, 2), (2, 3), [Shard(1), _StridedShard(0, split_factor=4)])
    _check((16, 6), (2, 2, 2), [_StridedShard(0, split_factor=4), Shard(0), Shard(1)])


def test_shard_boxes_match_distribute_tensor(fake_mesh):
    """At this process's coordinate (0, 0) of the fake 8 x 8 world, against distribute_tensor itself."""
    from torch.distributed.tensor import distribute_tensor

    for shape, placements in [
        ((10, 12), [Shard(0), Shard(1)]),
        ((10, 12), [Shard(0), Shard(0)]),
        ((16, 24), [_StridedShard(1, split_factor=2), Shard(1)]),
        ((5, 3), [Replicate(), Shard(0)]),
    ]:
        full = torch.arange(math.prod(shape)).reshape(shape)
        local = distribute_tensor(full, fake_mesh, placements, src_data_rank=None).to_local()
        boxes = shard_boxes(shape, MESH, (0, 0), placements)
        assert torch.equal(_assemble(shape, tuple(local.shape), boxes), local), (shape, placements)


def test_partial_is_refused():
    with pytest.raises(ValueError, match="Partial"):
        shard_boxes((8, 8), (2, 2), (0, 1), [Shard(0), Partial()])
    with pytest.raises(ValueError, match="Partial"):
        shard_boxes((8,), (4,), (0,), [Partial("sum")])


def test_random_placements_against_dtensor():
    """Many small random cases: shapes 0..13 per dim (uneven, empty), meshes of 1-3 dims, any mix of
    Replicate, Shard and _StridedShard (any split factor) on any dims, every coordinate."""
    rng = np.random.default_rng(7)
    strided = 0
    for _ in range(300):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(0, 14, ndim))
        mesh_shape = tuple(int(n) for n in rng.integers(1, 5, int(rng.integers(1, 4))))
        placements = []
        for _mesh_dim in mesh_shape:
            d = int(rng.integers(0, ndim))
            kind = int(rng.integers(0, 3))
            placements.append([Replicate(), Shard(d), _StridedShard(d, split_factor=int(rng.integers(1, 5)))][kind])
        strided += any(isinstance(p, _StridedShard) for p in placements)
        _check(shape, mesh_shape, placements)
    assert strided > 100


def test_negative_shard_dims_are_normalised():
    from torch.distributed.tensor import Shard

    from loader.placements import shard_boxes

    assert shard_boxes((4, 8), (2,), (1,), [Shard(-1)]) == shard_boxes((4, 8), (2,), (1,), [Shard(1)])
    assert shard_boxes((4, 8), (2,), (1,), [Shard(-1)]) == ((((0, 4), (4, 8)), ((0, 4), (0, 4))),)


def test_fp8_shard_bytes_count_the_codes_not_their_scales(tmp_path):
    """A rank's shard bytes for a dequantized FP8 weight are its codes (1 B each; the float32 scales beside them
    are not the weight's dtype); its bytes read are the codes and the scale blocks (rank_figures)."""
    import json

    from safetensors.torch import save_file

    w = torch.randn(256, 384).to(torch.float8_e4m3fn)
    save_file({"w": w, "w_scale_inv": torch.rand(2, 3) + 0.5}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    )
    model = nn.Module()
    model.w = nn.Parameter(torch.empty(256, 384, dtype=torch.bfloat16))
    (fig,) = simulate_load(model, str(tmp_path))
    assert fig.shard_bytes == 256 * 384 and fig.bytes_read == 256 * 384 + 6 * 4
    assert fig.whole_tensor_bytes == 256 * 384 + 6 * 4 and fig.traced == 1 and fig.deferred == 0
