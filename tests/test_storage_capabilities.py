"""Storage capabilities (loader/storage/capabilities.py): what each driver declares, and how the layers above ask.

Real drivers over real files: the local store and its readers, and a remote store over a small backend that serves
a local folder's files (a real implementation of the backend contract).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from loader.storage import DirectFileReader, FileReader, LocalStore, ObjectIdentity, RangeReader, open_reader
from loader.storage import capabilities as caps
from loader.storage.remote import RemoteStore

URL = "https://example.invalid/ckpt"


class FolderBackend:
    """A remote backend over a local folder (``URL/name`` is ``folder/name``), one range a request."""

    multi_range = False

    def __init__(self, folder: str) -> None:
        self.folder, self.closed = folder, False

    def stat(self, location: str) -> ObjectIdentity | None:
        path = os.path.join(self.folder, location[len(URL) + 1 :])
        return ObjectIdentity(os.path.getsize(path), '"v1"') if os.path.exists(path) else None

    def get(self, location: str, ranges, identity: ObjectIdentity) -> list[bytes]:
        with open(os.path.join(self.folder, location[len(URL) + 1 :]), "rb") as f:
            return [os.pread(f.fileno(), b - a, a) for a, b in ranges]

    def close(self) -> None:
        self.closed = True


class PinnedFolderBackend(FolderBackend):
    """The same, with multi-range requests and versions it can be pinned to (as the Hub's)."""

    multi_range = True

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.pinned: list[str] = []

    def pin(self, version: str) -> str:
        self.pinned.append(version)
        return version


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 64)
    return tmp_path


def test_the_local_readers_declare_what_they_can_do(folder):
    """The buffered reader keeps readahead hints, scatters runs and probes the page cache; the direct reader, built
    by composition, has none of these (not methods set to None: it has no such attribute at all)."""
    buffered, direct = FileReader(), DirectFileReader()
    for kind in (caps.ReadsAhead, caps.ScattersRuns, caps.ProbesCache):
        assert caps.has(buffered, kind) and caps.capability(buffered, kind) is buffered
        assert not caps.has(direct, kind) and caps.capability(direct, kind) is None
    assert not any(hasattr(direct, n) for n in ("read_ahead", "read_runs_to", "cached"))
    assert isinstance(buffered, RangeReader) and isinstance(direct, RangeReader)


def test_a_direct_reader_reads_what_a_buffered_one_does_and_counts_alike(folder):
    path = str(folder / "f.bin")
    data = (folder / "f.bin").read_bytes()
    with DirectFileReader() as direct, FileReader() as buffered:
        for reader in (direct, buffered):
            out = bytearray(1000)
            reader.pread_into(path, 123, out)
            assert bytes(out) == data[123:1123]
        assert direct.bytes_read == buffered.bytes_read == 1000
        assert direct.reads >= 1 and direct.gap_bytes >= buffered.gap_bytes


def test_direct_io_is_chosen_by_the_stores_declared_capability(folder):
    """``open_reader(direct_io=True)`` asks the store for :class:`~caps.ReadsDirect`: a local store has it, a
    remote store does not (its reader is its own, whatever ``direct_io`` says)."""
    local = LocalStore(str(folder))
    assert caps.has(local, caps.ReadsDirect) and caps.has(local, caps.Stages)
    assert type(open_reader(local, {}, direct_io=True)) is DirectFileReader
    assert type(open_reader(local, {}, direct_io=False)) is FileReader
    remote = RemoteStore(URL, FolderBackend(str(folder)))
    assert not caps.has(remote, caps.ReadsDirect) and not caps.has(remote, caps.Stages)
    reader = open_reader(remote, {}, direct_io=True)
    assert type(reader) is type(remote.reader({})) and not isinstance(reader, (FileReader, DirectFileReader))


def test_store_capabilities_local_and_remote(folder):
    local, backend = LocalStore(str(folder)), FolderBackend(str(folder))
    remote = RemoteStore(URL, backend)
    assert not caps.is_remote(local) and caps.is_remote(remote)
    assert caps.capability(local, caps.RemembersProbes) is None
    probes = caps.capability(remote, caps.RemembersProbes)
    assert probes is remote and probes.probed(remote.locate("f.bin")) is None
    assert remote.exists(remote.locate("f.bin"))
    assert probes.probed(remote.locate("f.bin")) == ObjectIdentity(256 * 64, '"v1"')
    caps.close_store(local)  # holds no connection: nothing to do, no error
    caps.close_store(remote)
    assert backend.closed


def test_backend_capabilities_flags_and_methods(folder):
    """A backend's flags are read as they are now (HTTP turns ``multi_range`` off as it learns); ``pin`` and
    ``first`` are there or not."""
    plain, pinned = FolderBackend(str(folder)), PinnedFolderBackend(str(folder))
    assert not caps.multi_range(plain) and caps.multi_range(pinned)
    pinned.multi_range = False
    assert not caps.multi_range(pinned)
    assert not caps.rechecks_heads(plain)
    assert caps.capability(plain, caps.PinsVersions) is None and caps.capability(pinned, caps.PinsVersions) is pinned
    assert caps.capability(plain, caps.FetchesFirst) is None
    store = RemoteStore(URL, pinned)
    store.pin({store.locate("f.bin"): ObjectIdentity(256 * 64, '"v1"', "abc123")})
    assert pinned.pinned == ["abc123"]


def test_a_scattering_reader_reads_runs_into_place(folder):
    """:class:`~caps.ScattersRuns` as the executor uses it: each run straight to its address."""
    from regiontrace.executor import RunGrid

    path, data = str(folder / "f.bin"), (folder / "f.bin").read_bytes()
    runs = RunGrid(100, 16, ((8, 64),))  # 8 runs of 16 bytes, 64 apart
    dest = np.zeros((8, 16), dtype=np.uint8)
    with FileReader() as reader:
        scatter = caps.capability(reader, caps.ScattersRuns)
        assert scatter is not None
        scatter.read_runs_to(path, runs, dest.ctypes.data + 16 * np.arange(8, dtype=np.int64))
    assert [bytes(r) for r in dest] == [data[100 + 64 * i : 116 + 64 * i] for i in range(8)]


def test_every_capability_declares_its_members():
    assert caps.members(caps.ReadsAhead) == {"read_ahead"}
    assert caps.members(caps.Remote) == {"remote"}
    assert caps.members(caps.Stages) == {"stage"}
    names = [n for kind in caps.CAPABILITIES for n in caps.members(kind)]
    assert len(names) == len(set(names)), "two capabilities declare the same name"
