"""The storage's write side (loader/storage/writing.py, the local driver loader/storage/local_write.py): staged
objects, positioned writes, the commit that publishes them over the folder in one step, the abort, the lock.

Real files in a temporary folder; the commit's crash and kill cases are tests/test_save_atomic.py's.
"""

from __future__ import annotations

import os

import pytest

from loader.storage import LocalStore, ObjectWriter, Staging, open_staging, stage
from loader.storage import capabilities as caps
from loader.storage.local_commit import destination
from loader.storage.local_lock import locked


def staged_beside(path) -> list[str]:
    return sorted(n for n in os.listdir(os.path.dirname(path)) if n.startswith(os.path.basename(path) + ".tmp-"))


def test_a_staged_folder_is_committed_in_one_step(tmp_path):
    target = tmp_path / "ckpt"
    staging = LocalStore(str(target)).stage()
    assert isinstance(staging, Staging)
    assert staging.target == str(target) and staging.folder == staging.location
    assert staged_beside(target) == [os.path.basename(staging.location)] and not target.exists()
    staging.create("model.safetensors", 64, b"HEAD")
    with staging.open("model.safetensors") as w:
        assert isinstance(w, ObjectWriter)
        w.pwrite(10, memoryview(b"0123456789"))
        w.pwrite(60, memoryview(b"tail"))
        w.sync()
    staging.put("model.safetensors.index.json", b"{}")
    staging.commit()
    data = (target / "model.safetensors").read_bytes()
    assert data == b"HEAD" + bytes(6) + b"0123456789" + bytes(40) + b"tail"
    assert (target / "model.safetensors.index.json").read_bytes() == b"{}"
    assert staged_beside(target) == []  # the staging folder is the new folder


def test_another_writer_opens_the_staging_area_by_its_location(tmp_path):
    """What another rank does: the location posted, the same objects written at other offsets."""
    staging = stage(str(tmp_path / "ckpt"))
    staging.create("a.bin", 8, b"")
    other = open_staging(staging.location)
    with other.open("a.bin") as w:
        w.pwrite(4, memoryview(b"rank"))
    with staging.open("a.bin") as w:
        w.pwrite(0, memoryview(b"zero"))
    open_staging(staging.location, str(tmp_path / "ckpt")).commit(timeout=None)
    assert (tmp_path / "ckpt" / "a.bin").read_bytes() == b"zerorank"


def test_a_commit_over_a_folder_keeps_the_users_files_and_replaces_the_weights(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "README.md").write_text("mine")
    (target / "model.safetensors").write_bytes(b"old weights")
    staging = stage(str(target))
    staging.create("model.safetensors", 3, b"new")
    staging.commit()
    assert (target / "README.md").read_text() == "mine"
    assert (target / "model.safetensors").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging, no old folder, no lock file left


def test_an_abort_removes_what_was_staged_and_leaves_the_folder(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"old")
    staging = stage(str(target))
    staging.create("model.safetensors", 3, b"new")
    staging.abort()
    assert not os.path.exists(staging.location)
    assert (target / "model.safetensors").read_bytes() == b"old" and staged_beside(target) == []


def test_an_object_is_created_once(tmp_path):
    staging = stage(str(tmp_path / "ckpt"))
    staging.create("a.bin", 4, b"ab")
    assert os.path.getsize(os.path.join(staging.location, "a.bin")) == 4  # the full size, reserved
    with pytest.raises(FileExistsError):
        staging.create("a.bin", 4, b"")
    staging.abort()


def test_what_cannot_be_saved_to_is_refused_before_anything_is_created(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="it is a file, not a folder"):
        stage(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="no write side"):
        stage("https://example.invalid/ckpt")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_a_symlink_to_a_folder_commits_into_the_folder_it_names(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert destination(str(tmp_path / "link")) == str(tmp_path / "real")
    staging = stage(str(tmp_path / "link"))
    staging.put("x.txt", b"x")
    staging.commit()
    assert (tmp_path / "real" / "x.txt").read_bytes() == b"x" and os.path.islink(tmp_path / "link")


def test_a_commit_waits_for_the_lock_at_most_its_timeout(tmp_path):
    """A commit into a folder whose lock another commit holds: ``timeout=0`` gives up at once, the staged objects
    and the folder as they were; once the lock is free the same staging area commits."""
    target = str(tmp_path / "ckpt")
    staging = stage(target)
    staging.put("x.txt", b"x")
    steps: list[str] = []
    with locked(target, None, steps.append):
        with pytest.raises(TimeoutError, match="another save into it held its lock"):
            staging.commit(timeout=0)
    assert steps == ["lock"] and not os.path.exists(target) and os.path.isdir(staging.location)
    staging.commit()
    assert open(os.path.join(target, "x.txt"), "rb").read() == b"x"


def test_only_a_store_with_a_write_side_stages():
    assert caps.has(LocalStore("/nonexistent"), caps.Stages)
