"""The commit never moves, copies or deletes what is not the checkpoint's.

A filesystem mounted inside the folder (a real ``tmpfs``, a bind mount) is refused before anything is written,
and so is one that appears while the save runs (at the commit, under its lock); a file the user writes into the
folder while the commit runs (a real process stalled at each commit step by tests/commit_worker.py) is in the new
folder afterwards; a lock path that is a symlink is not followed. Mounting needs root (the tests skip, saying so,
where ``mount`` is refused).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hf_models import build
from test_save_atomic import NEW, OLD, SHARDS, Worker, left_beside, steps_of, wait_for

from loader import save_hf_checkpoint
from loader.options import SaveOptions
from loader.storage import local_carry as carry
from loader.storage import local_commit as commit

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.proc.stdin.close()
    w.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, dict[str, bytes]]:
    """The checkpoint files (shards, index, configs) a save of each model writes, by seed."""
    root = tmp_path_factory.mktemp("reference")
    for seed in (OLD, NEW):
        save_hf_checkpoint(
            build("llama", seed)[1], root / str(seed), options=SaveOptions(max_shard_size=SHARDS[seed], progress=False)
        )
    return {seed: folder_bytes(root / str(seed)) for seed in (OLD, NEW)}


def folder_bytes(folder: Path, names=None) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in sorted(names if names is not None else os.listdir(folder))}


def holds(folder: Path, checkpoint: dict[str, bytes]) -> bool:
    """``folder`` holds exactly this checkpoint's files, byte for byte (and no other weight file)."""
    weights = {n for n in os.listdir(folder) if carry.WEIGHT_FILE.fullmatch(n) or n == carry.INDEX_NAME}
    return weights | set(checkpoint) == set(checkpoint) and folder_bytes(folder, checkpoint) == checkpoint


@pytest.fixture
def old(tmp_path) -> Path:
    """The old checkpoint with the user's README and tokenizer folder."""
    out = tmp_path / "ckpt" / "out"
    save_hf_checkpoint(build("llama", OLD)[1], out, options=SaveOptions(max_shard_size=SHARDS[OLD], progress=False))
    (out / "README.md").write_text("mine")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "vocab.txt").write_text("a b c")
    return out


# ---------------------------------------------------------------------------------------------------
# a filesystem mounted inside


def mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:  # (the paths here hold no character the table escapes)
        return [line.split(" ")[4] for line in f]


def mounted(target: Path) -> bool:
    return str(target) in mount_points()


@pytest.fixture
def mounts(tmp_path):
    """``mount(kind, target, source)``: a real mount (``tmpfs``, or ``bind`` of ``source``) under ``tmp_path``; after
    the test every mount under ``tmp_path`` is unmounted, wherever a failed save moved it. Skips when mounting is
    not permitted here."""

    def mount(kind: str, target: Path, source: Path | None = None) -> None:
        target.mkdir(parents=True, exist_ok=True)
        args = ["-t", "tmpfs", "-o", "size=1m", "tmpfs"] if kind == "tmpfs" else ["--bind", str(source)]
        done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount here ({' '.join(['mount', *args])}: {done.stderr.strip()}): needs root")

    yield mount
    for point in sorted((p for p in mount_points() if p.startswith(f"{tmp_path}/")), reverse=True):
        subprocess.run(["umount", "-l", point], check=True)


@pytest.mark.parametrize(
    ("kind", "table"), [("tmpfs", True), ("bind", True), ("tmpfs", False)], ids=["tmpfs", "bind", "tmpfs-by-device"]
)
def test_a_folder_with_a_filesystem_mounted_inside_is_refused_before_anything_is_written(
    old, saved, mounts, tmp_path, monkeypatch, kind, table
):
    """A ``tmpfs`` (or a bind mount of another folder) at ``out/data`` holding the user's data: the save raises a
    ``ValueError`` naming the mount point, and nothing is written, moved or emptied. Without a mount table (as
    off Linux) a mount is found by its device number (the bind mount of a folder of the same filesystem needs the
    table)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    mounts(kind, old / "tokenizer" / "data", elsewhere)
    (old / "tokenizer" / "data" / "dataset.bin").write_bytes(b"\x01" * 1000)
    if not table:
        monkeypatch.setattr(carry, "MOUNTINFO", str(tmp_path / "no-mount-table"))
    before = folder_bytes(old, [n for n in os.listdir(old) if n != "tokenizer"])
    with pytest.raises(ValueError, match="mount point inside it") as info:
        save_hf_checkpoint(build("llama", NEW)[1], old, options=SaveOptions(max_shard_size=SHARDS[NEW], progress=False))
    assert repr(str(old / "tokenizer" / "data")) in str(info.value)
    assert holds(old, saved[OLD]) and folder_bytes(old, before) == before
    assert mounted(old / "tokenizer" / "data")
    assert (old / "tokenizer" / "data" / "dataset.bin").read_bytes() == b"\x01" * 1000
    assert left_beside(old) == []  # no staging folder, no lock


def test_a_folder_that_is_a_mount_point_is_refused(mounts, tmp_path):
    out = tmp_path / "out"
    mounts("tmpfs", out)
    (out / "dataset.bin").write_bytes(b"\x02" * 100)
    with pytest.raises(ValueError, match="it is a mount point") as info:
        save_hf_checkpoint(build("llama", NEW)[1], out, options=SaveOptions(progress=False))
    assert repr(str(out)) in str(info.value)
    assert os.listdir(out) == ["dataset.bin"] and mounted(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_mount_appearing_during_the_save_is_refused_at_the_commit(worker, old, saved, mounts, tmp_path):
    """The save stalls under the commit's lock; a ``tmpfs`` is mounted inside the folder; the commit refuses it:
    the save fails (exit 3), the old checkpoint whole, the mount and its file in place, nothing left beside."""
    pid = worker.start(NEW, old, tmp_path / "c", hook="stall", at="recover")
    try:
        wait_for(lambda: (tmp_path / "c" / "stalled").exists(), "the save to stall")
        mounts("tmpfs", old / "data")
        (old / "data" / "dataset.bin").write_bytes(b"\x03" * 10)
    finally:
        (tmp_path / "c" / "go").touch()
    assert worker.wait(pid) == 3
    error = (tmp_path / "c" / "error").read_text()
    assert error.startswith("ValueError: cannot save to") and repr(str(old / "data")) in error
    assert holds(old, saved[OLD]) and (old / "data" / "dataset.bin").read_bytes() == b"\x03" * 10
    assert mounted(old / "data") and left_beside(old) == []


def test_a_leftover_old_folder_with_a_mount_inside_is_not_emptied(old, saved, mounts, caplog):
    """What an interrupted commit (or an earlier version's commit) left beside the folder, with a filesystem
    mounted inside: the next commit, which removes such leftovers, leaves this one whole and says so."""
    leftover = old.parent / "out.old-commit-abcd1234"
    shutil.copytree(old, leftover)
    mounts("tmpfs", leftover / "data")
    (leftover / "data" / "dataset.bin").write_bytes(b"\x04" * 10)
    with caplog.at_level(logging.WARNING, logger="loader"):
        save_hf_checkpoint(build("llama", NEW)[1], old, options=SaveOptions(max_shard_size=SHARDS[NEW], progress=False))
    assert holds(old, saved[NEW])
    assert holds(leftover, saved[OLD]) and (leftover / "data" / "dataset.bin").read_bytes() == b"\x04" * 10
    assert mounted(leftover / "data") and left_beside(old) == ["out.old-commit-abcd1234"]
    assert f"{leftover} is left in place: {leftover / 'data'} is mounted inside it" in caplog.text


# ---------------------------------------------------------------------------------------------------
# files written during the commit

BEFORE_SWAP = {True: ["carry tokenizer", "rescan", "stage", "swap"], False: ["rescan", "move-aside"]}


@pytest.mark.parametrize(
    ("swap", "at"),
    [(True, s) for s in [*BEFORE_SWAP[True], "take-late"]] + [(False, s) for s in [*BEFORE_SWAP[False], "take-late"]],
)
def test_a_file_written_into_the_folder_during_the_commit_is_kept(worker, old, saved, tmp_path, swap, at):
    """The save stalls just before commit step ``at``; meanwhile the user adds ``notes.txt`` and
    ``tokenizer/extra.txt``, replaces ``README.md`` (a new file renamed over it), and a process whose working folder
    is the old one adds ``cwd.txt`` there (after the swap that is the old folder, under its ``.old-commit-``
    name). After the save: the new checkpoint, whole, with every one of them as the user left it."""
    if swap and commit.swapper() is None:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    folder = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
    try:
        pid = worker.start(NEW, old, tmp_path / "c", hook="stall", at=at, swap=swap)
        try:
            wait_for(lambda: (tmp_path / "c" / "stalled").exists(), "the save to stall")
            (old / "notes.txt").write_text("written during the commit")
            (old / "tokenizer" / "extra.txt").write_text("x y")
            (old / "README.tmp").write_text("changed")
            os.replace(old / "README.tmp", old / "README.md")
            fd = os.open("cwd.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=folder)
            os.write(fd, b"by its working folder")
            os.close(fd)
        finally:
            (tmp_path / "c" / "go").touch()
        assert worker.wait(pid) == 0
    finally:
        os.close(folder)
    assert steps_of(tmp_path / "c")[-1] == "done"
    assert holds(old, saved[NEW])
    assert (old / "notes.txt").read_text() == "written during the commit"
    assert (old / "tokenizer" / "extra.txt").read_text() == "x y"
    assert (old / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert (old / "README.md").read_text() == "changed"
    assert (old / "cwd.txt").read_text() == "by its working folder"
    assert left_beside(old) == []


def test_a_folder_turned_into_a_file_during_the_commit_keeps_the_old_folder(worker, old, saved, tmp_path):
    """The user replaces the (already carried) ``tokenizer`` folder by a file while the commit runs: the new
    checkpoint is committed, and the old folder, holding that file, is kept beside it as ``out.kept-*``, which
    the next commit leaves alone too."""
    pid = worker.start(NEW, old, tmp_path / "c", hook="stall", at="swap")
    try:
        wait_for(lambda: (tmp_path / "c" / "stalled").exists(), "the save to stall")
        shutil.rmtree(old / "tokenizer")
        (old / "tokenizer").write_text("now a file")
    finally:
        (tmp_path / "c" / "go").touch()
    assert worker.wait(pid) == 0
    assert holds(old, saved[NEW])
    (left,) = left_beside(old)
    assert left.startswith("out.kept-") and (old.parent / left / "tokenizer").read_text() == "now a file"
    assert "remove-old" not in steps_of(tmp_path / "c")
    save_hf_checkpoint(build("llama", OLD)[1], old, options=SaveOptions(max_shard_size=SHARDS[OLD], progress=False))
    assert holds(old, saved[OLD]) and left_beside(old) == [left]


# ---------------------------------------------------------------------------------------------------
# the lock


@pytest.mark.parametrize("target", ["missing", "existing"])
def test_a_lock_path_that_is_a_symlink_is_not_followed(old, saved, tmp_path, target):
    """``.out.lock`` is a symlink to a file elsewhere (missing, or the user's): the save refuses with an
    ``OSError`` naming the lock path; the file is not created (or not touched), the link stays, the old
    checkpoint is whole and the staging folder gone."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "file"
    if target == "existing":
        victim.write_text("the user's")
    lock = old.parent / ".out.lock"
    lock.symlink_to(victim)
    with pytest.raises(OSError, match="lock path is a symlink") as info:
        save_hf_checkpoint(build("llama", NEW)[1], old, options=SaveOptions(max_shard_size=SHARDS[NEW], progress=False))
    assert str(lock) in str(info.value)
    assert os.listdir(elsewhere) == ([] if target == "missing" else ["file"])
    if target == "existing":
        assert victim.read_text() == "the user's"
    assert lock.is_symlink() and os.readlink(lock) == str(victim)
    assert holds(old, saved[OLD]) and left_beside(old) == [".out.lock"]
