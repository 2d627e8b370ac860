"""Hostile or odd checkpoint input: always a ``CheckpointError`` naming the file, never a bare Python error,
never a hang.

Inputs that could block (FIFOs, devices) are opened in a subprocess with a timeout, so that a regression
fails the test instead of hanging the run. The data-section rule (the tensors' byte ranges tile it exactly)
is checked against the safetensors library itself.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from loader.checkpoint import FileIdentity, SafetensorsCheckpoint, TensorInfo, read_header, read_header_file
from loader.checkpoint.folder import MAX_INDEX_BYTES
from loader.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120  # seconds for a subprocess that opens a few files: far more than it needs, far less than a hang
INDEX = "model.safetensors.index.json"


def write_raw(path: Path, header: object = None, data: bytes = b"", *, raw: bytes | None = None) -> str:
    """A hand-made safetensors file: 8-byte length, header JSON (or ``raw`` bytes), data."""
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def u8(begin: int, end: int) -> dict:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def expect_error(path: str | Path, *names: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        SafetensorsCheckpoint.open(path)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    return info.value


def shards(folder: Path) -> dict[str, str]:
    """Two real shards in ``folder``; returns their weight map."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.ones(2)}, str(folder / "one.safetensors"))
    save_file({"b": torch.zeros(3)}, str(folder / "two.safetensors"))
    return {"a": "one.safetensors", "b": "two.safetensors"}


def write_index(folder: Path, weight_map: dict) -> str:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder / INDEX)


# ----------------------------------------------------------------------------------------------- not files

PROBE = """
import json, sys
from loader import SafetensorsCheckpoint
from loader.errors import CheckpointError
out = []
for path in sys.argv[1:]:
    try:
        SafetensorsCheckpoint.open(path)
        out.append({"type": None})
    except CheckpointError as e:
        out.append({"type": type(e).__name__, "message": str(e), "path": e.path})
    except Exception as e:
        out.append({"type": "bare " + type(e).__name__, "message": str(e), "path": None})
print(json.dumps(out))
"""


def open_in_subprocess(paths: list[str]) -> list[dict]:
    """Open each path with ``SafetensorsCheckpoint.open`` in a fresh process; fail (not hang) if it blocks."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run([sys.executable, "-c", PROBE, *paths], capture_output=True, text=True, env=env,
                           timeout=TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening one of {paths} blocked for {TIMEOUT} s")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _make_odd_inputs(base: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """``{case: (path to open, file the error must name, words it must hold)}``."""
    cases: dict[str, tuple[str, str, tuple[str, ...]]] = {}

    def folder(name: str) -> Path:
        d = base / name
        d.mkdir()
        return d

    d = folder("fifo_file")
    os.mkfifo(d / "x.safetensors")
    cases["fifo given as the file"] = (str(d / "x.safetensors"), str(d / "x.safetensors"), ("FIFO",))
    d = folder("fifo_model")
    os.mkfifo(d / "model.safetensors")
    cases["fifo as model.safetensors"] = (str(d), str(d / "model.safetensors"), ("FIFO",))
    d = folder("fifo_index")
    shards(d)
    os.mkfifo(d / INDEX)
    cases["fifo as the index"] = (str(d), str(d / INDEX), ("FIFO",))
    d = folder("fifo_shard")
    weight_map = shards(d)
    os.mkfifo(d / "three.safetensors")
    write_index(d, weight_map | {"c": "three.safetensors"})
    cases["fifo as a shard"] = (str(d), str(d / "three.safetensors"), ("FIFO",))
    if os.path.exists("/dev/zero"):
        cases["/dev/zero given as the file"] = ("/dev/zero", "/dev/zero", ("character device",))
        d = folder("zero_link")
        os.symlink("/dev/zero", d / "model.safetensors")
        cases["symlink to /dev/zero"] = (str(d), str(d / "model.safetensors"), ("character device",))
    d = folder("dir_model")
    (d / "model.safetensors").mkdir()
    cases["directory as model.safetensors"] = (str(d), str(d / "model.safetensors"), ("directory",))
    d = folder("dir_index")
    shards(d)
    (d / INDEX).mkdir()
    cases["directory as the index"] = (str(d), str(d / INDEX), ("directory",))
    d = folder("dir_listed")
    save_file({"a": torch.ones(2)}, str(d / "a.safetensors"))
    (d / "b.safetensors").mkdir()
    cases["directory among the shards"] = (str(d), str(d / "b.safetensors"), ("directory",))
    d = folder("dir_in_index")
    weight_map = shards(d)
    (d / "sub").mkdir()
    write_index(d, weight_map | {"c": "sub"})
    cases["index names a directory"] = (str(d), str(d / "sub"), ("directory",))
    d = folder("loop_model")
    os.symlink("model.safetensors", d / "model.safetensors")
    cases["symlink loop as model.safetensors"] = (str(d), str(d / "model.safetensors"), ("symbolic links",))
    d = folder("loop_listed")
    os.symlink("b.safetensors", d / "a.safetensors")
    os.symlink("a.safetensors", d / "b.safetensors")
    cases["symlink loop among the shards"] = (str(d), str(d / "a.safetensors"), ("symbolic links",))
    d = folder("loop_shard")
    weight_map = shards(d)
    os.symlink("loop.safetensors", d / "loop.safetensors")
    write_index(d, weight_map | {"c": "loop.safetensors"})
    cases["index names a symlink loop"] = (str(d), str(d / "loop.safetensors"), ("symbolic links",))
    d = folder("dangling")
    os.symlink(base / "nowhere.safetensors", d / "model.safetensors")
    cases["dangling symlink"] = (str(d), str(d / "model.safetensors"), ("No such file",))
    return cases


@pytest.fixture(scope="module")
def odd_inputs(tmp_path_factory) -> dict[str, tuple[dict, str, tuple[str, ...]]]:
    """Every odd input opened once, all in one subprocess: ``{case: (result, file, words)}``."""
    cases = _make_odd_inputs(tmp_path_factory.mktemp("odd"))
    results = open_in_subprocess([path for path, _, _ in cases.values()])
    return {name: (res, file, words) for (name, (_, file, words)), res in zip(cases.items(), results)}


ODD_CASES = [
    "fifo given as the file", "fifo as model.safetensors", "fifo as the index", "fifo as a shard",
    "/dev/zero given as the file", "symlink to /dev/zero", "directory as model.safetensors",
    "directory as the index", "directory among the shards", "index names a directory",
    "symlink loop as model.safetensors", "symlink loop among the shards", "index names a symlink loop",
    "dangling symlink",
]  # fmt: skip


@pytest.mark.parametrize("case", ODD_CASES)
def test_odd_file_is_a_checkpoint_error_naming_it(odd_inputs, case: str):
    if case not in odd_inputs:
        pytest.skip("no /dev/zero here")
    result, file, words = odd_inputs[case]
    assert result["type"] == "CheckpointError", result
    assert result["path"] == file and result["message"].startswith(file), result
    for word in words:
        assert word in result["message"], (word, result)


# ----------------------------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("opener,closer", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_header(tmp_path: Path, opener: str, closer: str):
    depth = 100_000
    raw = ('{"w": ' + opener * depth + "1" + closer * depth + "}").encode()
    path = write_raw(tmp_path / "deep.safetensors", raw=raw)
    err = expect_error(path, path, "nested too deeply")
    assert err.path == path


def test_deeply_nested_index(tmp_path: Path):
    shards(tmp_path)
    depth = 100_000
    (tmp_path / INDEX).write_text('{"weight_map": ' + "[" * depth + "]" * depth + "}")
    expect_error(tmp_path, str(tmp_path / INDEX), "nested too deeply")


def test_nul_byte_in_index_file_name(tmp_path: Path):
    weight_map = shards(tmp_path)
    index = write_index(tmp_path, weight_map | {"b": "two\0.safetensors"})
    err = expect_error(tmp_path, index, "NUL", "'b'")
    assert (err.path, err.key) == (index, "b")


def test_nul_byte_in_the_path_itself(tmp_path: Path):
    with pytest.raises(FileNotFoundError) as info:
        SafetensorsCheckpoint.open(str(tmp_path) + "/x\0.safetensors")
    assert isinstance(info.value, CheckpointError) and "\\x00" in str(info.value)


@pytest.mark.parametrize("name", ["", 7, None])
def test_index_file_name_not_a_name(tmp_path: Path, name: object):
    weight_map = shards(tmp_path)
    index = write_index(tmp_path, weight_map | {"b": name})
    expect_error(tmp_path, index, "'b'", "file name")


def test_oversized_index_is_refused_before_reading(tmp_path: Path):
    shards(tmp_path)
    index = tmp_path / INDEX
    with open(index, "wb") as f:  # sparse: costs no disk
        f.write(b'{"weight_map": {}}')
        f.truncate(MAX_INDEX_BYTES + 1)
    tracemalloc.start()
    try:
        expect_error(tmp_path, str(index), "limit")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_duplicate_keys_in_entry_and_metadata(tmp_path: Path):
    raw = b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "dtype": "U8"}}'
    path = write_raw(tmp_path / "a.safetensors", raw=raw, data=b"\0")
    expect_error(path, path, "'w'", "duplicate JSON key 'dtype'")
    raw = b'{"__metadata__": {"x": "1", "x": "2"}}'
    path = write_raw(tmp_path / "b.safetensors", raw=raw)
    expect_error(path, path, "__metadata__", "duplicate JSON key 'x'")


def test_entry_with_extra_fields_is_accepted(tmp_path: Path):
    """As the safetensors library: unknown fields of an entry are ignored."""
    entry = u8(0, 2) | {"note": {"any": ["thing"]}}
    path = write_raw(tmp_path / "a.safetensors", {"w": entry}, b"\1\2")
    with safe_open(path, "pt") as f:
        assert list(f.keys()) == ["w"]
    assert SafetensorsCheckpoint.open(path)["w"].shape == (2,)


def test_hostile_shapes_are_refused_quickly(tmp_path: Path):
    many_dims = {"dtype": "U8", "shape": [2] * 1_000_000, "data_offsets": [0, 1]}
    path = write_raw(tmp_path / "a.safetensors", {"w": many_dims}, b"\0")
    expect_error(path, path, "'w'", "needs more than")
    huge = {"dtype": "F32", "shape": [10**30, 10**30], "data_offsets": [0, 4]}
    path = write_raw(tmp_path / "b.safetensors", {"w": huge}, b"\0" * 4)
    expect_error(path, path, "'w'", "needs more than")
    ones = {"dtype": "F32", "shape": [1] * 100 + [2], "data_offsets": [0, 8]}  # valid, many dims
    path = write_raw(tmp_path / "c.safetensors", {"w": ones}, b"\0" * 8)
    assert SafetensorsCheckpoint.open(path)["w"].shape == (1,) * 100 + (2,)


# ----------------------------------------------------------------------------------------------- data section


def library_accepts(path: str) -> bool:
    try:
        with safe_open(path, "pt") as f:
            f.keys()
        return True
    except Exception:
        return False


def we_accept(path: str) -> bool:
    try:
        SafetensorsCheckpoint.open(path)
        return True
    except CheckpointError:
        return False


@pytest.mark.parametrize(
    ("header", "size", "words"),
    [
        ({"a": u8(0, 8), "b": u8(12, 20)}, 20, ("'b'", "gap", "[8, 12)")),
        ({"a": u8(4, 12)}, 12, ("'a'", "gap", "[0, 4)")),
        ({"a": u8(0, 8)}, 12, ("4 trailing bytes",)),
        ({}, 4, ("4 trailing bytes",)),
        ({"e": u8(0, 0)}, 3, ("3 trailing bytes",)),
        ({"a": u8(0, 8), "e": u8(20, 20)}, 8, ("'e'", "past the data section")),
        ({"a": u8(0, 8), "b": u8(4, 12)}, 12, ("'b'", "overlaps", "'a'")),
        ({"a": u8(0, 8), "b": u8(0, 8)}, 8, ("overlaps",)),
        ({"a": u8(0, 8), "e": u8(4, 4)}, 8, ("'e'", "empty tensor at 4 lies inside", "'a'")),
    ],
)
def test_data_section_must_be_tiled(tmp_path: Path, header: dict, size: int, words: tuple[str, ...]):
    path = write_raw(tmp_path / "t.safetensors", header, b"\0" * size)
    assert not library_accepts(path)
    expect_error(path, path, *words)


@pytest.mark.parametrize(
    ("header", "size"),
    [
        ({"b": u8(8, 16), "a": u8(0, 8)}, 16),  # out of order in the header
        ({"e0": u8(0, 0), "a": u8(0, 8), "e8": u8(8, 8), "b": u8(8, 16), "e16": u8(16, 16)}, 16),
        ({"z": u8(8, 8), "y": u8(0, 8), "x": u8(8, 8)}, 8),
        ({}, 0),
    ],
)
def test_tiled_data_sections_are_accepted(tmp_path: Path, header: dict, size: int):
    path = write_raw(tmp_path / "t.safetensors", header, bytes(range(size)))
    assert library_accepts(path)
    ckpt = SafetensorsCheckpoint.open(path)
    assert list(ckpt.keys()) == list(header)


def test_save_file_with_empty_tensors_is_accepted(tmp_path: Path):
    tensors = {"empty": torch.empty(0, 3), "a": torch.arange(4.0), "z": torch.empty(0, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    assert set(SafetensorsCheckpoint.open(tmp_path)) == set(tensors)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiling")


@settings(max_examples=300, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 4)), max_size=5),
    size=st.integers(0, 16),
)
def test_tiling_rule_matches_the_safetensors_library(scratch: Path, spans: list[tuple[int, int]], size: int):
    header = {f"t{i}": u8(begin, begin + n) for i, (begin, n) in enumerate(spans)}
    path = write_raw(scratch / "t.safetensors", header, b"\0" * size)
    assert we_accept(path) == library_accepts(path), (header, size)


# ----------------------------------------------------------------------------------------------- scale


def test_header_of_200k_entries_in_and_out_of_order(tmp_path: Path):
    n = 200_000
    entries = [(f"layers.{i // 1000}.experts.{i % 1000}.w", u8(4 * i, 4 * i + 4)) for i in range(n)]
    forward = write_raw(tmp_path / "f.safetensors", dict(entries), bytes(4 * n))
    backward = write_raw(tmp_path / "b.safetensors", dict(entries[::-1]), bytes(4 * n))
    tensors, _ = read_header(forward)
    base = os.path.getsize(forward) - 4 * n
    assert len(tensors) == n and list(tensors) == [k for k, _ in entries]
    last = tensors[entries[-1][0]]
    assert last == TensorInfo(entries[-1][0], forward, torch.uint8, (4,), base + 4 * n - 4, base + 4 * n)
    tensors_b, _ = read_header(backward)
    assert list(tensors_b) == [k for k, _ in entries[::-1]]
    assert all(tensors_b[k].data_start == tensors[k].data_start for k, _ in entries[:: n // 100])


# ----------------------------------------------------------------------------------------------- identity


def test_identities_come_from_the_header_reads(tmp_path: Path):
    shards(tmp_path)
    header = read_header_file(str(tmp_path / "one.safetensors"))
    assert header.identity == FileIdentity.of(os.stat(tmp_path / "one.safetensors"))
    assert list(header.tensors) == ["a"] and header.metadata == {}
    ckpt = SafetensorsCheckpoint.open(tmp_path)
    assert ckpt.identities == {f: FileIdentity.of(os.stat(f)) for f in ckpt.files}
    assert SafetensorsCheckpoint.from_infos(ckpt.tensors).identities == {}
    os.utime(tmp_path / "one.safetensors", ns=(0, 0))  # a change of mtime is a change of identity
    assert SafetensorsCheckpoint.open(tmp_path).identities != ckpt.identities
