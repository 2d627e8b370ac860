"""Bad inputs through ``load_hf_checkpoint``: every error names the file/tensor and leaves the model as it was.

Bad checkpoint files raise :class:`loader.CheckpointError` (a ``ValueError``) at planning time, before any
byte is written; mapping problems raise ``ValueError`` naming the tensor; a read that fails mid-load (a
file changed underneath) names the file, and ``rollback=True`` restores the previous values.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from loader import (
    CheckpointError,
    Convert,
    HFLoadPlanner,
    Rename,
    SafetensorsCheckpoint,
    SafetensorsReader,
    load_hf_checkpoint,
)
from loader.options import LoadOptions, Rules

# ----------------------------------------------------------------------------------------------- helpers


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)  # a.weight (3, 4), a.bias (3,)
        self.b = nn.Linear(3, 2, bias=False)  # b.weight (2, 3)
        self.register_buffer("steps", torch.zeros(2))


def tiny() -> Tiny:
    torch.manual_seed(0)
    net = Tiny()
    with torch.no_grad():
        net.steps.normal_()
    return net


def good_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(3, generator=g),
        "b.weight": torch.randn(2, 3, generator=g), "steps": torch.randn(2, generator=g),
    }  # fmt: skip


def raw_file(
    path: Path,
    tensors: dict[str, torch.Tensor],
    *,
    edit=None,
    header_bytes: bytes | None = None,
    header_len: int | None = None,
    tail: int | None = None,
) -> Path:
    """Write a safetensors file by hand; ``edit(header)`` may corrupt the header, ``tail`` cuts the data."""
    header, data, pos = {}, b"", 0
    for key, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[key] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        data += raw
        pos += len(raw)
    if edit is not None:
        edit(header)
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    if tail is not None:
        data = data[:tail]
    path.write_bytes(struct.pack("<Q", len(hb) if header_len is None else header_len) + hb + data)
    return path


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} was written"


def expect_checkpoint_error(path, *names: str, model: nn.Module | None = None, **kwargs) -> CheckpointError:
    """Load ``path`` into a fresh Tiny expecting a CheckpointError naming every string in ``names``."""
    model = model or tiny()
    before = snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(model, path, options=LoadOptions(progress=False), **kwargs)
    err = info.value
    assert isinstance(err, ValueError)
    for name in names:
        assert name in str(err), (name, str(err))
    assert_unchanged(model, before)
    return err


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


# ----------------------------------------------------------------------------------------------- bad files


def test_truncated_data_section(folder):
    path = raw_file(folder / "model.safetensors", good_tensors(), tail=52)  # a.weight [0, 48) fits, a.bias not
    err = expect_checkpoint_error(folder, str(path), "'a.bias'", "past the data section")
    assert err.path == str(path) and err.key == "a.bias"


def test_truncated_below_length_prefix(folder):
    (folder / "model.safetensors").write_bytes(b"\x01\x02\x03")
    expect_checkpoint_error(folder, str(folder / "model.safetensors"), "truncated")


def test_header_length_past_end(folder):
    path = raw_file(folder / "model.safetensors", good_tensors(), header_len=10_000)
    expect_checkpoint_error(folder, str(path), "header length 10000 runs past the end")


@pytest.mark.parametrize("header", [b"\xff\xfe{}", b"{not json", b'{"a.weight": {"dtype": "F32"'])
def test_header_not_utf8_json(folder, header):
    path = raw_file(folder / "model.safetensors", good_tensors(), header_bytes=header)
    expect_checkpoint_error(folder, str(path), "not valid UTF-8 JSON")


def test_overlapping_offsets(folder):
    def overlap(h):
        h["a.bias"]["data_offsets"] = [40, 52]  # inside a.weight's [0, 48)

    path = raw_file(folder / "model.safetensors", good_tensors(), edit=overlap)
    expect_checkpoint_error(folder, str(path), "'a.bias'", "'a.weight'", "overlaps")


def test_offsets_outside_data_section(folder):
    def outside(h):
        h["b.weight"]["data_offsets"] = [1000, 1024]

    path = raw_file(folder / "model.safetensors", good_tensors(), edit=outside)
    expect_checkpoint_error(folder, str(path), "'b.weight'", "past the data section")


def test_byte_length_not_shape_times_dtype(folder):
    def wrong_shape(h):
        h["a.weight"]["shape"] = [3, 5]

    path = raw_file(folder / "model.safetensors", good_tensors(), edit=wrong_shape)
    expect_checkpoint_error(folder, str(path), "'a.weight'", "span 48 bytes", "needs 60")


def test_unknown_dtype(folder):
    def bad_dtype(h):
        h["a.bias"]["dtype"] = "F33"

    path = raw_file(folder / "model.safetensors", good_tensors(), edit=bad_dtype)
    expect_checkpoint_error(folder, str(path), "'a.bias'", "'F33'")


def test_absurd_header_size_is_not_allocated(folder):
    # claims more than the file holds
    path = raw_file(folder / "model.safetensors", good_tensors(), header_len=2**63 - 1)
    expect_checkpoint_error(folder, str(path), "runs past the end")
    # a (sparse) 300 MB file whose header claims 200 MB: refused by the header limit, nothing allocated
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 200_000_000))
        f.truncate(300_000_000)
    tracemalloc.start()
    try:
        expect_checkpoint_error(folder, str(path), "header length 200000000 exceeds")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000


def write_index(folder: Path, weight_map: dict[str, str]) -> Path:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def two_shards(folder: Path) -> dict[str, str]:
    t = good_tensors()
    save_file({k: t[k] for k in ("a.weight", "a.bias")}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in ("b.weight", "steps")}, str(folder / "model-00002-of-00002.safetensors"))
    return {
        "a.weight": "model-00001-of-00002.safetensors",
        "a.bias": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
        "steps": "model-00002-of-00002.safetensors",
    }


def test_sharded_folder_loads(folder):
    write_index(folder, two_shards(folder))
    net = tiny()
    report = load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    for k, v in good_tensors().items():
        assert torch.equal(net.state_dict()[k], v), k
    assert report.bytes_read == sum(v.numel() * 4 for v in good_tensors().values())


def test_index_names_missing_file(folder):
    weight_map = two_shards(folder)
    weight_map["b.weight"] = "model-00003-of-00002.safetensors"
    index = write_index(folder, weight_map)
    expect_checkpoint_error(folder, str(index), "'b.weight'", "model-00003-of-00002.safetensors")


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "/abs.safetensors"])
def test_index_path_outside_folder(folder, name):
    weight_map = two_shards(folder)
    save_file({"steps": good_tensors()["steps"]}, str(folder.parent / "outside.safetensors"))
    weight_map["steps"] = name if not name.startswith("/") else str(folder.parent / "outside.safetensors")
    index = write_index(folder, weight_map)
    expect_checkpoint_error(folder, str(index), "'steps'", "escapes the checkpoint folder")


def test_same_key_in_two_files(folder):
    t = good_tensors()
    save_file({k: t[k] for k in ("a.weight", "a.bias", "steps")}, str(folder / "part-1.safetensors"))
    save_file({k: t[k] for k in ("b.weight", "steps")}, str(folder / "part-2.safetensors"))
    expect_checkpoint_error(folder, str(folder / "part-2.safetensors"), "'steps'", "part-1.safetensors")


def test_corrupt_shard_of_transformers_checkpoint(tmp_path):
    """A real sharded save_pretrained folder with one bad shard: the error names that shard and tensor."""
    pytest.importorskip("transformers")
    from hf_models import build, save

    _, model = build("qwen3_moe")
    save(model, tmp_path, max_shard_size="20KB")
    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    assert len(shards) >= 3
    victim = tmp_path / shards[1]
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 1)  # the last tensor of the shard lacks a byte
    (header_len,) = struct.unpack("<Q", victim.read_bytes()[:8])
    header = json.loads(victim.read_bytes()[8 : 8 + header_len])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    _, fresh = build("qwen3_moe", seed=1)
    expect_checkpoint_error(tmp_path, str(victim), repr(last), model=fresh)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_reports_checkpoint_error(folder):
    """Inside dcp.load the same validation runs in SafetensorsReader.read_metadata; torch re-raises the
    error as its own type (an AssertionError or CheckpointException), whose message keeps file and tensor."""
    path = raw_file(folder / "model.safetensors", good_tensors(), tail=52)
    with pytest.raises(CheckpointError, match="'a.bias'"):
        SafetensorsReader(folder).read_metadata()
    net = tiny()
    before = snapshot(net)
    planner = HFLoadPlanner(net)
    with pytest.raises(BaseException) as info:
        dcp.load(planner.state_dict_for_load(), storage_reader=SafetensorsReader(folder), planner=planner, no_dist=True)
    assert str(path) in str(info.value) and "'a.bias'" in str(info.value)
    assert_unchanged(net, before)


# ----------------------------------------------------------------------------------------------- mapping errors


def good_file(folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path = folder / "model.safetensors"
    save_file(tensors if tensors is not None else good_tensors(), str(path))
    return path


def test_strict_missing_raises_before_any_write(folder):
    t = good_tensors()
    del t["a.bias"]
    good_file(folder, t)
    net = tiny()
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"1 model tensor\(s\) are not in the checkpoint: a\.bias"):
        load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    assert_unchanged(net, before)
    report = load_hf_checkpoint(net, folder, rules=Rules(strict=False), options=LoadOptions(progress=False))
    assert report.missing_keys == ("a.bias",)
    assert report.loaded_keys == ("a.weight", "b.weight", "steps")
    assert torch.equal(net.a.bias, before["a.bias"]) and torch.equal(net.a.weight, t["a.weight"])


def test_unexpected_keys_reported(folder):
    t = good_tensors()
    t["c.weight"] = torch.ones(2)
    t["a.extra"] = torch.ones(3)
    good_file(folder, t)
    net = tiny()
    report = load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    assert report.unexpected_keys == ("a.extra", "c.weight") and report.missing_keys == ()
    assert report.bytes_read == sum(v.numel() * 4 for k, v in t.items() if k not in ("c.weight", "a.extra"))


def test_unexpected_keys_are_logged_as_from_pretrained_does(tmp_path, caplog):
    """A 2-layer transformers checkpoint into a 1-layer model: the keys of layer 1 are unexpected, as
    from_pretrained reports them, and one warning lists them compactly (expert indices folded)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from hf_models import build

    auto, two = build("mixtral")
    two.save_pretrained(tmp_path)
    _, one = build("mixtral", num_hidden_layers=1)
    _, info = auto.from_pretrained(tmp_path, num_hidden_layers=1, output_loading_info=True)
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(one, str(tmp_path), options=LoadOptions(progress=False))
    # both report layer 1: from_pretrained by model names (experts merged), the loader by checkpoint keys
    assert info["unexpected_keys"] and all(k.startswith("model.layers.1.") for k in info["unexpected_keys"])
    assert len(report.unexpected_keys) == 19 and all(k.startswith("model.layers.1.") for k in report.unexpected_keys)
    assert {k for k in info["unexpected_keys"] if "experts" not in k and "gate." not in k} == {
        k for k in report.unexpected_keys if "block_sparse_moe" not in k
    }
    (warning,) = [r for r in caplog.records if r.name == "loader" and r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert message.startswith(f"{len(report.unexpected_keys)} checkpoint key(s) of {tmp_path} are unexpected")
    assert "model.layers.1.block_sparse_moe.experts.{0, 1, 2, 3}.w1.weight" in message
    assert "model.layers.1.input_layernorm.weight" in message and "LoadReport.unexpected_keys" in message
    assert len(message) < 1000
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loader"):  # nothing unexpected: nothing logged
        load_hf_checkpoint(build("mixtral")[1], str(tmp_path), options=LoadOptions(progress=False))
    assert not [r for r in caplog.records if "unexpected" in r.getMessage()]


def test_unexpected_keys_are_logged_by_rank_0_only(folder, caplog):
    from loader.report import load_report

    t = good_tensors()
    t.update({f"extra.{i}.weight": torch.ones(1) for i in range(30)})
    good_file(folder, t)
    net = tiny()
    plan = HFLoadPlanner(net).build_plan(SafetensorsCheckpoint.open(folder))
    for rank, logged in ((1, 0), (0, 1)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="loader"):
            report = load_report(plan, 0, rank, 2)
        assert report.unexpected_keys == tuple(f"extra.{i}.weight" for i in range(30))
        warnings = [r.getMessage() for r in caplog.records if r.name == "loader"]
        assert len(warnings) == logged
    assert "30 checkpoint key(s)" in warnings[0] and "extra.{0...29}.weight" in warnings[0]


def test_reports_print_as_a_short_summary(folder, tmp_path):
    """``str()``/``repr()`` of a LoadReport and a SaveReport is one line of counts, bytes and seconds; the full
    key tuples stay fields."""
    from loader import save_hf_checkpoint

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(100))

    torch.manual_seed(0)
    source = Wide()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(folder / "model.safetensors"))
    net = Wide()
    report = load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    text = str(report)
    assert text == repr(report) and "\n" not in text and len(text) < 250
    assert text.startswith("LoadReport(rank 0 of 1: 200 tensors loaded (200 traced, 0 deferred), 0 missing,")
    assert f"read {report.bytes_read / 1024:.1f} KiB of {report.planned_bytes / 1024:.1f} KiB planned" in text
    assert text.endswith(f"{report.seconds:.2f} s)") and report.seconds > 0
    assert len(report.loaded_keys) == 200 and "layers.99.weight" in report.loaded_keys
    saved = save_hf_checkpoint(net, str(tmp_path / "saved"))
    text = str(saved)
    assert text == repr(saved) and "\n" not in text and len(text) < 250 + len(saved.path)
    assert text.startswith(f"SaveReport({saved.path!r}, rank 0 of 1: 200 keys in 1 files, ")
    assert text.endswith(f"{saved.seconds:.2f} s)") and saved.seconds > 0 and len(saved.keys) == 200


def test_two_checkpoint_keys_to_one_name(folder):
    t = good_tensors()
    t["x.weight"] = t["a.weight"].clone()
    good_file(folder, t)
    net = tiny()
    before = snapshot(net)
    with pytest.raises(ValueError) as info:
        load_hf_checkpoint(
            net, folder, rules=Rules(weights_mapping=[Rename(r"^x\.", "a.")]), options=LoadOptions(progress=False)
        )
    message = str(info.value)
    assert "'a.weight'" in message and "'x.weight'" in message and "both map to model tensor" in message
    assert_unchanged(net, before)


def test_shape_mismatch(folder):
    t = good_tensors()
    t["a.weight"] = torch.randn(2, 4)
    good_file(folder, t)
    net = tiny()
    before = snapshot(net)
    with pytest.raises(ValueError) as info:
        load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    assert "'a.weight'" in str(info.value) and "checkpoint (2, 4) vs target (3, 4)" in str(info.value)
    assert_unchanged(net, before)
    # the same through a conversion (traced) and through a deferred one
    good_file(folder)
    for fn in (lambda w: w.t(), lambda w: w.t() * 1):
        with pytest.raises(ValueError, match=r"'b\.weight'.*checkpoint \(3, 2\) vs target \(2, 3\)"):
            load_hf_checkpoint(
                net,
                folder,
                rules=Rules(weights_mapping=[Convert("b.weight", "b.weight", fn)], strict=False),
                options=LoadOptions(progress=False),
            )
        assert_unchanged(net, before)


def test_target_on_meta_device(folder):
    good_file(folder)
    with torch.device("meta"):
        net = Tiny()
    with pytest.raises(ValueError, match=r"'a\.bias' is on the meta device"):
        load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    net.to_empty(device="cpu")
    load_hf_checkpoint(net, folder, options=LoadOptions(progress=False))
    assert torch.equal(net.b.weight, good_tensors()["b.weight"])


# ----------------------------------------------------------------------------------------------- mid-load failure


class Sabotage(HFLoadPlanner):
    """Truncates a checkpoint file right after planning: the file changes underneath the load."""

    def __init__(self, model, victim: Path, keep: int, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.victim, self.keep = victim, keep
        self.plans = []  # what build_plan returned

    def build_plan(self, checkpoint, *args, **kwargs):
        plan = super().build_plan(checkpoint, *args, **kwargs)
        self.plans.append(plan)
        with open(self.victim, "r+b") as f:
            f.truncate(self.keep)
        return plan


def sabotaged(folder: Path) -> tuple[Path, int]:
    """A two-shard checkpoint; returns the second shard and a size that cuts its last tensor, ``steps``."""
    write_index(folder, two_shards(folder))
    victim = folder / "model-00002-of-00002.safetensors"
    ckpt = SafetensorsCheckpoint.open(folder)
    assert ckpt["steps"].data_end == os.path.getsize(victim) and ckpt["b.weight"].data_end < ckpt["steps"].data_end
    return victim, os.path.getsize(victim) - 4


@pytest.mark.parametrize("rollback", [False, True])
def test_file_truncated_after_planning(folder, rollback):
    victim, keep = sabotaged(folder)
    net = tiny()
    before = snapshot(net)
    planner = Sabotage(net, victim, keep)
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(net, folder, planner=planner, options=LoadOptions(rollback=rollback, progress=False))
    assert isinstance(info.value, ValueError)
    assert str(victim) in str(info.value) and "changed underneath" in str(info.value)
    if rollback:
        assert_unchanged(net, before)
    else:  # the first shard was read before the failure: its tensors are new
        assert torch.equal(net.a.weight, good_tensors()["a.weight"])


def test_file_truncated_after_planning_deferred_rollback(folder):
    """A deferred conversion's source read fails: everything written so far is restored."""
    victim, keep = sabotaged(folder)
    net = tiny()
    before = snapshot(net)
    rules = [Convert("^steps", "steps", lambda s: s.cumsum(0))]  # untraceable: read whole, run for real
    planner = Sabotage(net, victim, keep, rules=Rules(extra_weights_mapping=rules))
    with pytest.raises(CheckpointError, match="changed underneath"):
        load_hf_checkpoint(net, folder, planner=planner, options=LoadOptions(rollback=True, progress=False))
    assert [d.conversion.targets for d in planner.plans[-1].deferred] == [("steps",)]
    assert_unchanged(net, before)
