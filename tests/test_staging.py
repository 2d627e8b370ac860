"""The staging ring of the executor: bounded, reused, double-buffered buffers and the copies out of them.

Real safetensors files, real blocks compiled by regiontrace, real reads: every load runs with a tiny staging
size (a few KiB) so that blocks are split and buffers rotate many times, and the loaded values must equal
the tensors ``safetensors`` reads, bit for bit. The device path (pinned buffers, ``non_blocking`` copies,
packing, gathers on the device, events before reuse) runs here on the CPU through :class:`FakeLink`, a
stand-in device whose copies only count as finished once an event recorded after them is waited on: it
checks that no staging buffer is written again before the copies out of it finished.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import build, clone_state, save
from safetensors.torch import load_file, save_file

import regiontrace as rt
from loader import HFLoadPlanner, SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import FileReader
from loader.execute import STAGING_BYTES, BlockExecutor
from loader.execute.staging import ALIGN, StagingRing, align
from loader.options import LoadOptions
from loader.plan import BlockRead
from loader.plan.slots import TargetSlot, full_box

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

ROOT = Path(__file__).resolve().parent.parent
STAGING = 4096  # bytes per buffer: every tensor below is split, every buffer reused many times


# ----------------------------------------------------------------------------------------- a stand-in device


class FakeEvent:
    def __init__(self, link: FakeLink, upto: int) -> None:
        self.link, self.upto = link, upto

    def synchronize(self) -> None:
        self.link.complete(self.upto)


class FakeLink:
    """A device on the CPU whose copies finish only when an event recorded after them is waited on.

    Each copy's destination is written at once, but its source bytes are remembered; when the copy is
    completed (an event recorded after it is synchronised, or :meth:`synchronize`), the source must still
    hold those bytes: a staging buffer written again before its copies finished fails the load.
    """

    pin = False

    def __init__(self) -> None:
        self.queued = 0
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.completed = 0

    def copy(self, dest: torch.Tensor, host: torch.Tensor) -> None:
        assert host.is_contiguous() and host.shape == dest.shape and host.dtype == dest.dtype
        dest.copy_(host)
        self.pending.append((self.queued, host, _bits(host).clone()))
        self.queued += 1

    def record(self) -> FakeEvent:
        return FakeEvent(self, self.queued)

    def complete(self, upto: int) -> None:
        keep = []
        for n, host, bits in self.pending:
            if n >= upto:
                keep.append((n, host, bits))
                continue
            assert torch.equal(_bits(host), bits), "a staging buffer was written before its copy out finished"
            self.completed += 1
        self.pending = keep

    def synchronize(self) -> None:
        self.complete(self.queued)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------- files and blocks


def write_files(root: Path) -> dict[str, torch.Tensor]:
    """Two shards of random tensors (bf16, f32); returns what ``safetensors`` reads back."""
    g = torch.Generator().manual_seed(0)
    first = {
        "a": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "b": torch.randn(96, generator=g),
        "q": torch.randn(128, 32, generator=g),
    }
    second = {
        "c": torch.randn(256, 64, generator=g).to(torch.bfloat16),
        "wide": torch.randn(48, 512, generator=g).to(torch.bfloat16),
    }
    save_file(first, str(root / "model-00001-of-00002.safetensors"))
    save_file(second, str(root / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in second}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = {}
    for name in sorted(os.listdir(root)):
        if name.endswith(".safetensors"):
            out |= load_file(str(root / name))
    return out


#: model tensors as functions of the checkpoint's tensors (run on RegionTensors to compile, on real ones to check)
CASES = {
    "contiguous": lambda t: t["a"],  # one run per part: straight copies
    "cast": lambda t: t["a"].to(torch.float32),  # bf16 -> f32
    "column": lambda t: t["c"][:, 16:32],  # 256 short runs: read by span, gathered
    "sparse_column": lambda t: t["wide"][:, 0:16],  # runs 32 B every 1 KiB: packed on the host
    "interleaved": lambda t: torch.cat([t["q"][0::2], t["q"][1::2]]),  # two blocks, overlapping spans
    "flipped": lambda t: t["a"].flip(0),
    "transposed_cast": lambda t: t["c"][:64].t().to(torch.float32),
    "broadcast": lambda t: t["b"].expand(4, 96),
    "sparse_broadcast": lambda t: t["wide"][:, 0:2].unsqueeze(1).expand(48, 3, 2),  # packed expanded
    "tiny": lambda t: t["b"][3:5],
}
#: model tensors this rank owns part of: (name, function, global box)
SHARDS = {"row_shard": (lambda t: t["c"], ((100, 180), (0, 64))), "col_shard": (lambda t: t["a"], ((0, 64), (8, 40)))}


def targets(checkpoint: SafetensorsCheckpoint, device: str = "cpu") -> tuple[dict, list[BlockRead]]:
    """Slots (filled with a sentinel) and block reads for every case and shard."""
    leaves = {k: rt.RegionTensor.leaf(k, tuple(checkpoint[k].shape), checkpoint[k].dtype) for k in checkpoint}
    slots, reads = {}, []
    for name, fn in CASES.items():
        t = fn(leaves)
        box = full_box(tuple(t.shape))
        local = torch.full(t.shape, -7, dtype=t.dtype, device=device)
        slots[name] = TargetSlot(name, tuple(t.shape), t.dtype, local, ((box, box),))
        reads += [BlockRead(name, box, b) for b in t.remap_blocks()]
    for name, (fn, box) in SHARDS.items():
        t = fn(leaves)
        local_box = tuple((0, b - a) for a, b in box)
        local = torch.full([b - a for a, b in box], -7, dtype=t.dtype, device=device)
        slots[name] = TargetSlot(name, tuple(t.shape), t.dtype, local, ((box, local_box),))
        reads += [BlockRead(name, local_box, b) for b in t.remap_blocks(box)]
    return slots, reads


def expected(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: fn(tensors).contiguous() for name, fn in CASES.items()}
    for name, (fn, box) in SHARDS.items():
        out[name] = fn(tensors)[tuple(slice(a, b) for a, b in box)]
    return out


def assert_bit_equal(slots: dict, want: dict) -> None:
    for name, value in want.items():
        got = slots[name].local.cpu()
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert torch.equal(_bits(got.contiguous()), _bits(value.contiguous())), name


def execute(root: Path, *, staging_bytes: int = STAGING, ring: StagingRing | None = None):
    checkpoint = SafetensorsCheckpoint.open(str(root))
    slots, reads = targets(checkpoint)
    done = []
    with FileReader() as reader:
        ex = BlockExecutor(checkpoint, slots, reader, staging_bytes=staging_bytes, progress=done.append, staging=ring)
        ex.run(reads)
    return ex, slots, reader, sum(done)


@pytest.fixture
def root(tmp_path: Path) -> tuple[Path, dict]:
    return tmp_path, write_files(tmp_path)


# ----------------------------------------------------------------------------------------- tests


def test_host_loads_through_a_small_ring_are_bit_exact(root):
    folder, tensors = root
    ex, slots, reader, progressed = execute(folder)
    assert_bit_equal(slots, expected(tensors))
    ring = ex.ring
    assert not ring.pin and ring.counts["host"] > 0 and ring.counts["acquire"] > 20  # rotated many times
    assert not {"straight", "gather", "pack", "oversized"} & set(ring.counts)
    assert 0 < len(ring.buffers()) <= 2 and all(b.numel() <= align(STAGING) for b in ring.buffers())
    assert progressed >= reader.bytes_read  # each block reports its bytes; bytes several blocks need are read once


def test_device_path_on_a_stand_in_device_is_bit_exact_and_never_reuses_a_busy_buffer(root):
    folder, tensors = root
    link = FakeLink()
    ex, slots, reader, progressed = execute(folder, ring=StagingRing(STAGING, link=link))
    assert_bit_equal(slots, expected(tensors))
    counts = ex.ring.counts
    assert counts["straight"] and counts["gather"] and counts["pack"] and not counts["host"]  # every route ran
    assert counts["wait"] > 0 and counts["acquire"] > 20 and not counts["oversized"]
    assert not link.pending and link.completed == link.queued > 0  # every copy finished before run returned
    assert len(ex.ring.buffers()) == 2 and all(b.numel() <= align(STAGING) for b in ex.ring.buffers())
    assert progressed >= reader.bytes_read


def test_the_reuse_check_catches_a_ring_that_does_not_wait(root, monkeypatch):
    """The stand-in device's check is real: a ring that rewrites a buffer without waiting fails the load."""
    folder, _ = root
    monkeypatch.setattr(StagingRing, "_wait", lambda self, stage: stage.events.clear())
    with pytest.raises(AssertionError, match="written before its copy out finished"):
        execute(folder, ring=StagingRing(STAGING, link=FakeLink()))


@pytest.mark.parametrize("staging_bytes", [ALIGN, 1000, 4096, 64 << 10, 64 << 20])
@pytest.mark.parametrize("device", ["host", "stand-in"])
def test_any_staging_size_loads_the_same_bytes(root, staging_bytes, device):
    """From one element per buffer to everything in one: same values, same bytes read, bounded buffers."""
    folder, tensors = root
    ring = StagingRing(staging_bytes, link=FakeLink() if device == "stand-in" else None)
    ex, slots, reader, progressed = execute(folder, ring=ring)
    assert_bit_equal(slots, expected(tensors))
    _, _, big, _ = execute(folder, staging_bytes=64 << 20)
    # bytes several blocks need are read once per batch: once in all with one big buffer
    assert big.bytes_read <= reader.bytes_read <= progressed
    if staging_bytes >= 64 << 10:
        assert reader.bytes_read == big.bytes_read
    assert len(ring.buffers()) <= 2 and all(b.numel() <= align(staging_bytes) for b in ring.buffers())


def test_a_shared_ring_serves_several_executors(root):
    """One ring passed to several executors (e.g. one per conversion): buffers allocated once, reused."""
    folder, tensors = root
    ring = StagingRing(STAGING, link=FakeLink())
    execute(folder, ring=ring)
    first = [b.data_ptr() for b in ring.buffers()]
    _, slots, _, _ = execute(folder, ring=ring)
    assert_bit_equal(slots, expected(tensors))
    assert [b.data_ptr() for b in ring.buffers()] == first


def test_small_loads_get_small_buffers(root):
    folder, tensors = root
    checkpoint = SafetensorsCheckpoint.open(str(folder))
    slots, reads = targets(checkpoint)
    reads = [r for r in reads if r.target == "tiny"]
    with FileReader() as reader:
        ex = BlockExecutor(checkpoint, slots, reader, staging=StagingRing(STAGING_BYTES, link=FakeLink()))
        ex.run(reads)  # a 64 MiB ring (on the host the block would be read straight into the tensor)
    assert torch.equal(slots["tiny"].local, tensors["b"][3:5])
    assert [b.numel() for b in ex.ring.buffers()] == [ALIGN]  # the 8 bytes read, not 64 MiB


@pytest.mark.parametrize("link", [None, "stand-in"])
@pytest.mark.parametrize("checkpoint_dtype", [torch.float32, torch.bfloat16])
def test_a_real_model_through_a_small_ring(tmp_path, link, checkpoint_dtype):
    """A tiny Qwen3-MoE (per-expert checkpoint merged into fused experts) planned by HFLoadPlanner and run
    with 4 KiB buffers: equal to the saved model (through the checkpoint's dtype), bit for bit."""
    _, source = build("qwen3_moe", seed=0)
    save(source, tmp_path, dtype=checkpoint_dtype)
    want = {k: v.to(checkpoint_dtype).to(v.dtype) for k, v in clone_state(source).items()}
    _, model = build("qwen3_moe", seed=1)
    plan = HFLoadPlanner(model).build_plan(SafetensorsCheckpoint.open(str(tmp_path)))
    ring = StagingRing(STAGING, link=FakeLink() if link else None)
    with FileReader() as reader:
        BlockExecutor(plan.checkpoint, plan.slots, reader, staging=ring).run(plan.reads)
    got = clone_state(model)
    for name, value in want.items():
        assert torch.equal(_bits(got[name].contiguous()), _bits(value.contiguous())), name
    if link or checkpoint_dtype != torch.float32:  # else every block is read straight into the model
        assert ring.counts["acquire"] > 2 * ring.count  # every buffer reused


def test_meta_model_onto_the_cpu_device(tmp_path):
    """``load_hf_checkpoint(meta model, path, device="cpu")`` (what docs/gpu.md shows with "cuda")."""
    _, source = build("qwen3_moe", seed=0)
    save(source, tmp_path)
    with torch.device("meta"):
        _, model = build("qwen3_moe", seed=1)
    load_hf_checkpoint(model, str(tmp_path), device="cpu", options=LoadOptions(progress=False))
    for name, value in clone_state(source).items():
        assert torch.equal(model.state_dict()[name], value), name


def test_gpu_bench_runs_on_the_cpu(tmp_path):
    """bench/gpu_bench.py --device cpu at a tiny size: it loads, checks every tensor and says so."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--device", "cpu", "--size", "tiny"]
    proc = subprocess.run([*cmd, "--repeat", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: every tensor equals from_pretrained's" in proc.stdout, proc.stdout


def test_fp8_value_reads_through_a_small_ring_on_a_stand_in_device(tmp_path):
    """FP8 dequantization (value reads) through 4 KiB buffers on the stand-in device: the codes' cast to
    float32 happens on the "device", the result equals dequantizing the whole weight."""
    from test_fp8 import write_fp8

    from loader.execute.values import run_values
    from loader.rules.fp8 import dequantize_quant_blocks

    stored = write_fp8(tmp_path, {"weight": torch.randn(96, 80)}, (32, 16))
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(96, 80, dtype=torch.bfloat16))
    plan = HFLoadPlanner(model).build_plan(SafetensorsCheckpoint.open(str(tmp_path)))
    assert plan.values and not plan.reads and not plan.deferred
    link = FakeLink()
    ring = StagingRing(STAGING, link=link)
    with FileReader() as reader:
        run_values(plan.values, plan.checkpoint, plan.slots, reader, staging=ring)
    want = dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], (32, 16), torch.bfloat16)
    assert torch.equal(model.weight.data, want)
    assert ring.counts["gather"] + ring.counts["pack"] > 0 and not link.pending  # copies done when run returns


def test_staging_bytes_is_a_load_option(tmp_path):
    _, source = build("qwen3_moe", seed=0)
    save(source, tmp_path, dtype=torch.bfloat16)
    _, model = build("qwen3_moe", seed=1)
    with pytest.raises(ValueError, match="staging_bytes"):
        load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(staging_bytes=0, progress=False))
    load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(staging_bytes=4096, progress=False))
    for name, value in clone_state(source).items():
        assert torch.equal(model.state_dict()[name], value.to(torch.bfloat16).float()), name
