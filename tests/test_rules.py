"""Tests for loader.rules: checkpoint-key planning must match transformers' from_pretrained exactly.

Every family test builds a tiny random model, saves it with ``save_pretrained`` (which writes the original
checkpoint layout, e.g. per-expert weights), plans the keys, runs every conversion on the saved tensors and
compares with the saved model and with what ``from_pretrained`` itself loads and records.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hf_models import FAMILIES, MIXTRAL, build, read_checkpoint
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.core_model_loading import MergeModulelist, WeightConverter, WeightRenaming
from transformers.core_model_loading import dot_natural_key as hf_dot_natural_key

from loader.options import LoadOptions, Rules
from loader.rules import Conversion, Convert, KeyPlan, Rename, dot_natural_key, plan_keys


def shapes_of(tensors):
    return {k: tuple(v.shape) for k, v in tensors.items()}


def run_plan(plan: KeyPlan, tensors) -> dict[str, torch.Tensor]:
    out = {}
    for conv in plan.conversions:
        produced = conv.run(tensors)
        assert tuple(produced) == conv.targets
        # the shapes its one meta run predicted (shared by every conversion of its signature)
        assert tuple(tuple(v.shape) for v in produced.values()) == conv.target_shapes, conv
        for name in produced:
            assert name not in out, f"{name} produced twice"
        out.update(produced)
    return out


def load_into(model: nn.Module, plan: KeyPlan, tensors) -> None:
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in run_plan(plan, tensors).items():
            state[name].copy_(value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (auto class, saved model, checkpoint dir, checkpoint tensors); built lazily, once."""
    cache = {}

    def get(family):
        if family not in cache:
            auto, model = build(family)
            directory = tmp_path_factory.mktemp(family)
            model.save_pretrained(directory)
            cache[family] = (auto, model, directory, read_checkpoint(directory))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_from_pretrained(family, saved, tmp_path):
    auto, model, directory, tensors = saved(family)
    fresh = auto.from_config(model.config)
    plan = plan_keys(fresh, shapes_of(tensors))
    state = model.state_dict()

    # every model tensor covered exactly once (directly or as a tied alias); each checkpoint key used once
    targets = [t for c in plan.conversions for t in c.targets]
    assert len(targets) == len(set(targets))
    assert set(targets) | set(plan.tied) == set(state)
    assert all(plan.tied[a] in targets for a in plan.tied)
    sources = [s for c in plan.conversions for s in c.sources]
    assert sorted(sources) == sorted(tensors) and len(sources) == len(set(sources))
    assert plan.missing_keys == [] and plan.unexpected_keys == [] and plan.skipped_keys == []
    for conv in plan.conversions:
        assert list(conv.sources) == sorted(conv.sources, key=dot_natural_key)
        assert conv.is_rename == (conv.description == "rename")

    # bit-exact reproduction of the saved model
    produced = run_plan(plan, tensors)
    for name, value in produced.items():
        assert torch.equal(value, state[name]), name

    # ... and of what from_pretrained loads, reports and records
    reference, info = auto.from_pretrained(directory, output_loading_info=True)
    ref_state = reference.state_dict()
    for name, value in produced.items():
        assert torch.equal(value, ref_state[name]), name
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    plan.record_on_model(fresh)
    assert repr(fresh._weight_conversions) == repr(reference._weight_conversions)

    # recorded conversions make save_pretrained write the original layout back
    load_into(fresh, plan, tensors)
    fresh.save_pretrained(tmp_path)
    resaved = read_checkpoint(tmp_path)
    assert list(resaved) == list(tensors)
    for key, value in tensors.items():
        assert torch.equal(resaved[key], value), key


def test_family_layouts(saved):
    """The layouts the family tests rely on: save_pretrained writes per-expert / fused-qkv checkpoints."""
    keys = list(saved("mixtral")[3])
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in keys
    descriptions = {c.description for c in plan_of(saved, "mixtral").conversions}
    assert descriptions == {
        "rename",
        "MergeModulelist(dim=0) -> Concatenate(dim=1)",
        "MergeModulelist(dim=0)",
    }
    for family in ("qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "ernie4_5_moe", "jamba"):
        assert "MergeModulelist(dim=0) -> Concatenate(dim=1)" in {
            c.description for c in plan_of(saved, family).conversions
        }, family
    nomic = [c for c in plan_of(saved, "nomic_bert").conversions if not c.is_rename]
    assert [(c.description, c.sources, c.targets) for c in nomic] == [
        (
            "Chunk(dim=0)",
            (f"encoder.layers.{i}.attn.Wqkv.weight",),
            qkv_names(f"layers.{i}.self_attn", "weight"),
        )
        for i in range(2)
    ]
    gradium = [c for c in plan_of(saved, "gradium_phonon_tts").conversions if not c.is_rename]
    assert [(c.description, c.sources, c.targets) for c in gradium] == [
        (
            "Chunk(dim=0) -> PermuteForRope",
            (f"layers.{i}.self_attn.in_proj.weight",),
            qkv_names(f"layers.{i}.self_attn", "weight"),
        )
        for i in range(2)
    ]
    # the permutation is real: q/k rows are not plain chunks of the fused tensor, v rows are
    fused = saved("gradium_phonon_tts")[3]["layers.0.self_attn.in_proj.weight"]
    out = gradium[0].run(saved("gradium_phonon_tts")[3])
    q, k, v = fused.chunk(3)
    assert torch.equal(out["layers.0.self_attn.v_proj.weight"], v)
    assert not torch.equal(out["layers.0.self_attn.q_proj.weight"], q)
    assert not torch.equal(out["layers.0.self_attn.k_proj.weight"], k)
    assert sorted(out["layers.0.self_attn.q_proj.weight"].flatten().tolist()) == sorted(q.flatten().tolist())
    assert all(c.is_rename for c in plan_of(saved, "gpt_oss").conversions)
    assert plan_of(saved, "llama").tied == {"lm_head.weight": "model.embed_tokens.weight"}
    vl = [c for c in plan_of(saved, "qwen3_vl_moe").conversions if not c.is_rename]
    assert {c.description for c in vl} == {"Transpose"} and len(vl) == 4


def qkv_names(prefix: str, suffix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{p}_proj.{suffix}" for p in "qkv")


def plan_of(saved, family) -> KeyPlan:
    auto, model, _, tensors = saved(family)
    return plan_keys(model, shapes_of(tensors))


def test_qwen3_vl_moe_transposed_checkpoint(saved, tmp_path):
    """Transpose(1, 2, check_dims=True) transposes only when the checkpoint shape differs from the model's."""
    auto, model, _, tensors = saved("qwen3_vl_moe")
    experts = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4
    original = {k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in tensors.items()}
    plan = plan_keys(model, shapes_of(original))
    state = model.state_dict()
    for conv in plan.conversions:
        for name, value in conv.run(original).items():
            assert torch.equal(value, state[name]), name
    save_file(original, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    reference = auto.from_pretrained(tmp_path)
    for name, value in run_plan(plan, original).items():
        assert torch.equal(value, reference.state_dict()[name]), name


@pytest.mark.parametrize("tie", [True, False])
def test_base_checkpoint_into_causal_lm(tie, tmp_path):
    config = AutoConfig.for_model("mixtral", **MIXTRAL, tie_word_embeddings=tie)
    torch.manual_seed(0)
    base = AutoModel.from_config(config)
    base.save_pretrained(tmp_path)
    tensors = read_checkpoint(tmp_path)
    assert not any(k.startswith("model.") for k in tensors)
    causal = AutoModelForCausalLM.from_config(config)
    plan = plan_keys(causal, shapes_of(tensors))
    assert plan.unexpected_keys == []
    reference, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(plan.missing_keys) == info["missing_keys"] == (set() if tie else {"lm_head.weight"})
    assert plan.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tie else {})
    base_state = base.state_dict()
    for name, value in run_plan(plan, tensors).items():
        assert name.startswith("model.")
        assert torch.equal(value, base_state[name.removeprefix("model.")]), name
        assert torch.equal(value, reference.state_dict()[name]), name
    plan.record_on_model(causal)
    assert repr(causal._weight_conversions) == repr(reference._weight_conversions)


def test_causal_lm_checkpoint_into_base(tmp_path):
    config = AutoConfig.for_model("mixtral", **MIXTRAL, tie_word_embeddings=False)
    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config(config)
    causal.save_pretrained(tmp_path)
    tensors = read_checkpoint(tmp_path)
    base = AutoModel.from_config(config)
    plan = plan_keys(base, shapes_of(tensors))
    reference, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert plan.unexpected_keys == ["lm_head.weight"] and info["unexpected_keys"] == {"lm_head.weight"}
    assert plan.missing_keys == [] and info["missing_keys"] == set()
    causal_state = causal.state_dict()
    for name, value in run_plan(plan, tensors).items():
        assert torch.equal(value, causal_state["model." + name]), name
        assert torch.equal(value, reference.state_dict()[name]), name


def test_head_keys_named_like_base_modules_load_as_from_pretrained_does(saved, tmp_path):
    """A head checkpoint whose head modules share names with base modules (``model.norm.*`` and ``norm.*``,
    ``model.embed_tokens.*`` and ``embed_tokens.*``) into the base model (prefix ``model``): the prefixed key is
    stripped, the plain one already names the tensor. from_pretrained loads whichever comes first in
    ``dot_natural_key`` order (``embed_tokens`` < ``model`` < ``norm``) and drops the other; so does the loader,
    which reports the dropped key as unexpected (from_pretrained reports nothing)."""
    from loader import load_hf_checkpoint

    _, causal, _, tensors = saved("mixtral")
    head = dict(tensors)
    head["norm.weight"] = torch.full_like(tensors["model.norm.weight"], 7.0)
    head["embed_tokens.weight"] = torch.full_like(tensors["model.embed_tokens.weight"], 3.0)
    ckpt = tmp_path / "head"
    ckpt.mkdir()
    save_file(head, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    causal.config.save_pretrained(ckpt)
    reference, info = AutoModel.from_pretrained(ckpt, output_loading_info=True)
    assert info["unexpected_keys"] == {"lm_head.weight"} and info["missing_keys"] == set()
    base = AutoModel.from_config(causal.config)
    report = load_hf_checkpoint(base, str(ckpt), options=LoadOptions(progress=False))
    ours, theirs = base.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(ours["norm.weight"], tensors["model.norm.weight"])  # model.norm.weight comes first
    assert torch.equal(ours["embed_tokens.weight"], head["embed_tokens.weight"])  # embed_tokens.weight first
    assert report.missing_keys == ()
    assert report.unexpected_keys == ("lm_head.weight", "model.embed_tokens.weight", "norm.weight")


def test_two_keys_to_one_tensor_without_the_prefix_still_fail(saved):
    """Only a collision the base model prefix makes is resolved as from_pretrained does: two keys one model's
    rules rename to one tensor remain an error naming both."""
    _, causal, _, tensors = saved("mixtral")
    base = AutoModel.from_config(causal.config)
    shapes = {k.removeprefix("model."): tuple(v.shape) for k, v in tensors.items()}
    shapes["my_norm.weight"] = shapes["norm.weight"]
    with pytest.raises(ValueError, match="'my_norm.weight' and 'norm.weight' both map to model tensor 'norm.weight'"):
        plan_keys(base, shapes, extra_weights_mapping=[Rename("my_norm.weight", "norm.weight")])


def like_from_pretrained(auto, config, tensors, tmp_path, *, key_mapping=None) -> KeyPlan:
    """Write ``tensors`` as a checkpoint, load it with from_pretrained and check that the plan reports,
    loads, records and re-saves exactly the same."""
    ckpt, resave, ref_resave = (tmp_path / name for name in ("ckpt", "ours", "theirs"))
    ckpt.mkdir()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(ckpt)
    reference, info = auto.from_pretrained(ckpt, key_mapping=key_mapping, output_loading_info=True)
    fresh = auto.from_config(config)
    plan = plan_keys(fresh, shapes_of(tensors), key_mapping=key_mapping)
    assert set(plan.missing_keys) - set(plan.ignored_missing_keys) == info["missing_keys"]
    assert len(set(plan.unexpected_keys) - set(plan.ignored_unexpected_keys)) == len(info["unexpected_keys"])
    ref_state = reference.state_dict()
    for name, value in run_plan(plan, tensors).items():
        assert torch.equal(value, ref_state[name]), name
    plan.record_on_model(fresh)
    assert repr(fresh._weight_conversions) == repr(reference._weight_conversions)
    load_into(fresh, plan, tensors)
    with torch.no_grad():  # missing tensors are initialised at random: take the reference's
        for name in plan.missing_keys:
            fresh.state_dict(keep_vars=True)[name].copy_(ref_state[name])
    fresh.save_pretrained(resave)
    reference.save_pretrained(ref_resave)
    ours, theirs = read_checkpoint(resave), read_checkpoint(ref_resave)
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    return plan


def test_key_mapping_regex(saved, tmp_path):
    auto, model, _, tensors = saved("mixtral")
    renamed = {re.sub(r"^model\.layers\.(\d+)\.", r"backbone.blocks.\1.", k): v for k, v in tensors.items()}
    assert "backbone.blocks.1.block_sparse_moe.experts.0.w1.weight" in renamed
    key_mapping = {r"^backbone\.blocks\.(\d+)\.": r"model.layers.\1."}
    plan = like_from_pretrained(auto, model.config, renamed, tmp_path, key_mapping=key_mapping)
    assert plan.missing_keys == [] and plan.unexpected_keys == []
    assert isinstance(plan.used_rules[0], WeightRenaming)
    assert plan.used_rules[0].source_patterns == [r"^backbone\.blocks\.(\d+)\."]
    state = model.state_dict()
    for name, value in run_plan(plan, renamed).items():
        assert torch.equal(value, state[name]), name
    # without the mapping nothing of the layers loads
    plain = plan_keys(model, shapes_of(renamed))
    assert len(plain.unexpected_keys) == len([k for k in renamed if k.startswith("backbone.")])


def test_prefix_change_in_scoped_submodel(saved, tmp_path):
    """Original llava layout: the CLIP tower keys carry `vision_model.`, which a PrefixChange scoped to the
    vision tower strips; once used, it is recorded and save_pretrained puts the prefix back."""
    auto, model, _, tensors = saved("llava_mixtral")
    original = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    plan = like_from_pretrained(auto, model.config, original, tmp_path)
    assert plan.missing_keys == [] and plan.unexpected_keys == []
    assert "PrefixChange" in [type(r).__name__ for r in plan.used_rules]
    assert plan.by_target()["model.vision_tower.post_layernorm.weight"].sources == (
        "vision_tower.vision_model.post_layernorm.weight",
    )


def test_legacy_renames(saved, tmp_path):
    """`LayerNorm.gamma/beta` legacy renames chain after the model's own renames."""
    auto, model, _, tensors = saved("nomic_bert")
    old = {
        k.replace("emb_ln.weight", "emb_ln.gamma").replace("emb_ln.bias", "emb_ln.beta"): v for k, v in tensors.items()
    }
    assert "emb_ln.gamma" in old
    plan = like_from_pretrained(auto, model.config, old, tmp_path)
    assert plan.missing_keys == [] and plan.unexpected_keys == []
    assert plan.by_target()["embeddings.LayerNorm.weight"].sources == ("emb_ln.gamma",)


def test_missing_and_unexpected_like_from_pretrained(saved, tmp_path):
    auto, model, _, tensors = saved("qwen2_moe")
    partial = {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.mlp.experts.")}
    partial["model.layers.0.mlp.surprise.weight"] = torch.ones(2)
    partial["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    plan = like_from_pretrained(auto, model.config, partial, tmp_path)
    assert plan.missing_keys == [
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    ]
    assert plan.unexpected_keys == [
        "model.layers.0.mlp.surprise.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
    ]


def test_duplicate_mapping_error_transformers(saved):
    _, model, _, tensors = saved("mixtral")
    shapes = shapes_of(tensors)
    shapes["model.layers.0.mlp.gate.weight"] = shapes["model.layers.0.block_sparse_moe.gate.weight"]
    with pytest.raises(ValueError) as err:
        plan_keys(model, shapes)
    message = str(err.value)
    assert "'model.layers.0.block_sparse_moe.gate.weight'" in message
    assert "'model.layers.0.mlp.gate.weight'" in message
    # an already-fused expert tensor next to the per-expert ones
    shapes = shapes_of(tensors)
    shapes["model.layers.1.mlp.experts.down_proj"] = (4, 32, 64)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj"):
        plan_keys(model, shapes)


def test_extra_rules_precede_defaults(saved):
    auto, model, _, tensors = saved("mixtral")
    renamed = {k.replace("block_sparse_moe.gate.", "router."): v for k, v in tensors.items()}
    plan = plan_keys(
        model, shapes_of(renamed), extra_weights_mapping=[Rename(r"\.router\.", ".block_sparse_moe.gate.")]
    )
    assert plan.unexpected_keys == [] and plan.missing_keys == []
    assert isinstance(plan.used_rules[0], Rename)
    # mixing in our Convert with transformers rules, and recording only what save_pretrained can reverse
    stack = Convert(".experts.*.w2.weight", ".experts.down_proj", lambda ws: torch.stack(ws))
    plan = plan_keys(model, shapes_of(tensors), extra_weights_mapping=[stack])
    downs = [c for c in plan.conversions if c.targets[0].endswith("down_proj")]
    assert downs and all(c.rule is stack for c in downs)
    state = model.state_dict()
    for name, value in run_plan(plan, tensors).items():
        assert torch.equal(value, state[name]), name
    fresh = auto.from_config(model.config)
    plan.record_on_model(fresh)
    assert [type(r).__name__ for r in fresh._weight_conversions] == ["WeightRenaming", "WeightConverter"]


def test_select_converter(saved):
    _, model, _, tensors = saved("mixtral")
    stack = Convert(".experts.*.w2.weight", ".experts.down_proj", lambda ws: torch.stack(ws))
    seen = []

    def select(source_pattern, target, candidates, *, source_key):
        seen.append((source_pattern, target, candidates, source_key))
        return candidates[-1]  # the transformers converter over ours

    plan = plan_keys(model, shapes_of(tensors), extra_weights_mapping=[stack], select_converter=select)
    assert len(seen) == 8
    pattern, target, candidates, key = seen[0]
    assert pattern == ".experts.*.w2.weight"  # the matched source pattern of the first candidate, not the key
    assert key == "model.layers.0.block_sparse_moe.experts.0.w2.weight"  # as the checkpoint stores it
    assert target == "model.layers.0.mlp.experts.down_proj"
    assert candidates[0] is stack and isinstance(candidates[1], WeightConverter)
    downs = [c for c in plan.conversions if c.targets[0].endswith("down_proj")]
    assert all(c.description == "MergeModulelist(dim=0)" for c in downs)
    none = plan_keys(model, shapes_of(tensors), extra_weights_mapping=[stack], select_converter=lambda *a: None)
    assert len(none.unexpected_keys) == 8 and len(none.missing_keys) == 2
    # a 3-argument selector (the documented signature before source_key=) still works
    three = []
    plan_keys(
        model,
        shapes_of(tensors),
        extra_weights_mapping=[stack],
        select_converter=lambda p, t, c: three.append(p) or c[0],
    )
    assert three == [".experts.*.w2.weight"] * 8


def test_map_checkpoint_key(saved):
    _, model, _, tensors = saved("llama")
    shapes = {"junk." + k: s for k, s in shapes_of(tensors).items()}
    shapes["optimizer.step"] = ()
    plan = plan_keys(model, shapes, map_checkpoint_key=lambda k: None if k == "optimizer.step" else k[5:])
    assert plan.skipped_keys == ["optimizer.step"]
    assert plan.unexpected_keys == [] and plan.missing_keys == []
    assert all(s.startswith("junk.") for c in plan.conversions for s in c.sources)
    junk = {"junk." + k: v for k, v in tensors.items()}
    state = model.state_dict()
    for name, value in run_plan(plan, junk).items():
        assert torch.equal(value, state[name])


def test_tied_both_in_checkpoint(saved):
    _, model, _, tensors = saved("llama")
    shapes = shapes_of(tensors)
    shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    plan = plan_keys(model, shapes)
    assert plan.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert [c.targets for c in plan.tied_duplicates] == [("lm_head.weight",)]
    assert "lm_head.weight" not in plan.by_target() and plan.missing_keys == []
    # only the alias in the checkpoint: it becomes the canonical name (transformers ties symmetrically)
    shapes = shapes_of(tensors)
    shapes["lm_head.weight"] = shapes.pop("model.embed_tokens.weight")
    plan = plan_keys(model, shapes)
    assert plan.tied == {"model.embed_tokens.weight": "lm_head.weight"} and plan.missing_keys == []


# ----------------------------------------------------------------------------------------------------------
# Plain nn.Module with our own rules
# ----------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        self.experts_w1 = nn.Parameter(torch.empty(3, 4, 8))
        self.norm = nn.LayerNorm(8)
        self.register_buffer("steps", torch.zeros(2))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def plain_checkpoint():
    g = torch.Generator().manual_seed(0)
    ckpt = {"tok.weight": torch.randn(10, 8, generator=g)}
    for i in range(2):
        for p in "qkv":
            ckpt[f"layers.{i}.attn.{p}.weight"] = torch.randn(8, 8, generator=g)
        for e in [0, 1, 2]:
            ckpt[f"layers.{i}.moe.experts.{e}.w1.weight"] = torch.randn(4, 8, generator=g)
        ckpt[f"layers.{i}.ln.weight"] = torch.randn(8, generator=g)
        ckpt[f"layers.{i}.ln.bias"] = torch.randn(8, generator=g)
        ckpt[f"layers.{i}.steps"] = torch.randn(2, generator=g)
    return ckpt


PLAIN_RULES = [
    Rename(r"^tok\.", "embed."),
    Rename(r"^layers\.(\d+)\.", r"blocks.\1."),
    Rename(r"\.ln\.", ".norm."),
    Convert(
        ["attn.q.weight", "attn.k.weight", "attn.v.weight"],
        "qkv.weight",
        lambda q, k, v: torch.cat([q, k, v]),
    ),
    Convert("moe.experts.*.w1.weight", "experts_w1", lambda ws: torch.stack(ws)),
]


def test_plain_module_rename_and_convert():
    net, ckpt = Net(), plain_checkpoint()
    plan = plan_keys(net, shapes_of(ckpt), weights_mapping=PLAIN_RULES)
    assert plan.unexpected_keys == [] and plan.missing_keys == []
    assert plan.tied == {"head.weight": "embed.weight"}
    by_target = plan.by_target()
    qkv = by_target["blocks.1.qkv.weight"]
    assert qkv.sources == tuple(f"layers.1.attn.{p}.weight" for p in "kqv")  # natural key order
    # fn receives them in source-pattern order
    assert qkv.groups == tuple((f"attn.{p}.weight", (f"layers.1.attn.{p}.weight",)) for p in "qkv")
    assert qkv.target_shapes == ((24, 8),) and not qkv.is_rename
    experts = by_target["blocks.0.experts_w1"]
    assert experts.sources == tuple(f"layers.0.moe.experts.{e}.w1.weight" for e in range(3))
    assert by_target["blocks.0.steps"].is_rename and by_target["blocks.0.steps"].description == "rename"
    out = run_plan(plan, ckpt)
    assert torch.equal(out["blocks.1.qkv.weight"], torch.cat([ckpt[f"layers.1.attn.{p}.weight"] for p in "qkv"]))
    assert torch.equal(
        out["blocks.0.experts_w1"],
        torch.stack([ckpt[f"layers.0.moe.experts.{e}.w1.weight"] for e in range(3)]),
    )
    assert torch.equal(out["embed.weight"], ckpt["tok.weight"])
    assert set(out) | set(plan.tied) == set(net.state_dict())
    plan.record_on_model(net)  # not a PreTrainedModel: no-op
    assert not hasattr(net, "_weight_conversions")


def test_plain_module_split_and_no_transformers_rules():
    """One-to-many Convert, unexpected and missing keys, no default rules for a plain module."""
    net, ckpt = Net(), plain_checkpoint()
    plain = plan_keys(net, shapes_of(ckpt))
    assert plain.conversions == [] and len(plain.unexpected_keys) == len(ckpt)
    assert "head.weight" in plain.missing_keys and "embed.weight" in plain.missing_keys

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 4)

    fused = {"attn.qk.weight": torch.randn(12, 8), "attn.qk.bias": torch.randn(12), "extra": torch.ones(1)}
    rule = Convert("attn.qk", ["q", "k"], lambda t: tuple(torch.split(t, [8, 4])))
    plan = plan_keys(Split(), shapes_of(fused), weights_mapping=[rule])
    assert [c.targets for c in plan.conversions] == [("q.bias", "k.bias"), ("q.weight", "k.weight")]
    assert plan.conversions[1].target_shapes == ((8, 8), (4, 8))
    assert plan.unexpected_keys == ["extra"] and plan.missing_keys == []
    out = run_plan(plan, fused)
    assert torch.equal(out["k.weight"], fused["attn.qk.weight"][8:])


class Traced(torch.Tensor):
    """A tensor subclass standing in for a tracer: conversions must pass it through torch functions."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_passes_through(saved):
    Traced.calls.clear()
    _, model, _, tensors = saved("mixtral")
    plan = plan_keys(model, shapes_of(tensors))
    traced = {k: v.as_subclass(Traced) for k, v in tensors.items()}
    state = model.state_dict()
    for conv in plan.conversions:
        for name, value in conv.run(traced).items():
            assert isinstance(value, Traced), (name, type(value))
            assert torch.equal(value.as_subclass(torch.Tensor), state[name])
    assert "stack" in Traced.calls and "cat" in Traced.calls
    net, ckpt = Net(), plain_checkpoint()
    plan = plan_keys(net, shapes_of(ckpt), weights_mapping=PLAIN_RULES)
    out = run_plan(plan, {k: v.as_subclass(Traced) for k, v in ckpt.items()})
    assert all(isinstance(v, Traced) for v in out.values())


def test_plain_module_errors():
    net, ckpt = Net(), plain_checkpoint()
    shapes = shapes_of(ckpt)
    # two checkpoint keys onto one tensor
    shapes["embed.weight"] = (10, 8)
    with pytest.raises(ValueError, match=r"'embed\.weight'.*'tok\.weight'|'tok\.weight'.*'embed\.weight'"):
        plan_keys(net, shapes, weights_mapping=PLAIN_RULES)
    with pytest.raises(ValueError) as err:
        plan_keys(net, shapes_of(ckpt), weights_mapping=[Rename(r"layers\.\d+\.ln\.weight", "embed.weight")])
    assert "layers.0.ln.weight" in str(err.value) and "layers.1.ln.weight" in str(err.value)
    assert "'embed.weight'" in str(err.value)
    # a Convert group without one of its sources
    shapes = shapes_of(ckpt)
    del shapes["layers.0.attn.v.weight"]
    with pytest.raises(ValueError, match=r"attn\.v\.weight"):
        plan_keys(net, shapes, weights_mapping=PLAIN_RULES)
    # a conversion producing something that is not a model tensor
    bad = Convert(["attn.q.weight", "attn.k.weight", "attn.v.weight"], ["qkv.weight", "nope"], lambda *t: t[:2])
    with pytest.raises(ValueError, match=r"blocks\.0\.nope.*not a tensor of the model"):
        plan_keys(net, shapes_of(ckpt), weights_mapping=[*PLAIN_RULES[:3], bad])
    with pytest.raises(TypeError):
        plan_keys(net, shapes_of(ckpt), weights_mapping=["not a rule"])
    with pytest.raises(ValueError):
        Convert("a.*.w", "b.*.w", lambda x: x)


def test_transformers_rules_on_plain_module():
    """transformers transforms work on any module, and our Rename has WeightRenaming's exact semantics."""
    net, ckpt = Net(), plain_checkpoint()
    rules = [
        WeightRenaming(r"^tok\.", "embed."),
        WeightRenaming(r"^layers\.(\d+)\.", r"blocks.\1."),
        WeightRenaming(r"\.ln\.", ".norm."),
        WeightConverter(["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", [_Cat()]),
        WeightConverter("moe.experts.*.w1.weight", "experts_w1", [MergeModulelist(dim=0)]),
    ]
    ours = run_plan(plan_keys(net, shapes_of(ckpt), weights_mapping=PLAIN_RULES), ckpt)
    theirs = run_plan(plan_keys(net, shapes_of(ckpt), weights_mapping=rules), ckpt)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


class _Cat(MergeModulelist):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: torch.cat([input_dict[p][0] for p in source_patterns])}


@pytest.mark.parametrize(
    "source,target",
    [
        (r"^tok\.", "embed."),
        (r"layers\.(\d+)\.attn", r"blocks.\1.attention"),
        ("mlp.experts.*.gate_proj.weight", "mlp.experts.gate_up_proj"),
        (".block_sparse_moe.", ".mlp."),
        ("norm1", "post_attention_layernorm"),
        ("LayerNorm.gamma", "LayerNorm.weight"),
        (r"(?<!model\.)layer.", r"model.layer."),
        (r"^(vision_encoder|audio_encoder)\.", r"model.\1."),
        ("weight", "kernel"),
    ],
)
def test_rename_mirrors_weight_renaming(source, target):
    keys = [
        "tok.weight",
        "layers.3.attn.q.weight",
        "model.layers.0.mlp.experts.7.gate_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "encoder.layer.0.norm1.weight",
        "encoder.layer.0.norm12.weight",
        "bert.LayerNorm.gamma",
        "model.layer.2.weight_scale_inv",
        "vision_encoder.patch.weight",
        "x.weight",
    ]
    ours, theirs = Rename(source, target), WeightRenaming(source, target)
    for key in keys:
        assert ours.rename(key) == theirs.rename_source_key(key)[0], key


def test_dot_natural_key_matches_transformers():
    keys = ["a.10.b", "a.2.b", "a.shard_11", "a.shard_2", "a.b2.c", "a.b10.c", "x"]
    assert [dot_natural_key(k) for k in keys] == [hf_dot_natural_key(k) for k in keys]


def test_conversion_is_frozen_and_comparable():
    conv = Conversion(("a",), ("b",), "rename", True)
    assert conv.run({"b": 1}) == {"a": 1}
    with pytest.raises(AttributeError):
        conv.targets = ("c",)  # type: ignore[misc]
    assert conv == Conversion(("a",), ("b",), "rename", True)


def test_imports_without_transformers():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["transformers"] = None  # make `import transformers` fail
        import torch
        from loader.rules import Rename, Convert, plan_keys
        net = torch.nn.Linear(2, 3)
        plan = plan_keys(net, {"w": (3, 2), "b": (3,)}, key_mapping={"^w$": "weight"},
                         weights_mapping=[Rename("^b$", "bias")])
        assert [c.targets for c in plan.conversions] == [("bias",), ("weight",)], plan
        plan.record_on_model(net)
        print("ok")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------------------
# Convert: back-references in targets, and patterns that match nothing


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(4, 4, bias=False) for _ in range(3))


class Layers(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attention = Attention()


def _qkv_tensors(n: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.self_attn.{p}_proj.weight": torch.randn(4, 4, generator=g) for i in range(n) for p in "qkv"
    }


def test_convert_targets_take_back_references_like_rename(tmp_path):
    """``\\1`` in every target pattern of a Convert with several sources and targets, as Rename's syntax promises."""
    from loader import load_hf_checkpoint

    tensors = _qkv_tensors()
    sources = [rf"model\.layers\.(\d+)\.self_attn\.{p}_proj\.weight" for p in "qkv"]
    targets = [rf"layers.\1.attention.w{p}.weight" for p in "qkv"]
    rule = Convert(sources, targets, lambda q, k, v: (q.t(), k, v * 2))
    plan = plan_keys(Layers(), shapes_of(tensors), weights_mapping=[rule])
    assert [c.targets for c in plan.conversions] == [
        tuple(f"layers.{i}.attention.w{p}.weight" for p in "qkv") for i in range(2)
    ]
    assert plan.missing_keys == [] and plan.unexpected_keys == []
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = Layers()
    report = load_hf_checkpoint(
        model, tmp_path, rules=Rules(weights_mapping=[rule]), options=LoadOptions(progress=False)
    )
    assert report.deferred == ()
    for i, layer in enumerate(model.layers):
        src = {p: tensors[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"}
        attention = layer.attention
        assert torch.equal(attention.wq.weight, src["q"].t()) and torch.equal(attention.wk.weight, src["k"])
        assert torch.equal(attention.wv.weight, src["v"] * 2)
    # a back-reference inside a key (its prefix kept), repeated in a target, and a target without it
    rule = Convert(r"blocks\.(\d+)\.w", [r"layers.\1.attention.wq.weight", r"layers.\1.attention.wk.weight"],
                   lambda w: (w, w + 1))  # fmt: skip
    plan = plan_keys(Layers(1), {"model.blocks.0.w": (4, 4)}, weights_mapping=[Rename(r"^model\.", ""), rule])
    assert plan.conversions[0].targets == ("layers.0.attention.wq.weight", "layers.0.attention.wk.weight")


def test_a_convert_whose_pattern_matches_nothing_is_named_with_the_nearest_keys(tmp_path):
    from loader import load_hf_checkpoint, transfer_weights

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Parameter(torch.zeros(12, 4))

    g = torch.Generator().manual_seed(0)
    tensors = {f"attn.{p}.weight": torch.randn(4, 4, generator=g) for p in "qkv"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    fused = Convert(["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv", lambda q, k, v: torch.cat([q, k, v]))
    typo = Convert(["attn.q.weight", "attn.k.wieght", "attn.v.weight"], "qkv", lambda q, k, v: torch.cat([q, k, v]))
    wrong = Convert(r"atn\.q\.weight", "qkv", lambda q: q.repeat(3, 1))
    with pytest.raises(ValueError, match="1 model tensor.*not in the checkpoint: qkv") as info:
        load_hf_checkpoint(Fused(), tmp_path, rules=Rules(weights_mapping=[wrong]), options=LoadOptions(progress=False))
    message = str(info.value)
    assert "matched no checkpoint key" in message and repr(r"atn\.q\.weight") in message
    assert "nearest checkpoint keys: ['attn.q.weight'" in message
    with pytest.raises(ValueError, match="have no checkpoint key in the source's layout") as info:
        transfer_weights(Fused(), Fused(), src_mapping=[fused], dst_mapping=[wrong], source_shapes=shapes_of(tensors))
    assert "matched no checkpoint key" in str(info.value) and "'attn.q.weight'" in str(info.value)
    # a typo in one of several patterns: the rule matched keys, its group lacks the pattern (named, with the keys)
    with pytest.raises(ValueError, match=r"no checkpoint key for source pattern 'attn\.k\.wieght'"):
        load_hf_checkpoint(Fused(), tmp_path, rules=Rules(weights_mapping=[typo]), options=LoadOptions(progress=False))
    # without a typo no note: the tensor is simply not in the checkpoint
    with pytest.raises(ValueError, match="not in the checkpoint: qkv") as info:
        load_hf_checkpoint(Fused(), tmp_path, rules=Rules(weights_mapping=[]), options=LoadOptions(progress=False))
    assert "matched no checkpoint key" not in str(info.value)
