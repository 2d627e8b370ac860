"""Direct I/O (``direct_io=True``): ``O_DIRECT`` reads through aligned bounce buffers, bit-identical to buffered ones.

Real files on this machine's disk (``tmp_path``), real ``O_DIRECT`` descriptors: every read case of
tests/test_staging.py, a real model through ``load_hf_checkpoint`` with 1 and 2 I/O threads, the page cache
bypassed (a second read reads the disk again: ``/proc/self/io`` ``read_bytes``), a truncated file, and the
fallback where the kernel refuses a direct read (``EINVAL``).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from hf_models import build, clone_state, save
from test_read_faults import truncate
from test_staging import STAGING, assert_bit_equal, expected, targets, write_files

from loader import CheckpointError, SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import FileReader
from loader.execute import BlockExecutor
from loader.execute.staging import StagingRing
from loader.options import LoadOptions, StorageOptions
from loader.storage import direct
from loader.storage.direct import DirectFileReader

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def o_direct_refused(folder: Path) -> str | None:
    """Why files in ``folder`` cannot be opened with ``O_DIRECT``, or None when they can."""
    if not direct.HAS_DIRECT:
        return "no O_DIRECT on this platform"
    probe = folder / "probe"
    probe.write_bytes(b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        return f"{folder}: O_DIRECT refused ({errno.errorcode.get(e.errno, e.errno)})"
    finally:
        probe.unlink()
    return None


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    reason = o_direct_refused(tmp_path)
    if reason:
        pytest.skip(reason)
    return tmp_path


def physical_reads() -> int:
    """Bytes this process has caused to be read from storage (``/proc/self/io`` ``read_bytes``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def execute(folder: Path, reader: FileReader, threads: int = 1):
    checkpoint = SafetensorsCheckpoint.open(str(folder))
    slots, reads = targets(checkpoint)
    with reader:
        ring = StagingRing.for_threads(STAGING, threads)
        BlockExecutor(checkpoint, slots, reader, staging=ring, io_threads=threads).run(reads)
    return slots


@pytest.mark.parametrize("threads", [1, 2])
def test_every_read_case_is_bit_identical_with_o_direct(disk, threads, caplog):
    tensors = write_files(disk)
    direct_reader, buffered = DirectFileReader(), FileReader()
    with caplog.at_level(logging.DEBUG, logger="loader"):
        assert_bit_equal(execute(disk, direct_reader, threads), expected(tensors))
    assert not [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]  # really direct
    execute(disk, buffered, threads)
    assert direct_reader.bytes_read == buffered.bytes_read  # the bytes callers use; the alignment overread apart
    assert direct_reader.gap_bytes > buffered.gap_bytes


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_model_loads_bit_identically_with_direct_io(disk, threads, dtype):
    _, source = build("qwen3_moe", seed=0)
    save(source, disk, dtype=dtype)
    _, model = build("qwen3_moe", seed=1)
    kwargs = {"io_threads": threads, "staging_bytes": 4096, "progress": False}
    report = load_hf_checkpoint(model, str(disk), storage=StorageOptions(direct_io=True), options=LoadOptions(**kwargs))
    got = clone_state(model)
    for name, value in clone_state(source).items():
        assert torch.equal(got[name].view(torch.uint8), value.to(dtype).to(value.dtype).view(torch.uint8)), name
    _, again = build("qwen3_moe", seed=1)
    assert load_hf_checkpoint(again, str(disk), options=LoadOptions(**kwargs)).bytes_read == report.bytes_read


def test_direct_reads_bypass_the_page_cache(disk):
    """Read twice with O_DIRECT: the disk is read twice (a buffered second read would come from the cache)."""
    path = disk / "blob.bin"
    data = os.urandom(4 << 20)
    path.write_bytes(data)
    out = bytearray(len(data) - 1000)
    align, counts = direct.logical_block_size(path.stat().st_dev), []
    for _ in range(2):
        before = physical_reads()
        with DirectFileReader() as reader:
            reader.pread_into(str(path), 1000, out)  # unaligned: a window from 0
        counts.append(physical_reads() - before)
        assert bytes(out) == data[1000:] and reader.gap_bytes == 1000 % align and reader.bytes_read == len(out)
    if counts[0] == 0:
        pytest.skip("read_bytes does not count this filesystem's reads")
    assert counts[1] >= len(out)


def test_a_truncated_file_is_a_checkpoint_error_naming_it(disk):
    _, source = build("qwen3_moe", seed=0)
    save(source, disk)
    checkpoint = SafetensorsCheckpoint.open(str(disk))
    file = checkpoint.files[0]
    truncate(Path(file), os.path.getsize(file) // 2)
    with DirectFileReader() as reader:  # no identity known: the short read itself is the error
        info = checkpoint[max(checkpoint, key=lambda k: checkpoint[k].data_start)]
        with pytest.raises(CheckpointError, match="unexpected end of file") as e:
            reader.pread_into(file, info.data_start, bytearray(info.nbytes))
    assert e.value.path == file


def test_a_refused_direct_read_falls_back_to_the_page_cache_with_a_log_line(disk, monkeypatch, caplog):
    """With no alignment (1 byte) the kernel refuses the reads (EINVAL): the load reads through the page cache,
    says so once, and is bit-identical."""
    monkeypatch.setattr(direct, "logical_block_size", lambda device: 1)
    _, source = build("qwen3_moe", seed=0)
    save(source, disk)
    _, model = build("qwen3_moe", seed=1)
    with caplog.at_level(logging.DEBUG, logger="loader"):
        load_hf_checkpoint(
            model,
            str(disk),
            options=LoadOptions(staging_bytes=4096, progress=False),
            storage=StorageOptions(direct_io=True),
        )
    for name, value in clone_state(source).items():
        assert torch.equal(model.state_dict()[name], value), name
    refused = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert refused and sum(r.levelno == logging.WARNING for r in refused) == 1


def test_tmpfs_direct_io_loads_or_falls_back(monkeypatch):
    """/dev/shm (tmpfs: O_DIRECT since Linux 6.6, refused before): either way the load is bit-identical."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        _, source = build("qwen3_moe", seed=0)
        save(source, Path(folder))
        _, model = build("qwen3_moe", seed=1)
        load_hf_checkpoint(model, folder, options=LoadOptions(progress=False), storage=StorageOptions(direct_io=True))
        for name, value in clone_state(source).items():
            assert torch.equal(model.state_dict()[name], value), name
