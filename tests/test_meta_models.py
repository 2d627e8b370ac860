"""Meta-device models: ``load_hf_checkpoint(..., device=...)`` materialises, loads, initialises the rest."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from hf_models import FAMILIES, build, config_of, save
from safetensors.torch import load_file, save_file

from loader import CheckpointError, HFLoadPlanner, load_hf_checkpoint
from loader.materialize import materialize
from loader.options import LoadOptions, Rules


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

    report = load_hf_checkpoint(meta, str(tmp_path), device="cpu", options=LoadOptions(progress=False))

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

    load_hf_checkpoint(meta, str(tmp_path), device=torch.device("cpu"), options=LoadOptions(progress=False))

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

    report = load_hf_checkpoint(model, str(tmp_path), device="cpu", options=LoadOptions(progress=False))

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
        load_hf_checkpoint(meta, str(tmp_path), device="cpu", options=LoadOptions(progress=False))
    assert_on_meta(meta)  # raised before anything was read: the model is as it was

    # a plain module: a non-persistent buffer nothing can initialise; strict=False zeroes it (and says so)
    (tmp_path / "plain").mkdir()
    source = Plain()
    save_file(dict(source.state_dict()), tmp_path / "plain" / "model.safetensors")
    with torch.device("meta"):
        plain = WithTable()
    with pytest.raises(ValueError, match="initialised by the model: table"):
        load_hf_checkpoint(plain, str(tmp_path / "plain"), device="cpu", options=LoadOptions(progress=False))
    with torch.device("meta"):
        plain = WithTable()
    load_hf_checkpoint(
        plain, str(tmp_path / "plain"), device="cpu", rules=Rules(strict=False), options=LoadOptions(progress=False)
    )
    assert torch.equal(plain.a.weight, source.a.weight) and torch.equal(plain.table, torch.zeros(3, dtype=torch.long))


def test_without_device_a_meta_model_is_refused(tmp_path):
    save_file(dict(Plain().state_dict()), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Plain()
    with pytest.raises(ValueError, match="is on the meta device: materialize the model first"):
        load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert model.a.weight.device.type == "meta"


def test_a_materialised_model_is_loaded_as_before(tmp_path):
    source = Plain()
    save_file(dict(source.state_dict()), tmp_path / "model.safetensors")
    model = Plain()
    weight = model.a.weight
    load_hf_checkpoint(model, str(tmp_path), device="cpu", options=LoadOptions(progress=False))
    assert model.a.weight is weight and torch.equal(weight, source.a.weight)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) by every name."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_on_meta(model: torch.nn.Module, before: dict[str, torch.Tensor] | None = None) -> None:
    """Every tensor of ``model`` is on meta (and, given ``before``, the very tensor it was)."""
    tensors = model_tensors(model)
    assert all(t.is_meta for t in tensors.values()), sorted(n for n, t in tensors.items() if not t.is_meta)
    if before is not None:
        assert sorted(tensors) == sorted(before) and all(tensors[n] is t for n, t in before.items())


def bytes_read_by_this_process() -> int:
    """``rchar`` of ``/proc/self/io``: every byte this process has read (files, pipes)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def llama_without(folder, *keys: str, **overrides) -> str:
    """A tiny llama checkpoint in ``folder`` without ``keys``."""
    _, model = build("llama", seed=4, **overrides)
    save(model, folder)
    tensors = load_file(folder / "model.safetensors")
    for key in keys:
        del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_a_strict_error_leaves_the_model_on_meta_having_read_only_headers(tmp_path):
    path = llama_without(tmp_path, "model.norm.weight", vocab_size=2048)
    size = os.path.getsize(tmp_path / "model.safetensors")
    meta = meta_model("llama", vocab_size=2048)
    before = model_tensors(meta)
    read = bytes_read_by_this_process()
    with pytest.raises(ValueError, match=r"1 model tensor\(s\) are not in the checkpoint: model.norm.weight "):
        load_hf_checkpoint(meta, path, device="cpu", options=LoadOptions(progress=False))
    read = bytes_read_by_this_process() - read
    assert_on_meta(meta, before)
    assert read < size / 20, (read, size)  # the header and config.json: a few KB of 330 KB
    read = bytes_read_by_this_process()  # the count sees a load's reads
    load_hf_checkpoint(meta, path, device="cpu", rules=Rules(strict=False), options=LoadOptions(progress=False))
    assert bytes_read_by_this_process() - read > 0.95 * size


class TruncatingPlanner(HFLoadPlanner):
    """Cuts ``file`` by 64 bytes once the load is planned: the read fails after the model was allocated."""

    file = ""

    def build_plan(self, *args, **kwargs):
        plan = super().build_plan(*args, **kwargs)
        os.truncate(self.file, os.path.getsize(self.file) - 64)
        return plan


@pytest.mark.parametrize("when", ["before the load", "after planning"])
def test_a_truncated_file_leaves_the_model_on_meta(tmp_path, when):
    path = llama_without(tmp_path)
    file = tmp_path / "model.safetensors"
    meta = meta_model("llama")
    before = model_tensors(meta)
    planner = None
    if when == "before the load":
        os.truncate(file, os.path.getsize(file) - 64)
    else:
        planner = TruncatingPlanner(meta)
        planner.file = str(file)
    # after planning, the file's identity check refuses it when it is opened for reading
    match = "model.safetensors.*" + ("run past the data section" if planner is None else "changed underneath")
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(meta, path, device="cpu", planner=planner, options=LoadOptions(progress=False))
    assert_on_meta(meta, before)


class Owned(torch.nn.Module):
    """Initialises itself in ``reset_parameters``, writing through ``.data`` (no version counter of the
    parameter moves)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(64, 40))
        self.bias = torch.nn.Parameter(torch.empty(64))
        self.reset_parameters()

    def reset_parameters(self):
        self.weight.data.fill_(2.0)
        self.bias.data.copy_(torch.arange(64.0))


class Bare(torch.nn.Module):
    """No init of its own."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.empty(64, 40))


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.owned, self.linear, self.bare = Owned(), torch.nn.Linear(40, 64), Bare()


PATTERN = 7.0


def prime_allocator(*shapes: tuple[int, ...]) -> None:
    """Free many tensors of ``shapes`` holding ``PATTERN``: memory allocated next and never written shows it."""
    held = [torch.full(shape, PATTERN) for shape in shapes for _ in range(64)]
    del held


def test_the_primed_allocator_shows_in_uninitialised_memory():
    """The tests below would see memory nothing initialised: without an init, the pattern shows."""
    with torch.device("meta"):
        model = Mixed()
    prime_allocator((64, 40), (64,))
    made = materialize(model, "cpu")
    assert sum(bool((t == PATTERN).any()) for t in made.values()) >= 3


def test_strict_false_initialises_what_nothing_loaded_as_the_model_would(tmp_path, caplog):
    """reset_parameters() of the module where defined (only the tensors not loaded), zeros where no init is."""
    stored = {"owned.weight": torch.randn(64, 40), "linear.weight": torch.randn(64, 40)}
    save_file(stored, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Mixed()
    prime_allocator((64, 40), (64,))
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(
            model, str(tmp_path), device="cpu", rules=Rules(strict=False), options=LoadOptions(progress=False)
        )
    torch.manual_seed(1)
    reference = torch.nn.Linear(40, 64)  # its constructor runs reset_parameters: the same draws

    assert sorted(report.missing_keys) == ["bare.table", "linear.bias", "owned.bias"]
    assert torch.equal(model.owned.weight, stored["owned.weight"])  # loaded: not reset
    assert torch.equal(model.linear.weight, stored["linear.weight"])
    assert torch.equal(model.owned.bias, torch.arange(64.0))  # its reset_parameters, through .data
    assert torch.equal(model.linear.bias, reference.bias)
    assert torch.equal(model.bare.table, torch.zeros(64, 40))  # no init: zeros, never the freed memory
    warned = [r.getMessage() for r in caplog.records if "neither loaded nor initialised" in r.getMessage()]
    assert len(warned) == 1 and warned[0].endswith("by the model: bare.table; they hold zeros"), warned


def test_reset_parameters_keeps_the_modules_other_tensors(tmp_path):
    """A module with a tensor on meta and one already allocated (neither in the checkpoint): its
    reset_parameters initialises the meta one; the other keeps its values."""
    save_file({"linear.weight": torch.randn(64, 40), "bare.table": torch.randn(64, 40)}, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = Mixed()
    model.owned.weight = torch.nn.Parameter(torch.full((64, 40), 5.0))
    load_hf_checkpoint(
        model,
        str(tmp_path / "m.safetensors"),
        device="cpu",
        rules=Rules(strict=False),
        options=LoadOptions(progress=False),
    )
    assert torch.equal(model.owned.weight, torch.full((64, 40), 5.0))
    assert torch.equal(model.owned.bias, torch.arange(64.0))


class Parent(torch.nn.Module):
    """Its reset_parameters initialises its own parameter only; its child has no init."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.empty(64))
        self.bare = Bare()

    def reset_parameters(self):
        torch.nn.init.ones_(self.scale)


def test_a_parents_reset_parameters_leaves_its_childs_tensor_reported(tmp_path, caplog):
    save_file({"other": torch.zeros(1)}, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = Parent()
    with caplog.at_level(logging.WARNING, logger="loader"):
        load_hf_checkpoint(
            model,
            str(tmp_path / "m.safetensors"),
            device="cpu",
            rules=Rules(strict=False),
            options=LoadOptions(progress=False),
        )
    assert torch.equal(model.scale, torch.ones(64)) and torch.equal(model.bare.table, torch.zeros(64, 40))
    assert [r.getMessage() for r in caplog.records if "neither loaded" in r.getMessage()] == [
        "1 model tensor(s) from the meta device were neither loaded nor initialised by the model: bare.table; "
        "they hold zeros"
    ]


def test_in_place_inits_of_a_transformers_model_count_as_initialised(tmp_path, caplog):
    """A transformers model's own init writes parameters in place (their ``.data`` version never moves): the
    tensors it wrote are initialised, hold its values and are not reported as left uninitialised."""
    path = llama_without(tmp_path, "model.norm.weight", "lm_head.weight", tie_word_embeddings=False)
    meta = meta_model("llama", tie_word_embeddings=False)
    prime_allocator(tuple(meta.lm_head.weight.shape), tuple(meta.model.norm.weight.shape))
    torch.manual_seed(2)
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(
            meta, path, device="cpu", rules=Rules(strict=False), options=LoadOptions(progress=False)
        )
    torch.manual_seed(2)
    reference = torch.empty(meta.lm_head.weight.shape).normal_(0.0, meta.config.initializer_range)

    assert sorted(report.missing_keys) == ["lm_head.weight", "model.norm.weight"]
    assert torch.equal(meta.model.norm.weight, torch.ones(meta.model.norm.weight.shape))
    assert torch.equal(meta.lm_head.weight, reference)
    assert not [r for r in caplog.records if "neither loaded nor initialised" in r.getMessage()]


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


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_device_meta_is_a_clear_error_before_anything_is_read(tmp_path, device):
    """``device="meta"`` would load nothing into a model that holds no data: a ValueError, the model untouched."""
    _, model = build("llama", seed=1)
    save(model, tmp_path)
    meta = meta_model("llama")
    before = {k: (v.device.type, id(v)) for k, v in meta.state_dict(keep_vars=True).items()}
    with pytest.raises(ValueError, match=r"device=.*meta.*holds no data.*'cpu', 'cuda'"):
        load_hf_checkpoint(meta, str(tmp_path), device=device, options=LoadOptions(progress=False))
    assert {k: (v.device.type, id(v)) for k, v in meta.state_dict(keep_vars=True).items()} == before
    _, built = build("llama", seed=2)  # a model already materialised: the same error
    with pytest.raises(ValueError, match="holds no data"):
        load_hf_checkpoint(built, str(tmp_path), device=device, options=LoadOptions(progress=False))
