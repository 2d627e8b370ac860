"""Exchanged reads (loader/distributed/exchange_reads.py, loader/storage/held.py): the HeldReader over a real local
file and a real FileReader, then a real 4-rank gloo world (started once, shared by the distributed tests here)
loading local files with ``exchange_reads=True``: equal to the loads without it, and failing on every rank when a
rank's fetch fails, a rank's later read fails, or a rank dies at the exchange. The plan itself:
tests/test_exchange_plan.py."""

from __future__ import annotations

import os
import shutil
import signal
import sys

import numpy as np
import pytest
import torch

from loader.storage import FileReader
from loader.storage.held import HeldFile, HeldReader
from regiontrace import RunGrid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZE = 1 << 16
#: held pieces: two touching ones, one alone
PIECES = [(1000, 1100), (1100, 1200), (5000, 5064)]


@pytest.fixture
def file(tmp_path) -> tuple[str, bytes]:
    path = str(tmp_path / "data.bin")
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def held_bytes(data: bytes, a: int, b: int) -> bytes:
    """What the held pieces hold at ``[a, b)``: not the file's bytes (each inverted), so a test tells them apart."""
    return bytes(x ^ 0xFF for x in data[a:b])


def held_file(data: bytes, pieces=PIECES) -> HeldFile:
    views = [memoryview(bytearray(held_bytes(data, a, b))) for a, b in pieces]
    return HeldFile([a for a, _ in pieces], [b for _, b in pieces], views)


def test_held_bytes_come_from_memory_the_others_from_the_file(file):
    path, data = file
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held_file(data)})
        out = bytearray(150)
        reader.pread_into(path, 1020, out)  # across the two touching pieces
        assert bytes(out) == held_bytes(data, 1020, 1170)
        assert (reader.served, inner.bytes_read, inner.reads) == (150, 0, 0)
        out = bytearray(100)
        reader.pread_into(path, 2000, out)  # not held: the file's bytes, through the inner reader
        assert bytes(out) == data[2000:2100]
        assert (reader.served, inner.bytes_read, inner.reads) == (150, 100, 1)
        assert (reader.bytes_read, reader.reads) == (inner.bytes_read, inner.reads)  # counts are the inner's
        out = bytearray(20)
        reader.pread_into(path, 990, out)  # starts before the held bytes: read whole from the file
        assert bytes(out) == data[990:1010]
        assert reader.served == 150


def test_a_read_starting_in_held_bytes_and_running_past_them_raises(file):
    path, data = file
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held_file(data)})
        for offset, n in [(1150, 100), (5000, 65), (1199, 2)]:
            with pytest.raises(RuntimeError, match="not all held") as e:
                reader.pread_into(path, offset, bytearray(n))
            assert path in str(e.value)
        assert inner.bytes_read == 0  # no short copy completed from the file either


def test_consecutive_buffers_each_from_where_its_bytes_are(file):
    path, data = file
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held_file(data)})
        outs = [memoryview(bytearray(n)) for n in (50, 100, 0, 50)]  # [950, 1000) in the file, then held
        reader.pread_consecutive(path, 950, outs)
        assert [bytes(o) for o in outs] == [
            data[950:1000],
            held_bytes(data, 1000, 1100),
            b"",
            held_bytes(data, 1100, 1150),
        ]
        assert (reader.served, inner.bytes_read) == (150, 50)
        outs = [memoryview(bytearray(n)) for n in (30, 30)]  # none held: one consecutive read of the file
        reader.pread_consecutive(path, 3000, outs)
        assert b"".join(bytes(o) for o in outs) == data[3000:3060]
        assert (inner.bytes_read, inner.reads) == (110, 2)


def test_runs_some_held_some_read_from_the_file(file):
    path, data = file
    grid = RunGrid(1000, 16, ((8, 64),))  # runs of 16 bytes every 64 from byte 1000
    runs = [(int(a), int(a) + 16) for a in grid.starts()]
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held_file(data, runs[:4])})
        out = bytearray(grid.end - 1000)
        reader.read_runs(path, grid, memoryview(out), 1000, wanted=8 * 16)
        got = [bytes(out[a - 1000 : b - 1000]) for a, b in runs]
        assert got == [held_bytes(data, a, b) for a, b in runs[:4]] + [data[a:b] for a, b in runs[4:]]
        assert (reader.served, inner.bytes_read) == (64, 64)
        other = path + ".copy"  # a file with nothing held: the inner reader's own read_runs
        shutil.copy(path, other)
        out = bytearray(grid.end - 1000)
        reader.read_runs(other, grid, memoryview(out), 1000, wanted=8 * 16)
        assert [bytes(out[a - 1000 : b - 1000]) for a, b in runs] == [data[a:b] for a, b in runs]
        assert (reader.served, inner.bytes_read) == (64, 64 + 128)


class HintedFileReader(FileReader):
    """A real FileReader that keeps the ranges each ``will_read`` hint names (a remote reader fetches them)."""

    def __init__(self) -> None:
        super().__init__()
        self.hints: list[tuple[str, list[tuple[int, int]]]] = []

    def will_read(self, file, ranges, *, sparse):
        self.hints.append((file, list(ranges())))
        super().will_read(file, ranges, sparse=sparse)


def test_will_read_passes_on_only_the_ranges_not_held(file):
    path, data = file
    shutil.copy(path, path + ".other")  # a file with nothing held
    with HintedFileReader() as inner:
        reader = HeldReader(inner, {path: held_file(data)})
        wanted = [(1000, 1100), (1100, 1200), (2000, 2100), (5000, 5064), (6000, 6001)]
        reader.will_read(path, lambda: wanted, sparse=True)
        reader.will_read(path + ".other", lambda: wanted, sparse=True)
        assert inner.hints == [(path, [(2000, 2100), (6000, 6001)]), (path + ".other", wanted)]


def test_closing_drops_the_held_bytes_not_the_inner_reader(file):
    path, data = file
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held_file(data)})
        with reader:
            pass
        out = bytearray(100)
        reader.pread_into(path, 1000, out)  # nothing held any more: the file's bytes
        assert bytes(out) == data[1000:1100] and reader.served == 0


# -- a 4-rank gloo world ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import dist_models as dm
    import exchange_worker
    import transformers
    from gloo_world import run_world

    root = tmp_path_factory.mktemp("exchange")
    ctx = {"store": str(root / "store"), "out": str(root), "layout": str(root / "layout.safetensors")}
    torch.save(dm.expected_state(dm.write_checkpoint(ctx["layout"])), root / "layout_ref.pt")
    ctx["layout_ref"] = str(root / "layout_ref.pt")
    ctx["changing"] = str(root / "changing" / "layout.safetensors")  # rewritten by one scenario
    os.makedirs(root / "changing")
    shutil.copy(ctx["layout"], ctx["changing"])
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2),
        **dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2),
        **dict(vocab_size=70, tie_word_embeddings=False),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ctx["moe"] = str(root / "moe")
    model.save_pretrained(ctx["moe"])
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "moe_ref.pt")
    ctx["moe_ref"] = str(root / "moe_ref.pt")
    return run_world(exchange_worker.__file__, root, str(root), ctx, expected_codes=[0, 0, -signal.SIGKILL, 0])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["moe_tp4", "moe_ep_tp_2x2", "moe_dcp_tp4"])
def test_exchanged_local_loads_equal_the_loads_without(results, name):
    from gloo_world import ok

    for r, res in enumerate(ok(results, name)):
        assert res["unequal"] == [] and res["bad"] == [], (r, res)
        # what a rank did not fetch itself, a peer fetched and sent it; each fetches about its shard
        assert res["planned_bytes"] <= res["bytes_read"] + res["bytes_exchanged"], (r, res)
        assert res["bytes_read"] <= 1.05 * res["shard_bytes"], (r, res)
        if "tp4" in name:  # column shards (o_proj, the experts' down_proj): fetched in chunks and exchanged
            assert res["bytes_exchanged"] > 0, (r, res)


@pytest.mark.dist
def test_exchanged_reads_of_every_layout_and_conversion(results):
    from gloo_world import ok

    per_rank = ok(results, "layout_tp4")
    for r, res in enumerate(per_rank):
        assert res["unequal"] == [] and res["bad"] == [], (r, res)
    assert sum(res["bytes_exchanged"] for res in per_rank) > 0


@pytest.mark.dist
def test_a_file_changed_under_one_ranks_fetch_fails_every_rank(results):
    from gloo_world import ok

    for r, res in enumerate(ok(results, "changed_on_one_rank")):
        assert res["type"] == "CheckpointError", (r, res)
        assert res["path"].endswith(os.path.join("changing", "layout.safetensors")), (r, res)
        assert "changed underneath" in res["message"] and "rank 2" in res["message"], (r, res)
        assert res["unchanged"], f"rank {r} was not restored"


@pytest.mark.dist
def test_a_failure_after_the_exchange_rolls_back_every_rank(results):
    from gloo_world import ok

    per_rank = ok(results, "fails_after_exchange")
    for r, res in enumerate(per_rank):
        assert res["type"] == "RuntimeError", (r, res)
        assert "failed on rank 2" in res["message"] and "breaks on rank 2" in res["message"], (r, res)
        assert res["unchanged"], f"rank {r} was not restored"
    assert per_rank[2]["written"] == [True], per_rank[2]  # the exchanged column shards had been written


@pytest.mark.dist
def test_a_rank_dying_at_the_exchange_fails_the_others(results):
    assert "dies_at_the_exchange" not in results[2]  # killed before it could save
    for r in (0, 1, 3):
        res = results[r]["dies_at_the_exchange"]
        assert res["ok"], res
        assert res["type"] == "PeerFailure" and res["stage"] == "reading", (r, res)
        assert res["unchanged"], f"rank {r} was not restored"
