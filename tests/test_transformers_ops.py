"""transformers' ConversionOps traced on RegionTensors, called exactly as transformers' loader calls them.

Each converter runs through a real ``WeightConverter``: tensors are registered with ``add_tensor`` (in
checkpoint order, one list per source pattern) and ``WeightConverter.convert(layer_name, model=, config=)``
runs every op with ``op.convert(collected, source_patterns=, target_patterns=, full_layer_name=, model=,
config=, missing_keys=)`` — the same call as ``convert_and_load_state_dict_in_model``. The traced result is
checked against the same conversion on real tensors with :func:`regiontrace.testing.assert_converter_exact`
(materialize, random-box blocks, and the unique-code oracle).
"""

from copy import deepcopy

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    Conv3dToLinear,
    ErnieFuseAndSplitTextVisionExperts,
    ErnieSplitAndDecoupleTextVisionExperts,
    Inkling2LoopDequantizeExperts,
    Inkling2LoopMergeMessageQueries,
    Inkling2UnpadVocab,
    Interleave,
    LinearToConv3d,
    MergeModulelist,
    PermuteForRope,
    Split,
    SplitModulelist,
    Transpose,
    VisionFuseAndPermuteForRope,
    VisionUnfuseAndPermuteForRope,
    WeightConverter,
)
from transformers.utils import logging as hf_logging

import regiontrace as rt
from regiontrace.testing import assert_converter_exact

hf_logging.set_verbosity_error()  # the deprecated Vision*PermuteForRope ops warn on construction

BF16 = torch.bfloat16


def meta_model(params):
    """An nn.Module holding meta parameters under dotted names (what ``model.get_parameter`` reads)."""
    root = nn.Module()
    for name, shape in params.items():
        *path, last = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(last, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))
    return root


def loader_call(converter, layer_name, keys, model=None, config=None):
    """A function of the checkpoint tensors (by checkpoint key) that converts them like transformers' loader.

    Args:
        converter: a WeightConverter template (deep-copied per call, as the loader does per target key).
        layer_name: the first target key (the loader's ``renamed_key``).
        keys: ``(checkpoint key, index of its source pattern)`` in checkpoint order.
    """

    def convert(**tensors):
        conv = deepcopy(converter)
        for key, i in keys:
            conv.add_tensor(layer_name, key, conv.source_patterns[i], lambda t=tensors[key]: t)
        out = conv.convert(layer_name, model=model, config=config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    return convert


def check(converter, layer_name, keys, specs, model=None, config=None):
    fn = loader_call(converter, layer_name, keys, model, config)
    out = assert_converter_exact(fn, boxes=6, **specs)
    assert out and all(isinstance(t, rt.RegionTensor) for t in out.values())
    return out


def pieces(t):
    return len(t.region.pieces)


# ---------------------------------------------------------------------------------------------------
# one op at a time


@pytest.mark.parametrize("dim", [0, 1])
def test_chunk(dim):
    conv = WeightConverter("qkv_proj.weight", ["q_proj.weight", "k_proj.weight", "v_proj.weight"], [Chunk(dim=dim)])
    shape = (12, 5) if dim == 0 else (5, 12)
    out = check(
        conv,
        "model.layers.0.attn.q_proj.weight",
        [("model.layers.0.attn.qkv_proj.weight", 0)],
        {"model.layers.0.attn.qkv_proj.weight": (shape, BF16)},
    )
    assert list(out) == [
        "model.layers.0.attn.q_proj.weight",
        "model.layers.0.attn.k_proj.weight",
        "model.layers.0.attn.v_proj.weight",
    ]
    assert all(pieces(t) == 1 for t in out.values())


def test_chunk_with_num_shards_attribute():
    conv = WeightConverter("experts.gate_up", "experts.*.proj", [Chunk(dim=0, num_shards_attribute="num_experts")])
    config = PretrainedConfig(num_experts=3)
    out = check(
        conv, "mlp.experts.0.proj", [("mlp.experts.gate_up", 0)], {"mlp.experts.gate_up": ((6, 4), BF16)}, config=config
    )
    assert list(out) == ["mlp.experts.0.proj", "mlp.experts.1.proj", "mlp.experts.2.proj"]


def test_split_sized_like_the_model_parameters():
    # Molmo2's mapping: one fused att_proj split into GQA-sized q, k, v
    conv = WeightConverter(
        "self_attn.att_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [Split(dim=0)]
    )
    model = meta_model(
        {
            "layers.0.self_attn.q_proj.weight": (8, 6),
            "layers.0.self_attn.k_proj.weight": (2, 6),
            "layers.0.self_attn.v_proj.weight": (2, 6),
        }
    )
    out = check(
        conv,
        "layers.0.self_attn.q_proj.weight",
        [("layers.0.self_attn.att_proj.weight", 0)],
        {"layers.0.self_attn.att_proj.weight": ((12, 6), BF16)},
        model=model,
    )
    assert [tuple(t.shape) for t in out.values()] == [(8, 6), (2, 6), (2, 6)]


@pytest.mark.parametrize("dim", [0, 1])
def test_concatenate(dim):
    conv = WeightConverter(
        ["q_proj.weight", "k_proj.weight", "v_proj.weight"], "qkv_proj.weight", [Concatenate(dim=dim)]
    )
    keys = [("attn.v_proj.weight", 2), ("attn.q_proj.weight", 0), ("attn.k_proj.weight", 1)]  # any order
    shapes = {"attn.q_proj.weight": (8, 4), "attn.k_proj.weight": (2, 4), "attn.v_proj.weight": (2, 4)}
    if dim == 1:
        shapes = {k: (s[1], s[0]) for k, s in shapes.items()}
    out = check(conv, "attn.qkv_proj.weight", keys, {k: (s, BF16) for k, s in shapes.items()})
    (fused,) = out.values()
    assert fused.sources() == set(shapes)
    assert pieces(fused) == 3
    # compiled for a row box, each source gives at most one block
    blocks = fused.remap_blocks(((1, fused.shape[0] - 1), (0, fused.shape[1])))
    assert len(blocks) == len({b.source for b in blocks})


def test_merge_modulelist():
    E, I, H = 4, 6, 5
    conv = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)])
    keys = [(f"layers.0.mlp.experts.{e}.down_proj.weight", 0) for e in range(E)]
    out = check(conv, "layers.0.mlp.experts.down_proj", keys, {k: ((H, I), BF16) for k, _ in keys})
    (merged,) = out.values()
    assert merged.shape == (E, H, I) and pieces(merged) == E
    assert len(merged.remap_blocks(((0, E), (1, 3), (2, 5)))) == E


def test_merge_modulelist_passes_a_stacked_tensor_through():
    conv = MergeModulelist(dim=0)
    stacked = rt.RegionTensor.leaf("experts.down_proj", (4, 3, 2), BF16)
    out = rt.trace(
        lambda d: conv.convert(d, source_patterns=["experts.down_proj"], target_patterns=["down"]),
        {"experts.down_proj": stacked},
    )
    assert out["down"] is stacked


def test_split_modulelist():
    E = 3
    conv = WeightConverter("mlp.experts.down_proj", "mlp.experts.*.down_proj.weight", [SplitModulelist(dim=0)])
    out = check(
        conv,
        "mlp.experts.0.down_proj.weight",
        [("mlp.experts.down_proj", 0)],
        {"mlp.experts.down_proj": ((E, 4, 1), BF16)},
    )
    assert list(out) == [f"mlp.experts.{e}.down_proj.weight" for e in range(E)]
    assert all(t.shape == (4, 1) for t in out.values())  # only the split dim is squeezed


def test_transpose():
    conv = WeightConverter("mlp.gate.weight_1", "mlp.vision_moe.gate.weight", [Transpose(dim0=0, dim1=1)])
    out = check(
        conv,
        "model.mlp.vision_moe.gate.weight",
        [("model.mlp.gate.weight_1", 0)],
        {"model.mlp.gate.weight_1": ((6, 4), BF16)},
    )
    (t,) = out.values()
    assert t.shape == (4, 6) and pieces(t) == 1


@pytest.mark.parametrize("stored", [(3, 8, 5), (3, 5, 8)])
def test_transpose_check_dims(stored):
    # qwen3_vl_moe: transpose experts only when the checkpoint layout differs from the model's
    conv = WeightConverter("mlp.experts.down_proj", "mlp.experts.down_proj", [Transpose(1, 2, check_dims=True)])
    name = "model.layers.0.mlp.experts.down_proj"
    model = meta_model({name: (3, 8, 5)})
    out = check(conv, name, [(name, 0)], {name: (stored, BF16)}, model=model)
    (t,) = out.values()
    assert t.shape == (3, 8, 5)
    (block,) = t.remap_blocks(((0, 3), (0, 8), (0, 5)))
    assert block.source_box() is not None


@pytest.mark.parametrize("inverse", [False, True])
def test_permute_for_rope(inverse):
    heads, head_dim, hidden = 4, 8, 6
    dim0 = heads * head_dim
    conv = WeightConverter("attention.wq.weight", "self_attn.q_proj.weight", [PermuteForRope(inverse=inverse)])
    config = PretrainedConfig(num_attention_heads=heads)
    out = check(
        conv,
        "layers.0.self_attn.q_proj.weight",
        [("layers.0.attention.wq.weight", 0)],
        {"layers.0.attention.wq.weight": ((dim0, hidden), BF16)},
        config=config,
    )
    (t,) = out.values()
    assert pieces(t) == 1  # the rope permutation is one factored affine piece


def test_permute_for_rope_on_a_bias():
    conv = WeightConverter("attention.wq.bias", "self_attn.q_proj.bias", [PermuteForRope()])
    out = check(
        conv,
        "self_attn.q_proj.bias",
        [("attention.wq.bias", 0)],
        {"attention.wq.bias": ((16,), BF16)},
        config=PretrainedConfig(num_attention_heads=2),
    )
    assert pieces(next(iter(out.values()))) == 1


def test_chunk_then_permute_for_rope_on_the_vision_config():
    # the vision qkv mapping: Chunk(dim=0) then PermuteForRope(subconfig_key="vision_config", q and k only)
    conv = WeightConverter(
        "wqkv",
        ["attn.q_proj", "attn.k_proj", "attn.v_proj"],
        [Chunk(dim=0), PermuteForRope(subconfig_key="vision_config", permute_layer_names=["q_proj", "k_proj"])],
    )
    config = PretrainedConfig(vision_config=PretrainedConfig(num_attention_heads=2), num_attention_heads=7)
    out = check(
        conv,
        "blocks.0.attn.q_proj.weight",
        [("blocks.0.wqkv.weight", 0)],
        {"blocks.0.wqkv.weight": ((24, 5), BF16)},
        config=config,
    )
    assert [pieces(t) for t in out.values()] == [1, 1, 1]


def test_deprecated_vision_unfuse_and_fuse_permute_for_rope():
    config = PretrainedConfig(vision_config=PretrainedConfig(num_attention_heads=2))
    unfuse = WeightConverter(
        "qkv",
        ["q_proj", "k_proj", "v_proj"],
        [VisionUnfuseAndPermuteForRope(dim=0, permute_layer_names=["q_proj", "k_proj"])],
    )
    out = check(
        unfuse,
        "blocks.0.attn.q_proj.weight",
        [("blocks.0.attn.qkv.weight", 0)],
        {"blocks.0.attn.qkv.weight": ((24, 5), BF16)},
        config=config,
    )
    assert [pieces(t) for t in out.values()] == [1, 1, 1]
    fuse = WeightConverter(
        ["q_proj", "k_proj", "v_proj"],
        "qkv",
        [VisionFuseAndPermuteForRope(dim=0, permute_layer_names=["q_proj", "k_proj"])],
    )
    keys = [("attn.q_proj.weight", 0), ("attn.k_proj.weight", 1), ("attn.v_proj.weight", 2)]
    out = check(fuse, "attn.qkv.weight", keys, {k: ((8, 5), BF16) for k, _ in keys}, config=config)
    (fused,) = out.values()
    assert fused.shape == (24, 5) and pieces(fused) == 3


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dim", [0, 1])
def test_interleave(dim, inverse):
    conv = WeightConverter("mlp.experts.w13_weight", "mlp.experts.gate_up_proj", [Interleave(dim=dim, inverse=inverse)])
    shape = (3, 8, 4) if dim == 1 else (8, 4)
    out = check(
        conv,
        "layers.0.mlp.experts.gate_up_proj",
        [("layers.0.mlp.experts.w13_weight", 0)],
        {"layers.0.mlp.experts.w13_weight": (shape, BF16)},
    )
    assert pieces(next(iter(out.values()))) == 1


def test_interleave_then_chunk():
    conv = WeightConverter("shared_w13_weight", ["gate_proj", "up_proj"], [Interleave(dim=1), Chunk(dim=1)])
    out = check(
        conv,
        "layers.0.mlp.gate_proj",
        [("layers.0.mlp.shared_w13_weight", 0)],
        {"layers.0.mlp.shared_w13_weight": ((4, 10), BF16)},
    )
    gate, up = out.values()
    assert gate.shape == up.shape == (4, 5)
    assert pieces(gate) == pieces(up) == 1  # every other column of the source


def test_conv3d_to_linear_and_back():
    conv = WeightConverter(
        r"patch_embed\.proj\.weight",
        r"patch_embed\.linear_proj\.weight",
        [Conv3dToLinear(in_channels=3, kernel_size=(2, 4, 4))],
    )
    out = check(
        conv,
        "visual.patch_embed.linear_proj.weight",
        [("visual.patch_embed.proj.weight", 0)],
        {"visual.patch_embed.proj.weight": ((8, 3, 2, 4, 4), BF16)},
    )
    (t,) = out.values()
    assert t.shape == (8, 96) and pieces(t) == 1
    back = WeightConverter("linear_proj.weight", "proj.weight", [LinearToConv3d(in_channels=3, kernel_size=(2, 4, 4))])
    out = check(
        back,
        "patch_embed.proj.weight",
        [("patch_embed.linear_proj.weight", 0)],
        {"patch_embed.linear_proj.weight": ((8, 96), BF16)},
    )
    (t,) = out.values()
    assert t.shape == (8, 3, 2, 4, 4) and pieces(t) == 1


# ---------------------------------------------------------------------------------------------------
# chains from transformers' own mappings


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_moe_merge_then_concatenate_from_the_real_mapping(model_type):
    E, I, H = 4, 6, 5
    mapping = get_checkpoint_conversion_mapping(model_type)
    gate_up = next(c for c in mapping if isinstance(c, WeightConverter) and "gate_up_proj" in c.target_patterns[0])
    down = next(c for c in mapping if isinstance(c, WeightConverter) and "down_proj" in c.target_patterns[0])
    assert [type(op) for op in gate_up.operations] == [MergeModulelist, Concatenate]
    gate_name, up_name = (p.replace("*", "{}") for p in gate_up.source_patterns)
    prefix = "model.layers.0" if model_type == "mixtral" else "model.layers.0."
    keys = [(prefix + gate_name.format(e), 0) for e in range(E)] + [(prefix + up_name.format(e), 1) for e in range(E)]
    target = prefix + gate_up.target_patterns[0]
    out = check(gate_up, target, keys, {k: ((I, H), BF16) for k, _ in keys})
    (fused,) = out.values()
    assert fused.shape == (E, 2 * I, H) and pieces(fused) == 2 * E
    # a TP shard of the intermediate dim in the gate half: one block per expert
    assert len(fused.remap_blocks(((0, E), (0, I // 2), (0, H)))) == E
    # an EP shard of two experts: each of the 4 source tensors in one block
    assert len(fused.remap_blocks(((1, 3), (0, 2 * I), (0, H)))) == 4
    down_name = down.source_patterns[0].replace("*", "{}")
    keys = [(prefix + down_name.format(e), 0) for e in range(E)]
    out = check(down, prefix + down.target_patterns[0], keys, {k: ((H, I), BF16) for k, _ in keys})
    assert next(iter(out.values())).shape == (E, H, I)


def test_merge_then_concatenate_then_split_back():
    """The loader's chain and its reverse (what save_pretrained runs) compose to the identity map."""
    E, I, H = 3, 4, 2
    merge = WeightConverter(
        ["experts.*.w1.weight", "experts.*.w3.weight"],
        "experts.gate_up_proj",
        [MergeModulelist(dim=0), Concatenate(dim=1)],
    )
    keys = [(f"experts.{e}.w1.weight", 0) for e in range(E)] + [(f"experts.{e}.w3.weight", 1) for e in range(E)]
    fn = loader_call(merge, "experts.gate_up_proj", keys)
    leaves = {k: rt.RegionTensor.leaf(k, (I, H), BF16) for k, _ in keys}
    (fused,) = rt.trace(fn, **leaves).values()
    chunked = rt.trace(
        lambda t: Chunk(dim=1).convert({"gate_up": t}, source_patterns=["gate_up"], target_patterns=["w1", "w3"]), fused
    )
    for name, part in chunked.items():
        split = rt.trace(
            lambda t, name=name: SplitModulelist(dim=0).convert(
                {name: t}, source_patterns=["gate_up"], target_patterns=[f"experts.*.{name}.weight"]
            ),
            part,
        )
        for key, t in split.items():
            assert t.sources() == {key}
            (block,) = t.remap_blocks()
            assert block.source == key and block.src_offset == 0 and block.source_box() == ((0, 0), (I, H), (0, 1))


def test_ernie_fuse_and_split_text_vision_experts():
    E, I, H = 4, 3, 2
    conv = WeightConverter(
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        ["mlp.text_experts.gate_up_proj", "mlp.vision_experts.gate_up_proj"],
        [ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)],
    )
    keys = [(f"mlp.experts.{e}.gate_proj.weight", 0) for e in range(E)]
    keys += [(f"mlp.experts.{e}.up_proj.weight", 1) for e in range(E)]
    out = check(
        conv, "mlp.text_experts.gate_up_proj", keys, {k: ((I, H), BF16) for k, _ in keys}, config=PretrainedConfig()
    )
    assert [t.shape for t in out.values()] == [(E // 2, 2 * I, H)] * 2
    back = WeightConverter(
        ["mlp.text_experts.gate_up_proj", "mlp.vision_experts.gate_up_proj"],
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        [ErnieSplitAndDecoupleTextVisionExperts(stack_dim=0, concat_dim=1)],
    )
    keys = [("mlp.text_experts.gate_up_proj", 0), ("mlp.vision_experts.gate_up_proj", 1)]
    out = check(
        back,
        "mlp.experts.0.gate_proj.weight",
        keys,
        {k: ((2, 2 * I, H), BF16) for k, _ in keys},
        config=PretrainedConfig(),
    )
    assert len(out) == 2 * E


def test_inkling2_pure_index_ops():
    conv = WeightConverter(
        ["message_queries", "kv_message_queries"], "merged_queries", [Inkling2LoopMergeMessageQueries()]
    )
    out = check(
        conv,
        "loop.merged_queries",
        [("loop.message_queries", 0), ("loop.kv_message_queries", 1)],
        {"loop.message_queries": ((6, 4), BF16), "loop.kv_message_queries": ((6, 4), BF16)},
    )
    assert next(iter(out.values())).shape == (3, 4, 4)
    # dropping padded vocab rows: a slice plus a cast to the parameter's dtype
    conv = WeightConverter("lm_head.weight", "lm_head.weight", [Inkling2UnpadVocab()])
    config = PretrainedConfig(vocab_size=16, unpadded_vocab_size=13)
    model = meta_model({"lm_head.weight": (13, 4)})  # float32 parameter
    out = check(
        conv, "lm_head.weight", [("lm_head.weight", 0)], {"lm_head.weight": ((16, 4), BF16)}, model=model, config=config
    )
    (t,) = out.values()
    assert t.shape == (13, 4) and t.dtype == torch.float32


def test_gguf_pure_ops():
    gguf = pytest.importorskip("transformers.integrations.gguf.gguf_conversion_mapping")
    conv = WeightConverter("attn_norm.weight", "input_layernorm.weight", [gguf.Unsqueeze(0), gguf.Cast(BF16)])
    out = check(
        conv,
        "blk.0.input_layernorm.weight",
        [("blk.0.attn_norm.weight", 0)],
        {"blk.0.attn_norm.weight": ((5,), torch.float32)},
    )
    (t,) = out.values()
    assert t.shape == (1, 5) and t.dtype == BF16


# ---------------------------------------------------------------------------------------------------
# ops that are not pure index mappings raise Untraceable, naming the op


def _direct(op, tensors, sources, targets, **kwargs):
    return lambda: op.convert(dict(zip(sources, tensors)), source_patterns=sources, target_patterns=targets, **kwargs)


def test_non_index_ops_are_untraceable():
    gguf = pytest.importorskip("transformers.integrations.gguf.gguf_conversion_mapping")
    x = rt.RegionTensor.leaf("w", (4, 4), BF16)
    cases = [
        (_direct(gguf.LogNegate(), [x], ["w"], ["w"]), "log"),  # pointwise, but not exactly rounded
        (_direct(gguf.PermuteRows(torch.tensor([2, 0, 1, 3])), [x], ["w"], ["w"]), "index"),
        (_direct(gguf.TiledToGroupedInputs(2, 2), [x], ["w"], ["w"]), "index"),
        (_direct(Inkling2LoopMergeMessageQueries(inverse=True), [x.view(2, 2, 4)], ["w"], ["q", "kv"]), "index"),
    ]
    for call, op in cases:
        with pytest.raises(rt.Untraceable, match=f"`{op}`"):
            call()


def test_a_vocabulary_padded_into_a_new_zeros_buffer_traces_as_torch_runs_it():
    """transformers' own padding (``Inkling2UnpadVocab(inverse=True)``: ``new_zeros``, the rows copied in) is a
    constant piece and the checkpoint's rows."""
    x, real = rt.RegionTensor.leaf("w", (4, 4), BF16), torch.randn(4, 4).to(BF16)
    config = PretrainedConfig(vocab_size=6)
    traced = _direct(Inkling2UnpadVocab(inverse=True), [x], ["w"], ["w"], config=config)()
    want = _direct(Inkling2UnpadVocab(inverse=True), [real], ["w"], ["w"], config=config)()
    ((name, t),) = traced.items()
    out = rt.materialize(t, rt.constants.with_constants({"w": real}, t.region))
    assert torch.equal(out, want[name]) and rt.coverage(t).exact


def test_gguf_subtract_one_traces_to_exact_values():
    gguf = pytest.importorskip("transformers.integrations.gguf.gguf_conversion_mapping")
    op = gguf.SubtractOne()
    out = op.convert({"w": rt.RegionTensor.leaf("w", (4, 4), BF16)}, source_patterns=["w"], target_patterns=["w"])
    real = torch.randn(4, 4, dtype=BF16)
    want = op.convert({"w": real.clone()}, source_patterns=["w"], target_patterns=["w"])["w"]
    assert not out["w"].is_index_map and torch.equal(rt.materialize(out["w"], {"w": real}), want)


def test_dequantize_experts_is_untraceable():
    weight = rt.RegionTensor.leaf("w", (2, 4, 32), torch.float8_e4m3fn)
    scale = rt.RegionTensor.leaf("s", (2, 4, 1), torch.uint8)
    op = Inkling2LoopDequantizeExperts()
    with pytest.raises(rt.Untraceable, match="`sub`|`mul`|`copy_`|`exp2`"):
        op.convert({"w": [weight], "s": [scale]}, source_patterns=["w", "s", "amax", "den"], target_patterns=["e"])
