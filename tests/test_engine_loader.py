"""``load_engine_weights``: a checkpoint into vLLM-style modules through their own ``load_weights``, traced per rank
at TP 1/2/4 in one process, each parameter bit-identical to the same ``load_weights`` run on real tensors, each rank
reading exactly the bytes of the elements it takes; loaders that leave elements unwritten or write them twice, and
checkpoints that do not fit, refused before any byte is read; keys that do not trace read whole, and logged."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_models import ColumnLinear, ColumnParameter, TinyLlama, TinyMoE
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import loader
from loader import SafetensorsCheckpoint

CONFIG = dict(
    vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved by ``save_pretrained`` in bfloat16: ``(config, folder)``."""
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return config, folder


def oracle(module: torch.nn.Module, path) -> dict[str, torch.Tensor]:
    """The module's own ``load_weights`` on the real tensors (``safetensors.torch.load_file``)."""
    module.load_weights(load_file(path).items())
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def needed_bytes(make, path) -> int:
    """Bytes of the checkpoint elements the module takes, counted by running its loader on tensors of distinct
    ids (float64: each element of every key its own value), independently of any trace."""
    tensors, sizes, base = {}, {}, 1
    for k, t in load_file(path).items():
        tensors[k] = torch.arange(base, base + t.numel(), dtype=torch.float64).reshape(t.shape)
        sizes[k] = (base, base + t.numel(), t.element_size())
        base += t.numel()
    module = make(torch.float64)
    module.load_weights(tensors.items())
    ids = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).unique()
    return sum(int(((ids >= a) & (ids < b)).sum()) * size for a, b, size in sizes.values())


def assert_loaded(module, expected):
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), expected[name]), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_per_rank_matches_its_own_load_weights(llama, tp):
    config, folder = llama
    path = folder / "model.safetensors"
    for rank in range(tp):
        module = TinyLlama(config, rank, tp)
        report = loader.load_engine_weights(module, str(folder), tp_size=tp)
        assert_loaded(module, oracle(TinyLlama(config, rank, tp), path))
        need = needed_bytes(lambda dtype, rank=rank: TinyLlama(config, rank, tp, dtype), path)
        assert report.bytes_read == report.planned_bytes == need
        assert set(report.loaded_keys) == set(report.traced) == {n for n, _ in module.named_parameters()}
        assert not report.missing_keys and not report.deferred
        assert all(c.exact for c in report.certificates.values())
        embed = report.certificates["model.embed_tokens.weight"]
        per = module.model.embed_tokens.per
        rows = max(0, min(config.vocab_size - rank * per, per))
        assert embed.constant == ((((rows, per), (0, config.hidden_size)),) if rows < per else ())


def test_fused_moe_experts(tmp_path):
    experts, hidden, inter = 3, 4, 8
    gen = torch.Generator().manual_seed(1)
    tensors = {
        f"experts.{e}.{w}.weight": torch.randn((inter, hidden) if w != "w2" else (hidden, inter), generator=gen)
        for e in range(experts)
        for w in ("w1", "w2", "w3")
    }
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, tmp_path / "moe.safetensors")
    path = tmp_path / "moe.safetensors"
    for tp in (1, 2):
        for rank in range(tp):
            module = TinyMoE(experts, hidden, inter, rank, tp)
            report = loader.load_engine_weights(module, str(path), tp_size=tp)
            assert_loaded(module, oracle(TinyMoE(experts, hidden, inter, rank, tp), path))
            need = needed_bytes(lambda dtype, rank=rank, tp=tp: TinyMoE(experts, hidden, inter, rank, tp, dtype), path)
            assert report.bytes_read == report.planned_bytes == need
            assert len(report.certificates["w13_weight"].writes) == 2 * experts


def test_a_float32_module_casts_as_its_copy_does(llama):
    config, folder = llama
    module = TinyLlama(config, 1, 2, torch.float32)
    loader.load_engine_weights(module, str(folder / "model.safetensors"), tp_size=2)
    assert_loaded(module, oracle(TinyLlama(config, 1, 2, torch.float32), folder / "model.safetensors"))


def test_parameters_are_put_back(llama):
    config, folder = llama
    module = TinyLlama(config, 0, 2)
    before = {n: p for n, p in module.named_parameters()}
    loader.load_engine_weights(module, str(folder), tp_size=2)
    assert all(p is before[n] for n, p in module.named_parameters())
    assert all(hasattr(p, "weight_loader") for n, p in module.named_parameters() if "proj" in n or "embed" in n)


class Twice(torch.nn.Module):
    """One parameter: key ``a`` written whole (or zeroed, with ``zero``), then key ``b`` into its first rows."""

    def __init__(self, zero: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4, 3), float("nan"), dtype=dtype), requires_grad=False)
        self.zero = zero

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name == "a":
                self.w.data.zero_() if self.zero else self.w.data.copy_(t)
            else:
                self.w.data[:2].copy_(t)


@pytest.fixture
def ab(tmp_path):
    path = tmp_path / "ab.safetensors"
    save_file({"a": torch.randn(4, 3), "b": torch.randn(2, 3)}, path)
    return path


def test_written_twice_is_refused_naming_the_keys(ab):
    module = Twice()
    with pytest.raises(ValueError, match=r"parameter 'w' \(4, 3\): elements \[0:2, 0:3\] are written twice") as e:
        loader.load_engine_weights(module, str(ab))
    assert "'a'" in str(e.value) and "'b'" in str(e.value)
    assert module.w.isnan().all()  # nothing read, nothing written


def test_zeroed_then_copied_is_not_written_twice(ab):
    module = Twice(zero=True)
    report = loader.load_engine_weights(module, str(ab))
    assert_loaded(module, oracle(Twice(zero=True), ab))
    cov = report.certificates["w"]
    assert cov.complete and cov.overwritten == (((0, 2), (0, 3)),) and cov.constant == (((2, 4), (0, 3)),)
    assert report.bytes_read == report.planned_bytes == 2 * 3 * 4  # ``a`` is only zeroed: none of it read


class HalfQKV(TinyLlama):
    """A loader that forgets the ``v`` shard of the fused qkv."""

    def load_weights(self, weights):
        return super().load_weights((n, t) for n, t in weights if "v_proj" not in n)


def test_unwritten_elements_are_refused_naming_the_box_and_keys(llama):
    config, folder = llama
    module = HalfQKV(config, 0, 2)
    with pytest.raises(ValueError, match=r"parameter 'model.layers.0.self_attn.qkv_proj.weight' \(16, 16\)") as e:
        loader.load_engine_weights(module, str(folder), tp_size=2)
    message = str(e.value)
    assert "elements [12:16, 0:16] are never written" in message
    assert "'model.layers.0.self_attn.q_proj.weight'" in message and "k_proj" in message
    assert all(p.isnan().all() for p in module.parameters())


@pytest.mark.parametrize("tp", [1, 2])
def test_extra_vocabulary_rows_are_refused(llama, tmp_path, tp):
    """vLLM's loader narrows a checkpoint with 64 more vocabulary rows than the model to the model's: refused."""
    config, folder = llama
    tensors = load_file(folder / "model.safetensors")
    key = "model.embed_tokens.weight"
    tensors[key] = torch.cat([tensors[key], torch.randn(64, config.hidden_size).to(torch.bfloat16)])
    save_file(tensors, tmp_path / "model.safetensors")
    for rank in range(tp):
        module = TinyLlama(config, rank, tp)
        with pytest.raises(
            ValueError, match=rf"checkpoint tensor '{key}' \(164, 16\) does not fit parameter\(s\) {key}"
        ):
            loader.load_engine_weights(module, str(tmp_path), tp_size=tp)
        assert all(p.isnan().all() for p in module.parameters())


def test_extra_rows_of_a_projection_are_refused(llama, tmp_path):
    config, folder = llama
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = torch.cat([tensors[key], tensors[key]])  # 32 rows more
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"'{key}' \(64, 16\) does not fit parameter\(s\) .*gate_up_proj"):
        loader.load_engine_weights(TinyLlama(config, 0, 2), str(tmp_path), tp_size=2)


class CheckedNorms(TinyLlama):
    """A loader that looks at its norms' values (``.item()``): those keys do not trace."""

    def load_weights(self, weights):
        for name, t in weights:
            if name.endswith("layernorm.weight") and t.abs().max().item() > 1e4:
                raise ValueError(f"{name} is out of range")
            super().load_weights([(name, t)])


def test_untraceable_keys_fall_back_alone_and_are_logged(llama, caplog):
    config, folder = llama
    path = folder / "model.safetensors"
    module = CheckedNorms(config, 1, 2)
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = loader.load_engine_weights(module, str(folder), tp_size=2)
    assert_loaded(module, oracle(CheckedNorms(config, 1, 2), path))
    norms = [k for k in load_file(path) if k.endswith("layernorm.weight")]
    assert set(report.deferred_reasons) == set(norms) and all("max" in r for r in report.deferred_reasons.values())
    assert set(report.deferred) == set(norms) and set(report.loaded_keys) == {n for n, _ in module.named_parameters()}
    (line,) = [r.getMessage() for r in caplog.records if "do not trace" in r.getMessage()]
    assert all(k in line for k in norms) and "`max`" in line
    whole = sum(SafetensorsCheckpoint.open(path)[k].nbytes for k in norms)
    traced = needed_bytes(lambda dtype: TinyLlama(config, 1, 2, dtype), path) - whole
    assert report.bytes_read == report.planned_bytes == traced + whole


def test_a_url_loads_only_its_ranges(llama):
    """Over http (nginx): each rank fetches the planned bytes, bit-identical to the local load."""
    import servers

    from loader.options import RemoteOptions, RequestCosts, StorageOptions

    config, folder = llama
    storage = StorageOptions(remote=RemoteOptions(costs=RequestCosts(latency=1e-9)))  # no gap worth reading through
    for web in servers.serve(servers.nginx(folder.parent)):
        for rank in range(2):
            module = TinyLlama(config, rank, 2)
            report = loader.load_engine_weights(module, f"{web}/{folder.name}", storage=storage, tp_size=2)
            assert_loaded(module, oracle(TinyLlama(config, rank, 2), folder / "model.safetensors"))
            assert (
                report.bytes_read
                >= report.planned_bytes
                == needed_bytes(
                    lambda dtype, rank=rank: TinyLlama(config, rank, 2, dtype), folder / "model.safetensors"
                )
            )


@pytest.mark.dist
def test_a_gloo_group_loads_each_ranks_slot(llama, tmp_path):
    """Four ranks, one TP slot each: bit-identical to each rank's own load_weights, with and without exchanged
    reads; a loader broken on rank 1 is refused on every rank, before any rank wrote, and so are shares whose union
    leaves rows of a key unread."""
    import engine_worker
    from gloo_world import WORLD, ok, run_world

    config, folder = llama
    ctx = {
        "store": str(tmp_path / "store"),
        "out": str(tmp_path),
        "folder": str(folder),
        "file": str(folder / "model.safetensors"),
        "config": CONFIG,
    }
    results = run_world(engine_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    for name in ("load", "exchanged"):
        for rank, res in enumerate(ok(results, name)):
            assert res["equal"] and res["exact"], (name, rank)
            need = needed_bytes(lambda dtype, rank=rank: TinyLlama(config, rank, WORLD, dtype), ctx["file"])
            assert res["planned"] == need, (name, rank)
            if name == "load":
                assert res["bytes_read"] == need
    for res in ok(results, "broken_on_rank_1"):
        assert "qkv_proj.weight" in res["error_message"] and "never written" in res["error_message"]
        assert res["untouched"]
    hidden = CONFIG["hidden_size"]
    for res in ok(results, "shares_that_do_not_meet"):  # every rank's reads fit a share; their union does not
        assert f"indices [{3 * hidden // 4}, {hidden}) of its dim 0 are read by no rank" in res["error_message"]
        assert "'model.norm.weight'" in res["error_message"] and res["untouched"]


class Scaled(torch.nn.Module):
    """A parameter, a buffer ``load_weights`` writes (a quantization scale) and one it does not (a cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4, 3), float("nan")), requires_grad=False)
        self.register_buffer("scale", torch.full((4,), float("nan")))
        self.register_buffer("cache", torch.arange(5.0), persistent=False)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            (self.w if name == "w" else self.scale).data.copy_(t)


def test_a_buffer_the_loader_writes_is_loaded_and_a_cache_left_alone(tmp_path):
    path = tmp_path / "scaled.safetensors"
    save_file({"w": torch.randn(4, 3), "scale": torch.randn(4)}, path)
    module = Scaled()
    cache = module.cache
    report = loader.load_engine_weights(module, str(path))
    reference = Scaled()
    reference.load_weights(load_file(path).items())
    assert torch.equal(module.w, reference.w) and torch.equal(module.scale, reference.scale)
    assert module.cache is cache and torch.equal(cache, torch.arange(5.0))
    assert report.loaded_keys == ("scale", "w") and report.missing_keys == () and report.certificates["scale"].exact


def test_a_parameter_subclass_keeps_its_methods_and_properties(tmp_path):
    """vLLM's ``BasevLLMParameter`` subclasses load through their own methods: the stand-in is one of them."""
    path = tmp_path / "linear.safetensors"
    save_file({"weight": torch.randn(8, 3)}, path)
    for rank in range(2):
        module = ColumnLinear(3, 8, rank, 2)
        param = module.weight
        report = loader.load_engine_weights(module, str(path), tp_size=2)
        assert module.weight is param and type(param) is ColumnParameter
        assert_loaded(module, oracle(ColumnLinear(3, 8, rank, 2), path))
        assert report.bytes_read == 4 * 3 * 4 and report.certificates["weight"].exact


class AssertingNorms(TinyLlama):
    """A loader whose weight_loader asserts on shapes and says nothing (as vLLM's do): a bare AssertionError."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            if name.endswith("input_layernorm.weight"):
                param = params[name]
                assert param.shape == t.shape
            super().load_weights([(name, t)])


def test_a_loader_that_raises_is_an_error_naming_the_tensor_and_the_parameter(llama, tmp_path):
    config, folder = llama
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.0.input_layernorm.weight"
    tensors[key] = torch.cat([tensors[key], tensors[key]])
    save_file(tensors, tmp_path / "model.safetensors")
    module = AssertingNorms(config, 0, 1)
    before = {n: p.clone() for n, p in module.named_parameters()}
    with pytest.raises(loader.CheckpointError) as info:
        loader.load_engine_weights(module, str(tmp_path), tp_size=1)
    message = str(info.value)
    assert f"checkpoint tensor {key!r} ([32]" in message and "AssertionError" in message
    assert "into parameter 'model.layers.0.input_layernorm.weight'" in message and info.value.key == key
    assert all(torch.equal(p.nan_to_num(), before[n].nan_to_num()) for n, p in module.named_parameters())


class CheckedTwice(Twice):
    """``Twice`` whose key ``a`` looks at its values (``.item()``): ``a`` falls back, ``b`` (after it) traces."""

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name == "a" and t.abs().max().item() > 1e4:
                raise ValueError("a is out of range")
            super().load_weights([(name, t)])


def test_a_traced_key_after_a_fallback_key_writing_the_same_rows_still_wins(ab, caplog):
    """The module's order: ``a`` whole, then ``b`` over its first rows; ``a`` is loaded for real after the region
    reads, so ``b`` is loaded again after it (logged), and the result is the module's own."""
    module = CheckedTwice()
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = loader.load_engine_weights(module, str(ab))
    assert_loaded(module, oracle(CheckedTwice(), ab))
    tensors = load_file(ab)
    assert torch.equal(module.w.data[:2], tensors["b"]) and torch.equal(module.w.data[2:], tensors["a"][2:])
    assert report.deferred_reasons.keys() == {"a"}
    assert any("loaded again for real" in r.getMessage() and "b" in r.getMessage() for r in caplog.records)
