"""End-to-end tests of ``load_hf_checkpoint`` / ``HFLoadPlanner`` on real files and real models.

Oracle: transformers itself. For tiny random models of many families the checkpoint is written by
``save_pretrained`` (the original layout, e.g. per-expert tensors), loaded into a freshly initialised model,
and every tensor is compared bit for bit with the saved model and with ``from_pretrained`` of the same files.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_models import build, clone_state, config_of, read_checkpoint, save
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoModel, AutoModelForCausalLM

from loader import (
    Convert,
    HFLoadPlanner,
    LoadReport,
    Rename,
    SafetensorsCheckpoint,
    SafetensorsReader,
    load_hf_checkpoint,
)
from loader.hooks import PlanHooks
from loader.options import LoadOptions, Rules
from loader.rules import dot_natural_key

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

ORACLE_FAMILIES = [
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "jamba", "ernie4_5_moe", "gpt_oss", "llama",
    "qwen3_vl_moe", "nomic_bert", "gradium_phonon_tts", "llava_mixtral",
]  # fmt: skip
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def nsorted(keys) -> tuple[str, ...]:
    return tuple(sorted(set(keys), key=dot_natural_key))


def identities(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {k: (id(v), v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}


def assert_bit_equal(actual: dict, expected: dict, names=None) -> None:
    for name in expected if names is None else names:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype and a.shape == e.shape, (name, a.dtype, e.dtype, a.shape, e.shape)
        assert torch.equal(_bits(a), _bits(e)), name


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t


def cast_like(state: dict, like: dict, via: torch.dtype) -> dict:
    """``state`` as a ``via`` checkpoint loaded into tensors of ``like``'s dtypes."""
    return {k: v.to(via).to(like[k].dtype) if v.is_floating_point() else v for k, v in state.items()}


def tied_groups(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family, dtype)`` -> (auto class, saved float32 model, checkpoint dir, checkpoint tensors)."""
    cache: dict = {}

    def get(family: str, dtype: str = "f32"):
        if (family, dtype) not in cache:
            auto, model = build(family) if (family, "f32") not in cache else cache[family, "f32"][:2]
            directory = tmp_path_factory.mktemp(f"{family}_{dtype}")
            save(model, directory, DTYPES[dtype])
            cache[family, dtype] = (auto, model, directory, read_checkpoint(directory))
        return cache[family, dtype]

    return get


# ----------------------------------------------------------------------------------------------------------
# transformers families: bit-exact against the saved model and from_pretrained
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt_dtype", list(DTYPES))
@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_family_oracle(family, ckpt_dtype, saved, tmp_path):
    auto, model, directory, tensors = saved(family, ckpt_dtype)
    _, fresh = build(family, seed=1)  # float32, every element different from the saved model
    before = identities(fresh)
    state = model.state_dict()
    assert not any(torch.equal(fresh.state_dict()[k], v) for k, v in state.items() if v.is_floating_point())

    report = load_hf_checkpoint(fresh, directory, options=LoadOptions(progress=False))

    assert isinstance(report, LoadReport)
    loaded = fresh.state_dict()
    expected = cast_like(state, loaded, DTYPES[ckpt_dtype])
    assert_bit_equal(loaded, expected)
    reference, info = auto.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert_bit_equal(loaded, reference.state_dict())

    # the model's tensors were written in place
    assert identities(fresh) == before
    # every tensor traced (no deferred conversion for these families), each read once
    assert report.deferred == () and report.deferred_reasons == {}
    assert report.traced and len(report.traced) == len(set(report.traced)) and report.blocks > 0
    assert report.loaded_keys == nsorted(state) and isinstance(report.loaded_keys, tuple)
    assert report.missing_keys == () == tuple(info["missing_keys"])
    assert report.unexpected_keys == () == tuple(info["unexpected_keys"])
    assert info["mismatched_keys"] == set()
    ckpt = SafetensorsCheckpoint.open(directory)
    assert report.bytes_read == report.planned_bytes == ckpt.total_bytes
    # tied weights: loaded once, reported under every name, still one tensor
    for names in tied_groups(fresh):
        assert len(set(names) & set(report.traced)) == 1, names
        assert set(names) <= set(report.loaded_keys)
    if family == "llama":
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
        assert "lm_head.weight" in report.loaded_keys and "lm_head.weight" not in report.traced
    # persistent buffers in the checkpoint are loaded
    buffers = [n for n, _ in fresh.named_buffers() if n in state]
    assert set(buffers) <= set(report.loaded_keys)
    if family == "deepseek_v3":
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in buffers

    # conversions recorded like from_pretrained: save_pretrained writes the original checkpoint back
    assert repr(fresh._weight_conversions) == repr(reference._weight_conversions)
    fresh.save_pretrained(tmp_path)
    resaved = read_checkpoint(tmp_path)
    assert list(resaved) == list(tensors)
    for key, value in tensors.items():
        assert torch.equal(resaved[key].to(value.dtype), value), key


def test_family_plans_use_rarer_ops(saved):
    """The families above really exercise Transpose(check_dims), Chunk and Chunk -> PermuteForRope."""
    ops = {}
    for family in ("qwen3_vl_moe", "nomic_bert", "gradium_phonon_tts", "mixtral"):
        _, model, directory, _ = saved(family)
        planner = HFLoadPlanner(build(family, seed=2)[1])
        plan = planner.build_plan(SafetensorsCheckpoint.open(directory))
        ops[family] = {c.description for c in plan.conversions if not c.is_rename}
    assert ops["qwen3_vl_moe"] == {"Transpose"}
    assert ops["nomic_bert"] == {"Chunk(dim=0)"}
    assert ops["gradium_phonon_tts"] == {"Chunk(dim=0) -> PermuteForRope"}
    assert "MergeModulelist(dim=0) -> Concatenate(dim=1)" in ops["mixtral"]


def test_dtype_cast_to_lower_precision(saved):
    """A float32 checkpoint into a bfloat16 model rounds exactly like from_pretrained(dtype=bfloat16)."""
    auto, _, directory, _ = saved("qwen3_moe")
    _, fresh = build("qwen3_moe", seed=1, dtype=torch.bfloat16)
    report = load_hf_checkpoint(fresh, directory, options=LoadOptions(progress=False))
    assert report.deferred == ()
    reference = auto.from_pretrained(directory, dtype=torch.bfloat16)
    assert_bit_equal(fresh.state_dict(), reference.state_dict())


def test_qwen3_vl_moe_transposed_checkpoint(saved, tmp_path):
    """Transpose(1, 2, check_dims=True) transposes only when the checkpoint's expert tensors are transposed."""
    auto, model, _, tensors = saved("qwen3_vl_moe")
    experts = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4
    original = {k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in tensors.items()}
    save_file(original, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    _, fresh = build("qwen3_vl_moe", seed=1)
    report = load_hf_checkpoint(fresh, tmp_path, options=LoadOptions(progress=False))
    assert report.deferred == () and report.missing_keys == () and report.unexpected_keys == ()
    assert_bit_equal(fresh.state_dict(), model.state_dict())
    assert_bit_equal(fresh.state_dict(), auto.from_pretrained(tmp_path).state_dict())


@pytest.mark.parametrize("tie", [True, False])
def test_base_checkpoint_into_causal_lm(tie, tmp_path):
    config = config_of("mixtral", tie_word_embeddings=tie)
    torch.manual_seed(0)
    base = AutoModel.from_config(config)
    base.save_pretrained(tmp_path)
    causal = AutoModelForCausalLM.from_config(config)
    if not tie:  # lm_head is not in a base checkpoint
        with pytest.raises(ValueError, match="lm_head.weight"):
            load_hf_checkpoint(causal, tmp_path, options=LoadOptions(progress=False))
    report = load_hf_checkpoint(causal, tmp_path, rules=Rules(strict=tie), options=LoadOptions(progress=False))
    reference, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(report.missing_keys) == info["missing_keys"] == (set() if tie else {"lm_head.weight"})
    assert report.unexpected_keys == () and report.deferred == ()
    names = [n for n in causal.state_dict() if n not in report.missing_keys]
    assert_bit_equal(causal.state_dict(), reference.state_dict(), names)
    base_state = base.state_dict()
    for name in names:
        if name.startswith("model."):
            assert torch.equal(causal.state_dict()[name], base_state[name.removeprefix("model.")]), name
    assert repr(causal._weight_conversions) == repr(reference._weight_conversions)


def test_causal_lm_checkpoint_into_base(tmp_path):
    config = config_of("mixtral", tie_word_embeddings=False)
    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config(config)
    causal.save_pretrained(tmp_path)
    base = AutoModel.from_config(config)
    report = load_hf_checkpoint(base, tmp_path, options=LoadOptions(progress=False))
    reference, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert report.unexpected_keys == ("lm_head.weight",) and info["unexpected_keys"] == {"lm_head.weight"}
    assert report.missing_keys == () and info["missing_keys"] == set()
    assert_bit_equal(base.state_dict(), reference.state_dict())
    causal_state = causal.state_dict()
    for name, value in base.state_dict().items():
        assert torch.equal(value, causal_state["model." + name]), name
    # lm_head is not needed, so not read
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert report.bytes_read == ckpt.total_bytes - ckpt["lm_head.weight"].nbytes


def test_ignored_keys_reported_like_from_pretrained(saved, tmp_path):
    """Keys transformers ignores (stale rotary inv_freq) are not unexpected; real extras and gaps are."""
    auto, model, _, tensors = saved("qwen2_moe")
    partial = {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.mlp.experts.")}
    partial["model.layers.0.mlp.surprise.weight"] = torch.ones(2)
    partial["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(partial, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    _, fresh = build("qwen2_moe", seed=1)
    with pytest.raises(ValueError, match=r"2 model tensor\(s\) are not in the checkpoint"):
        load_hf_checkpoint(fresh, tmp_path, options=LoadOptions(progress=False))
    report = load_hf_checkpoint(fresh, tmp_path, rules=Rules(strict=False), options=LoadOptions(progress=False))
    reference, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    assert (
        set(report.missing_keys)
        == info["missing_keys"]
        == {
            "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj",
        }
    )
    assert report.unexpected_keys == ("model.layers.0.mlp.surprise.weight",)
    assert info["unexpected_keys"] == {"model.layers.0.mlp.surprise.weight"}
    assert_bit_equal(fresh.state_dict(), reference.state_dict(), report.loaded_keys)
    assert set(report.loaded_keys) | set(report.missing_keys) == set(fresh.state_dict())


def test_fewer_layers_reads_only_what_it_needs(saved):
    """A one-layer model from a two-layer checkpoint reads exactly the bytes of the tensors it loads."""
    auto, model, directory, tensors = saved("mixtral")
    _, small = build("mixtral", seed=1, num_hidden_layers=1)
    report = load_hf_checkpoint(small, directory, options=LoadOptions(progress=False))
    layer1 = [k for k in tensors if k.startswith("model.layers.1.")]
    assert report.unexpected_keys == nsorted(layer1) and report.missing_keys == ()
    ckpt = SafetensorsCheckpoint.open(directory)
    needed = [k for k in tensors if k not in layer1]
    assert report.bytes_read == report.planned_bytes == sum(ckpt[k].nbytes for k in needed)
    assert_bit_equal(small.state_dict(), model.state_dict(), small.state_dict())
    reference = auto.from_pretrained(directory, config=small.config)
    assert_bit_equal(small.state_dict(), reference.state_dict())


def test_sharded_checkpoint(saved, tmp_path):
    """save_pretrained with small shards: index.json honoured, same result, same bytes."""
    auto, model, _, _ = saved("olmoe")
    save(model, tmp_path, torch.bfloat16, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) >= 3
    _, fresh = build("olmoe", seed=1)
    report = load_hf_checkpoint(fresh, tmp_path, options=LoadOptions(progress=False))
    assert_bit_equal(fresh.state_dict(), auto.from_pretrained(tmp_path, dtype=torch.float32).state_dict())
    assert report.bytes_read == SafetensorsCheckpoint.open(tmp_path).total_bytes


class PreferTransformers(PlanHooks):
    """Picks transformers' converter over ours, recording what the hook receives."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def select_converter(self, source_pattern, target_name, candidates, *, source_key=None):
        self.seen.append((source_pattern, target_name, source_key, candidates))
        return candidates[-1]


class PreferOursThreeArgs(PlanHooks):
    """An override written against the 3-argument hook (no ``source_key``)."""

    def select_converter(self, source_pattern, target_name, candidates):
        assert source_pattern == ".experts.*.w2.weight", source_pattern
        return candidates[0]


def test_select_converter_hook_gets_the_matched_pattern(saved):
    """On a real MoE model, where our Convert and transformers' MergeModulelist both match each expert's w2: the
    hook receives the matched source pattern, the target name and (by keyword) the checkpoint key."""
    _, model, directory, _ = saved("mixtral")
    stack = Convert(".experts.*.w2.weight", ".experts.down_proj", lambda ws: torch.stack(ws))
    for cls, ours in ((PreferTransformers, False), (PreferOursThreeArgs, True)):
        _, fresh = build("mixtral", seed=1)
        planner = HFLoadPlanner(fresh, rules=Rules(extra_weights_mapping=[stack]), hooks=cls())
        load_hf_checkpoint(fresh, directory, planner=planner, options=LoadOptions(progress=False))
        assert_bit_equal(fresh.state_dict(), model.state_dict())
        downs = [
            c
            for c in planner.key_plan(SafetensorsCheckpoint.open(directory)).conversions
            if c.targets[0].endswith("down_proj")
        ]
        assert len(downs) == 2 and all((c.rule is stack) == ours for c in downs)
    first = HFLoadPlanner(
        build("mixtral", seed=1)[1], rules=Rules(extra_weights_mapping=[stack]), hooks=PreferTransformers()
    )
    load_hf_checkpoint(first.model, directory, planner=first, options=LoadOptions(progress=False))
    first = first.hooks
    assert len(first.seen) == 8  # 2 layers x 4 experts
    pattern, target, key, candidates = first.seen[0]
    # the pattern that matched the renamed key (block_sparse_moe -> mlp), the key as the checkpoint stores it
    assert pattern == ".experts.*.w2.weight" and target == "model.layers.0.mlp.experts.down_proj"
    assert key == "model.layers.0.block_sparse_moe.experts.0.w2.weight"
    assert candidates[0] is stack and type(candidates[1]).__name__ == "WeightConverter"
    keys = {f"model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight" for i in (0, 1) for e in range(4)}
    assert {k for _, _, k, _ in first.seen} == keys


# ----------------------------------------------------------------------------------------------------------
# dcp.load in one process
# ----------------------------------------------------------------------------------------------------------


def dcp_load(model: nn.Module, directory, reader=None, planner=None) -> LoadReport:
    planner = planner or HFLoadPlanner(model)
    reader = reader or SafetensorsReader(directory)
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
    return planner.finish(reader)


def same_report(a: LoadReport, b: LoadReport) -> None:
    for field in ("loaded_keys", "missing_keys", "unexpected_keys", "traced", "deferred", "bytes_read"):
        assert getattr(a, field) == getattr(b, field), field


@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_dcp_single_process_safetensors_reader(family, saved):
    auto, model, directory, tensors = saved(family, "bf16")
    _, fresh = build(family, seed=1)
    before = identities(fresh)
    report = dcp_load(fresh, directory)
    assert identities(fresh) == before
    assert_bit_equal(fresh.state_dict(), cast_like(model.state_dict(), fresh.state_dict(), torch.bfloat16))
    _, again = build(family, seed=2)
    same_report(report, load_hf_checkpoint(again, directory, options=LoadOptions(progress=False)))
    assert repr(fresh._weight_conversions) == repr(again._weight_conversions)


@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_dcp_single_process_hf_storage_reader(family, saved):
    """torch's HuggingFaceStorageReader serves every plan whose blocks read plain boxes of tensors (gradium's
    PermuteForRope included: it reads each whole q/k chunk, a box, in a permuted order)."""
    _, model, directory, _ = saved(family, "bf16")
    _, fresh = build(family, seed=1)
    report = dcp_load(fresh, directory, reader=dcp.HuggingFaceStorageReader(str(directory)))
    assert_bit_equal(fresh.state_dict(), cast_like(model.state_dict(), fresh.state_dict(), torch.bfloat16))
    _, again = build(family, seed=2)
    same_report(report, load_hf_checkpoint(again, directory, options=LoadOptions(progress=False)))


class EveryOtherRow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.zeros(4, 6))


def test_hf_storage_reader_refuses_strided_blocks_before_reading(tmp_path):
    """A step slice reads no box: torch's reader cannot serve it, which is known before any read."""
    save_file({"w": torch.randn(8, 6)}, os.path.join(tmp_path, "model.safetensors"))
    net = EveryOtherRow()
    planner = HFLoadPlanner(net, rules=Rules(weights_mapping=[Convert("w", "rows", lambda w: w[::2])]))
    with pytest.raises(CheckpointException) as err:  # dcp wraps each rank's error
        dcp_load(net, tmp_path, reader=dcp.HuggingFaceStorageReader(str(tmp_path)), planner=planner)
    ((error, _),) = err.value.failures.values()
    assert isinstance(error, ValueError)
    assert "'rows'" in str(error) and "use loader.SafetensorsReader" in str(error)
    assert torch.equal(net.rows, torch.zeros(4, 6))


KV, GROUP, HEAD_DIM, HIDDEN = 2, 3, 4, 8


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Separate q/k/v -> one fused qkv, interleaved per KV head (each head's q rows, then its k, then its v)."""
    heads = [t.view(KV, -1, HIDDEN) for t in (q, k, v)]
    return torch.cat(heads, dim=1).reshape(-1, HIDDEN)


class FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, KV * (GROUP + 2) * HEAD_DIM, bias=False)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_hf_storage_reader_loads_qkv_interleaved_per_kv_head(tmp_path, model_dtype):
    """Regression: blocks whose dims split one source dim (KV heads x rows) read plain boxes of q, k and v; torch's
    HuggingFaceStorageReader serves them (staged, then copied through the block), with and without a cast."""
    g = torch.Generator().manual_seed(3)
    ckpt = {
        f"attn.{n}.weight": torch.randn(KV * size * HEAD_DIM, HIDDEN, generator=g).to(torch.bfloat16)
        for n, size in (("q", GROUP), ("k", 1), ("v", 1))
    }
    save_file(ckpt, os.path.join(tmp_path, "model.safetensors"))
    rules = [Convert(["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", interleave_qkv)]
    net = FusedQKV().to(model_dtype)
    planner = HFLoadPlanner(net, rules=Rules(weights_mapping=rules))
    report = dcp_load(net, tmp_path, reader=dcp.HuggingFaceStorageReader(str(tmp_path)), planner=planner)
    expected = interleave_qkv(*(ckpt[f"attn.{n}.weight"] for n in "qkv")).to(model_dtype)
    assert_bit_equal(net.state_dict(), {"qkv.weight": expected})
    assert report.traced == ("qkv.weight",) and report.blocks == 3
    plan = planner.build_plan(SafetensorsCheckpoint.open(tmp_path))  # the plan is a value: the same one again
    assert all(r.block.source_box() is not None for r in plan.reads)
    assert report.bytes_read == sum(t.numel() * 2 for t in ckpt.values())


# ----------------------------------------------------------------------------------------------------------
# A plain nn.Module with hand-written Convert rules
# ----------------------------------------------------------------------------------------------------------

DIM, HEADS, EXPERTS = 16, 4, 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # fused from q, k, v
        self.q_rope = nn.Linear(DIM, DIM, bias=False)  # checkpoint is interleaved rope: permuted
        self.proj = nn.Linear(DIM, 8)  # checkpoint stores the weight transposed
        self.experts = nn.Parameter(torch.empty(EXPERTS, 8, DIM))  # stacked from per-expert tensors
        self.scale = nn.Parameter(torch.empty(DIM))  # checkpoint stores half of it: untraceable `sum`
        self.register_buffer("running", torch.empty(5))


class Plain(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(DIM, 12, bias=False)
        self.head.weight = self.embed.weight  # tied


def rope_permute(w: torch.Tensor) -> torch.Tensor:
    """Interleaved -> rotate-half rope layout (what transformers' llama conversion script does)."""
    out, inp = w.shape
    return w.view(HEADS, out // HEADS // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def halve_back(w: torch.Tensor) -> torch.Tensor:
    return torch.stack([w, w]).sum(0)  # `sum`: not traceable, deferred


PLAIN_RULES = [
    Rename(r"^tok\.", "embed."),
    Rename(r"^blocks\.(\d+)\.", r"layers.\1."),
    Convert(["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", lambda q, k, v: torch.cat([q, k, v])),
    Convert("attn.wq.weight", "q_rope.weight", rope_permute),
    Convert("out.weight_t", "proj.weight", lambda w: w.t()),
    Rename("out.bias", "proj.bias"),
    Convert("moe.*.w", "experts", lambda ws: torch.stack(ws)),
    Convert("scale_half", "scale", halve_back),
]


def plain_checkpoint(layers: int = 2, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    ckpt = {"tok.weight": r(12, DIM)}
    for i in range(layers):
        p = f"blocks.{i}."
        for name in "qkv":
            ckpt[p + f"attn.{name}.weight"] = r(DIM, DIM)
        ckpt[p + "attn.wq.weight"] = r(DIM, DIM)
        ckpt[p + "out.weight_t"] = r(DIM, 8)
        ckpt[p + "out.bias"] = r(8)
        for e in range(EXPERTS):
            ckpt[p + f"moe.{e}.w"] = r(8, DIM)
        ckpt[p + "scale_half"] = r(DIM)
        ckpt[p + "running"] = r(5)
    return ckpt


def plain_expected(ckpt: dict, layers: int = 2) -> dict[str, torch.Tensor]:
    out = {"embed.weight": ckpt["tok.weight"], "head.weight": ckpt["tok.weight"]}
    for i in range(layers):
        p, q = f"blocks.{i}.", f"layers.{i}."
        out[q + "qkv.weight"] = torch.cat([ckpt[p + f"attn.{n}.weight"] for n in "qkv"])
        out[q + "q_rope.weight"] = rope_permute(ckpt[p + "attn.wq.weight"])
        out[q + "proj.weight"] = ckpt[p + "out.weight_t"].t()
        out[q + "proj.bias"] = ckpt[p + "out.bias"]
        out[q + "experts"] = torch.stack([ckpt[p + f"moe.{e}.w"] for e in range(EXPERTS)])
        out[q + "scale"] = ckpt[p + "scale_half"] * 2
        out[q + "running"] = ckpt[p + "running"]
    return out


def write_sharded(ckpt: dict, directory, shards: int = 2) -> None:
    """Write ``ckpt`` as ``shards`` files and an index.json, like save_pretrained does."""
    keys = list(ckpt)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: ckpt[k].contiguous() for k in keys[s::shards]}
        save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture
def plain_dir(tmp_path):
    ckpt = plain_checkpoint()
    write_sharded(ckpt, tmp_path)
    return tmp_path, ckpt


def fresh_plain(dtype=torch.float32) -> Plain:
    torch.manual_seed(1)
    net = Plain().to(dtype)
    with torch.no_grad():
        for t in net.state_dict().values():
            t.normal_()
    return net


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_plain_module_convert_rules(plain_dir, model_dtype):
    directory, ckpt = plain_dir
    net = fresh_plain(model_dtype)
    before = identities(net)
    report = load_hf_checkpoint(
        net, directory, rules=Rules(weights_mapping=PLAIN_RULES), options=LoadOptions(progress=False)
    )
    expected = {k: v.to(model_dtype) for k, v in plain_expected(ckpt).items()}
    assert_bit_equal(net.state_dict(), expected)
    assert identities(net) == before and net.head.weight is net.embed.weight
    # only the untraceable `sum` is deferred, and it says why
    assert report.deferred == ("layers.0.scale", "layers.1.scale")
    assert set(report.deferred_reasons) == {"layers.0.scale", "layers.1.scale"}
    assert all("sum" in why for why in report.deferred_reasons.values())
    assert set(report.traced) == set(expected) - {"head.weight", "layers.0.scale", "layers.1.scale"}
    assert report.loaded_keys == nsorted(expected) and report.missing_keys == report.unexpected_keys == ()
    assert report.bytes_read == report.planned_bytes == sum(v.numel() * 4 for v in ckpt.values())
    assert not hasattr(net, "_weight_conversions")  # not a transformers model: nothing recorded


def test_plain_module_through_dcp(plain_dir):
    """Strided blocks (transpose, rope permute) and deferred conversions also run inside dcp.load."""
    directory, ckpt = plain_dir
    net = fresh_plain()
    report = dcp_load(net, directory, planner=HFLoadPlanner(net, rules=Rules(weights_mapping=PLAIN_RULES)))
    assert_bit_equal(net.state_dict(), plain_expected(ckpt))
    same_report(
        report,
        load_hf_checkpoint(
            fresh_plain(), directory, rules=Rules(weights_mapping=PLAIN_RULES), options=LoadOptions(progress=False)
        ),
    )


def test_supports_symbolic_false_defers_everything(plain_dir):
    directory, ckpt = plain_dir

    class NoTrace(PlanHooks):
        def supports_symbolic(self, conversion):
            return conversion.is_rename  # every Convert runs for real

    net = fresh_plain()
    report = load_hf_checkpoint(
        net,
        directory,
        planner=HFLoadPlanner(net, hooks=NoTrace(), rules=Rules(weights_mapping=PLAIN_RULES)),
        options=LoadOptions(progress=False),
    )
    assert_bit_equal(net.state_dict(), plain_expected(ckpt))
    assert "layers.0.qkv.weight" in report.deferred and "layers.1.experts" in report.deferred
    assert report.deferred_reasons["layers.0.qkv.weight"] == "rejected by supports_symbolic"
    assert set(report.traced) == {
        "embed.weight",
        "layers.0.proj.bias",
        "layers.1.proj.bias",
        "layers.0.running",
        "layers.1.running",
    }


def test_planner_hooks_map_and_select(plain_dir):
    """map_checkpoint_key renames or skips keys; default_weights_mapping supplies the rules."""
    directory, ckpt = plain_dir

    class Hooks(PlanHooks):
        def default_weights_mapping(self, model):
            return PLAIN_RULES

        def map_checkpoint_key(self, key):
            return None if key.endswith("running") else key

    net = fresh_plain()
    before = clone_state(net)
    report = load_hf_checkpoint(
        net,
        directory,
        planner=HFLoadPlanner(net, hooks=Hooks(), rules=Rules(strict=False)),
        options=LoadOptions(progress=False),
    )
    assert report.missing_keys == ("layers.0.running", "layers.1.running")
    assert report.unexpected_keys == ()  # skipped keys are neither loaded nor unexpected
    expected = plain_expected(ckpt)
    names = [k for k in expected if not k.endswith("running")]
    assert_bit_equal(net.state_dict(), expected, names)
    assert_bit_equal(net.state_dict(), before, ["layers.0.running", "layers.1.running"])


def test_partial_regions_read_only_needed_bytes(tmp_path):
    """A conversion that needs part of a tensor reads exactly those bytes (rows, columns, a strided pick)."""
    big = torch.arange(40 * 24, dtype=torch.float32).reshape(40, 24)
    save_file({"big": big, "other": torch.ones(1000)}, str(tmp_path / "model.safetensors"))

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = nn.Parameter(torch.zeros(3, 24))
            self.cols = nn.Parameter(torch.zeros(40, 2))
            self.every_other = nn.Parameter(torch.zeros(5, 24))

    rules = [Convert("big", ["rows", "cols", "every_other"], lambda w: (w[2:5], w[:, 7:9], w[10:20:2]))]
    net = Small()
    report = load_hf_checkpoint(
        net, tmp_path / "model.safetensors", rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False)
    )
    assert torch.equal(net.rows, big[2:5]) and torch.equal(net.cols, big[:, 7:9])
    assert torch.equal(net.every_other, big[10:20:2])
    assert report.unexpected_keys == ("other",) and report.deferred == ()
    # every needed element once: the column pick overlaps both row picks, and those bytes are not read twice
    needed = torch.zeros(40, 24, dtype=torch.bool)
    needed[2:5] = needed[:, 7:9] = needed[10:20:2] = True
    assert report.bytes_read == report.planned_bytes == int(needed.sum()) * 4 < (3 * 24 + 40 * 2 + 5 * 24) * 4


def test_strict_false_reports_missing(plain_dir):
    directory, ckpt = plain_dir
    torch.manual_seed(3)
    net = Plain(layers=3)
    before = clone_state(net)
    with pytest.raises(ValueError, match=r"layers\.2\.qkv\.weight.*strict=False"):
        load_hf_checkpoint(
            net, directory, rules=Rules(weights_mapping=PLAIN_RULES), options=LoadOptions(progress=False)
        )
    assert_bit_equal(net.state_dict(), before)
    report = load_hf_checkpoint(
        net, directory, rules=Rules(weights_mapping=PLAIN_RULES, strict=False), options=LoadOptions(progress=False)
    )
    assert report.missing_keys == nsorted(k for k in net.state_dict() if k.startswith("layers.2."))
    assert_bit_equal(net.state_dict(), plain_expected(ckpt))
    assert_bit_equal(net.state_dict(), before, report.missing_keys)


def test_bf16_checkpoint_into_plain_float32(tmp_path):
    ckpt = plain_checkpoint(dtype=torch.bfloat16)
    save_file(ckpt, str(tmp_path / "model.safetensors"))
    net = fresh_plain()
    report = load_hf_checkpoint(
        net, tmp_path, rules=Rules(weights_mapping=PLAIN_RULES), options=LoadOptions(progress=False)
    )
    expected = {k: v.float() for k, v in plain_expected(ckpt).items()}
    assert_bit_equal(net.state_dict(), expected)
    assert report.bytes_read == sum(v.numel() * 2 for v in ckpt.values())


def test_extra_weights_mapping_and_key_mapping(plain_dir):
    """extra rules come first, then key_mapping renames, then weights_mapping."""
    directory, ckpt = plain_dir
    # a rule placed before the defaults takes the qkv keys: the transformers-style qkv Convert never sees them
    swap = Convert(
        ["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", lambda q, k, v: torch.cat([v, k, q])
    )
    net = fresh_plain()
    load_hf_checkpoint(
        net,
        directory,
        rules=Rules(
            weights_mapping=PLAIN_RULES[2:],
            extra_weights_mapping=[swap],
            key_mapping={r"^tok\.": "embed.", r"^blocks\.(\d+)\.": r"layers.\1."},
        ),
        options=LoadOptions(progress=False),
    )
    expected = plain_expected(ckpt)
    expected["layers.1.qkv.weight"] = torch.cat([ckpt[f"blocks.1.attn.{n}.weight"] for n in "vkq"])
    expected["layers.0.qkv.weight"] = torch.cat([ckpt[f"blocks.0.attn.{n}.weight"] for n in "vkq"])
    assert_bit_equal(net.state_dict(), expected)


# ----------------------------------------------------------------------------------------------------------
# progress bar and log lines
# ----------------------------------------------------------------------------------------------------------


def test_progress_bar_and_log_lines(plain_dir, capfd, caplog):
    directory, _ = plain_dir
    with caplog.at_level(logging.INFO, logger="loader"):
        report = load_hf_checkpoint(
            fresh_plain(), directory, rules=Rules(weights_mapping=PLAIN_RULES), options=LoadOptions(progress=False)
        )
    assert "loading" not in capfd.readouterr().err
    messages = [r.getMessage() for r in caplog.records if r.name == "loader"]
    traced = len(report.traced)
    assert any(
        m.startswith(
            f"planned {traced} tensors as region or value reads, 2 through 2 deferred conversions, "
            f"{report.planned_bytes} bytes"
        )
        for m in messages
    ), messages
    load_hf_checkpoint(
        fresh_plain(), directory, rules=Rules(weights_mapping=PLAIN_RULES), options=LoadOptions(progress=True)
    )
    err = capfd.readouterr().err
    assert "loading" in err and "B" in err
    # default: on only when stderr is a terminal (it is captured here)
    load_hf_checkpoint(fresh_plain(), directory, rules=Rules(weights_mapping=PLAIN_RULES))
    assert "loading" not in capfd.readouterr().err


def test_many_run_blocks_are_read_by_span_in_one_strided_copy(tmp_path):
    """Column slices and step slices read hundreds of short runs: exact values, exact bytes."""
    from safetensors.torch import save_file
    from torch import nn

    from loader import Convert, load_hf_checkpoint
    from loader.execute import STRIDED_RUNS, read_layout

    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(300, 8, generator=g).to(torch.bfloat16), "u": torch.randn(200, 6, generator=g)}
    save_file(src, str(tmp_path / "model.safetensors"))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.cols = nn.Parameter(torch.zeros(300, 3))
            self.every_other = nn.Parameter(torch.zeros(200, 3, dtype=torch.float64))

    rules = [Convert("w", "cols", lambda w: w[:, 2:5]), Convert("u", "every_other", lambda u: u[:, ::2].double())]
    net = Net()
    report = load_hf_checkpoint(
        net, str(tmp_path), rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False)
    )
    assert torch.equal(net.cols.data, src["w"][:, 2:5].float())
    assert torch.equal(net.every_other.data, src["u"][:, ::2].double())
    assert report.deferred == ()
    assert report.bytes_read == 300 * 3 * 2 + 200 * 3 * 4  # exactly the elements the model needs
    import regiontrace as rt

    x = rt.RegionTensor.leaf("w", (300, 8), torch.bfloat16)
    assert len(read_layout(x[:, 2:5].remap_blocks()[0]).runs) > STRIDED_RUNS


def test_deferred_transformers_conversions_cast_sources_like_from_pretrained(tmp_path):
    """Deferred WeightConverters get sources cast to the target dtype first (transformers' order)."""
    import hf_models

    from loader import HFLoadPlanner, load_hf_checkpoint
    from loader.plan import deferred_inputs

    _, saved = hf_models.build("mixtral", seed=0)
    hf_models.save(saved, tmp_path, dtype=torch.bfloat16)

    class NoTracing(PlanHooks):
        def supports_symbolic(self, conversion):
            return conversion.is_rename

    _, traced_model = hf_models.build("mixtral", seed=1)
    _, deferred_model = hf_models.build("mixtral", seed=2)
    load_hf_checkpoint(traced_model, str(tmp_path), options=LoadOptions(progress=False))
    report = load_hf_checkpoint(
        deferred_model,
        str(tmp_path),
        planner=HFLoadPlanner(deferred_model, hooks=NoTracing()),
        options=LoadOptions(progress=False),
    )
    assert report.deferred and "rejected by supports_symbolic" in " ".join(report.deferred_reasons.values())
    for name, t in traced_model.state_dict().items():
        assert torch.equal(t, deferred_model.state_dict()[name]), name
    planner = HFLoadPlanner(deferred_model, hooks=NoTracing())
    from loader.checkpoint import SafetensorsCheckpoint

    plan = planner.build_plan(SafetensorsCheckpoint.open(str(tmp_path)))
    conv = plan.deferred[0].conversion
    inputs = deferred_inputs(conv, {k: torch.zeros(2, dtype=torch.bfloat16) for k in conv.sources}, plan.slots)
    assert {t.dtype for t in inputs.values()} == {torch.float32}
