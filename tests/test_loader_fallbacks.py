"""Conversions that do not trace: each fallback to a deferred read (sources read whole, run for real) is logged
once per load, naming the model tensors, the rule and the op that stopped the trace; a function that cannot run on
the meta tensors planning gives it, or that returns a meta tensor, is a clear error naming the rule and its target,
never a bare torch error.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from loader import Convert, HFLoadPlanner, SafetensorsReader, load_hf_checkpoint
from loader.hooks import PlanHooks
from loader.options import LoadOptions, Rules

VOCAB, PADDED, DIM = 5, 8, 4


class Padded(nn.Module):
    """Two layers whose embeddings are padded to ``PADDED`` rows (vLLM's padded vocabulary), and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(PADDED, DIM) for _ in range(2)])
        self.norm = nn.Parameter(torch.zeros(DIM))


def pad_vocab(w):
    return F.pad(w, (0, 0, 0, PADDED - w.shape[0]))


def into_fresh_buffer(w):  # a weight_loader's way: a new buffer, the checkpoint rows copied in
    out = w.new_zeros(PADDED, w.shape[1])
    out[: w.shape[0]].copy_(w)
    return out


def write(folder) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"emb.{i}": torch.randn(VOCAB, DIM, generator=g) for i in range(2)} | {"norm": torch.randn(DIM)}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return tensors


def rules(fn) -> list:
    return [Convert(r"emb\.(\d+)", r"layers.\1.weight", fn), Convert("norm", "norm", lambda n: n)]


def fallback_lines(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "does not trace" in r.getMessage()
    ]


def scaled_pad(w):  # padding inside values computed by pointwise ops: read whole
    return F.pad(w, (0, 0, 0, PADDED - w.shape[0])) * 2


@pytest.mark.parametrize("pad", [pad_vocab, into_fresh_buffer])
def test_a_padded_vocabulary_is_traced_its_padding_filled_and_only_the_real_rows_read(tmp_path, caplog, pad):
    tensors = write(tmp_path)
    loads = {}
    for name, hooks in (("traced", None), ("deferred", NoTracing())):
        model = Padded()
        with caplog.at_level(logging.WARNING, logger="loader"):
            planner = HFLoadPlanner(model, hooks=hooks, rules=Rules(weights_mapping=rules(pad)))
            loads[name] = (model, load_hf_checkpoint(model, tmp_path, planner=planner))
    (model, report), (real, _) = loads["traced"], loads["deferred"]
    assert set(report.traced) == {"layers.0.weight", "layers.1.weight", "norm"} and report.deferred == ()
    assert fallback_lines(caplog) == []
    for i in range(2):
        assert torch.equal(model.layers[i].weight, pad(tensors[f"emb.{i}"]))
        assert torch.equal(model.layers[i].weight, real.layers[i].weight)
    real_bytes = sum(t.numel() * t.element_size() for t in tensors.values())  # the padding is never read
    assert report.bytes_read == report.planned_bytes == real_bytes


def unset_rows(w):  # a new buffer whose last rows nothing writes: they hold no source's values
    out = w.new_empty(PADDED, w.shape[1])
    out[: w.shape[0]].copy_(w)
    return out


def test_padding_inside_values_is_computed_its_constants_filled(tmp_path):
    """Constant elements inside values computed by pointwise ops (``F.pad(w) * 2``) are a value program's constant
    input, filled without a read: traced and exact."""
    tensors = write(tmp_path)
    model = Padded()
    report = load_hf_checkpoint(model, tmp_path, rules=Rules(weights_mapping=rules(scaled_pad)), options=QUIET_LOAD)
    assert report.deferred == () and "layers.0.weight" in report.traced
    for i in range(2):
        assert torch.equal(model.layers[i].weight, scaled_pad(tensors[f"emb.{i}"]))


QUIET_LOAD = LoadOptions(progress=False)


@pytest.mark.parametrize(("fn", "op"), [(unset_rows, "prior")])
def test_each_fallback_is_logged_once_naming_tensors_rule_and_op(tmp_path, caplog, fn, op):
    tensors = write(tmp_path)
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(
            model := Padded(), tmp_path, rules=Rules(weights_mapping=rules(fn)), options=LoadOptions(progress=False)
        )
    assert report.deferred == ("layers.0.weight", "layers.1.weight")
    for i in range(2):  # (the rows new_empty leaves unset hold whatever was there)
        assert torch.equal(model.layers[i].weight[:VOCAB], fn(tensors[f"emb.{i}"])[:VOCAB])
    (line,) = fallback_lines(caplog)  # one line for both layers: one rule, one reason
    assert "2 model tensor(s)" in line and "layers.{0, 1}.weight" in line
    assert f"fn={fn.__name__}" in line and op in line and "read whole" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loader"):  # inside dcp.load too
        planner = HFLoadPlanner(Padded(), rules=Rules(weights_mapping=rules(fn)))
        dcp.load(planner.state_dict_for_load(), storage_reader=SafetensorsReader(str(tmp_path)), planner=planner,
                 no_dist=True)  # fmt: skip
    assert len(fallback_lines(caplog)) == 1 and op in fallback_lines(caplog)[0]


class NoTracing(PlanHooks):
    def supports_symbolic(self, conversion):
        return False


def test_a_conversion_the_hook_sends_to_a_deferred_read_is_not_warned_about(tmp_path, caplog):
    write(tmp_path)
    model = Padded()
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(
            model,
            tmp_path,
            planner=HFLoadPlanner(model, hooks=NoTracing(), rules=Rules(weights_mapping=rules(pad_vocab))),
        )
    assert set(report.deferred) == {"layers.0.weight", "layers.1.weight", "norm"}
    assert fallback_lines(caplog) == []


def into_real_memory(w):  # on meta tensors the copy has no data to copy
    out = torch.zeros(PADDED, w.shape[1])
    out[: w.shape[0]].copy_(w)
    return out


def into_meta_memory(w):  # runs on meta, but returns no data when run for real
    out = torch.empty(PADDED, w.shape[1], device="meta")
    out[: w.shape[0]].copy_(w)
    return out


@pytest.mark.parametrize(("fn", "says"), [(into_real_memory, "failed on meta tensors"), (into_meta_memory, "returned")])
def test_a_function_writing_into_a_buffer_of_the_wrong_device_is_a_clear_error(tmp_path, fn, says):
    write(tmp_path)
    model = Padded()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=says) as info:
        load_hf_checkpoint(model, tmp_path, rules=Rules(weights_mapping=rules(fn)), options=LoadOptions(progress=False))
    message = str(info.value)
    assert f"fn={fn.__name__}" in message and "layers.0.weight" in message and "meta" in message
    assert "new_zeros" in message  # what to write instead
    if fn is into_real_memory:  # planning failed: nothing was written
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_transfer_fallback_is_logged_once_naming_tensor_rule_and_op(caplog):
    """vLLM's padded vocabulary as a destination rule: its keys move whole, and the log says so."""
    from loader import transfer_weights

    torch.manual_seed(0)
    src, dst = nn.Embedding(VOCAB, DIM), nn.Embedding(PADDED, DIM)
    rule = Convert(r"^weight", "weight", pad_vocab)
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = transfer_weights(src, dst, src_mapping=[], dst_mapping=[rule])
    assert report.fallback == ("weight",) and torch.equal(dst.weight, pad_vocab(src.weight))
    (line,) = fallback_lines(caplog)
    assert "weight via Convert(['^weight'], ['weight'], fn=pad_vocab)" in line
    assert "constant_pad_nd" in line and "moved whole" in line
