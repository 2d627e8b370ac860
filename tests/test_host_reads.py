"""Files the ranks of one host read together (loader/execute/host_shared.py): the coverage of a rank's reads, the
decision every rank makes from every rank's post, and the reader that honours it. The decision on a real 4-rank gloo
world (one host, one copy of the files) is in tests/test_distributed.py::test_host_ranks_read_shared_files_ahead."""

from __future__ import annotations

import base64
import os
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.execute import host_shared
from loader.execute.host_shared import GRANULE, coverage, files_to_read_ahead, mates
from loader.storage.capabilities import ReadsAhead, has
from loader.storage.local import FileReader

SIZE = 40 * GRANULE + 123


def _post(host: str, files: dict[str, tuple[str, list[tuple[int, int]]]], size: int = SIZE) -> dict:
    """A post as :func:`host_shared.post` makes it: ``{path: (key, spans)}``."""
    return {
        "host": host,
        "files": {p: [k, size, host_shared._encode(coverage(spans, size))] for p, (k, spans) in files.items()},
    }


def _decide(posts: list[dict], rank: int, fraction: float) -> set[str]:
    """What a load decides for ``rank`` from every rank's post: its mates' files (as fetched aside), then
    :func:`files_to_read_ahead` (loader/load.py's ``_agree_on_reads``)."""
    ranks = mates(posts, rank)
    if rank not in ranks:
        return set()
    files = [host_shared.unpack(host_shared.pack(posts[r]["files"])) for r in ranks]
    return files_to_read_ahead(files, ranks.index(rank), fraction)


@given(st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 3 * GRANULE)), max_size=8))
def test_coverage_holds_exactly_the_granules_a_span_touches(raw):
    spans = [(a, min(SIZE, a + n)) for a, n in raw]
    bits = coverage(spans, SIZE)
    assert len(bits) == -(-SIZE // GRANULE)
    touched = {g for a, b in spans for g in range(a // GRANULE, (b - 1) // GRANULE + 1)}
    assert set(np.flatnonzero(bits).tolist()) == touched
    assert np.array_equal(host_shared._decode(host_shared._encode(bits), len(bits)), bits)


@settings(max_examples=60)
@given(st.integers(2, 8), st.data())
def test_a_file_is_read_ahead_where_two_or_more_host_ranks_cover_half_of_it(world, data):
    """Ranks on two hosts, each reading one contiguous stretch of the same file (same key): a rank reads it ahead
    exactly when at least two ranks of its own host read it and their stretches cover half its granules."""
    hosts = data.draw(st.lists(st.sampled_from("ab"), min_size=world, max_size=world))
    stretches = [data.draw(st.tuples(st.integers(0, SIZE - 1), st.integers(1, SIZE))) for _ in range(world)]
    spans = [[(a, min(SIZE, a + n))] for a, n in stretches]
    posts = [_post(h, {"/ckpt/model.safetensors": ("k", s)}) for h, s in zip(hosts, spans)]
    n = -(-SIZE // GRANULE)
    for r in range(world):
        mates = [q for q in range(world) if hosts[q] == hosts[r]]
        union = np.zeros(n, dtype=bool)
        for q in mates:
            union |= coverage(spans[q], SIZE)
        expected = len(mates) >= 2 and union.sum() >= 0.5 * n
        assert (_decide(posts, r, 0.5) == {"/ckpt/model.safetensors"}) == expected


def test_only_the_same_file_counts():
    """Another key (another file, or the same path rewritten since) or another size is another file's pages."""
    half = [(0, SIZE // 2 + GRANULE)]
    other = [(SIZE // 2, SIZE)]
    same = [_post("a", {"/x": ("k1", half)}), _post("a", {"/y": ("k1", other)})]  # one inode under two paths
    assert _decide(same, 0, 0.5) == {"/x"} and _decide(same, 1, 0.5) == {"/y"}
    rewritten = [_post("a", {"/x": ("k1", half)}), _post("a", {"/x": ("k2", other)})]
    assert _decide(rewritten, 0, 0.5) == set()
    resized = [_post("a", {"/x": ("k1", half)}), _post("a", {"/x": ("k1", other)}, size=SIZE + GRANULE)]
    assert _decide(resized, 0, 0.5) == set()
    alone = [_post("a", {"/x": ("k1", [(0, SIZE)])}), _post("a", {})]  # a rank reading all of it alone: its own rule
    assert _decide(alone, 0, 0.5) == set()


def test_the_reader_reads_shared_files_ahead_and_lists_the_files_it_advised_random(tmp_path):
    paths = []
    for name in ("a", "b"):
        p = tmp_path / name
        p.write_bytes(os.urandom(1 << 16))
        paths.append(str(p))
    with FileReader() as reader:
        reader.read_ahead([paths[0]])
        for p in paths:
            reader.will_read(p, lambda: [(0, 4096)], sparse=True)
            buf = bytearray(4096)
            reader.pread_into(p, 0, buf)
            assert bytes(buf) == open(p, "rb").read(4096)
        assert reader.sparse_files == {paths[1]}
        reader.will_read(paths[1], lambda: [(0, 4096)], sparse=False)
        assert reader.sparse_files == {paths[1]}


def test_a_direct_io_reader_neither_counts_nor_reads_ahead():
    """``O_DIRECT`` reads bypass the page cache: such a rank posts no files and is never told to read ahead."""
    from loader.storage.direct import DirectFileReader

    assert not has(DirectFileReader(), ReadsAhead) and has(FileReader(), ReadsAhead)


def test_a_host_id_names_the_kernel():
    h = host_shared.host_id()
    assert h.startswith(("boot:", "host:")) and len(h) > 5
    assert h == host_shared.host_id()


@pytest.mark.parametrize("spans", [[], [(5, 5)]])
def test_no_bytes_no_granules(spans):
    assert not coverage(spans, SIZE).any()


def test_a_ranks_files_travel_compressed_and_come_back_whole():
    """A rank's files post (what the host's other ranks fetch aside from the gather) round-trips, and the
    coverage of a tensor-parallel rank of a 5 GB file (all ones) compresses to a few dozen bytes."""
    big = 5 * (1 << 30)
    files = {"/ckpt/model-00001.safetensors": ["1:2:3:4:5", big, host_shared._encode(coverage([(0, big)], big))]}
    text = host_shared.pack(files)
    assert host_shared.unpack(text) == files
    assert len(text) < 200


@pytest.mark.parametrize(
    ("posted", "what"),
    [
        ("not base64 at all!", "is not base64"),
        (base64.b64encode(b"plain bytes, not zlib").decode(), "is not compressed with zlib"),
        (base64.b64encode(zlib.compress(b"{not json")).decode(), "is not JSON"),
        (base64.b64encode(zlib.compress(b"[1, 2]")).decode(), "is a JSON list, not an object of files"),
        (host_shared.pack({"/ckpt/a": ["k", 10]}), "gives '/ckpt/a' [\"k\", 10], not [key, size, coverage]"),
        (host_shared.pack({"/ckpt/a": ["k", -1, "00"]}), "gives '/ckpt/a' the key \"k\" and size -1"),
        (host_shared.pack({"/ckpt/a": ["k", SIZE, "00"]}), "a coverage that is not 6 bytes of hex"),
        (host_shared.pack({"/ckpt/a": ["k", SIZE, "zz" * 6]}), "gives '/ckpt/a' a coverage that is not hex"),
    ],
)
def test_a_post_that_is_not_a_file_list_names_the_rank_and_what_is_wrong(posted, what):
    """What a host's ranks fetch of a mate is checked as it is unpacked: garbage is an error naming the rank that
    posted it, what is wrong and the start of what it posted (the load agrees on it: every rank raises it, see
    tests/test_exchange_reads.py::test_a_rank_posting_garbage_as_its_host_files_fails_every_rank_naming_it)."""
    with pytest.raises(host_shared.PostError, match="rank 3 posted a list of its files that ") as caught:
        host_shared.unpack(posted, 3)
    assert what in str(caught.value) and repr(posted[:60]) in str(caught.value)
    assert isinstance(caught.value, ValueError)
