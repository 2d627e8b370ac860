"""loader.placements' model-building helpers: placements from TP plans and globs, and ``shard_module``'s DTensors.

The DTensors are real, on torch's fake process group (4 ranks, this process is rank 1; created by a module
fixture and destroyed after the last test here, so it never leaks into other tests of the same worker).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loader.placements import (
    placement_text,
    placements_matching,
    plan_placements,
    shard_boxes,
    shard_module,
    style_placement,
)

WORLD, RANK = 4, 1


class Tiny(nn.Module):
    """Attention, fused experts, a norm, a buffer and a tied head, with transformers-style TP/EP plans."""

    tp_plan = {
        "embed.weight": "embedding_rowwise",
        "layers.*.q_proj": "colwise",
        "layers.*.o_proj": "rowwise",
        "layers.*.experts.gate_up_proj": "packed_colwise",
        "layers.*.experts.down_proj": "rowwise",
        "head": "colwise_gather_output",
    }
    _ep_plan = {"layers.*.experts.gate_up_proj": "grouped_gemm", "layers.*.experts.down_proj": "grouped_gemm"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.norm = nn.Parameter(torch.ones(8))
        self.register_buffer("steps", torch.zeros(3), persistent=False)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight  # tied


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=True)
        self.o_proj = nn.Linear(8, 8, bias=True)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(4, 6, 8))
        self.experts.down_proj = nn.Parameter(torch.empty(4, 8, 3))


@pytest.fixture(scope="module")
def world():
    """A 4-rank fake world (this process is rank 1); destroyed afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - another test leaked a process group
        pytest.fail("a default process group is already initialised in this pytest worker")
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    return init_device_mesh("cpu", shape)


# ---------------------------------------------------------------------------------------------------
# placements


@pytest.mark.parametrize(
    ("style", "ndim", "want"),
    [
        ("colwise", 2, Shard(0)),
        ("colwise", 1, Shard(0)),
        ("colwise", 3, Shard(1)),
        ("rowwise", 2, Shard(1)),
        ("rowwise", 1, Replicate()),
        ("packed_colwise", 3, _StridedShard(1, split_factor=2)),
        ("packed_colwise", 1, Shard(0)),
        ("packed_rowwise", 2, _StridedShard(1, split_factor=2)),
        ("embedding_rowwise", 2, Shard(0)),
        ("embedding_colwise", 2, Shard(1)),
        ("grouped_gemm", 3, Shard(0)),
        ("replicated_with_grad_allreduce", 2, Replicate()),
        ("colwise", 0, Replicate()),
    ],
)
def test_style_placement_follows_transformers_styles(style, ndim, want):
    got = style_placement(style, ndim)
    assert type(got) is type(want) and got == want


def test_plan_placements_from_the_models_own_plans():
    model = Tiny()
    two_d, why = plan_placements(model, (2, 2))
    assert two_d["layers.0.experts.gate_up_proj"] == (Shard(0), _StridedShard(1, split_factor=2))
    assert two_d["layers.1.experts.down_proj"] == (Shard(0), Shard(2))
    assert two_d["layers.0.q_proj.weight"] == (Replicate(), Shard(0))
    assert two_d["layers.0.q_proj.bias"] == (Replicate(), Shard(0))
    assert two_d["layers.0.o_proj.weight"] == (Replicate(), Shard(1))
    assert "layers.0.o_proj.bias" not in two_d and "norm" not in two_d  # replicated: left out
    assert two_d["embed.weight"] == two_d["head.weight"] == (Replicate(), Shard(0))
    assert why["layers.0.experts.gate_up_proj"] == "grouped_gemm (EP) x packed_colwise (TP)"
    assert why["embed.weight"] == "embedding_rowwise (TP)"

    one_d, _ = plan_placements(model, (4,))  # experts by their TP style on a 1-D mesh ...
    assert one_d["layers.0.experts.gate_up_proj"] == (_StridedShard(1, split_factor=2),)
    ep, why = plan_placements(model, (4,), experts="ep")  # ... or over experts
    assert ep["layers.0.experts.gate_up_proj"] == (Shard(0),) and why["layers.0.experts.down_proj"].endswith("(EP)")
    with pytest.raises(ValueError, match="1-D"):
        plan_placements(model, (2, 2, 1))


def test_placements_matching_first_glob_wins():
    model = Tiny()
    got = placements_matching(
        model,
        {"*experts.*": [Shard(0)], "layers.0.*": [Shard(1)], "*_proj.weight": [Replicate(), Shard(0)]},
    )
    assert got["layers.1.experts.gate_up_proj"] == (Shard(0),)  # the first pattern, though the third matches too
    assert got["layers.0.q_proj.bias"] == (Shard(1),)
    assert got["layers.1.o_proj.weight"] == (Replicate(), Shard(0))
    assert "layers.1.o_proj.bias" not in got and "norm" not in got and "embed.weight" not in got


def test_placement_text():
    assert placement_text([Replicate(), Shard(0)]) == "[R, S(0)]"
    assert placement_text((Shard(0), _StridedShard(1, split_factor=2))) == "[S(0), S(1, strided x2)]"


# ---------------------------------------------------------------------------------------------------
# shard_module


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_shard_module_local_shards_follow_dtensor(world, mesh_shape):
    mesh = _mesh(mesh_shape)
    with torch.device("meta"):
        model = Tiny()
    placements, _ = plan_placements(model, mesh_shape, experts="ep")
    assert shard_module(model, mesh, placements) is model
    coordinate = tuple(mesh.get_coordinate())
    state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        assert t.device.type == "cpu", name  # everything materialised
        if name not in placements:
            assert not isinstance(t.data, DTensor) and t.isnan().all(), name
            continue
        data = t.data
        assert isinstance(t, nn.Parameter) and not t.requires_grad and isinstance(data, DTensor), name
        assert tuple(data.placements) == placements[name] and data.device_mesh is mesh
        local = data.to_local()
        assert local.isnan().all(), name  # a loader must write every element
        # the local shard is exactly the union of loader.placements' boxes for this coordinate
        boxes = shard_boxes(tuple(data.shape), mesh_shape, coordinate, placements[name])
        assert sum(math.prod(b - a for a, b in lb) for _, lb in boxes) == local.numel(), name
        assert all(b <= n for _, lb in boxes for (_, b), n in zip(lb, local.shape)), name
    assert model.head.weight is model.embed.weight  # still tied
    assert model.steps.device.type == "cpu" and isinstance(model.layers[0].q_proj.weight, nn.Parameter)


def test_shard_module_on_meta_and_materialised_models(world):
    mesh = _mesh((2, 2))
    with torch.device("meta"):
        model = Tiny()
    placements = placements_matching(model, {"*experts.down_proj": [Shard(0), Shard(2)]})
    shard_module(model, mesh, placements, device="meta")  # for planning: no memory
    down = model.layers[0].experts.down_proj.data
    assert isinstance(down, DTensor) and down.to_local().device.type == "meta"
    assert tuple(down.to_local().shape) == (2, 8, 1)  # rank 1 is (0, 1): experts 0:2, column 2 of 3
    assert model.norm.device.type == "meta"

    model = Tiny()  # already on CPU: the values are overwritten with fill, placed tensors replaced
    shard_module(model, mesh, {"layers.1.o_proj.weight": [Replicate(), Shard(1)]}, fill=7.0)
    assert (model.norm == 7.0).all() and (model.layers[1].o_proj.weight.data.to_local() == 7.0).all()
    assert model.embed.weight.dtype == torch.float32 and (model.embed.weight == 7.0).all()
    with pytest.raises(KeyError, match="nope"):
        shard_module(Tiny(), mesh, {"nope": [Shard(0), Shard(0)]})
