"""Files that change while they are read: the load must never fault and never load garbage.

Each scenario that could kill the interpreter runs in a subprocess (``python -c``) that loads a TP-style
column shard (``ROWS`` short runs per tensor: the many-run read path), tampers with a checkpoint file at a
fixed point, and writes what happened (``result.json``) and the model's tensors before and after
(``before.safetensors`` / ``after.safetensors``). The test asserts the exit status (0: no signal), the
error (a ``CheckpointError`` naming the file, ``.path`` set) and the model's bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loader import CheckpointError, HFLoadPlanner, SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import FileIdentity, FileReader
from loader.execute import STRIDED_RUNS, read_layout
from loader.hooks import PlanHooks
from loader.options import LoadOptions
from loader.plan.slots import TargetSlot
from regiontrace.executor import RunGrid

TESTS = os.path.dirname(os.path.abspath(__file__))
ROWS, COLS = 512, 64  # bf16: 128 B rows; columns [C0, C1) are 32 B of every row, ROWS runs per tensor
C0, C1 = 16, 32
FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TIMEOUT = 300


# ----------------------------------------------------------------------------------------------- the model


def checkpoint_tensors(seed: int = 0, rows: int = ROWS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g),
        "col": torch.randn(rows, COLS, generator=g).to(torch.bfloat16),
        "col2": torch.randn(rows, COLS, generator=g).to(torch.bfloat16),
    }  # fmt: skip


def write_checkpoint(root: Path, seed: int = 0, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """Two shards: ``a``, ``b`` in the first; the column-sharded ``col``, ``col2`` (``rows`` rows) in the second."""
    t = checkpoint_tensors(seed, rows)
    save_file({k: t[k] for k in ("a", "b")}, str(root / FIRST))
    save_file({k: t[k] for k in ("col", "col2")}, str(root / SECOND))
    weight_map = {"a": FIRST, "b": FIRST, "col": SECOND, "col2": SECOND}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return t


class Net(nn.Module):
    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.a = nn.Parameter(torch.randn(16, 8, generator=g))
        self.b = nn.Parameter(torch.randn(8, generator=g))
        self.col = nn.Parameter(torch.randn(rows, COLS, generator=g).to(torch.bfloat16))
        self.col2 = nn.Parameter(torch.randn(rows, COLS, generator=g).to(torch.bfloat16))


def expected_state(net_before: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict:
    """``a``, ``b`` loaded whole; of ``col``/``col2`` only columns ``[C0, C1)`` (this rank's shard)."""
    out = {k: v.clone() for k, v in net_before.items()}
    out["a"], out["b"] = tensors["a"], tensors["b"]
    for k in ("col", "col2"):
        out[k][:, C0:C1] = tensors[k][:, C0:C1]
    return out


class ColumnShard(PlanHooks):
    """This rank owns columns ``[C0, C1)`` of ``col`` and ``col2`` (a TP column shard: one short run per row)."""

    def target_slot(self, name: str, tensor: torch.Tensor) -> TargetSlot:
        if name not in ("col", "col2"):
            return super().target_slot(name, tensor)
        rows = tensor.shape[0]
        boxes = ((((0, rows), (C0, C1)), ((0, rows), (0, C1 - C0))),)  # one (global box, local box) pair
        return TargetSlot(name, tuple(tensor.shape), tensor.dtype, tensor.data[:, C0:C1], boxes)


class ColumnShardPlanner(HFLoadPlanner):
    """A planner with :class:`ColumnShard`'s hooks; ``after_plan(checkpoint, plan)`` runs after the headers were read
    and the plan built, before any data read."""

    def __init__(self, model: nn.Module, after_plan=None) -> None:
        super().__init__(model, hooks=ColumnShard())
        self.after_plan = after_plan

    def build_plan(self, checkpoint, *args, **kwargs):
        plan = super().build_plan(checkpoint, *args, **kwargs)
        if self.after_plan is not None:
            self.after_plan(checkpoint, plan)
        return plan


def state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# ----------------------------------------------------------------------------------------------- tampering


def overwrite_in_place(path: Path) -> None:
    """Same inode, same size, other data bytes; the mtime moved on by a second (coarse clocks cannot hide it)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        n = min(4096, st.st_size // 4)  # the tail of the data section
        f.seek(st.st_size - n)
        f.write((bytes(range(256)) * 16)[:n])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def overwrite_mtime_put_back(path: Path) -> None:
    """Same inode, same size, other data bytes, and the old atime and mtime put back with ``os.utime``."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        n = min(4096, st.st_size // 4)
        f.seek(st.st_size - n)
        f.write((bytes(range(256)) * 16)[:n])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def recreate_same_mtime(path: Path) -> None:
    """Deleted and written anew (the filesystem may hand out the freed inode number again) with the same size
    and the old mtime put back: only the ctime tells the two apart when the inode number is reused."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    n = min(4096, len(data) // 4)
    data[-n:] = (bytes(range(256)) * 16)[:n]
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def replace_file(path: Path) -> None:
    """A new file (new inode) renamed over ``path``: other values, a longer header (every offset moves)."""
    t = checkpoint_tensors(seed=7)
    tmp = path.with_suffix(".new")
    save_file({k: t[k] for k in ("col", "col2")}, str(tmp), metadata={"format": "pt", "note": "x" * 100})
    os.replace(tmp, path)


def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def data_start(path: Path, key: str) -> int:
    return SafetensorsCheckpoint.open(str(path))[key].data_start


# ----------------------------------------------------------------------------------------------- scenarios
# (run in a subprocess: each writes result.json, before.safetensors and after.safetensors into ``root``)


def _finish(root: Path, before: dict, net: nn.Module, error: BaseException | None, **extra) -> None:
    save_file(before, str(root / "before.safetensors"))
    save_file(state(net), str(root / "after.safetensors"))
    kind = None if error is None else type(error).__name__
    result = {"error": kind, "message": str(error or ""), "path": getattr(error, "path", None), **extra}
    (root / "result.json").write_text(json.dumps(result))


def _load(root: Path, tamper, *, rollback: bool) -> None:
    """Load ``root`` into a Net through ``load_hf_checkpoint``; ``tamper(checkpoint, plan)`` runs after planning."""
    net = Net()
    before = state(net)
    error = None
    try:
        load_hf_checkpoint(
            net,
            str(root),
            planner=ColumnShardPlanner(net, tamper),
            options=LoadOptions(rollback=rollback, progress=False),
        )
    except CheckpointError as e:
        error = e
    _finish(root, before, net, error)


def scenario_truncated_after_planning(root: Path) -> None:
    victim = root / SECOND
    keep = data_start(victim, "col") + 1000  # inside col: its many-run read hits the end of the file
    _load(root, lambda ckpt, plan: truncate(victim, keep), rollback=True)


def scenario_replaced(root: Path, rollback: bool) -> None:
    _load(root, lambda ckpt, plan: replace_file(root / SECOND), rollback=rollback)


def scenario_overwritten(root: Path) -> None:
    _load(root, lambda ckpt, plan: overwrite_in_place(root / SECOND), rollback=True)


def scenario_overwritten_mtime_put_back(root: Path) -> None:
    _load(root, lambda ckpt, plan: overwrite_mtime_put_back(root / SECOND), rollback=True)


def scenario_recreated_same_mtime(root: Path) -> None:
    _load(root, lambda ckpt, plan: recreate_same_mtime(root / SECOND), rollback=True)


class WriterAfterFirstRead(FileReader):
    """A reader of the real files during whose load a writer rewrites ``victim`` in place, right after the
    first bytes of ``victim`` were read: the rest of the reads see the new bytes (same size, new mtime)."""

    def __init__(self, victim: str) -> None:
        super().__init__()
        self.victim, self.done = victim, False

    def _after(self, file: str) -> None:
        if file == self.victim and not self.done:
            self.done = True
            overwrite_in_place(Path(file))

    def pread_into(self, file, offset, out) -> None:
        super().pread_into(file, offset, out)
        self._after(file)

    def read_spans(self, file, spans, out, base, *, wanted=None) -> None:
        super().read_spans(file, spans, out, base, wanted=wanted)
        self._after(file)


def scenario_changed_during_read(root: Path) -> None:
    from loader.execute import execute_plan

    net = Net()
    before = state(net)
    plan = ColumnShardPlanner(net).build_plan(SafetensorsCheckpoint.open(str(root)))
    reader = WriterAfterFirstRead(str(root / SECOND))
    error = None
    try:
        with reader:
            execute_plan(plan, reader, LoadOptions(rollback=True))
    except CheckpointError as e:
        error = e
    _finish(root, before, net, error, tampered=reader.done)


def scenario_truncated_between_blocks(root: Path) -> None:
    """Direct BlockExecutor run: after the first block (col) of the second file, that file is cut inside
    col2, which is then read from the open descriptor (no reopen): a short read, not a fault."""
    from loader.execute import BlockExecutor

    net = Net()
    before = state(net)
    checkpoint = SafetensorsCheckpoint.open(str(root))
    plan = ColumnShardPlanner(net).build_plan(checkpoint)
    victim = root / SECOND
    keep = data_start(victim, "col2") + 1000
    reads = [r for r in plan.reads if checkpoint[r.block.source].file == str(victim)]
    calls = []

    def progress(n: int) -> None:
        if not calls:
            truncate(victim, keep)
        calls.append(n)

    error = None
    try:
        with FileReader() as reader:
            BlockExecutor(checkpoint, plan.slots, reader, progress=progress).run(reads)
    except CheckpointError as e:
        error = e
    _finish(root, before, net, error, blocks_done=len(calls))


def run_scenario(root: Path, call: str, module: str = "test_read_faults") -> dict:
    """Run ``call`` (e.g. ``scenario_replaced(root, True)``), a function of test module ``module``, in a fresh
    interpreter; its exit status must be 0 (negative: killed by a signal)."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {TESTS!r})
        from {module} import *
        root = Path(sys.argv[1])
        {call}
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit status {proc.returncode} (negative: killed by signal)\n{proc.stderr}"
    result = json.loads((root / "result.json").read_text())
    result["before"] = load_file(str(root / "before.safetensors"))
    result["after"] = load_file(str(root / "after.safetensors"))
    return result


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path)
    return tmp_path


def assert_names_victim(result: dict, root: Path, *words: str) -> None:
    victim = str(root / SECOND)
    assert result["error"] == "CheckpointError", result
    assert result["path"] == victim and victim in result["message"], result
    for w in words:
        assert w in result["message"], (w, result["message"])


# ----------------------------------------------------------------------------------------------- tests


def test_normal_load_is_bit_exact(root):
    """Unchanged files: the column shards and whole tensors load bit for bit; bytes_read counts exactly the
    shard's bytes, the gaps read through (on pages the runs touch anyway) are counted apart."""
    from loader.execute import execute_plan

    tensors = load_file(str(root / FIRST)) | load_file(str(root / SECOND))
    net = Net()
    before = state(net)
    plan = ColumnShardPlanner(net).build_plan(SafetensorsCheckpoint.open(str(root)))
    cols = [read_layout(r.block) for r in plan.reads if r.target in ("col", "col2")]
    assert len(cols) == 2 and all(len(c.runs) == ROWS > STRIDED_RUNS and c.run == C1 - C0 for c in cols)  # many-run
    with FileReader() as reader:  # what load_hf_checkpoint runs
        execute_plan(plan, reader)
    assert bit_equal(state(net), expected_state(before, tensors))
    assert reader.bytes_read == (16 * 8 + 8) * 4 + 2 * ROWS * (C1 - C0) * 2
    assert reader.gap_bytes == 2 * (ROWS - 1) * (COLS - (C1 - C0)) * 2  # each tensor's span minus its runs


def test_truncated_after_planning_is_an_error_not_a_signal(root):
    """(a) the file holding the column shards is cut after planning: CheckpointError, model restored."""
    result = run_scenario(root, "scenario_truncated_after_planning(root)")
    assert_names_victim(result, root, "changed underneath")
    assert bit_equal(result["after"], result["before"])


def test_truncated_while_its_blocks_are_read_is_a_short_read(root):
    """(a) cut after the first block of the file was read, through the descriptor already open: the next
    many-run read comes up short — a CheckpointError, the process lives on."""
    result = run_scenario(root, "scenario_truncated_between_blocks(root)")
    assert_names_victim(result, root, "changed underneath")
    assert result["blocks_done"] == 1  # col was read, col2 was not
    after, before = result["after"], result["before"]
    assert not torch.equal(after["col"], before["col"]) and torch.equal(after["col2"], before["col2"])


@pytest.mark.parametrize("rollback", [False, True])
def test_replaced_file_is_refused(root, rollback):
    """(b) a new file renamed over a shard after its header was read: refused when opened for data (inode);
    without rollback the first shard's tensors are already loaded, with rollback every byte is restored."""
    result = run_scenario(root, f"scenario_replaced(root, {rollback})")
    assert_names_victim(result, root, "changed underneath", "inode")
    after, before = result["after"], result["before"]
    if rollback:
        assert bit_equal(after, before)
    else:
        assert not torch.equal(after["a"], before["a"])  # the first shard was read before the failure
        assert torch.equal(after["col"], before["col"])  # nothing of the replaced file was loaded


def test_overwritten_in_place_same_size_is_refused(root):
    """(c) same inode, same size, new bytes and mtime: refused when opened for data; model restored."""
    size = os.path.getsize(root / SECOND)
    result = run_scenario(root, "scenario_overwritten(root)")
    assert os.path.getsize(root / SECOND) == size
    assert_names_victim(result, root, "changed underneath", "mtime_ns")
    assert bit_equal(result["after"], result["before"])


@pytest.mark.parametrize("scenario", ["scenario_overwritten_mtime_put_back", "scenario_recreated_same_mtime"])
def test_rewritten_with_the_old_mtime_put_back_is_refused(root, scenario):
    """Rewritten in place (or deleted and recreated, perhaps on the same inode number) with size and mtime put
    back by ``os.utime``: the ctime, which no user-space call can set back, still tells; model restored."""
    result = run_scenario(root, f"{scenario}(root)")
    assert_names_victim(result, root, "changed underneath", "ctime_ns")
    assert bit_equal(result["after"], result["before"])


def test_changed_during_the_read_is_caught_after_the_last_read(root):
    """(d) rewritten in place after the first bytes of the file were read: the reads that follow see the new
    bytes; the check after the file's last read refuses them, and rollback restores every tensor."""
    result = run_scenario(root, "scenario_changed_during_read(root)")
    assert result["tampered"]
    assert_names_victim(result, root, "changed underneath", "mtime_ns")
    assert bit_equal(result["after"], result["before"])


RACE_ROWS, RACE_LOADS = 32768, 60  # 4 MiB per column-sharded tensor: each many-run copy takes a while


def test_truncation_racing_the_reads_never_kills_the_process(tmp_path):
    """A writer process cuts and restores the shard over and over while this process loads it many times:
    every load either raises CheckpointError naming the file or is bit-exact; the process never dies (a
    memory-mapped copy dies of SIGBUS here)."""
    root = tmp_path
    write_checkpoint(root, rows=RACE_ROWS)
    victim = root / SECOND
    original = victim.read_bytes()
    keep = data_start(victim, "col2")  # cuts col2 off; rewritten at once (~1 ms), again and again
    writer = textwrap.dedent(f"""
        import os, sys, time
        path, keep, stop = sys.argv[1], {keep}, sys.argv[2]
        tail = open(path, "rb").read()[keep:]
        fd = os.open(path, os.O_WRONLY)
        while not os.path.exists(stop):
            os.ftruncate(fd, keep)
            os.pwrite(fd, tail, keep)
            time.sleep(0.002)
    """)
    loads = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        sys.path.insert(0, {TESTS!r})
        from test_read_faults import *
        root = Path(sys.argv[1])
        tensors = checkpoint_tensors(rows={RACE_ROWS})
        outcomes = {{"ok": 0, "error": 0}}
        for _ in range({RACE_LOADS}):
            net = Net({RACE_ROWS})
            before = state(net)
            try:
                load_hf_checkpoint(net, str(root), planner=ColumnShardPlanner(net), options=LoadOptions(progress=False))
            except CheckpointError as e:
                assert e.path == str(root / SECOND), e
                outcomes["error"] += 1
                kind = "changed underneath" if "changed underneath" in str(e) else "header"
                outcomes[kind] = outcomes.get(kind, 0) + 1
                continue
            assert bit_equal(state(net), expected_state(before, tensors))
            outcomes["ok"] += 1
        print(json.dumps(outcomes))
    """)
    stop = root / "stop"
    proc = subprocess.Popen([sys.executable, "-c", writer, str(victim), str(stop)])
    try:
        result = subprocess.run(
            [sys.executable, "-c", loads, str(root)], capture_output=True, text=True, timeout=TIMEOUT
        )
    finally:
        stop.touch()
        proc.wait(timeout=60)
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stderr}"
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcomes["ok"] + outcomes["error"] == RACE_LOADS, outcomes
    assert victim.read_bytes() == original


# ----------------------------------------------------------------------------------------------- the reader


def test_reader_refuses_a_file_that_is_not_the_expected_identity(root):
    path = str(root / FIRST)
    identity = FileIdentity.of(os.stat(path))
    with FileReader({path: identity}) as reader:
        reader.pread_into(path, 0, bytearray(8))  # opened and checked: fine
        overwrite_in_place(root / FIRST)
        reader.pread_into(path, 0, bytearray(8))  # no check between reads of an open file
        with pytest.raises(CheckpointError, match="mtime_ns") as info:
            reader.verify(path)
        assert info.value.path == path
    with FileReader() as reader:
        reader.expect(path, identity)  # checked on open
        with pytest.raises(CheckpointError, match="changed underneath"):
            reader.fd(path)
        assert path not in reader.files._fds
        reader.expect(path, FileIdentity.of(os.stat(path)))
        reader.verify_all()


def test_read_spans_short_file_is_an_error(root):
    path = str(root / SECOND)
    size = os.path.getsize(path)
    truncate(root / SECOND, size - 10)
    out = bytearray(100)
    with FileReader() as reader, pytest.raises(CheckpointError, match="unexpected end of file") as info:
        reader.read_spans(path, [(size - 100, size - 50), (size - 40, size)], memoryview(out), size - 100)
    assert info.value.path == path


def test_pread_consecutive_reads_the_exact_bytes_and_refuses_a_short_file(tmp_path):
    """Many buffers filled from consecutive file bytes with one preadv per IOV_MAX of them: the same bytes as one
    read per buffer, empty buffers skipped; a file that ends early is a CheckpointError naming it."""
    from loader.storage import IOV_MAX

    path = str(tmp_path / "bytes.bin")
    data = np.random.default_rng(0).integers(0, 256, 3 * IOV_MAX * 5 + 7, dtype=np.uint8).tobytes()
    Path(path).write_bytes(data)
    sizes = [5] * (3 * IOV_MAX) + [0, 3]
    outs = [bytearray(n) for n in sizes]
    with FileReader() as reader:
        reader.pread_consecutive(path, 4, [memoryview(o) for o in outs])
        assert b"".join(outs) == data[4 : 4 + sum(sizes)]
        assert reader.bytes_read == sum(sizes) and reader.reads == 4  # 3 full iovec arrays + the last buffer
    truncate(Path(path), 4 + sum(sizes) - 2)
    with FileReader() as reader, pytest.raises(CheckpointError, match="unexpected end of file") as info:
        reader.pread_consecutive(path, 4, [memoryview(bytearray(n)) for n in sizes])
    assert info.value.path == path


def test_small_tensors_side_by_side_are_read_in_few_calls(tmp_path):
    """2000 small tensors stored one after another load bit-exactly with a handful of read calls, not one each;
    beside them, tensors no whole copy can fill (a cast, a non-contiguous parameter) load exactly too."""
    n = 2000
    values = {f"t{i}": torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(n)}
    values["z_cast"], values["z_transposed"] = torch.randn(4, 5), torch.randn(4, 5)
    save_file(values, str(tmp_path / "model.safetensors"))
    model = nn.ParameterDict({k: nn.Parameter(torch.empty(3)) for k in values if k.startswith("t")})
    model["z_cast"] = nn.Parameter(torch.empty(4, 5, dtype=torch.float64))
    model["z_transposed"] = nn.Parameter(torch.empty(5, 4).t())
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    plan = HFLoadPlanner(model).build_plan(checkpoint)
    from loader.execute import execute_plan

    with FileReader() as reader:
        execute_plan(plan, reader, LoadOptions(progress=False))
    assert all(torch.equal(model[k].detach(), v.to(model[k].dtype)) for k, v in values.items())
    assert not model["z_transposed"].is_contiguous()
    assert reader.bytes_read == n * 12 + 2 * 80 and reader.reads <= n // 1000 + 4


def test_page_spans_read_no_page_the_runs_do_not_touch():
    """The spans a block's runs are read by (RunGrid.spans, what FileReader.read_runs reads)."""
    page = 4096
    # 32 B of every 128 B row: one range
    assert RunGrid(16, 32, ((100, 128),)).spans(page) == [(16, 99 * 128 + 48)]
    # 4 KiB of every 32 KiB row: gaps hold whole untouched pages, one range per run
    assert RunGrid(100, 4096, ((4, 32768),)).spans(page) == [(100 + r * 32768, 4196 + r * 32768) for r in range(4)]
