"""The GPU path on a real CUDA device: pinned, double-buffered staging and value reads on the device.

Skipped where torch sees no CUDA device (CI and this project's development machines); the stand-in device of
tests/test_staging.py covers the same logic on the CPU. ``bench/gpu_check.sh`` runs this file and the GPU benchmark
on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import build, clone_state, save
from test_fp8 import Weight, write_fp8
from test_staging import STAGING, assert_bit_equal, expected, targets, write_files

from loader import SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import FileReader
from loader.execute import BlockExecutor, StagingRing
from loader.options import LoadOptions
from loader.rules.fp8 import dequantize_quant_blocks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]


@pytest.mark.parametrize("staging_bytes", [STAGING, 1 << 20, 64 << 20])
def test_every_read_case_lands_on_the_device_bit_exact(tmp_path, staging_bytes):
    """Contiguous, cast, column, sparse column, interleaved, flipped, broadcast and sharded blocks, through pinned
    buffers of several sizes: straight copies, gathers on the device and packs on the host."""
    tensors = write_files(tmp_path)
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    slots, reads = targets(checkpoint, device="cuda")
    ring = StagingRing(staging_bytes)
    with FileReader() as reader:
        BlockExecutor(checkpoint, slots, reader, staging=ring).run(reads)
    assert ring.pin and all(b.is_pinned() for b in ring.buffers())
    assert ring.counts["straight"] > 0 and ring.counts["gather"] + ring.counts["pack"] > 0
    assert_bit_equal(slots, expected(tensors))


@pytest.mark.parametrize("meta", [False, True])
def test_a_model_on_the_gpu_equals_the_cpu_load(tmp_path, meta):
    _, source = build("qwen3_moe", seed=0)
    save(source, tmp_path, dtype=torch.bfloat16)
    _, cpu_model = build("qwen3_moe", seed=1)
    load_hf_checkpoint(cpu_model, str(tmp_path), options=LoadOptions(progress=False))
    if meta:
        with torch.device("meta"):
            _, model = build("qwen3_moe", seed=1)
        load_hf_checkpoint(
            model, str(tmp_path), device="cuda", options=LoadOptions(staging_bytes=STAGING, progress=False)
        )
    else:
        _, model = build("qwen3_moe", seed=1)
        model = model.to("cuda")
        load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(staging_bytes=STAGING, progress=False))
    want = clone_state(cpu_model)
    for name, value in model.state_dict().items():
        assert value.device.type == "cuda", name
        assert torch.equal(value.cpu(), want[name]), name


def test_fp8_dequantizes_on_the_device_bit_identically(tmp_path):
    shape, block = (300, 200), (128, 128)
    stored = write_fp8(tmp_path, {"weight": torch.randn(shape)}, block)
    model = Weight(shape).to("cuda")
    report = load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(staging_bytes=STAGING, progress=False))
    assert report.deferred == ()
    want = dequantize_quant_blocks(stored["weight"], stored["weight_scale_inv"], block, torch.bfloat16)
    assert torch.equal(model.weight.data.cpu(), want)
