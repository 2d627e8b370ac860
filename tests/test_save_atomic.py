"""The commit of ``save_hf_checkpoint`` is one atomic step (issue 15).

Every save runs in a real process forked by tests/commit_worker.py (torch and transformers imported once) with a
hook before each commit step that kills it (SIGKILL), raises (a rename that fails) or stalls it. What is left is
read back by ``load_hf_checkpoint`` *and* transformers' ``from_pretrained``: exactly the old model or exactly the
new one, bit for bit, with the user's own files (a README, a tokenizer folder) kept. The old checkpoint holds 6
shards (20KB), the new 3 (45KB): a mix of the two, or a folder of shards without its index, cannot pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_models import build, clone_state
from transformers import AutoModelForCausalLM

from loader import CheckpointError, SafetensorsCheckpoint, load_hf_checkpoint, save_hf_checkpoint
from loader.options import LoadOptions, SaveOptions
from loader.storage import local_commit as commit

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

HERE = Path(__file__).resolve().parent
OLD, NEW, NEXT = 1, 2, 3  # model seeds
SHARDS = {OLD: "20KB", NEW: "45KB", NEXT: "45KB"}
SWAP_STEPS = [
    "lock",
    "recover",
    "carry README.md",
    "carry tokenizer",
    "rescan",
    "stage",
    "swap",
    "take-late",
    "remove-old",
    "done",
]
FALLBACK_STEPS = [
    "lock",
    "recover",
    "carry README.md",
    "carry tokenizer",
    "rescan",
    "move-aside",
    "move-in",
    "take-late",
    "remove-old",
    "done",
]
FRESH_STEPS = ["lock", "recover", "rename", "done"]


class Worker:
    def __init__(self) -> None:
        path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])  # this checkout's loader
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "commit_worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=HERE, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip

    def ask(self, **cmd: object) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the commit worker died"
        return json.loads(line)

    def start(self, seed: int, out: Path, control: Path, hook: str = "none", at: int | str = -1, **kw) -> int:
        control.mkdir(parents=True, exist_ok=True)
        cmd = dict(seed=seed, out=str(out), shard=SHARDS[seed], control=str(control), hook=hook, at=at, **kw)
        return self.ask(op="start", **cmd)["pid"]

    def wait(self, pid: int) -> int:
        return self.ask(op="wait", pid=pid)["code"]

    def save(self, *args, **kwargs) -> int:
        return self.wait(self.start(*args, **kwargs))


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.proc.stdin.close()
    w.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def states() -> dict[int, dict[str, torch.Tensor]]:
    return {seed: clone_state(build("llama", seed)[1]) for seed in (OLD, NEW, NEXT)}


@pytest.fixture(scope="module")
def old_folder(tmp_path_factory) -> Path:
    """The old checkpoint (6 shards and the index), with a README and a tokenizer folder of the user's."""
    folder = tmp_path_factory.mktemp("old") / "out"
    save_hf_checkpoint(build("llama", OLD)[1], folder, options=SaveOptions(max_shard_size=SHARDS[OLD], progress=False))
    (folder / "README.md").write_text("mine")
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "vocab.txt").write_text("a b c")
    return folder


def fresh_copy(old_folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt" / "out"
    shutil.copytree(old_folder, out)
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def which_model(path: Path, states: dict) -> tuple[int | None, int | None]:
    """The seed whose every tensor ``load_hf_checkpoint`` and ``from_pretrained`` of ``path`` give, bit for bit
    (None: no single model)."""

    def match(state: dict) -> int | None:
        found = [s for s, want in states.items() if all(bit_equal(state[k], v) for k, v in want.items())]
        return found[0] if len(found) == 1 else None

    model = build("llama", 0)[1]
    load_hf_checkpoint(model, path, options=LoadOptions(progress=False))
    ours = match(clone_state(model))
    theirs = match(clone_state(AutoModelForCausalLM.from_pretrained(path)))
    return ours, theirs


def assert_whole(path: Path, seed: int, states: dict) -> None:
    assert which_model(path, states) == (seed, seed)
    assert (path / "README.md").read_text() == "mine"
    assert (path / "tokenizer" / "vocab.txt").read_text() == "a b c"


def steps_of(control: Path) -> list[str]:
    return (control / "steps").read_text().splitlines()


def left_beside(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out.parent) if n != "out")


# ---------------------------------------------------------------------------------------------------
# the steps


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "fallback"])
def test_the_commit_steps_and_what_they_keep(worker, states, old_folder, tmp_path, swap):
    """One whole save: the steps taken (the swap where Linux offers it), the user's files carried over as
    hard links of the very same files, the folder's mode kept, nothing left beside the folder."""
    if swap and commit.swapper() is None:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    out = fresh_copy(old_folder, tmp_path)
    os.chmod(out, 0o750)
    (out.parent / "out.old-20241201").mkdir()  # the user's, not a commit's leftover: left alone
    readme = os.stat(out / "README.md").st_ino
    assert worker.save(NEW, out, tmp_path / "c", swap=swap) == 0
    assert steps_of(tmp_path / "c") == (SWAP_STEPS if swap else FALLBACK_STEPS)
    assert_whole(out, NEW, states)
    assert os.stat(out / "README.md").st_ino == readme and os.stat(out).st_mode & 0o777 == 0o750
    assert sorted(os.listdir(out)) == sorted(
        ["README.md", "tokenizer", "config.json", "generation_config.json", "model.safetensors.index.json"]
        + [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    )
    assert left_beside(out) == ["out.old-20241201"]


def test_a_symlink_to_a_folder_stays_a_symlink(states, old_folder, tmp_path):
    """Saving into a symlink to a folder commits in the folder it names (beside it); the link stays."""
    out = fresh_copy(old_folder, tmp_path)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    save_hf_checkpoint(build("llama", NEW)[1], link, options=SaveOptions(max_shard_size=SHARDS[NEW], progress=False))
    assert link.is_symlink() and os.readlink(link) == str(out)
    assert_whole(out, NEW, states)
    assert left_beside(out) == []


# ---------------------------------------------------------------------------------------------------
# SIGKILL before every step


@pytest.mark.parametrize(("swap", "steps"), [(True, SWAP_STEPS), (False, FALLBACK_STEPS)], ids=["swap", "fallback"])
def test_a_kill_at_every_commit_step_leaves_the_old_or_the_new_model(worker, states, old_folder, tmp_path, swap,
                                                                      steps):  # fmt: skip
    """SIGKILL just before each step (so just after the one before): exit status -9, then the folder holds the old
    model whole before the swap and the new one whole after it. With two renames, a kill between them leaves no
    folder and the old one whole under ``out.old-*``, put back by the next save. The next save always commits
    cleanly: the user's files kept, nothing of the killed save's commit left but its staging folder."""
    if swap and commit.swapper() is None:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    at_swap = steps.index("swap" if swap else "move-in")
    for k, step in enumerate(steps):
        case = tmp_path / str(k)
        out = fresh_copy(old_folder, case)
        assert worker.save(NEW, out, case / "c", hook="kill", at=k, swap=swap) == -9, step
        assert steps_of(case / "c")[-1] == step
        if not swap and step == "move-in":  # between the two renames
            assert not os.path.exists(out)
            (aside,) = [out.parent / n for n in left_beside(out) if n.startswith("out.old-")]
            assert_whole(aside, OLD, states)
        else:
            assert_whole(out, NEW if k > at_swap else OLD, states)
        assert all(n == ".out.lock" or n.startswith(("out.tmp-", "out.old-")) for n in left_beside(out)), step
        save_hf_checkpoint(
            build("llama", NEXT)[1], out, options=SaveOptions(max_shard_size=SHARDS[NEXT], progress=False)
        )
        assert_whole(out, NEXT, states)
        assert all(n.startswith("out.tmp-") for n in left_beside(out)), (step, left_beside(out))
        assert len(left_beside(out)) <= 1


def test_a_kill_while_saving_into_a_new_path(worker, states, tmp_path):
    for k, step in enumerate(FRESH_STEPS):
        out = tmp_path / str(k) / "out"
        assert worker.save(NEW, out, tmp_path / str(k) / "c", hook="kill", at=k) == -9, step
        if k <= FRESH_STEPS.index("rename"):
            assert not os.path.exists(out), step
        else:
            assert which_model(out, states) == (NEW, NEW)


# ---------------------------------------------------------------------------------------------------
# a failed rename


@pytest.mark.parametrize(("swap", "steps"), [(True, SWAP_STEPS), (False, FALLBACK_STEPS)], ids=["swap", "fallback"])
def test_an_error_at_any_commit_step_leaves_the_old_checkpoint_whole(worker, states, old_folder, tmp_path, swap,
                                                                      steps):  # fmt: skip
    """An ``OSError`` in place of each step (the swap or a rename failing): up to the swap the save raises and
    the old checkpoint is whole, with nothing left beside it; after the swap the save has succeeded (the removal
    of the old folder is best effort, what it leaves goes at the next commit)."""
    if swap and commit.swapper() is None:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    at_swap = steps.index("swap" if swap else "move-in")
    for k, step in enumerate(steps):
        case = tmp_path / str(k)
        out = fresh_copy(old_folder, case)
        code = worker.save(NEW, out, case / "c", hook="error", at=k, swap=swap)
        if k <= at_swap:
            assert code == 3, step
            assert "OSError: [Errno 5] injected failure" in (case / "c" / "error").read_text()
            assert_whole(out, OLD, states)
            assert left_beside(out) == [], (step, left_beside(out))
        else:
            assert code == 0, step
            assert_whole(out, NEW, states)
            left = left_beside(out)  # the old folder, when its removal failed, or kept when the move out of it did
            assert len(left) == (step in ("take-late", "remove-old")), left
            assert all(n.startswith("out.kept-" if step == "take-late" else "out.old-") for n in left), left


# ---------------------------------------------------------------------------------------------------
# concurrent saves


def wait_for(predicate, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_concurrent_saves_commit_one_after_the_other(worker, states, old_folder, tmp_path):
    """Save A stalls in the middle of its commit (staged, holding the lock); save B, into the same folder, waits
    for the lock. Meanwhile a reader sees the old model, whole. Then A commits, B commits after it: both succeed,
    the folder holds B's model whole, nothing is left beside it."""
    out = fresh_copy(old_folder, tmp_path)
    a = worker.start(NEW, out, tmp_path / "a", hook="stall", at="swap")
    try:
        wait_for(lambda: (tmp_path / "a" / "stalled").exists(), "save A to stall")
        b = worker.start(NEXT, out, tmp_path / "b")
        wait_for(lambda: (tmp_path / "b" / "steps").exists() and "wait" in steps_of(tmp_path / "b"), "B to wait")
        assert_whole(out, OLD, states)
    finally:
        (tmp_path / "a" / "go").touch()
    assert (worker.wait(a), worker.wait(b)) == (0, 0)
    assert_whole(out, NEXT, states)
    assert left_beside(out) == []


def test_a_save_waits_for_the_lock_no_longer_than_its_timeout(worker, states, old_folder, tmp_path):
    out = fresh_copy(old_folder, tmp_path)
    a = worker.start(NEW, out, tmp_path / "a", hook="stall", at="stage")
    try:
        wait_for(lambda: (tmp_path / "a" / "stalled").exists(), "save A to stall")
        assert worker.save(NEXT, out, tmp_path / "b", timeout=0.5) == 3
    finally:
        (tmp_path / "a" / "go").touch()
    error = (tmp_path / "b" / "error").read_text()
    assert error.startswith("TimeoutError: cannot commit the checkpoint to") and ".out.lock" in error
    assert worker.wait(a) == 0
    assert_whole(out, NEW, states)
    assert left_beside(out) == []


# ---------------------------------------------------------------------------------------------------
# the load side: shards without their index


def test_a_folder_of_shards_without_an_index_is_refused(states, old_folder, tmp_path):
    """What the old commit left when killed: the old shards, some new ones over them, no index. Refused, naming
    the folder and the missing index, as ``from_pretrained`` refuses it."""
    out = fresh_copy(old_folder, tmp_path)
    new = tmp_path / "new"
    save_hf_checkpoint(build("llama", NEW)[1], new, options=SaveOptions(max_shard_size=SHARDS[NEW], progress=False))
    os.remove(out / "model.safetensors.index.json")
    for name in os.listdir(new):
        if name.startswith("model-"):
            shutil.copy(new / name, out / name)
    for opener in (
        SafetensorsCheckpoint.open,
        lambda p: load_hf_checkpoint(build("llama", 0)[1], p, options=LoadOptions(progress=False)),
    ):
        with pytest.raises(CheckpointError, match="model.safetensors.index.json") as info:
            opener(out)
        assert str(out) in str(info.value) and "model-00001-of-00003.safetensors, model-00001-of-00006" in str(
            info.value
        )
    with pytest.raises(OSError, match="no file named model.safetensors"):
        AutoModelForCausalLM.from_pretrained(out)
