"""Tests for loader.checkpoint: header parsing/validation, sharded folders, byte-range reads."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from loader.checkpoint import (
    DTYPES,
    FileReader,
    SafetensorsCheckpoint,
    TensorInfo,
    coalesce_ranges,
    read_ranges,
    read_tensor,
)
from loader.errors import CheckpointError, CheckpointNotFoundError
from loader.options import LoadOptions

# ----------------------------------------------------------------------------------------------- helpers


def write_raw(path: Path, header: object, data: bytes = b"", *, header_bytes: bytes | None = None) -> str:
    """Write a hand-made safetensors file: 8-byte length, header JSON, data."""
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": offsets or [0, 8]}


def expect_error(path: str, *names: str) -> CheckpointError:
    """Open ``path`` expecting a CheckpointError whose message names every string in ``names``."""
    with pytest.raises(CheckpointError) as info:
        SafetensorsCheckpoint.open(path)
    err = info.value
    assert isinstance(err, ValueError)
    for name in names:
        assert name in str(err), (name, str(err))
    return err


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point and dtype.itemsize > 1:
            t = torch.randn(3, 5, generator=g).to(dtype)
        else:  # random bytes reinterpreted: covers ints, bool-safe values, fp8 and complex bit patterns
            t = torch.randint(0, 256, (3, 5 * dtype.itemsize), generator=g, dtype=torch.uint8)
            if dtype == torch.bool:
                t = t % 2
            t = t.view(dtype)
        out[f"t_{name}"] = t
    out["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    return out


@pytest.fixture
def single(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    tensors = all_dtype_tensors()
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def make_sharded(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    a = {"w1": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b1": torch.ones(3, dtype=torch.bfloat16)}
    b = {"w2": torch.arange(8, dtype=torch.int64).reshape(4, 2)}
    save_file(a, str(root / "model-00001-of-00002.safetensors"))
    save_file(b, str(root / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in b}
    write_index(root, weight_map)
    return root


def write_index(root: Path, weight_map: dict, *, raw: str | None = None) -> str:
    path = root / "model.safetensors.index.json"
    path.write_text(raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(path)


# ----------------------------------------------------------------------------------------------- positive


def test_single_file(single):
    path, tensors = single
    ckpt = SafetensorsCheckpoint.open(path)
    assert ckpt.root == os.path.dirname(path)
    assert ckpt.files == (path,)
    assert set(ckpt.keys()) == set(tensors)
    assert ckpt.metadata == {path: {"format": "pt"}}
    assert "scalar" in ckpt and "nope" not in ckpt
    assert len(ckpt) == len(tensors)
    info = ckpt["t_F32"]
    assert info.file == path and info.shape == (3, 5) and info.dtype == torch.float32
    assert (info.itemsize, info.numel, info.nbytes) == (4, 15, 60)
    assert ckpt["scalar"].shape == () and ckpt["scalar"].numel == 1
    assert ckpt.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # absolute offsets: the data section starts right after the header
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
    assert min(i.data_start for i in ckpt.tensors.values()) == 8 + header_len


def test_folder_with_model_safetensors(single, tmp_path: Path):
    path, tensors = single
    save_file({"other": torch.zeros(1)}, str(tmp_path / "ignored-extra.safetensors"))
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert ckpt.files == (path,) and set(ckpt.keys()) == set(tensors)


def test_folder_without_index_takes_all_shards_sorted(tmp_path: Path):
    save_file({"b": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    ckpt = SafetensorsCheckpoint.open(str(tmp_path))
    assert [os.path.basename(f) for f in ckpt.files] == ["a.safetensors", "b.safetensors"]
    assert ckpt["b"].file.endswith("b.safetensors")


def test_sharded_with_index(tmp_path: Path):
    root = make_sharded(tmp_path)
    save_file({"stray": torch.ones(1)}, str(root / "unlisted.safetensors"))
    for path in (root, root / "model.safetensors.index.json"):
        ckpt = SafetensorsCheckpoint.open(path)
        assert ckpt.root == str(root)
        assert [os.path.basename(f) for f in ckpt.files] == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
        assert set(ckpt.keys()) == {"w1", "b1", "w2"}
        for key, info in ckpt.tensors.items():
            assert torch.equal(read_tensor(info), load_file(info.file)[key])


def test_index_subset_of_file_keys_is_fine(tmp_path: Path):
    root = make_sharded(tmp_path)
    write_index(root, {"w1": "model-00001-of-00002.safetensors"})
    ckpt = SafetensorsCheckpoint.open(root)
    assert list(ckpt.keys()) == ["w1"] and len(ckpt.files) == 1


def test_read_tensor_bit_identical_every_dtype(single):
    path, _ = single
    ref = load_file(path)
    ckpt = SafetensorsCheckpoint.open(path)
    with FileReader() as reader:
        for key, info in ckpt.tensors.items():
            got = read_tensor(info, reader)
            assert got.dtype == ref[key].dtype and got.shape == ref[key].shape, key
            assert torch.equal(got.reshape(-1).view(torch.uint8), ref[key].reshape(-1).view(torch.uint8)), key
        assert reader.bytes_read == ckpt.total_bytes
    assert {"t_BF16", "t_F8_E4M3", "t_F8_E5M2", "t_BOOL"} <= set(ckpt.keys())


def test_read_tensor_is_writable_and_fresh(single):
    path, _ = single
    info = SafetensorsCheckpoint.open(path)["t_F32"]
    a, b = read_tensor(info), read_tensor(info)
    a.zero_()
    assert not torch.equal(a, b)


def test_from_infos_without_files():
    infos = {
        "x": TensorInfo("x", "/nowhere/a.safetensors", torch.float16, (4, 4), 100, 132),
        "y": TensorInfo("y", "/nowhere/b.safetensors", torch.float32, (2,), 100, 108),
    }
    ckpt = SafetensorsCheckpoint.from_infos(infos, root="/nowhere")
    assert ckpt.files == ("/nowhere/a.safetensors", "/nowhere/b.safetensors")
    assert ckpt.total_bytes == 40 and ckpt["x"].nbytes == 32
    with pytest.raises(ValueError):
        SafetensorsCheckpoint.from_infos({"z": infos["x"]})


def test_missing_path_is_file_not_found(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        SafetensorsCheckpoint.open(tmp_path / "nope")


def test_error_pickles_with_attributes(tmp_path: Path):
    path = write_raw(tmp_path / "x.safetensors", {"k": entry(dtype="Q9")}, b"\0" * 8)
    err = expect_error(path)
    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.path, again.key) == (str(err), path, "k")


# ----------------------------------------------------------------------------------------------- bad files


def test_truncated_below_8_bytes(tmp_path: Path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x05\0\0")
    expect_error(str(path), str(path), "truncated")


def test_header_length_past_eof(tmp_path: Path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    expect_error(str(path), str(path), "past the end")


def test_absurd_header_length_is_not_allocated(tmp_path: Path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    expect_error(str(path), str(path))
    path.write_bytes(struct.pack("<Q", 200_000_000) + b" ")  # sparse file bigger than the header limit
    with open(path, "r+b") as f:
        f.truncate(200_000_100)
    expect_error(str(path), str(path), "limit")


def test_header_not_utf8(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", None, header_bytes=b'{"\xff": 1}')
    expect_error(path, path, "UTF-8")


def test_header_not_json(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", None, header_bytes=b"{not json")
    expect_error(path, path, "JSON")


def test_header_not_object(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", [1, 2])
    expect_error(path, path, "object")


def test_header_duplicate_key(tmp_path: Path):
    raw = b'{"k": %s, "k": %s}' % (json.dumps(entry()).encode(), json.dumps(entry()).encode())
    path = write_raw(tmp_path / "t.safetensors", None, b"\0" * 8, header_bytes=raw)
    expect_error(path, path, "duplicate", "'k'")


def test_bad_metadata(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", {"__metadata__": {"a": 1}})
    expect_error(path, path, "__metadata__")


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_entry_missing_field(tmp_path: Path, field: str):
    e = entry()
    del e[field]
    path = write_raw(tmp_path / "t.safetensors", {"w.0": e}, b"\0" * 8)
    expect_error(path, path, "'w.0'", field)


@pytest.mark.parametrize(
    "bad",
    [
        "not a dict",
        {"dtype": 5, "shape": [2], "data_offsets": [0, 8]},
        {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},
        {"dtype": "F32", "shape": [2], "data_offsets": "0-8"},
    ],
)
def test_entry_wrong_types(tmp_path: Path, bad: object):
    path = write_raw(tmp_path / "t.safetensors", {"w.0": bad}, b"\0" * 8)
    expect_error(path, path, "'w.0'")


def test_unknown_dtype(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", {"w": entry(dtype="F17")}, b"\0" * 8)
    expect_error(path, path, "'w'", "F17")


@pytest.mark.parametrize("shape", [[-2], [2.0], [True, 2], [None]])
def test_bad_shape(tmp_path: Path, shape: list):
    path = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=shape)}, b"\0" * 8)
    expect_error(path, path, "'w'", "shape")


@pytest.mark.parametrize("offsets", [[0], [0, 8, 9], [0.0, 8], [-8, 0], [8, 0], [True, 8]])
def test_bad_data_offsets(tmp_path: Path, offsets: list):
    path = write_raw(tmp_path / "t.safetensors", {"w": entry(offsets=offsets)}, b"\0" * 16)
    expect_error(path, path, "'w'", "data_offsets")


def test_byte_length_mismatch(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=[3], offsets=[0, 8])}, b"\0" * 12)
    expect_error(path, path, "'w'", "needs 12")


def test_offsets_outside_data_section(tmp_path: Path):
    path = write_raw(tmp_path / "t.safetensors", {"w": entry(offsets=[4, 12])}, b"\0" * 8)
    expect_error(path, path, "'w'", "past the data section")


def test_overlapping_tensors(tmp_path: Path):
    header = {"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}
    path = write_raw(tmp_path / "t.safetensors", header, b"\0" * 12)
    err = expect_error(path, path, "overlaps", "'a'", "'b'")
    assert err.key == "b"


def test_adjacent_and_empty_tensors_do_not_overlap(tmp_path: Path):
    header = {
        "a": entry(offsets=[0, 8]),
        "e": entry(shape=[0, 3], offsets=[8, 8]),
        "b": entry(offsets=[8, 16]),
    }
    path = write_raw(tmp_path / "t.safetensors", header, b"\0" * 16)
    ckpt = SafetensorsCheckpoint.open(path)
    assert read_tensor(ckpt["e"]).shape == (0, 3)


def test_duplicate_key_across_files(tmp_path: Path):
    save_file({"k": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"k": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    expect_error(str(tmp_path), "key 'k' in both a.safetensors and b.safetensors", "b.safetensors")


@pytest.mark.parametrize("kind", ["empty folder", "no safetensors", "missing path"])
def test_no_checkpoint_is_checkpoint_not_found(tmp_path: Path, kind: str):
    """An empty folder, a folder without ``.safetensors`` files and a missing path are all
    :class:`CheckpointNotFoundError`: a :class:`FileNotFoundError` (as the peers raise) and a CheckpointError;
    the load leaves the model untouched."""
    from torch import nn

    from loader import load_hf_checkpoint

    path = tmp_path / "ckpt"
    if kind != "missing path":
        path.mkdir()
    if kind == "no safetensors":
        (path / "config.json").write_text("{}")
        torch.save({"w": torch.ones(2)}, path / "model.pt")  # no name a format is found by (pytorch_model.bin is)
        (path / "model.safetensors.bak").write_bytes(b"")
    err = expect_error(str(path), str(path), "no such file or folder" if kind == "missing path" else "no .safetensors")
    assert isinstance(err, CheckpointNotFoundError) and isinstance(err, FileNotFoundError)
    assert err.path == str(path)
    model = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointNotFoundError, match=str(path)):
        load_hf_checkpoint(model, str(path), options=LoadOptions(progress=False))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------- bad index


def test_index_not_json(tmp_path: Path):
    root = make_sharded(tmp_path)
    index = write_index(root, {}, raw="{oops")
    expect_error(str(root), index, "JSON")


@pytest.mark.parametrize("raw", ['{"metadata": {}}', "[1]", '{"weight_map": []}'])
def test_index_without_weight_map(tmp_path: Path, raw: str):
    root = make_sharded(tmp_path)
    index = write_index(root, {}, raw=raw)
    expect_error(str(root), index, "weight_map")


def test_index_names_missing_file(tmp_path: Path):
    root = make_sharded(tmp_path)
    index = write_index(root, {"w1": "model-00001-of-00002.safetensors", "zz": "gone.safetensors"})
    expect_error(str(root), index, "gone.safetensors", "'zz'")


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_index_path_escapes_folder(tmp_path: Path, name: str):
    root = make_sharded(tmp_path)
    save_file({"w1": torch.ones(1)}, str(tmp_path / "outside.safetensors"))
    if name == "ABS":
        name = str(tmp_path / "outside.safetensors")
    index = write_index(root, {"w1": name})
    expect_error(str(root), index, "outside", "'w1'")


def test_index_symlinks_are_accepted(tmp_path: Path):
    """Symlinks to regular files are fine (more in test_hub_cache.py); the names must stay in the folder."""
    root = make_sharded(tmp_path)
    os.symlink(root / "model-00001-of-00002.safetensors", root / "inside.safetensors")
    write_index(root, {"w1": "inside.safetensors"})
    assert SafetensorsCheckpoint.open(root)["w1"].shape == (2, 3)


def test_index_key_missing_from_file(tmp_path: Path):
    root = make_sharded(tmp_path)
    index = write_index(root, {"w1": "model-00001-of-00002.safetensors", "w2": "model-00001-of-00002.safetensors"})
    expect_error(str(root), index, "'w2'", "model-00001-of-00002.safetensors")


def test_corrupt_shard_named_in_error(tmp_path: Path):
    root = make_sharded(tmp_path)
    shard = root / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:20])
    expect_error(str(root), str(shard))


# ----------------------------------------------------------------------------------------------- reading


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> tuple[str, bytes]:
    data = os.urandom(64 * 1024)
    path = tmp_path_factory.mktemp("blob") / "blob.bin"
    path.write_bytes(data)
    return str(path), data


range_lists = st.lists(
    st.tuples(st.integers(0, 64 * 1024), st.integers(0, 9000)).map(lambda t: (t[0], min(t[0] + t[1], 64 * 1024))),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(
    ranges=range_lists,
    max_gap=st.sampled_from([0, 64, 4096, 1 << 20]),
    ratio=st.sampled_from([1.0, 2.0, 8.0]),
)
def test_read_ranges_matches_slicing(blob, ranges, max_gap, ratio):
    path, data = blob
    with FileReader() as reader:
        got = read_ranges(path, ranges, max_gap=max_gap, max_overread=ratio, reader=reader)
        assert [bytes(v) for v in got] == [data[s:e] for s, e in ranges]
        groups = coalesce_ranges(ranges, max_gap=max_gap, max_overread=ratio)
        assert reader.reads == len(groups) <= sum(1 for s, e in ranges if e > s)
        assert reader.bytes_read == sum(e - s for s, e, _ in groups)
    # every non-empty range is covered by exactly one group, and groups are disjoint and sorted
    seen = sorted(i for _, _, members in groups for i in members)
    assert seen == [i for i, (s, e) in enumerate(ranges) if e > s]
    for (_, e1, _), (s2, _, _) in zip(groups, groups[1:]):
        assert e1 < s2
    for s, e, members in groups:
        assert all(s <= ranges[i][0] and ranges[i][1] <= e for i in members)


def test_coalescing_reduces_reads(blob):
    path, data = blob
    ranges = [(i * 1000, i * 1000 + 100) for i in range(20)]  # 900-byte gaps
    with FileReader() as merged, FileReader() as separate:
        a = read_ranges(path, ranges, reader=merged)
        b = read_ranges(path, ranges, max_gap=0, max_overread=1.0, reader=separate)
        assert [bytes(v) for v in a] == [bytes(v) for v in b] == [data[s:e] for s, e in ranges]
        assert merged.reads == 1 and separate.reads == 20
        assert separate.bytes_read == 2000 and merged.bytes_read == 19 * 1000 + 100


def test_coalescing_respects_overread_ratio():
    far = [(0, 100), (100_000, 100_100)]
    assert len(coalesce_ranges(far)) == 2
    assert len(coalesce_ranges(far, max_overread=1000.0)) == 1
    assert len(coalesce_ranges([(0, 100), (150, 250)], max_gap=0, max_overread=1.25)) == 1
    assert len(coalesce_ranges([(0, 100), (150, 250)], max_gap=0, max_overread=1.24)) == 2
    assert coalesce_ranges([(5, 5)]) == []
    with pytest.raises(ValueError):
        coalesce_ranges([(5, 4)])


def test_read_ranges_empty_and_overlapping(blob):
    path, data = blob
    got = read_ranges(path, [(10, 10), (0, 50), (20, 30), (40, 60)])
    assert [bytes(v) for v in got] == [b"", data[0:50], data[20:30], data[40:60]]


def test_short_read_at_eof(blob, tmp_path: Path):
    path, _ = blob
    with pytest.raises(CheckpointError, match="changed underneath") as info:
        read_ranges(path, [(64 * 1024 - 10, 64 * 1024 + 10)])
    assert path in str(info.value)
    with FileReader() as reader:
        buf = bytearray(10)
        reader.pread_into(path, 0, buf)
        assert reader.bytes_read == 10 and reader.reads == 1
        with pytest.raises(CheckpointError):
            reader.pread_into(path, 64 * 1024, buf)
        assert reader.bytes_read == 10


def test_read_tensor_after_truncation(single):
    path, _ = single
    info = SafetensorsCheckpoint.open(path)["t_F64"]
    with open(path, "r+b") as f:
        f.truncate(info.data_start + 1)
    with pytest.raises(CheckpointError, match="changed underneath"):
        read_tensor(info)
