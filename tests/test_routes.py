"""Routes the executor keeps per plan (loader/execute/routes.py): a reused plan reads each block the way its first
load decided,
into the tensor this load passes — bit-exact for every route (straight into place, scattered, by span, batched),
a replaced tensor of the same geometry is the one written, one of another geometry gets a route of its own.
Real files, a real plan cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from loader import SafetensorsCheckpoint
from loader.execute import execute_plan
from loader.execute.routes import DIRECT, SCATTER, SPAN, STAGED, routes_of
from loader.hooks import PlanHooks
from loader.plan import TargetSlot
from loader.plan.cache import PlanCache
from loader.planner import HFLoadPlanner
from loader.storage import FileReader
from loader.storage.scatter import SCATTER as CAN_SCATTER

ROWS = 48


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.zeros(ROWS // 4, 256))  # a row shard: one run, straight into place
        self.short = nn.Parameter(torch.zeros(ROWS, 64))  # 64 of every 256 columns: short runs, by span
        self.long = nn.Parameter(torch.zeros(ROWS, 2048))  # 2048 of every 8192 columns: long runs, scattered
        self.few = nn.Parameter(torch.zeros(4, 16))  # 16 of every 64 columns of 4 rows: few runs, batched


BOXES = {  # model name: (the checkpoint tensor's shape, the box of it this "rank" holds)
    "rows": ((ROWS, 256), ((ROWS // 4, ROWS // 2), (0, 256))),
    "short": ((ROWS, 256), ((0, ROWS), (64, 128))),
    "long": ((ROWS, 8192), ((0, ROWS), (2048, 4096))),
    "few": ((4, 64), ((0, 4), (16, 32))),
}
KINDS = {"rows": DIRECT, "short": SPAN, "long": SCATTER if CAN_SCATTER else SPAN, "few": STAGED}


class Sharded(PlanHooks):
    def target_slot(self, name: str, tensor: torch.Tensor) -> TargetSlot:
        shape, box = BOXES[name]
        local = tuple((0, b - a) for a, b in box)
        return TargetSlot(name, shape, tensor.dtype, tensor.data, ((box, local),))


@pytest.fixture()
def folder(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    full = {name: torch.randn(shape) for name, (shape, _) in BOXES.items()}
    save_file(full, str(tmp_path / "model.safetensors"))
    want = {name: full[name][tuple(slice(a, b) for a, b in box)] for name, (_, box) in BOXES.items()}
    return str(tmp_path), want


def _load(model: Model, path: str, cache: PlanCache):
    planner = HFLoadPlanner(model, hooks=Sharded())
    planner.plan_cache = cache
    plan = planner.build_plan(SafetensorsCheckpoint.open(path))
    with FileReader() as reader:
        execute_plan(plan, reader)
    return plan


def test_a_reused_plan_reads_by_the_routes_its_first_load_decided(folder):
    path, want = folder
    model, cache = Model(), PlanCache()
    first = _load(model, path, cache)
    kinds = {key[0].target: route.kind for key, route in routes_of(first).items()}
    assert kinds == KINDS
    kept = dict(routes_of(first))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    second = _load(model, path, cache)
    assert second is not first and routes_of(second) is routes_of(first)  # the plan reused, its routes with it
    assert routes_of(first) == kept  # nothing decided again
    for name, value in want.items():
        assert torch.equal(getattr(model, name).data, value), name


def test_a_replaced_tensor_is_the_one_written(folder):
    """The same geometry takes the kept route, applied to the new tensor; another geometry (a transposed
    tensor: rows not contiguous) is decided again, and both load exactly."""
    path, want = folder
    model, cache = Model(), PlanCache()
    first = _load(model, path, cache)
    old = {name: getattr(model, name).data for name in BOXES}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.rows.data = torch.zeros(ROWS // 4, 256)  # same geometry, new memory
        model.short.data = torch.zeros(64, ROWS).t()  # same shape, other strides
    count = len(routes_of(first))
    second = _load(model, path, cache)
    # one route decided for the new strides
    assert routes_of(second) is routes_of(first) and len(routes_of(first)) == count + 1
    for name, value in want.items():
        assert torch.equal(getattr(model, name).data, value), name
    assert not old["rows"].any() and not old["short"].any()  # the replaced tensors were not written


def test_the_routes_stay_bounded(folder):
    """Routes for ever new tensor geometries are dropped past a few per block, then decided anew."""
    path, want = folder
    model, cache = Model(), PlanCache()
    plan = _load(model, path, cache)
    routes_of(plan).update({("stale", i): None for i in range(4 * len(plan.reads) + 1024)})
    again = _load(model, path, cache)
    assert routes_of(again) is routes_of(plan) and len(routes_of(plan)) == len(KINDS)
    for name, value in want.items():
        assert torch.equal(getattr(model, name).data, value), name
