"""Meta-device models: ``load_hf_checkpoint(..., device=...)`` materialises, loads, initialises the rest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hf_models import FAMILIES, build, config_of, save
from safetensors.torch import load_file, save_file

from loader import load_hf_checkpoint


def meta_model(family: str, **overrides) -> torch.nn.Module:
    auto = FAMILIES[family][0]
    with torch.device("meta"):
        return auto.from_config(config_of(family, **overrides)).eval()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].device.type == "cpu", name
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_a_meta_transformers_model_equals_from_pretrained(tmp_path, family):
    auto, model = build(family, seed=3)
    save(model, tmp_path)
    meta = meta_model(family)

    report = load_hf_checkpoint(meta, str(tmp_path), device="cpu", progress=False)

    reference = auto.from_pretrained(tmp_path, dtype=torch.float32)
    assert report.missing_keys == ()
    assert_same_tensors(meta.state_dict(), reference.state_dict())
    # non-persistent buffers (rotary inv_freq) recomputed through the model's own init
    buffers = dict(meta.named_buffers())
    assert any(name.endswith("inv_freq") for name in buffers)
    assert_same_tensors(buffers, dict(reference.named_buffers()))
    assert not any(hasattr(t, "_is_hf_initialized") for t in [*meta.parameters(), *meta.buffers()])


def test_tied_weights_stay_tied(tmp_path):
    auto, model = build("llama", seed=1, tie_word_embeddings=True)
    save(model, tmp_path)
    meta = meta_model("llama", tie_word_embeddings=True)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight

    load_hf_checkpoint(meta, str(tmp_path), device=torch.device("cpu"), progress=False)

    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert isinstance(meta.lm_head.weight, torch.nn.Parameter) and meta.lm_head.weight.requires_grad
    assert_same_tensors(meta.state_dict(), auto.from_pretrained(tmp_path, dtype=torch.float32).state_dict())


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2, bias=False)
        self.register_buffer("scale", torch.ones(2))


def test_a_plain_meta_module(tmp_path):
    torch.manual_seed(0)
    source = Plain()
    save_file({k: torch.randn(v.shape) for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Plain()

    report = load_hf_checkpoint(model, str(tmp_path), device="cpu", progress=False)

    assert report.loaded_keys == ("a.bias", "a.weight", "b.weight", "scale")
    assert isinstance(model.a.weight, torch.nn.Parameter) and model.a.weight.requires_grad
    assert_same_tensors(model.state_dict(), load_file(tmp_path / "model.safetensors"))


class WithTable(Plain):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(3), persistent=False)


def test_strict_names_what_is_left_uninitialised(tmp_path):
    # a transformers model: a parameter the model lets be missing, that its own init does not cover
    _, model = build("llama", seed=2)
    save(model, tmp_path)
    meta = meta_model("llama")
    meta.extra = torch.nn.Parameter(torch.empty(3, device="meta"))
    meta._keys_to_ignore_on_load_missing = [r"^extra$"]
    with pytest.raises(ValueError, match=r"1 model tensor\(s\) .* neither loaded nor initialised by the model: extra "):
        load_hf_checkpoint(meta, str(tmp_path), device="cpu", progress=False)
    assert meta.extra.device.type == "cpu"

    # a plain module: a non-persistent buffer nothing can initialise; strict=False leaves it (and says so)
    (tmp_path / "plain").mkdir()
    source = Plain()
    save_file(dict(source.state_dict()), tmp_path / "plain" / "model.safetensors")
    with torch.device("meta"):
        plain = WithTable()
    with pytest.raises(ValueError, match="initialised by the model: table"):
        load_hf_checkpoint(plain, str(tmp_path / "plain"), device="cpu", progress=False)
    with torch.device("meta"):
        plain = WithTable()
    load_hf_checkpoint(plain, str(tmp_path / "plain"), device="cpu", strict=False, progress=False)
    assert torch.equal(plain.a.weight, source.a.weight) and plain.table.device.type == "cpu"


def test_without_device_a_meta_model_is_refused(tmp_path):
    save_file(dict(Plain().state_dict()), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Plain()
    with pytest.raises(ValueError, match="is on the meta device: materialize the model first"):
        load_hf_checkpoint(model, str(tmp_path), progress=False)
    assert model.a.weight.device.type == "meta"


def test_a_materialised_model_is_loaded_as_before(tmp_path):
    source = Plain()
    save_file(dict(source.state_dict()), tmp_path / "model.safetensors")
    model = Plain()
    weight = model.a.weight
    load_hf_checkpoint(model, str(tmp_path), device="cpu", progress=False)
    assert model.a.weight is weight and torch.equal(weight, source.a.weight)


DTENSOR_SCRIPT = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from loader.materialize import materialize

dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
mesh = init_device_mesh("cpu", (4,))
with torch.device("meta"):
    model = torch.nn.Linear(8, 6)
    local = torch.empty(2, 8)
model.weight = torch.nn.Parameter(
    DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(8, 8), stride=(8, 1))
)
made = materialize(model, "cpu")
weight = model.weight
assert sorted(made) == ["bias", "weight"] and made["weight"] is weight
assert isinstance(weight, torch.nn.Parameter) and isinstance(weight.data, DTensor)
assert weight.shape == (8, 8) and weight.placements == (Shard(0),) and weight.device_mesh is mesh
assert weight.to_local().shape == (2, 8) and weight.to_local().device.type == "cpu"
assert model.bias.device.type == "cpu" and not isinstance(model.bias.data, DTensor)
dist.destroy_process_group()
print("ok")
"""


def test_a_dtensor_allocates_only_its_local_shard():
    """In its own process: a (fake) default process group must not meet other tests' groups in this worker."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", DTENSOR_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
