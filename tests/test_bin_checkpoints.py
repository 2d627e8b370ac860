"""``torch.save`` checkpoints (``pytorch_model*.bin``) as a source format: ``load_hf_checkpoint`` takes a ``.bin``
folder as it takes a safetensors one, bit-identical to ``from_pretrained`` (llama and qwen3_moe, bf16 and fp32, one
file and shards with their index), reading only the tensors' bytes (the zip's tail, local headers and pickle at
open), on 4 gloo ranks and over nginx. Hostile archives: tests/test_bin_hostile.py."""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bin_files
import bin_worker
import servers
from bin_files import Member, members, save_bin, torch_bytes, write_zip
from gloo_world import WORLD, ok, run_world
from hf_models import build, save

from loader import load_hf_checkpoint
from loader.checkpoint import DTYPES, BinCheckpoint, SafetensorsCheckpoint, open_checkpoint, read_tensor
from loader.checkpoint.pickles import PickledObject, as_object, read_pickle
from loader.options import LoadOptions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
QUIET = LoadOptions(progress=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def assert_bit_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, e in expected.items():
        a = actual[name]
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(bits(a), bits(e)), name


def tensor_bytes(state: dict) -> int:
    return sum(t.nbytes for t in state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("shards", [None, 6000], ids=["one_file", "sharded"])
def test_bin_folder_loads_like_from_pretrained(tmp_path, family, dtype, shards):
    auto, model = build(family)
    state = save_bin(model, tmp_path, dtype, max_shard_bytes=shards)
    files = sorted(n for n in os.listdir(tmp_path) if n.endswith(".bin"))
    assert (len(files) > 1) == (shards is not None), files
    reference = auto.from_pretrained(tmp_path, dtype=dtype)
    _, fresh = build(family, seed=1, dtype=dtype)
    report = load_hf_checkpoint(fresh, tmp_path, options=QUIET)
    assert_bit_equal(fresh.state_dict(), reference.state_dict())
    checkpoint = open_checkpoint(tmp_path)
    assert isinstance(checkpoint, BinCheckpoint) and len(checkpoint.files) == len(files)
    # only tensor bytes are read, each once: the plan's, all of the checkpoint's tensors
    assert report.bytes_read == report.planned_bytes == tensor_bytes(state), report
    assert not report.unexpected_keys and not report.missing_keys


def test_a_partial_load_reads_only_its_tensors(tmp_path):
    """A model of one layer of the checkpoint's two reads that layer's bytes (and the shared ones) only."""
    _, model = build("llama")
    state = save_bin(model, tmp_path)
    _, small = build("llama", seed=1, num_hidden_layers=1)
    _, expected = build("llama", seed=1, num_hidden_layers=1)
    expected.load_state_dict({k: v for k, v in state.items() if k in expected.state_dict()}, strict=False)
    report = load_hf_checkpoint(small, tmp_path, options=QUIET)
    assert_bit_equal(small.state_dict(), expected.state_dict())
    wanted = sum(v.nbytes for k, v in state.items() if k in small.state_dict())
    assert report.bytes_read == report.planned_bytes == wanted < tensor_bytes(state)
    assert any("layers.1." in k for k in report.unexpected_keys)


def test_every_path_form_opens_the_same_checkpoint(tmp_path):
    _, model = build("llama")
    save_bin(model, tmp_path / "one")
    save_bin(model, tmp_path / "sharded", max_shard_bytes=6000)
    one = open_checkpoint(tmp_path / "one")
    for path in (tmp_path / "one" / "pytorch_model.bin", tmp_path / "sharded",
                 tmp_path / "sharded" / "pytorch_model.bin.index.json"):  # fmt: skip
        other = open_checkpoint(path)
        assert isinstance(other, BinCheckpoint) and set(other) == set(one), path
        for key in one:
            assert torch.equal(bits(read_tensor(other[key])), bits(read_tensor(one[key]))), (path, key)


def test_dcp_load_reads_a_bin_folder(tmp_path):
    """``dcp.load`` with ``HFLoadPlanner`` and ``SafetensorsReader`` takes a ``.bin`` folder too."""
    import torch.distributed.checkpoint as dcp

    from loader import HFLoadPlanner, SafetensorsReader

    _, model = build("llama")
    save_bin(model, tmp_path, max_shard_bytes=6000)
    _, fresh = build("llama", seed=1)
    planner, reader = HFLoadPlanner(fresh), SafetensorsReader(str(tmp_path))
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
    report = planner.finish(reader)
    assert_bit_equal(fresh.state_dict(), model.state_dict())
    assert report.bytes_read == report.planned_bytes


def test_safetensors_wins_over_bin_in_one_folder(tmp_path):
    _, model = build("llama")
    save(model, tmp_path)
    save_bin(build("llama", seed=3)[1], tmp_path)  # other values: the load must take the safetensors ones
    assert isinstance(open_checkpoint(tmp_path), SafetensorsCheckpoint)
    _, fresh = build("llama", seed=1)
    load_hf_checkpoint(fresh, tmp_path, options=QUIET)
    assert_bit_equal(fresh.state_dict(), model.state_dict())


def test_every_dtype_and_rebuild_reads_as_torch_load(tmp_path):
    """Typed storages (``_rebuild_tensor_v2``), untyped ones with a dtype (``_rebuild_tensor_v3``: float8,
    uint16/32/64), parameters, empty and 0-d tensors, read bit for bit as ``torch.load`` reads them."""
    g = torch.Generator().manual_seed(0)
    state = {str(d): (torch.randn(3, 5, generator=g) * 4).to(d) for d in DTYPES.values() if d.is_floating_point}
    state.update({str(d): torch.randint(0, 100, (4, 2), generator=g).to(d) for d in DTYPES.values()
                  if not d.is_floating_point and not d.is_complex})  # fmt: skip
    state["complex"] = torch.randn(3, dtype=torch.complex64, generator=g)
    state["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    state["empty"], state["scalar"] = torch.zeros(0, 3), torch.tensor(7.5)
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    expected = torch.load(path)
    checkpoint = open_checkpoint(path)
    assert list(checkpoint) == list(state)
    for key, value in expected.items():
        got = read_tensor(checkpoint[key])
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(bits(got), bits(value)), key


def test_views_into_one_storage_read_their_own_bytes(tmp_path):
    """Row slices of one storage (a fused tensor saved by its parts, tied weights) are contiguous views at an
    offset: each key's one chunk is its own bytes inside the shared record."""
    fused = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    state = {"q": fused[0:4], "k": fused[4:8], "v": fused[8:12], "row": fused[5], "tied": fused, "same": fused}
    path = tmp_path / "views.bin"
    torch.save(state, path)
    checkpoint = open_checkpoint(path)
    record = checkpoint["tied"].data_start
    assert [checkpoint[k].data_start - record for k in ("q", "k", "v", "row")] == [0, 64, 128, 80]
    for key, value in torch.load(path).items():
        assert torch.equal(read_tensor(checkpoint[key]), value), key


@pytest.mark.parametrize("zip64", [False, True], ids=["zip", "zip64"])
def test_an_archive_laid_out_by_another_writer_loads(tmp_path, zip64):
    """The same records written by another zip writer (true sizes in the local headers, no data descriptors;
    zip64: every central size and offset in zip64 extra fields, a zip64 end record) load the same."""
    _, model = build("llama")
    state = save_bin(model, tmp_path / "torch")
    (tmp_path / "other").mkdir()
    shutil.copy(tmp_path / "torch" / "config.json", tmp_path / "other")
    raw = (tmp_path / "torch" / "pytorch_model.bin").read_bytes()
    (tmp_path / "other" / "pytorch_model.bin").write_bytes(bin_files.rewrite(raw, zip64=zip64))
    _, fresh = build("llama", seed=1)
    report = load_hf_checkpoint(fresh, tmp_path / "other", options=QUIET)
    _, expected = build("llama", seed=1)
    load_hf_checkpoint(expected, tmp_path / "torch", options=QUIET)
    assert_bit_equal(fresh.state_dict(), expected.state_dict())
    assert report.bytes_read == tensor_bytes(state)


def test_a_comment_after_the_directory_is_skipped(tmp_path):
    raw = write_zip([Member(n, d) for n, d in members(torch_bytes({"w": torch.ones(3)}))])
    commented = raw[:-2] + (5).to_bytes(2, "little") + b"hello"  # the end record's comment
    path = tmp_path / "c.bin"
    path.write_bytes(commented)
    assert torch.equal(read_tensor(open_checkpoint(path)["w"]), torch.ones(3))


def test_opening_reads_the_tail_headers_and_pickle_only(tmp_path):
    """Opening a 4 MiB file reads well under 1% of it: the tail, the local headers and the pickle."""
    state = {f"w{i}": torch.randn(256, 1024) for i in range(4)}
    path = tmp_path / "big.bin"
    torch.save(state, path)
    from loader.storage import LocalStore

    class Counting(LocalStore):
        read = 0

        def read_range(self, location, start, end, identity):
            Counting.read += end - start
            return super().read_range(location, start, end, identity)

    from loader.checkpoint.torchzip import read_torch_file

    read_torch_file(str(path), Counting(str(tmp_path)))
    assert 0 < Counting.read < os.path.getsize(path) / 50


# --- 4 gloo ranks ---------------------------------------------------------------------------------------------


@pytest.mark.dist
def test_four_gloo_ranks_load_a_sharded_bin_folder(tmp_path):
    """qwen3_moe's experts and attention sharded over 4 ranks from a sharded ``.bin`` folder: every rank's full
    tensors equal the checkpoint's, and each reads only its shards' bytes."""
    _, model = build("qwen3_moe")
    state = save_bin(model, tmp_path / "ckpt", max_shard_bytes=20000)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "ref.pt")
    ctx = {"store": str(tmp_path / "store"), "out": str(tmp_path), "path": str(tmp_path / "ckpt")}
    ctx["ref"] = str(tmp_path / "ref.pt")
    results = run_world(bin_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    per_rank = ok(results, "bin_sharded")
    for r, res in enumerate(per_rank):
        assert res["bad"] == [], (r, res)
        assert res["bytes_read"] == res["planned_bytes"] < tensor_bytes(state), (r, res)


# --- over nginx -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("bin_remote")
    _, model = build("llama")
    save_bin(model, root / "sharded", max_shard_bytes=6000)
    torch.save({f"w{i}": torch.randn(64, 256) for i in range(40)}, root / "many.bin")
    for url in servers.serve(servers.nginx(root)):
        yield url, root


def test_a_sharded_bin_folder_loads_over_http_like_locally(served):
    pytest.importorskip("requests")
    url, root = served
    _, template = build("llama", seed=1)
    local, remote = copy.deepcopy(template), copy.deepcopy(template)
    local_report = load_hf_checkpoint(local, root / "sharded", options=QUIET)
    logged = len(url.requests())
    report = load_hf_checkpoint(remote, f"{url}/sharded", options=QUIET)
    assert_bit_equal(remote.state_dict(), local.state_dict())
    assert report.loaded_keys == local_report.loaded_keys and report.planned_bytes == local_report.planned_bytes
    assert report.planned_bytes <= report.bytes_read
    gets = [r for r in url.requests()[logged:] if r.method == "GET" and r.path.endswith(".bin")]
    sizes = {f"/sharded/{f.name}": f.stat().st_size for f in (root / "sharded").iterdir()}
    assert gets and all(r.range for r in gets), gets  # every request of a .bin file is a range: none whole
    assert sum(r.bytes for r in gets) < 1.5 * sum(s for p, s in sizes.items() if p.endswith(".bin")), gets


def test_opening_over_http_fetches_a_small_part_of_the_file(served):
    """A 2.6 MB file of 40 tensors: its first and last 64 KiB, and each local header (one range each)."""
    pytest.importorskip("requests")
    url, root = served
    logged = len(url.requests())
    checkpoint = open_checkpoint(f"{url}/many.bin")
    assert len(checkpoint) == 40
    gets = [r for r in url.requests()[logged:] if r.method == "GET"]
    assert all(r.range for r in gets) and sum(r.bytes for r in gets) < (root / "many.bin").stat().st_size / 10, gets


def test_torch_save_to_a_buffer_and_a_file_agree(tmp_path):
    """The archive's name inside (``archive/``, ``pytorch_model/``) does not matter."""
    state = {"w": torch.randn(4, 4)}
    buf = io.BytesIO()
    torch.save(state, buf)
    (tmp_path / "a.bin").write_bytes(buf.getvalue())
    torch.save(state, tmp_path / "b.bin")
    a, b = open_checkpoint(tmp_path / "a.bin"), open_checkpoint(tmp_path / "b.bin")
    assert torch.equal(read_tensor(a["w"]), read_tensor(b["w"]))


# --- the pickle reader on its own -----------------------------------------------------------------------------


@dataclasses.dataclass
class Point:
    x: int
    label: str


@pytest.mark.parametrize("protocol", range(6))
def test_read_pickle_reads_plain_data_at_every_protocol(protocol):
    shared = [1, 2.5, None, True]
    value = {"list": shared, "again": shared, "text": "ü\n\\x", "big": -(2**70), "bytes": b"\0\xff",
             "tuple": (1, (2, 3)), "set": {1, 2}, "frozen": frozenset({3}), "nested": [[]] * 3}  # fmt: skip
    data = pickle.dumps(value, protocol=protocol)
    builtins = "__builtin__" if protocol < 3 else "builtins"
    allowed = {(builtins, "set"): set, (builtins, "frozenset"): frozenset}
    allowed |= {("_codecs", "encode"): lambda text, codec: text.encode(codec)}  # bytes below protocol 3
    got = read_pickle(data, allowed=allowed)
    assert got == value and got["list"] is got["again"]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_read_pickle_builds_records_of_allowed_classes(protocol):
    """A dataclass (``NEWOBJ`` then ``BUILD``) becomes a :class:`PickledObject` holding its state."""
    name = (Point.__module__, Point.__qualname__)
    got = read_pickle(pickle.dumps([Point(3, "a")], protocol=protocol), allowed={name: as_object(name)})
    assert isinstance(got[0], PickledObject) and got[0].name == name and got[0].state == {"x": 3, "label": "a"}
