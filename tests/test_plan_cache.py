"""Plans reused (loader/plan/cache.py): a second load of the same model and checkpoint plans nothing; a rewritten
file, another model, other boxes (placements), other dtypes, other ties, other rules or settings plan anew; the
cache holds neither the model nor its tensors. Real safetensors files, loads through ``load_hf_checkpoint``."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from loader import HFLoadPlanner, SafetensorsCheckpoint, load_hf_checkpoint
from loader.hooks import PlanHooks
from loader.options import LoadOptions, Rules
from loader.plan import RankPlan, TargetSlot
from loader.plan.cache import PLANS, PlanCache


class Net(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(8, 6))
        self.b = self.a if tied else nn.Parameter(torch.zeros(8, 6))
        self.c = nn.Parameter(torch.zeros(5))


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(8, 6, generator=g), "b": torch.randn(8, 6, generator=g), "c": torch.randn(5, generator=g)}


@pytest.fixture
def ckpt(tmp_path) -> str:
    save_file(tensors(0), str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def load(model: nn.Module, path: str, **rules) -> tuple[int, int]:
    """Load with ``Rules(**rules)``; return (hits, misses) of the process's plan cache during it."""
    hits, misses = PLANS.hits, PLANS.misses
    load_hf_checkpoint(model, path, rules=Rules(**rules), options=LoadOptions(progress=False))
    return PLANS.hits - hits, PLANS.misses - misses


def plan(planner: HFLoadPlanner, path: str) -> RankPlan:
    return planner.build_plan(SafetensorsCheckpoint.open(path))


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_loaded(model: nn.Module, seed: int) -> None:
    want = tensors(seed)
    for k, v in values(model).items():
        assert torch.equal(v, want[k]), k


def test_a_second_load_plans_nothing(ckpt):
    model = Net()
    assert load(model, ckpt) == (0, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load(model, ckpt) == (1, 0)  # the kept plan, bound to this model's tensors
    assert_loaded(model, 0)
    planner = HFLoadPlanner(model)
    first, second = plan(planner, ckpt), plan(planner, ckpt)
    assert first is not second and first.reads is second.reads  # one plan, bound twice
    assert all(second.slots[n].local.data_ptr() == getattr(model, n).data_ptr() for n in "abc")


def test_a_rewritten_file_misses_and_its_values_load(ckpt):
    model = Net()
    load(model, ckpt)
    save_file(tensors(1), os.path.join(ckpt, "model.safetensors"))  # a new file under the same name
    assert load(model, ckpt) == (0, 1)
    assert_loaded(model, 1)


def test_another_model_misses(ckpt):
    load(Net(), ckpt)
    other = Net()
    assert load(other, ckpt) == (0, 1)
    assert_loaded(other, 0)


def test_other_dtypes_other_tensors_and_other_ties_miss(ckpt):
    model = Net()
    load(model, ckpt)
    model.c = nn.Parameter(torch.zeros(5, dtype=torch.float64))  # another dtype
    assert load(model, ckpt) == (0, 1)
    model.c = nn.Parameter(torch.zeros(5, dtype=torch.float64))  # another tensor, the same slot: the plan serves it
    assert load(model, ckpt) == (1, 0)
    assert torch.equal(model.c.data, tensors(0)["c"].double())
    model.d = nn.Parameter(torch.zeros(2))  # a tensor more (not in the checkpoint)
    assert load(model, ckpt, strict=False) == (0, 1)
    del model.d
    assert load(model, ckpt) == (1, 0)  # the same tensors and settings as two loads ago
    tied = Net(tied=True)
    assert load(tied, ckpt, strict=False) == (0, 1)
    tied.b = nn.Parameter(torch.zeros(8, 6))  # untied: b is loaded on its own now
    assert load(tied, ckpt, strict=False) == (0, 1)
    assert_loaded(tied, 0)


def test_other_rules_and_settings_miss(tmp_path):
    renamed = tensors(0)
    renamed["x"] = renamed.pop("a")  # the checkpoint calls a "x"
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model = Net()
    assert load(model, str(tmp_path), strict=False) == (0, 1)
    assert not model.a.data.any()  # nothing loads a
    assert load(model, str(tmp_path), strict=False, key_mapping={"^x$": "a"}) == (0, 1)
    assert_loaded(model, 0)
    assert load(model, str(tmp_path), strict=False, key_mapping={"^x$": "a"}) == (1, 0)  # renames compare by value
    with pytest.raises(ValueError, match="not in the checkpoint"):
        load(model, str(tmp_path))  # strict: a plan of its own, which refuses


class Rows(PlanHooks):
    """A placement without a process group: this "rank" owns rows ``[rank * 8, rank * 8 + 8)`` of a (16, 6) ``w``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def target_slot(self, name: str, tensor: torch.Tensor) -> TargetSlot:
        box = ((self.rank * 8, self.rank * 8 + 8), (0, 6))
        return TargetSlot(name, (16, 6), tensor.dtype, tensor.data, ((box, ((0, 8), (0, 6))),))


def test_other_boxes_miss(tmp_path):
    full = torch.randn(16, 6)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(8, 6))
    seen = []
    for rank in (0, 1, 1, 0):  # both kept (two plans per model)
        hits, misses = PLANS.hits, PLANS.misses
        load_hf_checkpoint(
            model, str(tmp_path), planner=HFLoadPlanner(model, hooks=Rows(rank)), options=LoadOptions(progress=False)
        )
        assert torch.equal(model.w.data, full[rank * 8 : rank * 8 + 8])
        seen.append((PLANS.hits - hits, PLANS.misses - misses))
    assert seen == [(0, 1), (0, 1), (1, 0), (1, 0)]
    planner = HFLoadPlanner(model, hooks=Rows(1))
    planner.plan_cache = cache = PlanCache(per_model=1)
    plan(planner, str(tmp_path))
    planner.hooks = Rows(0)
    plan(planner, str(tmp_path))
    planner.hooks = Rows(1)
    plan(planner, str(tmp_path))  # one plan per model kept here: rank 0's replaced rank 1's
    assert (cache.hits, cache.misses, len(cache)) == (0, 3, 1)


def test_planners_with_unkeyed_hooks_plan_every_load(ckpt):
    class Deferring(PlanHooks):
        def supports_symbolic(self, conversion) -> bool:
            return True

    model = Net()
    for _ in range(2):
        hits = PLANS.hits
        load_hf_checkpoint(
            model, ckpt, planner=HFLoadPlanner(model, hooks=Deferring()), options=LoadOptions(progress=False)
        )
        assert PLANS.hits == hits


def test_the_cache_holds_neither_the_model_nor_its_tensors(ckpt):
    model = Net()
    load(model, ckpt)
    (kept,) = PLANS.kept(model)
    assert all(s.local is None for s in kept.slots.values())  # no tensor of the model kept
    assert {n: (s.name, s.shape, s.dtype) for n, s in kept.slots.items()} == {
        n: (n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()
    }
    gc.collect()  # models of earlier tests go first
    ref, count = weakref.ref(model), len(PLANS)
    del model, kept
    gc.collect()
    assert ref() is None and len(PLANS) == count - 1
