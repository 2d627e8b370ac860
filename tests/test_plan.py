"""The plan as a value: ``build_plan`` returns everything a load executes and reports, each conversion's
outcome is a typed ``TracedConversion | Untraced``, and each conversion runs on meta once per signature (the trace
reuses that run). Also: the rules' shortcuts (joined searches, string sort keys) are exact.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import regiontrace as rt
from loader import Convert, HFLoadPlanner, Rename, SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import FileReader
from loader.execute import execute_plan
from loader.options import LoadOptions, Rules
from loader.plan import RankPlan, TracedConversion, Untraced
from loader.report import load_report
from loader.rules import dot_natural_key, plan_keys
from loader.rules.conversion import natural_order
from loader.rules.matching import Rule, RuleChain

LAYERS, EXPERTS = 4, 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.empty(EXPERTS, 4, 6))
        self.scaled = nn.Parameter(torch.empty(6))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])


def checkpoint_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(LAYERS):
        for e in range(EXPERTS):
            out[f"layers.{i}.experts.{e}.w"] = torch.randn(4, 6, generator=g)
        out[f"layers.{i}.scale_me"] = torch.randn(6, generator=g)
    return out


class Counted:
    """A conversion function that counts its calls by the kind of tensors it gets."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.calls = fn, {"meta": 0, "region": 0, "real": 0}
        self.__qualname__ = getattr(fn, "__qualname__", "fn")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        first = args[0][0] if isinstance(args[0], list) else args[0]
        kind = "region" if isinstance(first, rt.RegionTensor) else "meta" if first.device.type == "meta" else "real"
        self.calls[kind] += 1
        return self.fn(*args)


@pytest.fixture
def folder(tmp_path):
    save_file(checkpoint_tensors(), os.path.join(tmp_path, "model.safetensors"))
    return str(tmp_path)


def rules(stack: Counted, scale: Counted) -> list:
    return [Convert("experts.*.w", "experts", stack), Convert("scale_me", "scaled", scale)]


def test_each_conversion_runs_on_meta_once_per_signature(folder):
    stack, scale = Counted(lambda ws: torch.stack(ws)), Counted(lambda w: torch.stack([w, w]).sum(0))
    planner = HFLoadPlanner(Net(), rules=Rules(weights_mapping=rules(stack, scale)))
    planner.plan_cache = None  # plans not kept (tests/test_plan_cache.py): the key plan and traces are what is counted
    plan = planner.build_plan(SafetensorsCheckpoint.open(folder))
    # 4 layers, one signature each: one meta run (the rules'), one RegionTensor run (the trace), no more
    assert stack.calls == {"meta": 1, "region": 1, "real": 0}
    assert scale.calls == {"meta": 1, "region": 1, "real": 0}  # traced, found untraceable, deferred: no rerun
    assert len({c.signature for c in plan.conversions}) == 2 and len(plan.conversions) == 2 * LAYERS
    assert planner.cache.misses == 2 and planner.cache.hits == 2 * LAYERS - 2
    again = SafetensorsCheckpoint.open(folder)
    planner.build_plan(again)  # another checkpoint object: the rules run again (once), the traces are kept
    planner.build_plan(again)  # the same checkpoint again: nothing runs
    assert stack.calls["meta"] == 2 and stack.calls["region"] == 1


def test_a_transformers_converter_runs_on_meta_once_per_signature(folder):
    core = pytest.importorskip("transformers.core_model_loading")

    class CountedMerge(core.MergeModulelist):
        calls = {"meta": 0, "region": 0, "real": 0}

        def convert(self, input_dict: dict, *args: object, **kwargs: object) -> dict:
            first = next(iter(input_dict.values()))[0]
            kind = "region" if isinstance(first, rt.RegionTensor) else first.device.type
            CountedMerge.calls["meta" if kind == "meta" else kind if kind == "region" else "real"] += 1
            return super().convert(input_dict, *args, **kwargs)

    merge = core.WeightConverter("experts.*.w", "experts", [CountedMerge(dim=0)])
    net = Net()
    planner = HFLoadPlanner(
        net, rules=Rules(weights_mapping=[merge, Convert("scale_me", "scaled", lambda w: w.clone())])
    )
    plan = planner.build_plan(SafetensorsCheckpoint.open(folder))
    assert CountedMerge.calls == {"meta": 1, "region": 1, "real": 0}
    assert {c.targets for c in plan.conversions if c.rule is not None and "Merge" in c.description} == {
        (f"layers.{i}.experts",) for i in range(LAYERS)
    }
    assert all(c.target_shapes == ((EXPERTS, 4, 6),) for c in plan.conversions if "Merge" in c.description)


def test_outcomes_are_typed_values(folder):
    stack, scale = Counted(lambda ws: torch.stack(ws)), Counted(lambda w: torch.stack([w, w]).sum(0))
    plan = HFLoadPlanner(Net(), rules=Rules(weights_mapping=rules(stack, scale))).build_plan(
        SafetensorsCheckpoint.open(folder)
    )
    assert isinstance(plan, RankPlan) and len(plan.outcomes) == len(plan.conversions)
    for conv, outcome in zip(plan.conversions, plan.outcomes):
        if conv.targets[0].endswith("experts"):
            assert isinstance(outcome, TracedConversion) and set(outcome.outputs) == set(conv.targets)
            assert outcome.outputs[conv.targets[0]].shape == (EXPERTS, 4, 6)
        else:
            assert isinstance(outcome, Untraced) and "aten.sum" in outcome.reason
    assert [d.reason for d in plan.deferred] == [o.reason for o in plan.outcomes if isinstance(o, Untraced)]


def test_the_plan_is_a_value_nothing_is_read_back_from_the_planner(folder):
    stack, scale = Counted(lambda ws: torch.stack(ws)), Counted(lambda w: torch.stack([w, w]).sum(0))
    net = Net()
    planner = HFLoadPlanner(net, rules=Rules(weights_mapping=rules(stack, scale)))
    plan = planner.build_plan(SafetensorsCheckpoint.open(folder))
    for stale in ("plan", "slots", "checkpoint", "keyplan"):
        assert not hasattr(planner, stale), stale
    assert plan.checkpoint is not None and set(plan.slots) == set(net.state_dict()) and plan.keyplan.conversions
    with FileReader() as reader:  # what load_hf_checkpoint runs: the value alone
        execute_plan(plan, reader)
        report = load_report(plan, reader.bytes_read)
    tensors = checkpoint_tensors()
    for i in range(LAYERS):
        experts = torch.stack([tensors[f"layers.{i}.experts.{e}.w"] for e in range(EXPERTS)])
        assert torch.equal(net.layers[i].experts.data, experts)
        assert torch.equal(net.layers[i].scaled.data, tensors[f"layers.{i}.scale_me"] * 2)
    assert report.bytes_read == report.planned_bytes == sum(t.numel() * 4 for t in tensors.values())
    assert scale.calls["real"] == LAYERS
    other = Net()
    assert (
        load_hf_checkpoint(
            other, folder, rules=Rules(weights_mapping=rules(stack, scale)), options=LoadOptions(progress=False)
        )
        == report
    )
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), net.state_dict().values()))


def test_rules_planned_from_shapes_alone_are_rerun_on_the_checkpoint_dtypes(folder):
    """plan_keys without dtypes runs on the model tensors' dtypes; the plan reruns on the checkpoint's."""
    from loader.plan import plan_rank
    from loader.plan.slots import model_slots

    stack, scale = Counted(lambda ws: torch.stack(ws)), Counted(lambda w: torch.stack([w, w]).sum(0))
    net = Net().to(torch.bfloat16)
    checkpoint = SafetensorsCheckpoint.open(folder)
    keyplan = plan_keys(net, {k: checkpoint[k].shape for k in checkpoint.keys()}, weights_mapping=rules(stack, scale))
    assert {c.meta.dtypes[0] for c in keyplan.conversions} == {torch.bfloat16}
    plan = plan_rank(keyplan, checkpoint, model_slots(net))
    assert stack.calls["meta"] == 2  # once on bf16 (the rules), once on the checkpoint's float32 (the plan)
    dtypes = {t.dtype for o in plan.outcomes if isinstance(o, TracedConversion) for t in o.outputs.values()}
    assert dtypes == {torch.float32}


# ----------------------------------------------------------------------------------------------- exact shortcuts


def test_natural_order_sorts_exactly_like_dot_natural_key():
    rng = random.Random(0)
    parts = ["a", "b", "ab", "", "0", "7", "07", "10", "x9", "x10", "x010", "é", "Z", "_", "a1b", "\x01", "9" * 25]
    keys = [
        ".".join(rng.choice(parts) + rng.choice(["", "", "3", "12"]) for _ in range(rng.randint(1, 5)))
        for _ in range(5000)
    ]
    for a, b in zip(keys, keys[1:]):
        ka, kb, na, nb = dot_natural_key(a), dot_natural_key(b), natural_order(a), natural_order(b)
        assert (ka < kb, ka == kb) == (na < nb, na == nb), (a, b)
    assert sorted(keys, key=natural_order) == sorted(keys, key=dot_natural_key)
    with pytest.raises(ValueError, match="NUL"):
        natural_order("a\x00b")


TRICKY = [
    Rename(r"(?<!model\.)layer\.", "model.layer."),  # lookbehind
    Rename(r"^(vision|audio)\.", r"model.\1."),  # anchor and group
    Rename(r"(?P<c>a)(?P=c)x", "y"),  # a backreference: cannot be joined
    Rename(r"(?i:caps)", "lower"),  # a scoped inline flag
    Rename(r"(?P<name>norm)1", "norm_one"),  # a named group of its own
    Rename("LayerNorm.gamma", "LayerNorm.weight"),
]
KEYS = [
    "layer.0.w", "model.layer.0.w", "vision.x", "x.vision.y", "aax.w", "ax.w", "CAPS.w", "caps", "norm1.w", "norm12",
    "bert.LayerNorm.gamma", "bert.LayerNorm.gammas", "layer.norm1.CAPS.aax",
]  # fmt: skip


@pytest.mark.parametrize("subset", [TRICKY, TRICKY[:2] + TRICKY[4:], TRICKY[5:]])
def test_rule_chains_match_rule_by_rule(subset):
    """A chain's shortcuts (one joined search for keys no rule matches; renaming from the pre-check's match)
    give what applying each rule in turn gives, used-flags included."""
    chain, alone = RuleChain([Rule(r) for r in subset]), [Rule(r) for r in subset]
    for key in KEYS:
        expected = key
        for rule in alone:
            expected, _ = rule.rename(expected)
        assert chain.rename(key) == expected, key
        first = next(((*rule.rename(key), i) for i, rule in enumerate(alone) if rule.probe(key)[1] is not None), None)
        got = chain.first(key)
        assert (got[0], got[1], chain.rules.index(got[2])) == first if first else got == (key, None, None), key
    assert [r.used for r in chain.rules] == [r.used for r in alone]


def test_joined_search_is_skipped_for_patterns_it_would_change():
    from loader.rules.matching import _joined

    assert _joined([re.compile(r"(a)\1"), re.compile("b")]) is None
    assert _joined([re.compile(r"(?P<c>a)(?P=c)"), re.compile("b")]) is None
    assert _joined([re.compile(r"(?i)a"), re.compile("b")]) is None
    joined = _joined([re.compile(r"(?P<g0>x(?!\w))"), re.compile(r"(?P<g0>y)")])
    assert joined is not None and joined("a.x.b") and not joined("a.xz") and joined("ay")


def test_renamed_blocks_keep_every_field_but_the_source(folder):
    """Compiled blocks are renamed field by field (cheaper than dataclasses.replace): nothing else may change."""
    import dataclasses

    from loader.plan.traces import _rename

    block = rt.RemapBlock("#1", (2, 3), 5, (-3, 1), (1, 0), (0, 1), (1, 2), (4, 3), torch.bfloat16, (torch.float32,))
    renamed = _rename(block, ("a", "b"))
    assert renamed == dataclasses.replace(block, source="b")
    assert [f.name for f in dataclasses.fields(rt.RemapBlock)][-1] == "casts"  # a new field: update _rename


def test_planning_reading_and_reporting_pause_the_garbage_collector(tmp_path):
    """Many small tensors: no cyclic collection runs while a load plans, reads or reports (a full one walks the
    whole model; they made planning 200 000 tensors quadratic); the collector is back on afterwards, after an
    error too, and left off when the caller had it off."""
    import gc

    n = 3000
    model = nn.ParameterDict({f"p{i}": nn.Parameter(torch.empty(2)) for i in range(n)})
    values = {f"p{i}": torch.full((2,), float(i)) for i in range(n)}
    save_file(values, os.path.join(tmp_path, "model.safetensors"))
    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    def watched(fn, *args, **kwargs):
        gc.callbacks.append(seen)
        try:
            return fn(*args, **kwargs)
        finally:
            gc.callbacks.remove(seen)

    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    plan = watched(HFLoadPlanner(model).build_plan, checkpoint)
    with FileReader() as reader:
        watched(execute_plan, plan, reader, LoadOptions(progress=False))
    report = watched(load_report, plan, reader.bytes_read)
    assert len(collections) <= 3 and gc.isenabled()  # at most the one each exit's first allocation may start
    assert len(report.loaded_keys) == n and torch.equal(model["p7"].detach(), values["p7"])
    # the same allocations outside a load do trigger collections (so the check above can fail)
    collections.clear()
    watched(lambda: [[i] for i in range(20 * n)])
    assert len(collections) > 10
    model["extra"] = nn.Parameter(torch.empty(2))
    with pytest.raises(ValueError, match="not in the checkpoint: extra"):
        HFLoadPlanner(model, rules=Rules(strict=True)).build_plan(SafetensorsCheckpoint.open(str(tmp_path)))
    assert gc.isenabled()
    gc.disable()
    try:
        load_hf_checkpoint(model, str(tmp_path), rules=Rules(strict=False))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_load_then_a_save_of_the_same_model_share_one_trace_per_signature(folder):
    from loader.options import Rules
    from loader.save.sources import map_for_save

    class Kept(nn.Module):  # the experts only: their stack is a bijection (``scaled`` sums: no inverse)
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Module() for _ in range(LAYERS)])
            for layer in self.layers:
                layer.experts = nn.Parameter(torch.empty(EXPERTS, 4, 6))

    tensors = {k: v for k, v in checkpoint_tensors().items() if "experts" in k}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    mapping = [Convert("experts.*.w", "experts", lambda ws: torch.stack(ws))]
    model, checkpoint = Kept(), SafetensorsCheckpoint.open(folder)
    planner = HFLoadPlanner(model, rules=Rules(weights_mapping=mapping))
    plan = planner.build_plan(checkpoint)
    signatures = {planner.cache.signature(c, checkpoint) for c in plan.conversions}
    assert len(signatures) == 1 and planner.cache.misses == 1
    saved = map_for_save(model, Rules(weights_mapping=mapping), source_shapes=checkpoint, cache=planner.cache)
    assert planner.cache.misses == len(signatures)  # the save inverted the load's trace: nothing traced again
    assert {s.signature for s in saved.conversions} == signatures
    loaded = [o for o in plan.outcomes if isinstance(o, TracedConversion)]
    assert all(s.traced._shared is loaded[0]._shared for s in saved.conversions)
