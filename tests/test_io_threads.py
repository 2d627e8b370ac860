"""Parallel reads (``io_threads``): the same bytes in the same places whatever the number of I/O threads.

Real safetensors files, real blocks, real reads on real threads. Every read case of tests/test_staging.py (straight
reads, casts, column shards read by span, packed sparse shards, overlapping spans, flips, broadcasts) through a
tiny ring so that buffers rotate many times under several threads, on the host (copies on the I/O threads) and on
the stand-in device (copies queued by the calling thread; its check fails a buffer rewritten before its copies
finished). A checkpoint truncated underneath fails a read on an I/O thread: a ``CheckpointError`` naming the file,
and with ``rollback`` every tensor as it was.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from hf_models import build, clone_state, save
from test_read_faults import (
    SECOND,
    ColumnShardPlanner,
    Net,
    bit_equal,
    expected_state,
    state,
    truncate,
    write_checkpoint,
)
from test_staging import STAGING, FakeLink, assert_bit_equal, expected, targets, write_files

from loader import CheckpointError, SafetensorsCheckpoint, SafetensorsReader, load_hf_checkpoint
from loader.checkpoint import FileReader
from loader.execute import BlockExecutor, pool
from loader.execute.pool import MAX_AUTO_THREADS, chunks, copy_threads, resolve_io_threads
from loader.execute.staging import ALIGN, StagingRing, align
from loader.options import LoadOptions, StorageOptions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

THREADS = [1, 2, 4]


class ThreadsSeen(FileReader):
    """A real :class:`FileReader` that records which threads read, and on which one a read failed; with ``victim``,
    it truncates that file to half its size after its ``after``-th read (reads still in flight then fail)."""

    def __init__(self, *args, victim: Path | None = None, after: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: set[str] = set()
        self.failed_on: list[str] = []
        self.victim, self.after = victim, after
        self._lock2 = threading.Lock()

    def _seen(self, read, file, *args, **kwargs) -> None:
        name = threading.current_thread().name
        self.threads.add(name)
        try:
            read(file, *args, **kwargs)
        except CheckpointError:
            self.failed_on.append(name)
            raise
        if self.victim is not None and file == str(self.victim):
            with self._lock2:
                self.after -= 1
                if self.after == 0:
                    truncate(self.victim, self.victim.stat().st_size // 2)

    def pread_into(self, *args, **kwargs) -> None:
        self._seen(super().pread_into, *args, **kwargs)

    def pread_consecutive(self, *args, **kwargs) -> None:
        self._seen(super().pread_consecutive, *args, **kwargs)

    def read_runs(self, *args, **kwargs) -> None:
        self._seen(super().read_runs, *args, **kwargs)


def execute(root: Path, threads: int, ring: StagingRing):
    checkpoint = SafetensorsCheckpoint.open(str(root))
    slots, block_reads = targets(checkpoint)
    done = []
    with ThreadsSeen() as reader:
        ex = BlockExecutor(checkpoint, slots, reader, progress=done.append, staging=ring, io_threads=threads)
        ex.run(block_reads)
    return ex, slots, reader, sum(done)


@pytest.fixture
def root(tmp_path: Path) -> tuple[Path, dict]:
    return tmp_path, write_files(tmp_path)


@pytest.mark.parametrize("device", ["host", "stand-in"])
@pytest.mark.parametrize("threads", THREADS)
def test_every_read_case_is_bit_identical_with_any_number_of_threads(root, monkeypatch, threads, device):
    folder, tensors = root
    monkeypatch.setattr(pool, "DIRECT_CHUNK", 1000)  # reads straight into model memory cut into many jobs
    link = FakeLink() if device == "stand-in" else None
    ring = StagingRing.for_threads(STAGING, threads)
    ring.link = link
    ex, slots, reader, progressed = execute(folder, threads, ring)
    assert_bit_equal(slots, expected(tensors))
    _, _, one, _ = execute(folder, 1, StagingRing(ring.capacity))  # buffers of the same size: the same batches
    assert reader.bytes_read == one.bytes_read and progressed >= reader.bytes_read
    # the staging budget holds: io_threads + 1 buffers sharing two buffers' bytes
    assert len(ex.ring.buffers()) <= max(2, threads + 1)
    assert sum(b.numel() for b in ex.ring.buffers()) <= 2 * align(STAGING)
    assert ex.ring.counts["acquire"] > 2 * ex.ring.count and not ex.ring.counts["oversized"]
    if threads > 1:
        assert reader.threads and all(n.startswith("loader-io") for n in reader.threads)  # no read on the caller
    else:
        assert reader.threads == {threading.current_thread().name}
    if link is not None:
        assert not link.pending and link.completed == link.queued > 0  # every copy finished when run returned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", THREADS)
def test_a_real_model_loads_bit_identically_with_any_number_of_threads(tmp_path, threads, dtype):
    """A tiny Qwen3-MoE (per-expert checkpoint merged into fused experts) through ``load_hf_checkpoint``."""
    _, source = build("qwen3_moe", seed=0)
    save(source, tmp_path, dtype=dtype)
    want = {k: v.to(dtype).to(v.dtype) for k, v in clone_state(source).items()}
    _, model = build("qwen3_moe", seed=1)
    report = load_hf_checkpoint(
        model, str(tmp_path), options=LoadOptions(io_threads=threads, staging_bytes=4096, progress=False)
    )
    got = clone_state(model)
    for name, value in want.items():
        assert torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), name
    _, again = build("qwen3_moe", seed=1)
    assert (
        load_hf_checkpoint(again, str(tmp_path), options=LoadOptions(io_threads=1, progress=False)).bytes_read
        == report.bytes_read
    )


@pytest.mark.parametrize("rollback", [True, False])
def test_a_read_failing_on_an_io_thread_is_a_checkpoint_error_and_rolls_back(tmp_path, rollback):
    """The second file is truncated after its third read, mid-way through its column shards: reads fail on I/O
    threads while others are in flight; the error names the file, and with ``rollback`` every tensor is as it was."""
    write_checkpoint(tmp_path)
    net = Net()
    before = state(net)
    victim = tmp_path / SECOND
    readers: list[ThreadsSeen] = []

    def reader(self, direct_io=False):
        readers.append(ThreadsSeen(self.identities, victim=victim))
        return readers[-1]

    def tamper(checkpoint, plan) -> None:
        checkpoint.reader = reader.__get__(checkpoint)

    planner = ColumnShardPlanner(net, tamper)
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(
            net,
            str(tmp_path),
            planner=planner,
            options=LoadOptions(rollback=rollback, io_threads=4, staging_bytes=4096),
        )
    assert info.value.path == str(victim) and str(victim) in str(info.value)
    assert readers and readers[0].failed_on and all(n.startswith("loader-io") for n in readers[0].failed_on)
    if rollback:
        assert bit_equal(state(net), before)
    else:  # the first file's tensors were written before the failure
        assert not bit_equal(state(net), before)


def test_a_normal_column_shard_load_with_threads_is_bit_exact(tmp_path):
    tensors = write_checkpoint(tmp_path)
    net = Net()
    want = expected_state(state(net), tensors)
    load_hf_checkpoint(
        net, str(tmp_path), planner=ColumnShardPlanner(net), options=LoadOptions(io_threads=4, staging_bytes=4096)
    )
    assert bit_equal(state(net), want)


@pytest.mark.parametrize(
    "option, bad",
    [("io_threads", v) for v in (0, -1, 2.0, True, "2")] + [("direct_io", v) for v in (1, "yes", None)],
)
def test_read_options_are_validated_where_options_are_built(tmp_path, option, bad):
    _, source = build("qwen3_moe", seed=0)
    save(source, tmp_path)
    make, key = (StorageOptions, "storage") if option == "direct_io" else (LoadOptions, "options")
    with pytest.raises(ValueError, match=option):
        make(**{option: bad})
    with pytest.raises(ValueError, match=option):
        load_hf_checkpoint(source, str(tmp_path), **{key: make(**{option: bad})})
    with pytest.raises(ValueError, match=option):
        SafetensorsReader(str(tmp_path), **{key: make(**{option: bad})})


def test_the_automatic_setting_shares_the_cpus_among_the_ranks_on_this_host(monkeypatch):
    import os

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_io_threads(None) == min(MAX_AUTO_THREADS, cpus) and resolve_io_threads(3) == 3
    assert copy_threads(cpus) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))  # ranks fill the cores: one thread each, torch's at one
    assert resolve_io_threads(None) == 1 and copy_threads(1) == 1


def test_a_ring_for_threads_splits_the_budget():
    for threads in THREADS:
        ring = StagingRing.for_threads(1 << 20, threads)
        assert ring.count == max(2, threads + 1) and ring.count * ring.capacity <= 2 << 20
    tiny = StagingRing.for_threads(ALIGN, 8)  # two buffers' budget of ALIGN bytes each: no more buffers
    assert tiny.count == 2 and tiny.capacity == ALIGN


def test_chunks_cut_consecutive_views_into_groups_of_a_size():
    data = bytearray(range(256)) * 4
    views = [memoryview(data)[a:b] for a, b in [(0, 10), (10, 700), (700, 703), (703, 1024)]]
    groups = list(chunks(100, views, 128))
    assert [at for at, _ in groups] == [100 + 128 * i for i in range(len(groups))]
    assert all(sum(v.nbytes for v in g) <= 128 for _, g in groups)
    assert b"".join(bytes(v) for _, g in groups for v in g) == bytes(data)


def test_the_page_cache_probe_tells_a_cold_file_from_a_warm_one(tmp_path):
    """``FileReader.cached`` (what the automatic ``io_threads`` asks: a cold checkpoint is read in one stream) reads
    nothing from the disk to answer: dropped pages are reported as such, and cached once read."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    with FileReader() as reader:
        if reader.cached(str(path), 0) is None:
            pytest.skip("the kernel cannot tell (no RWF_NOWAIT)")
        assert reader.cached(str(path), 0) is True  # just written
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        if reader.cached(str(path), 512 << 10):
            pytest.skip("this filesystem keeps its pages (tmpfs)")
        assert reader.cached(str(path), 512 << 10) is False  # asking did not read it
        reader.pread_into(str(path), 512 << 10, bytearray(4096))
        assert reader.cached(str(path), 512 << 10) is True
