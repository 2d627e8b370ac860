"""What ``transfer_weights`` refuses before anything is sent (meta tensors, overlapping memory, ranks holding a
tensor differently) and the zero-element tensors it moves, in one process; the same on 4 gloo ranks are in
tests/test_transfer.py."""

from __future__ import annotations

import pytest
import torch
import transfer_models as tm
from torch import nn

from loader import save_hf_checkpoint, transfer_weights
from loader.options import SaveOptions
from loader.transfer.agreement import disagreement
from loader.transfer.memory import Span, first_overlap


def _pair_on(flat: torch.Tensor, a: slice | tuple, b: slice | tuple) -> tm.Pair:
    model = tm.Pair(values=False)
    model.a, model.b = nn.Parameter(flat[a].view(8, 8)), nn.Parameter(flat[b].view(8, 8))
    return model


def test_crossed_destinations_sharing_memory_are_refused_naming_both():
    dst = tm.Pair(values=False)
    dst.b = nn.Parameter(dst.a.data.view(8, 8))
    with pytest.raises(ValueError, match="destination model tensors 'a' and 'b' overlap in memory"):
        transfer_weights(tm.Pair(), dst, dst_mapping=tm.crossed())
    assert bool((dst.a == -1).all())


def test_destinations_overlapping_by_some_bytes_are_refused():
    flat = torch.full((127,), -1.0)
    with pytest.raises(ValueError, match="'a' and 'b' overlap in memory"):
        transfer_weights(tm.Pair(), _pair_on(flat, slice(0, 64), slice(63, 127)), dst_mapping=tm.crossed())
    assert bool((flat == -1).all())


def test_disjoint_views_of_one_buffer_receive_their_values():
    flat = torch.full((128,), -1.0)
    dst = _pair_on(flat, slice(0, 64), slice(64, 128))
    transfer_weights(tm.Pair(), dst, dst_mapping=tm.crossed())
    assert torch.equal(flat[:64].view(8, 8), tm.Pair().b) and torch.equal(flat[64:].view(8, 8), tm.Pair().a)


def test_interleaved_views_of_one_buffer_do_not_overlap():
    """Extents that overlap, elements that do not: ``w[:, 0::2]`` and ``w[:, 1::2]``."""
    w = torch.full((8, 16), -1.0)
    dst = tm.Pair(values=False)
    dst.a, dst.b = nn.Parameter(w[:, 0::2]), nn.Parameter(w[:, 1::2])
    transfer_weights(tm.Pair(), dst, dst_mapping=tm.crossed())
    assert torch.equal(w[:, 0::2], tm.Pair().b) and torch.equal(w[:, 1::2], tm.Pair().a)


def test_first_overlap_compares_bytes_of_strided_views():
    w = torch.zeros(4, 8)

    def span(name, t, side="destination"):
        size = t.element_size()
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return Span(name, side, t, t.storage_offset() * size, (t.storage_offset() + extent + 1) * size)

    assert first_overlap([span("x", w[:, ::2]), span("y", w[:, 1::2])]) is None
    hit = first_overlap([span("x", w[:, ::2]), span("y", w[:, 2::4])])
    assert hit is not None and {hit[0].name, hit[1].name} == {"x", "y"}
    assert first_overlap([span("x", w, "source"), span("y", w, "source")]) is None  # reading twice is fine
    bytes_ = w.view(torch.uint8)[:, 1:2]  # one byte inside float 0 of every row
    assert first_overlap([span("x", w[:, ::2]), span("y", bytes_)]) is not None
    assert first_overlap([span("x", w[:, 1::2]), span("y", bytes_)]) is None


def test_a_model_into_itself_with_a_transposing_rule_is_refused_naming_the_tensors():
    model = tm.Pair()
    with pytest.raises(ValueError, match="destination model tensor 'a' overlaps source model tensor 'a' in memory"):
        transfer_weights(model, model, dst_mapping=tm.transposed())
    assert torch.equal(model.a, tm.Pair().a)


def test_a_source_on_the_meta_device_is_refused_naming_the_tensor():
    with torch.device("meta"):
        source = tm.Pair()
    dst = tm.Pair(values=False)
    with pytest.raises(ValueError, match="source model tensor 'a' is on the meta device"):
        transfer_weights(source, dst)
    assert bool((dst.a == -1).all())


def test_a_destination_on_the_meta_device_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match="destination model tensor 'a' is on the meta device"):
        transfer_weights(tm.Pair(), tm.Pair(values=False).to("meta"))


def test_zero_element_tensors_transfer_as_save_and_load_do(tmp_path):
    dst = tm.Empty(values=False)
    report = transfer_weights(tm.Empty(), dst)
    assert torch.equal(dst.w, tm.Empty().w) and dst.e1.shape == (2, 0) and dst.e2.shape == (2, 0)
    assert report.bytes_received == 3 * 4
    save_hf_checkpoint(
        tm.Empty(), str(tmp_path / "ckpt"), options=SaveOptions(progress=False)
    )  # the same tensors save (and load)


def test_disagreement_names_the_tensor_and_every_ranks_view():
    views = [{"a": "float32"}, {"a": "bfloat16"}, None, {"a": "float32"}]
    message = disagreement("source", views)
    assert message is not None and "source model tensor 'a'" in message
    assert "rank 0: float32; rank 1: bfloat16; rank 3: float32" in message
    # ranks holding different tensors (pipeline stages) agree on what they share
    assert disagreement("source", [{"a": "x"}, {"b": "y"}, {"a": "x", "c": "z"}]) is None


FAKE_WORLD = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import transfer_models as tm
from loader import transfer_weights
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
try:
    transfer_weights(tm.Pair(), tm.Pair(values=False))
except RuntimeError as e:
    print("refused:", e)
"""


def test_a_transfer_under_a_fake_world_is_refused_clearly():
    """torch's fake process group has no peers: a clear RuntimeError, not a hang on values no rank posts."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", FAKE_WORLD], capture_output=True, text=True, timeout=300, env=env)
    assert "refused: transfer_weights under torch's fake process group (rank 1 of 4)" in proc.stdout, proc.stderr
