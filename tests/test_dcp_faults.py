"""Files that change while ``torch.distributed.checkpoint.load`` reads them through ``SafetensorsReader``: the same
promises as ``load_hf_checkpoint`` (tests/test_read_faults.py) — a file overwritten after planning is refused, a
file truncated mid-read is an error naming it, and with ``SafetensorsReader(options=LoadOptions(rollback=True))``
the model is left exactly as it was.

Each scenario runs in a subprocess (``python -c``) on the checkpoint and the column-sharded model of
test_read_faults.py, tampers with the second file at a fixed point, and writes the error (``dcp.load`` raises
torch's ``CheckpointException``; the reader's ``CheckpointError`` is its failure on rank 0) and the model's
tensors before and after. The test asserts the exit status, the error and the model's bytes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from loader import SafetensorsReader
from loader.checkpoint import FileReader
from loader.options import LoadOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_read_faults as read_faults
from test_read_faults import (
    FIRST,
    SECOND,
    ColumnShardPlanner,
    Net,
    bit_equal,
    checkpoint_tensors,
    data_start,
    expected_state,
    overwrite_in_place,
    overwrite_mtime_put_back,
    state,
    truncate,
    write_checkpoint,
)

TESTS = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------- tampering


class CutAfterFirstRead(FileReader):
    """The real reader of a load during which ``victim`` is truncated to ``keep`` bytes right after its first
    read: the load is cut in the middle of that file's reads."""

    def __init__(self, victim: str, keep: int, identities) -> None:
        super().__init__(identities)
        self.victim, self.keep, self.done = victim, keep, False

    def _after(self, file: str) -> None:
        if file == self.victim and not self.done:
            self.done = True
            truncate(Path(file), self.keep)

    def pread_into(self, file, offset, out) -> None:
        super().pread_into(file, offset, out)
        self._after(file)

    def read_spans(self, file, spans, out, base, *, wanted=None) -> None:
        super().read_spans(file, spans, out, base, wanted=wanted)
        self._after(file)


class CuttingReader(SafetensorsReader):
    """``SafetensorsReader`` whose reads go through :class:`CutAfterFirstRead`."""

    def __init__(self, path: str, victim: str, keep: int, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.victim, self.keep, self.cut = victim, keep, None

    def _file_reader(self) -> FileReader:
        self.cut = CutAfterFirstRead(self.victim, self.keep, self.checkpoint.identities)
        return self.cut


class CutAfterFirstCommit(DefaultLoadPlanner):
    """torch's own planner (plain box reads); ``victim`` is truncated to ``keep`` bytes after the first tensor
    read from it was committed: the next box of that file is read from the cut file."""

    def __init__(self, victim: str, keep: int) -> None:
        super().__init__()
        self.victim, self.keep, self.done, self.committed = victim, keep, False, []

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.committed.append(read_item.dest_index.fqn)
        if read_item.dest_index.fqn in ("col", "col2") and not self.done:
            self.done = True
            truncate(Path(self.victim), self.keep)


# ----------------------------------------------------------------------------------------------- scenarios
# (run in a subprocess: each writes result.json, before.safetensors and after.safetensors into ``root``)


def _finish(root: Path, before: dict, net, error: BaseException | None, **extra) -> None:
    """Record the outcome; ``error`` is the ``CheckpointException`` of ``dcp.load`` (or None)."""
    from safetensors.torch import save_file

    cause = None if error is None else next(iter(error.failures.values()))[0]
    result = {
        "error": None if error is None else type(error).__name__,
        "cause": None if cause is None else type(cause).__name__,
        "message": str(cause or ""),
        "outer": str(error or ""),
        "path": getattr(cause, "path", None),
        **extra,
    }
    save_file(before, str(root / "before.safetensors"))
    save_file(state(net), str(root / "after.safetensors"))
    (root / "result.json").write_text(json.dumps(result))


def _dcp_load(root: Path, net, planner, reader) -> BaseException | None:
    """``dcp.load`` into ``net`` in one process; its ``CheckpointException`` (a BaseException) or None."""
    state_dict = planner.state_dict_for_load() if hasattr(planner, "state_dict_for_load") else net.state_dict()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:
        return e
    return None


def scenario_overwritten(root: Path, put_back: bool, rollback: bool) -> None:
    """``SECOND`` overwritten in place (same size; the mtime moved on, or put back) after planning."""
    tamper = overwrite_mtime_put_back if put_back else overwrite_in_place
    net = Net()
    before = state(net)
    planner = ColumnShardPlanner(net, lambda ckpt, plan: tamper(root / SECOND))
    error = _dcp_load(root, net, planner, SafetensorsReader(str(root), options=LoadOptions(rollback=rollback)))
    _finish(root, before, net, error)


def scenario_truncated_mid_read(root: Path, rollback: bool) -> None:
    """``SECOND`` cut inside ``col2`` right after its first read (``FIRST`` already loaded, ``col`` partly)."""
    net = Net()
    before = state(net)
    victim = root / SECOND
    reader = CuttingReader(
        str(root), str(victim), data_start(victim, "col2") + 1000, options=LoadOptions(rollback=rollback)
    )
    error = _dcp_load(root, net, ColumnShardPlanner(net), reader)
    _finish(root, before, net, error, cut=reader.cut is not None and reader.cut.done)


def scenario_truncated_mid_read_default_planner(root: Path, rollback: bool) -> None:
    """torch's ``DefaultLoadPlanner``: ``SECOND`` cut inside ``col2`` after ``col`` was committed."""
    net = Net()
    before = state(net)
    victim = root / SECOND
    planner = CutAfterFirstCommit(str(victim), data_start(victim, "col2") + 1000)
    error = _dcp_load(root, net, planner, SafetensorsReader(str(root), options=LoadOptions(rollback=rollback)))
    _finish(root, before, net, error, committed=planner.committed)


def run_scenario(root: Path, call: str) -> dict:
    """Run ``call``, a scenario of this module, in a fresh interpreter (see :func:`test_read_faults.run_scenario`)."""
    return read_faults.run_scenario(root, call, module="test_dcp_faults")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path)
    return tmp_path


def assert_names_victim(result: dict, root: Path, *words: str) -> None:
    victim = str(root / SECOND)
    assert result["error"] == "CheckpointException" and result["cause"] == "CheckpointError", result
    assert result["path"] == victim and victim in result["message"] and victim in result["outer"], result
    for w in words:
        assert w in result["message"], (w, result["message"])


# ----------------------------------------------------------------------------------------------- tests


def test_dcp_load_through_the_reader_is_bit_exact(root):
    """The untampered load the scenarios below break: the model gets the shard, bit for bit."""
    net = Net()
    before = state(net)
    planner = ColumnShardPlanner(net)
    assert _dcp_load(root, net, planner, SafetensorsReader(str(root), options=LoadOptions(rollback=True))) is None
    assert bit_equal(state(net), expected_state(before, checkpoint_tensors()))


def test_metadata_carries_every_files_identity(root):
    """The identities recorded with the headers travel in ``storage_data`` to the plan's checkpoint."""
    from loader.checkpoint import FileIdentity, SafetensorsCheckpoint
    from loader.planner import checkpoint_from_metadata

    reader = SafetensorsReader(str(root))
    md = reader.read_metadata()
    want = SafetensorsCheckpoint.open(str(root)).identities
    assert set(want) == {str(root / FIRST), str(root / SECOND)}
    assert {i.fqn: v for i, v in md.storage_data.items() if isinstance(v, FileIdentity)} == want
    assert checkpoint_from_metadata(md).identities == want
    # a reader set up with metadata read elsewhere reads what those headers say, checked against their
    # identities: not the file as it is now, rewritten since
    overwrite_in_place(root / SECOND)
    other = SafetensorsReader(str(root))
    other.set_up_storage_reader(md, True)
    assert other.checkpoint.identities == want and other.checkpoint.tensors == reader.checkpoint.tensors
    assert want[str(root / SECOND)] != FileIdentity.of(os.stat(root / SECOND))


@pytest.mark.parametrize("put_back", [False, True], ids=["mtime_moved", "mtime_put_back"])
def test_overwritten_after_planning_is_refused_and_rolled_back(root, put_back):
    result = run_scenario(root, f"scenario_overwritten(root, put_back={put_back}, rollback=True)")
    assert_names_victim(result, root, "changed underneath", "ctime_ns")
    # FIRST was read before SECOND was found changed: rollback put a and b back
    assert bit_equal(result["after"], result["before"])


def test_overwritten_after_planning_without_rollback_loads_nothing_of_the_new_bytes(root):
    result = run_scenario(root, "scenario_overwritten(root, put_back=True, rollback=False)")
    assert_names_victim(result, root, "changed underneath")
    after, before, t = result["after"], result["before"], checkpoint_tensors()
    assert torch.equal(after["a"], t["a"]) and torch.equal(after["b"], t["b"])  # FIRST loaded (no rollback)
    assert torch.equal(after["col"], before["col"]) and torch.equal(after["col2"], before["col2"])


@pytest.mark.parametrize("rollback", [True, False])
def test_truncated_mid_read_names_the_file_and_rolls_back(root, rollback):
    result = run_scenario(root, f"scenario_truncated_mid_read(root, rollback={rollback})")
    assert result["cut"], "the file was never cut: the scenario tested nothing"
    assert_names_victim(result, root)
    if rollback:
        assert bit_equal(result["after"], result["before"])
    else:  # the half-written model the rollback must undo
        assert not torch.equal(result["after"]["a"], result["before"]["a"])


@pytest.mark.parametrize("rollback", [True, False])
def test_truncated_mid_read_with_torchs_planner_rolls_back(root, rollback):
    result = run_scenario(root, f"scenario_truncated_mid_read_default_planner(root, rollback={rollback})")
    assert result["committed"] == ["a", "b", "col"], result["committed"]
    assert_names_victim(result, root)
    if rollback:
        assert bit_equal(result["after"], result["before"])
    else:
        assert torch.equal(result["after"]["col"], checkpoint_tensors()["col"])
