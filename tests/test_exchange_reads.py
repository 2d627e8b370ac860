"""Exchanged reads (loader/execute/exchanged.py, loader/storage/held.py): the HeldReader over a real local
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.errors import CheckpointError
from loader.storage import FileReader
from loader.storage.held import HeldFile, HeldReader
from regiontrace.executor import RunGrid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZE = 1 << 13
#: rounds of the moe checkpoint's load on 4 ranks with a 1-byte budget: one per tensor holding exchanged bytes (those
#: holding none join a neighbour's part; tests/test_exchange_plan.py checks the rule), 24 of them in the first file
ROUNDS, FIRST_FILE_ROUNDS = 45, 24


@pytest.fixture(scope="module")
def file(tmp_path_factory) -> tuple[str, bytes]:
    path = str(tmp_path_factory.mktemp("held") / "data.bin")
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    shutil.copy(path, path + ".other")  # a file with nothing held
    return path, data


class Held:
    """Held spans of a file, holding other bytes than the file's (each inverted), so a test tells them apart;
    :meth:`expected` is what a read of ``[a, b)`` must give: each byte from memory where a span holds it, else the
    file's. Span ``i`` lies in buffer ``which[i]`` (default: alternately the first and the second), the spans of a
    buffer in reverse order with gaps between them, as a rank's received and fetched spans are not."""

    def __init__(self, data: bytes, spans: list[tuple[int, int]], which: list[int] | None = None) -> None:
        self.data, self.spans = data, spans
        self.which = [i % 2 for i in range(len(spans))] if which is None else which
        self.mask = np.zeros(len(data), dtype=bool)
        for a, b in spans:
            self.mask[a:b] = True
        self.memory = np.where(self.mask, np.frombuffer(data, np.uint8) ^ 0xFF, np.frombuffer(data, np.uint8))

    def file(self) -> HeldFile:
        offsets, parts = [0] * len(self.spans), [[np.full(5, 7, np.uint8)], [np.full(3, 7, np.uint8)]]
        for i in reversed(range(len(self.spans))):
            a, b = self.spans[i]
            offsets[i] = sum(len(p) for p in parts[self.which[i]])
            parts[self.which[i]] += [self.memory[a:b], np.full(i % 3, 7, np.uint8)]
        as_array = lambda xs: np.array(xs, dtype=np.int64).reshape(-1)
        return HeldFile(
            as_array([a for a, _ in self.spans]),
            as_array([b for _, b in self.spans]),
            as_array(self.which),
            as_array(offsets),
            tuple(np.concatenate(p) for p in parts),
        )

    def expected(self, a: int, b: int) -> bytes:
        return self.memory[a:b].tobytes()

    def held_in(self, a: int, b: int) -> int:
        return int(self.mask[a:b].sum())

    def not_held(self, a: int, b: int) -> list[tuple[int, int]]:
        """The maximal parts of ``[a, b)`` no span holds, ascending (a plain reference of ``missing``)."""
        out: list[tuple[int, int]] = []
        for x in range(a, b):
            if not self.mask[x]:
                if out and out[-1][1] == x:
                    out[-1] = (out[-1][0], x + 1)
                else:
                    out.append((x, x + 1))
        return out


@st.composite
def held_spans(draw) -> list[tuple[int, int]]:
    """Ascending, disjoint spans, some touching (as a rank's parcels cut at share bounds are)."""
    out, at = [], draw(st.integers(0, 300))
    for _ in range(draw(st.integers(0, 8))):
        n = draw(st.integers(1, 400))
        if at + n > SIZE:
            break
        out.append((at, at + n))
        at += n + draw(st.sampled_from([0, 0, 1, 7, 300]))
    return out


reads = st.tuples(st.integers(0, SIZE - 1), st.integers(0, 1500)).map(lambda r: (r[0], min(SIZE, r[0] + r[1])))
HELD = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HELD
@given(held_spans(), st.lists(reads, min_size=1, max_size=4))
def test_each_byte_read_comes_from_memory_where_held_else_from_the_file(file, spans, ranges):
    path, data = file
    held = Held(data, spans)
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held.file()})
        for a, b in ranges:
            served, fetched = reader.served, inner.bytes_read
            out = bytearray(b - a)
            reader.pread_into(path, a, out)
            assert bytes(out) == held.expected(a, b), (a, b)
            assert reader.served - served == held.held_in(a, b)  # from memory
            assert inner.bytes_read - fetched == (b - a) - held.held_in(a, b)  # the rest from the file
        assert (reader.bytes_read, reader.reads) == (inner.bytes_read, inner.reads)  # counts are the inner's


@HELD
@given(held_spans(), reads, st.lists(st.integers(0, 300), min_size=1, max_size=5))
def test_consecutive_buffers_each_byte_from_where_it_is(file, spans, start, sizes):
    path, data = file
    held = Held(data, spans)
    a = start[0]
    sizes = [min(n, SIZE - a - sum(sizes[:k])) for k, n in enumerate(sizes)]
    sizes = [max(n, 0) for n in sizes]
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held.file()})
        outs = [memoryview(bytearray(n)) for n in sizes]
        reader.pread_consecutive(path, a, outs)
        b = a + sum(sizes)
        assert b"".join(bytes(o) for o in outs) == held.expected(a, b)
        assert (reader.served, inner.bytes_read) == (held.held_in(a, b), (b - a) - held.held_in(a, b))


@HELD
@given(held_spans(), st.integers(0, 2000), st.integers(1, 40), st.integers(1, 12), st.integers(0, 100))
def test_runs_each_byte_from_where_it_is(file, spans, first, length, count, gap):
    path, data = file
    held = Held(data, spans)
    grid = RunGrid(first, length, ((count, length + gap),))
    runs = [(int(s), int(s) + length) for s in grid.starts()]
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held.file()})
        out = bytearray(grid.end - first)
        reader.read_runs(path, grid, memoryview(out), first, wanted=count * length)
        assert [bytes(out[a - first : b - first]) for a, b in runs] == [held.expected(a, b) for a, b in runs]
        in_memory = sum(held.held_in(a, b) for a, b in runs)
        assert (reader.served, inner.bytes_read) == (in_memory, count * length - in_memory)


@st.composite
def runs_and_spans(draw) -> tuple[RunGrid, list[tuple[int, int]], list[int]]:
    """A column shard's runs (one per row) and spans around them, each run drawn: inside a span (the run itself
    or more, up to the gaps' middles), across two touching spans, partly held (at either end), or not held; each
    span in either buffer."""
    length, gap = draw(st.integers(1, 64)), draw(st.integers(0, 40))
    count = draw(st.integers(1, 40))
    first = draw(st.integers(0, SIZE - count * (length + gap) - 1))
    grid = RunGrid(first, length, ((count, length + gap),))
    spans: list[tuple[int, int]] = []
    for s in grid.starts().tolist():
        kind = draw(st.sampled_from(["inside", "inside", "wider", "across", "head", "tail", "none"]))
        cut = draw(st.integers(1, length - 1)) if length > 1 else 0
        if kind == "inside" or (kind != "none" and not cut):
            spans.append((s, s + length))
        elif kind == "wider":
            spans.append((s - min(gap // 2, s - (spans[-1][1] if spans else 0)), s + length + gap // 2))
        elif kind == "across":
            spans += [(s, s + cut), (s + cut, s + length)]
        elif kind == "head":
            spans.append((s, s + cut))
        elif kind == "tail":
            spans.append((s + cut, s + length))
    which = [draw(st.integers(0, 1)) for _ in spans]
    return grid, spans, which


@HELD
@given(runs_and_spans())
def test_runs_inside_spans_copied_at_once_and_the_others_byte_by_byte_agree_with_a_plain_reading(file, drawn):
    path, data = file
    grid, spans, which = drawn
    held = Held(data, spans, which)
    runs = [(s, s + grid.length) for s in grid.starts().tolist()]
    with FileReader() as inner:
        reader = HeldReader(inner, {path: held.file()})
        out = bytearray(b"\x5a" * (grid.end - grid.first))
        reader.read_runs(path, grid, memoryview(out), grid.first, wanted=grid.count * grid.length)
        assert [bytes(out[a - grid.first : b - grid.first]) for a, b in runs] == [held.expected(a, b) for a, b in runs]
        in_memory = sum(held.held_in(a, b) for a, b in runs)
        assert (reader.served, inner.bytes_read) == (in_memory, grid.count * grid.length - in_memory)
        if not in_memory:  # nothing held: the inner reader's own read_runs
            assert inner.reads == 1


@HELD
@given(
    st.one_of(held_spans().map(lambda p: (p, [i % 2 for i in range(len(p))])), runs_and_spans().map(lambda d: d[1:])),
    st.lists(st.one_of(reads, st.integers(0, 20).map(lambda k: (k, -1))), max_size=12),
)
def test_will_read_hints_exactly_the_bytes_not_held_in_order(file, drawn, wanted):
    """Ranges inside one span dropped at once, the others cut around held bytes: as a plain reading of the mask.
    ``(k, -1)`` stands for the ``k``-th span itself (or a byte inside it)."""
    path, data = file
    spans, which = drawn
    held = Held(data, spans, which)
    ranges = [r if r[1] >= 0 else spans[r[0]] if r[0] < len(spans) else (r[0], r[0]) for r in wanted]
    with HintedFileReader() as inner:
        HeldReader(inner, {path: held.file()}).will_read(path, lambda: ranges, sparse=True)
        assert inner.hints == [(path, [m for a, b in ranges for m in held.not_held(a, b)])]


def test_a_file_with_nothing_held_is_read_by_the_inner_reader_alone(file):
    path, data = file
    grid = RunGrid(1000, 16, ((8, 64),))
    with FileReader() as inner:
        reader = HeldReader(inner, {path: Held(data, [(0, 4096)]).file()})
        out = bytearray(grid.end - 1000)
        reader.read_runs(path + ".other", grid, memoryview(out), 1000, wanted=8 * 16)
        starts = [int(s) for s in grid.starts()]
        assert [bytes(out[s - 1000 : s - 984]) for s in starts] == [data[s : s + 16] for s in starts]
        assert (reader.served, inner.bytes_read, inner.reads) == (0, 128, 1)  # one span: the inner's own read_runs


def test_a_read_past_the_files_end_raises_naming_it_even_from_held_bytes(file):
    path, data = file
    with FileReader() as inner:
        reader = HeldReader(inner, {path: Held(data, [(SIZE - 100, SIZE)]).file()})
        with pytest.raises(CheckpointError, match="end of file") as e:
            reader.pread_into(path, SIZE - 50, bytearray(100))  # held to the end, then past the file
        assert e.value.path == path


class HintedFileReader(FileReader):
    """A real FileReader that keeps the ranges each ``will_read`` hint names (a remote reader fetches them)."""

    def __init__(self) -> None:
        super().__init__()
        self.hints: list[tuple[str, list[tuple[int, int]]]] = []

    def will_read(self, file, ranges, *, sparse):
        self.hints.append((file, list(ranges())))
        super().will_read(file, ranges, sparse=sparse)


def test_will_read_passes_on_only_the_bytes_not_held(file):
    path, data = file
    held = Held(data, [(1000, 1100), (1100, 1200), (5000, 5064)])
    with HintedFileReader() as inner:
        reader = HeldReader(inner, {path: held.file()})
        wanted = [(1000, 1100), (1150, 1300), (2000, 2100), (4990, 5070), (6000, 6001)]
        reader.will_read(path, lambda: wanted, sparse=True)
        reader.will_read(path + ".other", lambda: wanted, sparse=True)
        not_held = [(1200, 1300), (2000, 2100), (4990, 5000), (5064, 5070), (6000, 6001)]
        assert inner.hints == [(path, not_held), (path + ".other", wanted)]


def test_closing_drops_the_held_bytes_not_the_inner_reader(file):
    path, data = file
    with FileReader() as inner:
        reader = HeldReader(inner, {path: Held(data, [(1000, 1100)]).file()})
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
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2),
        **dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2),
        **dict(vocab_size=70, tie_word_embeddings=False),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ctx["moe"] = str(root / "moe")
    model.save_pretrained(ctx["moe"], max_shard_size="40KB")  # two files: two rounds when one file is a round
    shards = sorted(f for f in os.listdir(ctx["moe"]) if f.endswith(".safetensors"))
    assert len(shards) == 2, shards
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "moe_ref.pt")
    ctx["moe_ref"] = str(root / "moe_ref.pt")
    ctx["changing"], ctx["second_shard"] = str(root / "changing"), shards[1]  # rewritten by one scenario
    shutil.copytree(ctx["moe"], ctx["changing"])
    return run_world(exchange_worker.__file__, root, str(root), ctx, expected_codes=[0, 0, -signal.SIGKILL, 0])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["moe_tp4", "moe_ep_tp_2x2", "moe_dcp_tp4", "moe_rounds_tp4"])
def test_exchanged_local_loads_equal_the_loads_without(results, name):
    from gloo_world import ok

    for r, res in enumerate(ok(results, name)):
        # both files in one round, or a round per tensor holding exchanged bytes: the files cut in parts
        assert res["exchanges"] == (ROUNDS if "rounds" in name else 1), (r, res)
        assert res["fetched_files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        assert res["unequal"] == [] and res["bad"] == [], (r, res)
        # what a rank did not fetch itself, a peer fetched and sent it; each fetches about its shard
        assert res["planned_bytes"] <= res["bytes_read"] + res["bytes_exchanged"], (r, res)
        assert res["bytes_read"] <= 1.05 * res["shard_bytes"], (r, res)
        if "tp4" in name:  # column shards (o_proj, the experts' down_proj): fetched in shares and exchanged
            assert res["bytes_exchanged"] > 0, (r, res)


@pytest.mark.dist
def test_exchanged_reads_of_every_layout_and_conversion(results):
    from gloo_world import ok

    per_rank = ok(results, "layout_tp4")
    for r, res in enumerate(per_rank):
        assert res["unequal"] == [] and res["bad"] == [], (r, res)
    assert sum(res["bytes_exchanged"] for res in per_rank) > 0


@pytest.mark.dist
def test_a_file_one_rank_knows_by_another_identity_is_not_exchanged_and_fails_every_rank(results):
    from gloo_world import ok

    for r, res in enumerate(ok(results, "changed_on_one_rank")):
        assert res["type"] == "CheckpointError", (r, res)
        assert res["path"].endswith(os.path.join("changing", "model-00002-of-00002.safetensors")), (r, res)
        assert "changed underneath" in res["message"] and "failed on rank 2" in res["message"], (r, res)
        # the first file was fetched, exchanged and written; the second (two identities) not fetched for exchange
        assert res["fetched_files"] == ["model-00001-of-00002.safetensors"], (r, res)
        assert res["fetched"] == res["exchanged"] == FIRST_FILE_ROUNDS, (r, res)
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
def test_ranks_disagreeing_on_exchanged_reads_fail_not_hang(results):
    """The same ValueError on every rank, naming each rank's setting, before anything is read."""
    from gloo_world import ok

    for r, res in enumerate(ok(results, "ranks_disagree")):
        assert res["type"] == "ValueError" and "disagree on exchange_reads" in res["message"], (r, res)
        assert "rank 0: True" in res["message"] and "rank 3: False" in res["message"], (r, res)
        assert res["unchanged"], f"rank {r} was not restored"


@pytest.mark.dist
def test_bytes_altered_after_their_fetch_fail_their_checksum_on_every_rank(results):
    """Rank 2's sent bytes altered after their checksum was computed, the real all_to_all run: the peer that received
    them finds the mismatch, and every rank raises the CheckpointError naming the file and rank 2, rolled back."""
    from gloo_world import ok

    per_rank = ok(results, "altered_in_transit")
    assert len(per_rank[2]["altered"]) == 1, per_rank[2]  # rank 2 sent altered bytes to one peer
    receiver = per_rank[2]["altered"][0]
    for r, res in enumerate(per_rank):
        assert res["type"] == "CheckpointError", (r, res)
        assert res["path"].endswith("layout.safetensors"), (r, res)
        assert "bytes rank 2 sent for exchanged reads fail their checksum" in res["message"], (r, res)
        assert f"failed on rank {receiver}" in res["message"], (r, res)
        assert res["unchanged"], f"rank {r} was not restored"


@pytest.mark.dist
def test_a_rank_posting_garbage_as_its_host_files_fails_every_rank_naming_it(results):
    """Rank 2 posts garbage for its host's ranks: every rank raises a ValueError naming rank 2, what is wrong and the
    start of what it posted (not base64's bare ``Incorrect padding``), before anything is read."""
    from gloo_world import ok

    for r, res in enumerate(ok(results, "garbage_host_post")):
        assert res["type"] in ("PostError", "ValueError"), (r, res)
        assert "rank 2 posted a list of its files that is not base64" in res["message"], (r, res)
        assert "'not base64 at all!'" in res["message"], (r, res)
        assert res["unchanged"], f"rank {r} was not restored"


@pytest.mark.dist
def test_a_rank_hanging_at_the_exchange_fails_every_rank_within_the_timeout(results):
    from gloo_world import ok

    per_rank = ok(results, "hangs_at_the_exchange")
    for r, res in enumerate(per_rank):
        assert res["type"] == "PeerFailure" and res["stage"] == "reading", (r, res)
        assert res["unchanged"], f"rank {r} was not restored"
    for r in (0, 1, 3):  # the others stopped waiting in the all_to_all, then named the rank that never came
        assert per_rank[r]["reason"] == "timeout" and tuple(per_rank[r]["ranks"]) == (2,), per_rank[r]
        assert "rank(s) 2 did not finish" in per_rank[r]["message"], per_rank[r]


@pytest.mark.dist
def test_a_rank_dying_at_the_exchange_fails_the_others(results):
    assert "dies_at_the_exchange" not in results[2]  # killed before it could save
    for r in (0, 1, 3):
        res = results[r]["dies_at_the_exchange"]
        assert res["ok"], res
        assert res["type"] == "PeerFailure" and res["stage"] == "reading", (r, res)
        assert res["unchanged"], f"rank {r} was not restored"
