"""The protocol-independent half of remote reading: planning requests, fetching them, the remote reader and store.

The backend of the first tests is a real one over local files (``os.pread`` on a real file, an identity from its
``stat``, every answer checked as the HTTP and S3 backends check theirs), with failures switched on per call: transient
ones (retried), permanent ones (a ``CheckpointError``), an object replaced mid-read, a request that blocks until
released. The last tests read through the real backends (tests/test_remote_backends.py tests them alone) from
real servers on 127.0.0.1: a column shard over nginx and moto's S3, and the fault server's faults as the reader
meets them (retried, refused, cancelling what was pending).
"""

from __future__ import annotations

import os
import random
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.errors import CheckpointError, CheckpointNotFoundError
from loader.options import RemoteOptions, RequestCosts, StorageOptions
from loader.storage import ObjectIdentity, RangeReader
from loader.storage.remote import RemoteReader, RemoteStore, Transient, remote_store
from loader.storage.remote.reader import plan as plan_for
from loader.storage.remote.requests_plan import MAX_OVERREAD, join_limit, merge_ranges, plan_requests
from regiontrace.executor import RunGrid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers

URL = "test://bucket/ckpt"


class FileBackend:
    """A :class:`~loader.storage.remote.Backend` over the files of a local folder: ``URL/name`` is ``folder/name``.

    Attributes:
        calls: Every ``get``'s ranges, in the order they started.
        transient: Calls to fail with :class:`Transient` before answering (counted down).
        fail_at: Offsets whose request (the one whose first range starts there) raises a ``CheckpointError``.
        gate: When set to an Event, the other requests wait for it.
    """

    def __init__(self, folder: str, *, multi_range: bool = False) -> None:
        self.folder, self.multi_range = folder, multi_range
        self.calls: list[list[tuple[int, int]]] = []
        self.transient = 0
        self.fail_at: set[int] = set()
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def path(self, location: str) -> str:
        assert location.startswith(URL + "/"), location
        return os.path.join(self.folder, location[len(URL) + 1 :])

    def stat(self, location: str) -> ObjectIdentity | None:
        try:
            st = os.stat(self.path(location))
        except FileNotFoundError:
            return None
        return ObjectIdentity(st.st_size, f'"{st.st_mtime_ns:x}-{st.st_ino:x}"')

    def get(self, location: str, ranges, identity: ObjectIdentity) -> list[bytes]:
        assert ranges and (len(ranges) == 1 or self.multi_range), ranges
        assert all(0 <= a < b for a, b in ranges) and all(b <= a for (_, b), (a, _) in zip(ranges, ranges[1:]))
        with self._lock:
            self.calls.append(list(ranges))
            transient = self.transient > 0
            self.transient -= transient
        if self.gate is not None and ranges[0][0] not in self.fail_at:
            self.gate.wait(30)
        if transient:
            raise Transient(f"{location}: HTTP 503")
        if ranges[0][0] in self.fail_at:
            raise CheckpointError(f"{location}: access refused (HTTP 403)", path=location)
        now = self.stat(location)
        if now != identity:
            raise CheckpointError(f"{location}: the object changed ({now} != {identity})", path=location)
        fd = os.open(self.path(location), os.O_RDONLY)
        try:
            return [os.pread(fd, b - a, a) for a, b in ranges]
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


@pytest.fixture
def blob(tmp_path):
    """A 4 MiB object of random bytes: ``(location, its bytes, the folder)``."""
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "model.safetensors").write_bytes(data)
    return f"{URL}/model.safetensors", data, str(tmp_path)


def _reader(
    folder: str, multi_range: bool = False, costs: RequestCosts | None = None, **remote
) -> tuple[RemoteReader, FileBackend]:
    backend = FileBackend(folder, multi_range=multi_range)
    opts = RemoteOptions(**{"backoff": 0.0, **remote}, costs=costs or RequestCosts())
    return RemoteReader(backend, opts), backend


def _column_shard(rows: int, row_bytes: int, shard_bytes: int, rank: int = 1) -> list[tuple[int, int]]:
    """A row-parallel weight's shard: ``shard_bytes`` of every ``row_bytes`` row, at the rank's column."""
    return [(r * row_bytes + rank * shard_bytes, r * row_bytes + (rank + 1) * shard_bytes) for r in range(rows)]


# -- planning ----------------------------------------------------------------------------------------------------

ranges_st = st.lists(st.tuples(st.integers(0, 1 << 18), st.integers(0, 1 << 16)), max_size=60).map(
    lambda xs: [(a, a + n) for a, n in xs]
)


def _counts(ranges, size: int = (1 << 18) + (1 << 16)) -> np.ndarray:
    """How many of ``ranges`` hold each byte."""
    delta = np.zeros(size + 1, dtype=np.int64)
    for a, b in ranges:
        delta[a] += 1
        delta[b] -= 1
    return np.cumsum(delta)[:-1]


@settings(max_examples=100, deadline=None)
@given(
    ranges=ranges_st,
    gap=st.integers(0, 1 << 18),
    max_bytes=st.integers(1 << 8, 1 << 17),
    multi=st.booleans(),
    max_ranges=st.integers(1, 8),
)
def test_plan_covers_every_wanted_byte_once_within_the_limits(ranges, gap, max_bytes, multi, max_ranges):
    plan = plan_requests(ranges, gap_bytes=gap, max_request_bytes=max_bytes, multi_range=multi, max_ranges=max_ranges)
    spans = [s for r in plan for s in r.spans]
    wanted = _counts(ranges) > 0
    # ascending, disjoint spans whose wanted ranges hold every wanted byte once, and nothing else
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
    assert (_counts(w for s in spans for w in s.wanted) == wanted).all()
    for s in spans:
        assert s.wanted[0][0] == s.start and s.wanted[-1][1] == s.end
        assert all(a < b <= c for (a, b), (c, _) in zip(s.wanted, s.wanted[1:]))
        assert s.nbytes <= max_bytes
        gaps = [c - b for (_, b), (c, _) in zip(s.wanted, s.wanted[1:])]
        assert all(g <= join_limit(gap, multi, max_ranges) for g in gaps)
    for r in plan:
        assert len(r.spans) <= (max_ranges if multi else 1)
        assert r.nbytes <= max_bytes
    fetched = sum(r.nbytes for r in plan)
    assert fetched <= (1 + MAX_OVERREAD) * wanted.sum()


def test_merge_ranges_merges_overlapping_and_touching_and_refuses_bad_ones():
    assert merge_ranges([(5, 9), (0, 3), (3, 4), (8, 12), (20, 20)]).tolist() == [[0, 4], [5, 12]]
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        merge_ranges([(0, 1), (4, 2)])


@pytest.mark.parametrize(("rows", "row_bytes", "shard_bytes"), [(1024, 8 << 10, 2 << 10), (512, 56 << 10, 7 << 10)])
def test_a_column_shard_reads_no_gap_with_the_defaults(rows, row_bytes, shard_bytes):
    """A row-parallel shard (a quarter, an eighth of each row): its gaps are under ``gap_bytes`` yet not read:
    bytes fetched = bytes wanted; 64 rows a request over multi-range HTTP, a request per row on S3."""
    o = RequestCosts()
    ranges = _column_shard(rows, row_bytes, shard_bytes)
    assert row_bytes - shard_bytes < o.gap_bytes  # a fixed gap threshold would read every gap
    for multi, count in ((True, -(-rows // o.max_ranges)), (False, rows)):
        plan = plan_requests(
            ranges, gap_bytes=o.gap_bytes, max_request_bytes=o.max_request_bytes, multi_range=multi, max_ranges=64
        )
        assert sum(r.nbytes for r in plan) == rows * shard_bytes
        assert len(plan) == count


def test_small_gaps_are_read_through_and_huge_ranges_split():
    o = RequestCosts()
    kw = {"gap_bytes": o.gap_bytes, "max_request_bytes": o.max_request_bytes, "multi_range": False, "max_ranges": 64}
    tensors = [(i * ((1 << 20) + 8), i * ((1 << 20) + 8) + (1 << 20)) for i in range(32)]  # 8 bytes between
    plan = plan_requests(tensors, **kw)
    assert len(plan) == 1 and plan[0].nbytes == 32 * (1 << 20) + 31 * 8
    plan = plan_requests([(0, 200 << 20)], **kw)
    assert [r.nbytes for r in plan] == [50 << 20] * 4


# -- the reader ----------------------------------------------------------------------------------------------------


def test_remote_reader_is_a_range_reader(blob):
    reader, _ = _reader(blob[2])
    assert isinstance(reader, RangeReader)


@pytest.mark.parametrize("multi", [False, True])
def test_planned_reads_are_served_from_the_fetched_spans_exactly(blob, multi):
    location, data, folder = blob
    reader, backend = _reader(folder, multi, costs=RequestCosts(max_ranges=4, max_request_bytes=64 << 10))
    ranges = _column_shard(128, 16 << 10, 2 << 10) + [(3 << 20, (3 << 20) + 300_000)]
    with reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        for a, b in ranges:
            out = bytearray(b - a)
            reader.pread_into(location, a, out)
            assert out == data[a:b]
        reader.verify(location)
        assert reader._window.held == 0  # every fetched span freed as its bytes were served
    plan = plan_for(backend, reader.options, ranges)
    assert reader.reads == len(backend.calls) == len(plan)
    assert reader.bytes_read == sum(r.nbytes for r in plan) == sum(b - a for a, b in ranges)
    assert reader.gap_bytes == 0


def test_out_of_order_overlapping_and_unplanned_reads(blob):
    location, data, folder = blob
    rng = random.Random(1)
    reader, backend = _reader(
        folder, True, costs=RequestCosts(max_ranges=8, max_request_bytes=32 << 10), fetch_ahead_bytes=256 << 10
    )
    ranges = [(a, a + rng.randrange(1, 5000)) for a in sorted(rng.sample(range(0, 4 << 20, 8192), 300))]
    reads = ranges + [(a + 10, b + 3000) for a, b in ranges[::7]] + [(0, 100), (len(data) - 50, len(data))]
    rng.shuffle(reads)
    with reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        for a, b in reads:
            out = bytearray(b - a)
            reader.pread_into(location, a, out)
            assert out == data[a:b], (a, b)
    assert reader.peak_bytes <= 256 << 10


def test_consecutive_reads_and_runs_across_fetched_spans(blob):
    location, data, folder = blob
    reader, backend = _reader(folder, costs=RequestCosts(max_request_bytes=10_000))
    with reader:
        reader.will_read(location, lambda: [(1000, 101_000)], sparse=False)
        outs = [bytearray(n) for n in (1, 9_999, 0, 50_000, 40_000)]
        reader.pread_consecutive(location, 1000, [memoryview(o) for o in outs])
        assert b"".join(outs) == data[1000:101_000]
        # runs: 100 bytes every 4096 from 200_000; gaps are not fetched, the runs land at their offsets
        runs = RunGrid(200_000, 100, ((64, 4096),))
        ranges = [(int(s), int(s) + 100) for s in runs.starts()]
        before = reader.bytes_read
        reader.will_read(location, lambda: ranges, sparse=True)
        out = bytearray(4096 * 63 + 100)
        reader.read_runs(location, runs, memoryview(out), 200_000, wanted=6400)
        for s in runs.starts().tolist():
            assert out[s - 200_000 : s - 200_000 + 100] == data[s : s + 100]
        assert reader.bytes_read - before == 6400
    assert reader.bytes_read == 100_000 + 6400 and reader.gap_bytes == 0


def test_runs_of_a_grid_as_the_executor_gives_them(blob):
    """A block's runs in closed form (a 2-d grid of 3 x 5 runs of 40 bytes, touching along the inner dim)."""
    location, data, folder = blob
    grid = RunGrid(10_000, 40, ((3, 1000), (5, 40)))
    reader, _ = _reader(folder, True)
    with reader:
        reader.will_read(location, grid.touching, sparse=True)
        out = bytearray(grid.end - grid.first)
        reader.read_runs(location, grid, memoryview(out), grid.first, wanted=600)
        reader.verify(location)
    for s in grid.starts().tolist():
        assert out[s - grid.first : s - grid.first + 40] == data[s : s + 40]
    assert reader.bytes_read == 600 and reader.reads == 1


def test_verify_frees_what_was_fetched_ahead_and_not_read(blob):
    location, _, folder = blob
    reader, _ = _reader(folder)
    with reader:
        reader.will_read(location, lambda: [(a, a + 1000) for a in range(0, 1 << 20, 10_000)], sparse=True)
        assert reader._window.held > 0
        reader.verify(location)
        assert reader._window.held == 0


def test_the_window_bounds_the_bytes_fetched_ahead(blob):
    location, data, folder = blob
    window = 100_000
    reader, backend = _reader(
        folder, costs=RequestCosts(max_request_bytes=30_000), fetch_ahead_bytes=window, requests_in_flight=4
    )
    ranges = [(a, a + 20_000) for a in range(0, 4 << 20, 40_000)]
    with reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        assert sum(b - a for c in backend.calls for a, b in c) <= window  # nothing consumed yet
        out = bytearray(len(data))
        for a, b in ranges:
            reader.pread_into(location, a, memoryview(out)[a:b])
            assert out[a:b] == data[a:b]
    assert 0 < reader.peak_bytes <= window
    assert reader.bytes_read == sum(b - a for a, b in ranges)  # every range fetched once


def test_a_read_past_the_window_is_fetched_directly_and_not_again(blob):
    location, data, folder = blob
    reader, backend = _reader(folder, fetch_ahead_bytes=50_000)
    ranges = [(a, a + 40_000) for a in range(0, 1_000_000, 100_000)]
    with reader:
        reader.will_read(location, lambda: ranges, sparse=False)
        out = bytearray(40_000)
        reader.pread_into(location, 500_000, out)  # beyond the window: fetched now, its planned fetch dropped
        assert out == data[500_000:540_000]
        for a, b in ranges:
            reader.pread_into(location, a, out)
            assert out == data[a:b]
    # its planned fetch was skipped; the second read of the same bytes is fetched directly again
    assert reader.bytes_read == 440_000 and reader.reads == 11


def test_transient_failures_are_retried(blob):
    location, data, folder = blob
    reader, backend = _reader(folder, retries=3)
    backend.transient = 3
    with reader:
        reader.will_read(location, lambda: [(0, 1000)], sparse=False)
        out = bytearray(1000)
        reader.pread_into(location, 0, out)
    assert out == data[:1000]
    assert reader.reads == 4 and reader.bytes_read == 1000


def test_retries_exhausted_name_the_url_and_what_failed(blob):
    location, _, folder = blob
    reader, backend = _reader(folder, retries=2)
    backend.transient = 10
    with reader, pytest.raises(CheckpointError, match=r"model\.safetensors: GET bytes \[0, 1000\) failed after 3 "):
        reader.pread_into(location, 0, bytearray(1000))
    assert reader.reads == 3 and reader.bytes_read == 0


def test_a_failure_cancels_the_pending_fetches(blob):
    location, data, folder = blob
    reader, backend = _reader(folder, costs=RequestCosts(max_request_bytes=10_000), requests_in_flight=2)
    backend.fail_at, backend.gate = {0}, threading.Event()
    ranges = [(a, a + 10_000) for a in range(0, 400_000, 20_000)]
    with reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        with pytest.raises(CheckpointError, match="403") as e:
            reader.pread_into(location, 0, bytearray(10_000))
        assert e.value.path == location
        with pytest.raises(CheckpointError, match="403"):  # the cause again, not a cancellation
            reader.pread_into(location, 20_000, bytearray(10_000))
        backend.gate.set()
        reader._fetcher.close()  # waits for the fetch that was running
        assert len(backend.calls) <= 3  # the failed one, the one running beside it, at most one starting
    backend.fail_at = set()
    reader.pread_into(location, 0, out := bytearray(100))  # closed: usable again
    assert out == data[:100]


def test_an_object_replaced_mid_read_is_refused(blob):
    location, data, folder = blob
    store = RemoteStore(URL, FileBackend(folder), RemoteOptions(backoff=0.0))
    head = store.head(location, 8)
    with store.reader({location: head.identity}) as reader:
        reader.pread_into(location, 0, bytearray(10))
        path = os.path.join(folder, "model.safetensors")
        os.replace(path, path + ".old")
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(CheckpointError, match="changed") as e:
            reader.pread_into(location, 100, bytearray(10))
        assert e.value.path == location


def test_reads_from_several_threads(blob):
    location, data, folder = blob
    reader, _ = _reader(folder, True, costs=RequestCosts(max_request_bytes=64 << 10), fetch_ahead_bytes=1 << 20)
    ranges = _column_shard(400, 10_000, 3000)
    errors = []

    def read(part):
        try:
            for a, b in part:
                out = bytearray(b - a)
                reader.pread_into(location, a, out)
                assert out == data[a:b]
        except BaseException as e:  # reported below
            errors.append(e)

    with reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        threads = [threading.Thread(target=read, args=(ranges[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_reads_outside_the_object_are_refused(blob):
    location, data, folder = blob
    reader, backend = _reader(folder)
    with reader, pytest.raises(CheckpointError, match=r"bytes \[4194300, 4194310\) lie outside"):
        reader.pread_into(location, len(data) - 4, bytearray(10))
    assert backend.calls == []


# -- the store -----------------------------------------------------------------------------------------------------


def test_the_remote_store(blob):
    location, data, folder = blob
    (open(os.path.join(folder, "config.json"), "wb")).write(b'{"a": 1}')
    backend = FileBackend(folder)
    store = RemoteStore(URL + "/", backend, RemoteOptions(backoff=0.0))
    assert store.root == URL and store.remote and store.list_names() is None
    assert store.locate("config.json") == URL + "/config.json"
    assert store.exists(location) and not store.exists(URL + "/missing.json")
    head = store.head(location, 1000)
    assert head.data == data[:1000] and head.size == len(data) and head.identity == backend.stat(location)
    assert store.read_range(location, 5, 50, head.identity) == data[5:50]
    assert store.read_small(URL + "/config.json", 100, "config") == b'{"a": 1}'
    calls = len(backend.calls)
    with pytest.raises(CheckpointError, match="index is 4194304 bytes, over the 1000-byte limit"):
        store.read_small(location, 1000, "index")
    assert len(backend.calls) == calls  # refused before reading
    with pytest.raises(CheckpointNotFoundError, match="missing.json: not found"):
        store.head(URL + "/missing.json", 8)
    backend.transient = 2
    assert store.read_range(location, 0, 4, head.identity) == data[:4]


# -- over real servers (tests/servers.py: nginx, moto's S3, the fault server on 127.0.0.1) -------------------------

ROWS, ROW_BYTES, SHARD_BYTES = 256, 8 << 10, 2 << 10  # a bf16 weight of 4096 columns; a rank of four's columns


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 2 MiB object (a weight of ROWS rows of ROW_BYTES) in a folder: ``(folder, its bytes)``."""
    folder = tmp_path_factory.mktemp("served")
    data = np.random.default_rng(1).integers(0, 256, ROWS * ROW_BYTES, dtype=np.uint8).tobytes()
    (folder / "model.safetensors").write_bytes(data)
    return folder, data


@pytest.fixture(scope="module")
def faults_server(served):
    pytest.importorskip("requests")
    yield from servers.serve(servers.fault_server(served[0]))


@pytest.fixture
def faults(faults_server):
    url, control = faults_server
    control.clear()
    return url, control


def _read_column_shard(store: RemoteStore, data: bytes, rank: int = 1) -> RemoteReader:
    """Read a rank's column shard of the weight as the executor does (will_read, read_runs, verify), checked."""
    location = store.locate("model.safetensors")
    ranges = _column_shard(ROWS, ROW_BYTES, SHARD_BYTES, rank)
    runs = RunGrid(ranges[0][0], SHARD_BYTES, ((ROWS, ROW_BYTES),))
    base, out = ranges[0][0], bytearray(ranges[-1][1] - ranges[0][0])
    with store.reader({location: store.head(location, 8).identity}) as reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        reader.read_runs(location, runs, memoryview(out), base, wanted=ROWS * SHARD_BYTES)
        reader.verify(location)
    assert all(out[a - base : b - base] == data[a:b] for a, b in ranges)
    return reader


def test_a_column_shard_over_nginx_in_multi_range_requests(served):
    pytest.importorskip("requests")
    folder, data = served
    for url in servers.serve(servers.nginx(folder)):
        store = remote_store(url, StorageOptions())
        reader = _read_column_shard(store, data)
        assert reader.bytes_read == ROWS * SHARD_BYTES and reader.gap_bytes == 0  # no gap fetched
        assert reader.reads == ROWS // RequestCosts().max_ranges  # 64 rows a request
        gets = [r for r in url.requests("/model.safetensors") if r.method == "GET"]
        assert len(gets) == reader.reads + 1 and sum(r.status == 206 for r in gets) == len(gets)  # + the head


def test_a_column_shard_over_s3_a_request_per_row(served):
    pytest.importorskip("boto3")
    folder, data = served
    for endpoint in servers.serve(servers.s3_server()):
        url = servers.put_folder(endpoint, "ckpt", "tiny", folder)
        store = remote_store(
            url, StorageOptions(backend={"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
        )
        reader = _read_column_shard(store, data)
        assert reader.bytes_read == ROWS * SHARD_BYTES and reader.reads == ROWS
        # requests dearer than bytes: the user lets the cost model read the gaps through, in a few large requests
        backend = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        options = StorageOptions(backend=backend, remote=RemoteOptions(costs=RequestCosts(max_overread=4.0)))
        reader = _read_column_shard(remote_store(url, options), data)
        assert reader.reads <= 2 and reader.bytes_read - reader.gap_bytes == ROWS * SHARD_BYTES
        assert reader.bytes_read < (ROWS + 1) * ROW_BYTES


def test_max_overread_is_validated():
    with pytest.raises(ValueError, match="max_overread"):
        RequestCosts(max_overread=-1.0)
    assert RequestCosts(max_overread=0).max_overread == 0


def test_a_server_error_is_retried_by_the_reader(faults, served):
    url, control = faults
    store = remote_store(url, StorageOptions(remote=RemoteOptions(backoff=0.0)))
    location = store.locate("model.safetensors")
    control.set("/model.safetensors", fail_then_ok=2)
    reader = _read_column_shard(store, served[1])  # the head's first GET fails twice, then all is well
    assert reader.bytes_read == ROWS * SHARD_BYTES
    assert [r.status for r in control.log()][:3] == [500, 500, 206]
    control.set("/model.safetensors", fail_then_ok=1)
    with store.reader() as reader:
        out = bytearray(100)
        reader.pread_into(location, 10_000, out)  # the identity the head's GET told; the get: a 500, then the bytes
    assert out == served[1][10_000:10_100] and reader.reads == 2


@pytest.mark.parametrize(("mode", "match"), [("hang", "failed after 2 attempts"), ("truncate", "failed after 2")])
def test_a_server_that_hangs_or_truncates_fails_after_the_retries(faults, mode, match):
    url, control = faults
    store = remote_store(url, StorageOptions(remote=RemoteOptions(request_timeout=0.5, retries=1, backoff=0.0)))
    location = store.locate("model.safetensors")
    identity = store.head(location, 8).identity
    control.set("/model.safetensors", **{mode: True})
    with store.reader({location: identity}) as reader:
        with pytest.raises(CheckpointError, match=match) as e:
            reader.pread_into(location, 0, bytearray(5000))
        assert e.value.path == location and reader.reads == 2


def test_a_server_that_ignores_range_is_refused_at_once(faults):
    url, control = faults
    store = remote_store(url, StorageOptions(remote=RemoteOptions(backoff=0.0)))
    location = store.locate("model.safetensors")
    identity = store.head(location, 8).identity
    control.set("/model.safetensors", ignore_range=True)
    with store.reader({location: identity}) as reader, pytest.raises(CheckpointError, match="Range") as e:
        reader.pread_into(location, 0, bytearray(10))
    assert e.value.path == location and reader.reads == 1  # not retried


def test_an_object_replaced_mid_load_stops_the_load(faults, served):
    """Replaced after 5 answers: the reads fail with a CheckpointError naming the URL, and what was pending is
    cancelled (the server sees few requests after the change)."""
    url, control = faults
    store = remote_store(
        url, StorageOptions(remote=RemoteOptions(backoff=0.0, requests_in_flight=2, costs=RequestCosts(max_ranges=1)))
    )
    location = store.locate("model.safetensors")
    identity = store.head(location, 8).identity
    control.set("/model.safetensors", change_etag_after=5)
    ranges = _column_shard(ROWS, ROW_BYTES, SHARD_BYTES)
    with store.reader({location: identity}) as reader:
        reader.will_read(location, lambda: ranges, sparse=True)
        with pytest.raises(CheckpointError, match="changed") as e:
            for a, b in ranges:
                out = bytearray(b - a)
                reader.pread_into(location, a, out)
                assert out == served[1][a:b]
        assert e.value.path == location
    assert len(control.log()) < 5 + 2 * 2 + 2  # the 5 answered, those in flight, none of the ROWS queued


def test_first_bytes_tell_size_and_identity_without_a_head_request(tmp_path):
    """Over nginx and S3 (moto): whether an object exists, its size, identity and first bytes come from one ranged
    GET (no HEAD), an empty object included; a missing one is absent; what that GET returned serves later reads of
    those bytes, through the store and through its readers, without another request."""
    pytest.importorskip("requests")
    pytest.importorskip("boto3")
    keys = {"key": "testing", "secret": "testing", "region_name": "us-east-1"}
    data = np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "empty.bin").write_bytes(b"")
    for web in servers.serve(servers.nginx(tmp_path)):
        for endpoint in servers.serve(servers.s3_server()):
            s3 = servers.put_folder(endpoint, "first", "x", tmp_path)
            for store in (
                remote_store(web, StorageOptions()),
                remote_store(s3, StorageOptions(backend={"endpoint_url": endpoint, **keys})),
            ):
                assert store.exists(store.locate("f.bin")) and store.exists(store.locate("empty.bin"))
                assert not store.exists(store.locate("missing.bin"))
                head = store.head(store.locate("f.bin"), 100)
                assert head.data == data[:100] and head.size == len(data) and head.identity.etag
                assert store.head(store.locate("empty.bin"), 8).size == 0
                location = store.locate("f.bin")
                assert store.read_range(location, 10, 90, head.identity) == data[10:90]  # from the first GET
                with store.reader({location: head.identity}) as reader:
                    out = bytearray(200)
                    reader.pread_into(location, 4000, out)  # 96 bytes from the first GET's 4 KiB, 104 fetched
                    assert out == data[4000:4200] and reader.reads == 1 and reader.bytes_read == 200
            logged = web.requests()
            assert logged and all(r.method == "GET" for r in logged), logged
            assert [r.range for r in logged if r.path == "/f.bin"] == ["bytes=0-4095", "bytes=4096-4199"]
