"""Hostile ``.bin`` checkpoints: every one is a :class:`CheckpointError` naming the file and the record, the tensor
or the global, before any tensor byte is read or any model tensor written; a pickle's globals are never imported
or run (``os.system``, ``builtins.eval``, ``posix.system`` through ``GLOBAL`` and ``STACK_GLOBAL``)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import sys
import zipfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bin_files import Member, members, save_bin, torch_bytes, write_zip
from hf_models import build, clone_state

from loader import load_hf_checkpoint
from loader.checkpoint import open_checkpoint
from loader.checkpoint.pickles import read_pickle
from loader.errors import CheckpointError
from loader.options import LoadOptions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def refused(tmp_path, archive: bytes, *needles: str) -> CheckpointError:
    """Opening ``archive`` (as ``pytorch_model.bin``) fails naming the file and every one of ``needles``."""
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(archive)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    message = str(info.value)
    assert message.startswith(str(path)) and info.value.path == str(path), message
    for needle in needles:
        assert needle in message, (needle, message)
    return info.value


def real_members() -> list[Member]:
    return [Member(n, d) for n, d in members(torch_bytes({"w": torch.arange(4, dtype=torch.float32)}))]


def named(items: list[Member], suffix: str) -> Member:
    return next(m for m in items if m.name.endswith(suffix))


# --- a hand-assembled torch pickle ------------------------------------------------------------------------------


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def _str(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s.encode())) + s.encode()


def tensor_pickle(size=(4,), stride=(1,), offset=0, numel=4, key="0", storage="FloatStorage", value=None) -> bytes:
    """``torch.save``'s pickle of ``{"w": tensor}`` with the fields given (``value``: these opcodes instead)."""
    tensor = value
    if tensor is None:
        pid = b"(" + _str("storage") + f"ctorch\n{storage}\n".encode() + _str(key) + _str("cpu") + _int(numel) + b"tQ"
        dims = b"(" + b"".join(map(_int, size)) + b"t(" + b"".join(map(_int, stride)) + b"t"
        hooks = b"ccollections\nOrderedDict\n)R"
        tensor = b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid + _int(offset) + dims + b"\x89" + hooks + b"tR"
    return b"\x80\x02ccollections\nOrderedDict\n)R(" + _str("w") + tensor + b"u."


def archive(pkl: bytes, records: dict[str, bytes] | None = None, byteorder: bytes = b"little") -> bytes:
    items = [Member("archive/data.pkl", pkl), Member("archive/byteorder", byteorder), Member("archive/version", b"3\n")]
    items += [Member(f"archive/data/{k}", v) for k, v in (records or {"0": bytes(16)}).items()]
    return write_zip(items)


def test_the_assembled_pickle_is_read_as_torch_reads_it(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(archive(tensor_pickle(), {"0": struct.pack("<4f", 1, 2, 3, 4)}))
    assert torch.load(path, weights_only=True)["w"].tolist() == [1, 2, 3, 4]
    assert open_checkpoint(tmp_path)["w"].shape == (4,)


# --- zip records ------------------------------------------------------------------------------------------------


def test_a_record_smaller_than_its_storage(tmp_path):
    items = real_members()
    named(items, "data/0").data = bytes(12)
    refused(tmp_path, write_zip(items), "record 'archive/data/0' holds 12 bytes, fewer than its storage's 16")


def test_a_storage_larger_than_its_record(tmp_path):
    refused(tmp_path, archive(tensor_pickle(numel=8)), "'archive/data/0' holds 16 bytes, fewer than its storage's 32")


def test_a_central_size_past_the_next_record(tmp_path):
    items = real_members()
    named(items, "data/0").claimed_size = 4096
    refused(tmp_path, write_zip(items), "record 'archive/data/0'", "overlaps the next record")


def test_two_records_at_one_offset(tmp_path):
    data = write_zip(real_members())
    items = real_members()
    first = zipfile.ZipFile(io.BytesIO(data)).infolist()
    named(items, "data/0").header_offset = first[0].header_offset
    refused(tmp_path, write_zip(items), "overlaps the next or the directory")


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_a_compressed_record(tmp_path, method):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members(torch_bytes({"w": torch.zeros(64)})):
            z.writestr(name, data, compress_type=method if name.endswith("data/0") else zipfile.ZIP_STORED)
    what = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}[method]
    refused(tmp_path, buf.getvalue(), "record 'archive/data/0' is compressed", what)


def test_a_local_header_that_names_another_record(tmp_path):
    items = real_members()
    named(items, "data/0").local_name = "archive/data/1"
    refused(tmp_path, write_zip(items), "record 'archive/data/0'", "disagrees with the central directory")


def test_a_record_listed_twice(tmp_path):
    items = real_members()
    items.append(Member(named(items, "data/0").name, bytes(16)))
    refused(tmp_path, write_zip(items), "record 'archive/data/0' appears twice")


def test_zip64_sentinels_without_their_extra_field(tmp_path):
    data = write_zip(real_members(), zip64=True)
    cd = data.index(b"PK\x01\x02")
    forged = data[:cd] + data[cd:].replace(b"\x01\x00\x18\x00", b"\x09\x00\x18\x00")
    refused(tmp_path, forged, "at its zip64 sentinel, and no zip64 extra field")


def test_zip64_sentinels_without_a_zip64_end_record(tmp_path):
    data = bytearray(write_zip(real_members()))
    eocd = data.rindex(b"PK\x05\x06")
    data[eocd + 12 : eocd + 16] = b"\xff\xff\xff\xff"  # the central directory's size at its sentinel
    refused(tmp_path, bytes(data), "zip64 sentinels but the archive has no zip64 end record")


def test_a_zip64_end_record_that_disagrees(tmp_path):
    data = bytearray(write_zip(real_members(), zip64=True))
    eocd = data.rindex(b"PK\x05\x06")
    data[eocd + 10 : eocd + 12] = struct.pack("<H", 3)  # entries: 3, the zip64 end record says otherwise
    refused(tmp_path, bytes(data), "end record's entries 3 disagrees with the zip64 end record's")


@pytest.mark.parametrize(
    "forge, needle",
    [
        (dict(entries=9), "central directory truncated: entry"),
        (dict(cd_size_delta=-20), "central directory truncated: entry"),
        (dict(cd_size_delta=20), "runs into its end records"),
    ],
    ids=["more_entries", "shorter", "longer"],
)
def test_a_forged_central_directory(tmp_path, forge, needle):
    refused(tmp_path, write_zip(real_members(), **forge), needle)


@pytest.mark.parametrize("cut", [1, 22, 100])
def test_a_truncated_file(tmp_path, cut):
    refused(tmp_path, torch_bytes({"w": torch.zeros(4)})[:-cut], "not a zip archive")


def test_the_legacy_torch_save_format(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=False)
    refused(tmp_path, buf.getvalue(), "not a zip archive")


def test_an_archive_without_data_pkl(tmp_path):
    items = [m for m in real_members() if not m.name.endswith("data.pkl")]
    refused(tmp_path, write_zip(items), "not a torch.save archive", "none")


def test_a_big_endian_file(tmp_path):
    refused(tmp_path, archive(tensor_pickle(), byteorder=b"big"), "only little-endian", "byteorder")


def test_an_encrypted_record(tmp_path):
    data = bytearray(write_zip(real_members()))
    cd = data.index(b"PK\x01\x02")
    data[cd + 8] |= 1  # the first entry's flags: encrypted
    refused(tmp_path, bytes(data), "is encrypted")


# --- the pickle's tensors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, needles",
    [
        (dict(size=(8,)), ["tensor 'w'", "runs past its storage '0'"]),
        (dict(offset=3, size=(2,)), ["tensor 'w'", "bytes [12, 20) runs past its storage"]),
        (dict(size=(2, 2), stride=(1, 2)), ["tensor 'w'", "non-contiguous view (size (2, 2), stride (1, 2))"]),
        (dict(key="9"), ["storage '9'", "no record 'archive/data/9'"]),
        (dict(offset=-1), ["storage offset -1 is not a non-negative int"]),
        (dict(size=(2,), stride=(1, 1)), ["differ in length"]),
        (dict(storage="QInt8Storage"), ["global 'torch.QInt8Storage' is not allowed"]),
    ],
    ids=["past_end", "offset_past_end", "transposed", "no_record", "negative", "ranks", "quantized"],
)
def test_a_forged_tensor(tmp_path, fields, needles):
    refused(tmp_path, archive(tensor_pickle(**fields)), *needles)


def test_a_transposed_tensor_saved_by_torch(tmp_path):
    refused(tmp_path, torch_bytes({"t": torch.zeros(3, 5).t()}), "tensor 't'", "non-contiguous view")


def test_a_value_that_is_not_a_tensor(tmp_path):
    refused(tmp_path, archive(tensor_pickle(value=_int(5))), "tensor 'w'", "state dict entry is 5, not a tensor")


def test_a_state_that_is_not_a_dict(tmp_path):
    refused(tmp_path, archive(b"\x80\x02" + _int(5) + b"."), "holds int, not a state dict")


# --- globals a pickle reaches for -------------------------------------------------------------------------------


class Reaching:
    """Pickles as a call of ``func(*args)``: what a hostile checkpoint carries."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("protocol, opcode", [(2, "GLOBAL"), (4, "STACK_GLOBAL")])
@pytest.mark.parametrize("func, name", [(os.system, "posix.system"), (eval, "builtins.eval"), (exec, "builtins.exec")])
def test_a_pickle_reaching_for_a_global_runs_nothing(tmp_path, protocol, opcode, func, name):
    """``pickle.dumps`` names builtins as ``__builtin__`` below protocol 3: named as the pickle names them."""
    name = name.replace("builtins.", "__builtin__.") if protocol < 3 else name
    marker = tmp_path / "ran"
    command = f"open({str(marker)!r}, 'w')" if func is not os.system else f"touch {marker}"
    pkl = pickle.dumps({"w": Reaching(func, command)}, protocol=protocol)
    assert (b"\x93" in pkl) == (opcode == "STACK_GLOBAL")
    with pytest.raises(CheckpointError, match=f"global '{name}' is not allowed"):
        read_pickle(pkl, allowed={}, name="x.bin")
    (tmp_path / "ckpt").mkdir()
    refused(tmp_path / "ckpt", archive(pkl), f"global '{name}' is not allowed", "refused without importing it")
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [("os", "system"), ("posix", "system"), ("builtins", "eval")])
@pytest.mark.parametrize("opcode", ["GLOBAL", "STACK_GLOBAL"])
def test_a_hand_written_global_runs_nothing(tmp_path, module, name, opcode):
    marker = tmp_path / "ran"
    arg = _str(f"touch {marker}" if name == "system" else f"open({str(marker)!r}, 'w')")
    if opcode == "GLOBAL":
        reach = f"c{module}\n{name}\n".encode()
    else:
        reach = (
            b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"
        )
    pkl = b"\x80\x04" + reach + arg + b"\x85R."
    refused(tmp_path, archive(pkl), f"global '{module}.{name}' is not allowed")
    assert not marker.exists()


@pytest.mark.parametrize(
    "pkl, needle",
    [
        (b"\x80\x02(X\x04\x00\x00\x00trueios\nsystem\n.", "INST"),
        (b"\x80\x02(ctorch\nFloatStorage\no.", "INST / OBJ"),
        (b"\x80\x02\x82\x01.", "EXT1"),
        (b"\x80\x02\x83\x01\x00.", "EXT2"),
        (b"\x80\x02ctorch\nFloatStorage\n)R.", "which is not an allowed global"),
        (b"\x80\x02}}b.", "BUILD on a dict, which takes no state"),
        (b"\x80\x02Pid\n.", "PERSID"),
        (b"\x80\x02" + _str("x") + b"Q.", "no persistent_load"),
        (b"\x80\x020.", "stack underflow"),
        (b"\x80\x02K\x01K\x02.", "STOP with 2 items"),
        (b"\x80\x02K\x01", "truncated"),
        (b"\x80\x02K\x01.junk", "bytes after STOP"),
        (b"\x80\x09K\x01.", "pickle protocol 9"),
        (b"\x80\x02]K\x01a}K\x01s.", "SETITEM(S) on a list"),
        (b"\x80\x02}]K\x01s.", "unhashable"),
        (b"\x80\x02h\x05.", "memo entry 5 was never stored"),
        (b"\x80\x02\xff.", "unknown opcode"),
    ],
)
def test_opcodes_that_would_execute_or_are_malformed(pkl, needle):
    with pytest.raises(CheckpointError, match="x.bin: pickle byte") as info:
        read_pickle(pkl, allowed={("torch", "FloatStorage"): object()}, name="x.bin")
    assert needle in str(info.value) and info.value.path == "x.bin"


def test_tuples_nested_too_deep_to_hash():
    deep = b"\x80\x02}" + b")" + b"\x85" * 5000 + b"K\x01s."  # {((((…)))): 1}
    with pytest.raises(CheckpointError, match="nested deeper than 1000"):
        read_pickle(deep, allowed={}, name="x.bin")
    assert read_pickle(b"\x80\x02}" + b")" + b"\x85" * 50 + b"K\x01s.", allowed={})


# --- a load stops before it writes ------------------------------------------------------------------------------


def test_a_hostile_shard_fails_the_load_with_the_model_untouched(tmp_path):
    _, model = build("llama")
    save_bin(model, tmp_path, max_shard_bytes=6000)
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    last = tmp_path / sorted(set(index["weight_map"].values()))[-1]
    pkl = pickle.dumps({"w": Reaching(os.system, "true")}, protocol=2)
    last.write_bytes(archive(pkl))
    _, fresh = build("llama", seed=1)
    before = clone_state(fresh)
    with pytest.raises(CheckpointError, match="global 'posix.system' is not allowed") as info:
        load_hf_checkpoint(fresh, tmp_path, options=LoadOptions(progress=False))
    assert info.value.path == str(last)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_an_index_naming_a_file_outside_the_folder(tmp_path):
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "../x.bin"}}))
    with pytest.raises(CheckpointError, match="'..' component"):
        open_checkpoint(tmp_path)


def test_shards_without_their_index(tmp_path):
    _, model = build("llama")
    save_bin(model, tmp_path, max_shard_bytes=6000)
    os.remove(tmp_path / "pytorch_model.bin.index.json")
    with pytest.raises(CheckpointError, match="shard file.* and no pytorch_model.bin.index.json"):
        open_checkpoint(tmp_path)
