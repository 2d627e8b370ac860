"""A head module and a base module of the same name, under ``base_model_prefix``.

A ``PreTrainedModel`` whose base model (``base``) holds ``linear`` and whose head holds its own ``linear``: the
names ``base.linear.*`` and ``linear.*`` are both model tensors. Oracle for the save: ``save_pretrained``, byte
for byte. For the load, each checkpoint key goes to the tensor it names (transformers 5's ``from_pretrained``
moves each through the prefix and exchanges the two; the load says so in a warning naming the keys), and a
checkpoint of the base model alone still loads into the base through the prefix, as ``from_pretrained`` loads it.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hf_models import read_checkpoint
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from loader import load_hf_checkpoint, save_hf_checkpoint
from loader.options import Rules

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


class HeadBaseConfig(PretrainedConfig):
    model_type = "regiontrace_head_base"


class BaseModel(PreTrainedModel):
    config_class = HeadBaseConfig
    base_model_prefix = "base"

    def __init__(self, config):
        super().__init__(config)
        self.linear = nn.Linear(4, 4)
        self.linear_2 = nn.Linear(4, 3)
        self.post_init()


class HeadModel(PreTrainedModel):
    config_class = HeadBaseConfig
    base_model_prefix = "base"

    def __init__(self, config):
        super().__init__(config)
        self.base = BaseModel(config)
        self.linear = nn.Linear(4, 4)
        self.linear2 = nn.Linear(4, 2)
        self.post_init()


def distinct(model: nn.Module) -> nn.Module:
    """Every element of every tensor a different value (init gives both linears' biases the same kind of values)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + 100 * (i + 1))
    return model


def test_a_head_and_a_base_module_of_one_name_save_as_save_pretrained(tmp_path, caplog):
    model = distinct(HeadModel(HeadBaseConfig()))
    model.save_pretrained(tmp_path / "theirs")
    with caplog.at_level(logging.WARNING, logger="loader"):
        save_hf_checkpoint(model, tmp_path / "ours")

    names = sorted(os.listdir(tmp_path / "theirs"))
    assert sorted(os.listdir(tmp_path / "ours")) == names
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    saved = read_checkpoint(tmp_path / "ours")
    state = model.state_dict()
    assert saved.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(saved[key], value), key  # base.linear.* the base's, linear.* the head's
    assert not torch.equal(saved["base.linear.weight"], saved["linear.weight"])
    assert "'base.linear.weight' -> 'linear.weight'" in caplog.text  # from_pretrained of it would exchange them


def test_a_checkpoint_with_a_head_and_a_base_module_of_one_name_loads_each_where_it_is_named(tmp_path, caplog):
    model = distinct(HeadModel(HeadBaseConfig()))
    model.save_pretrained(tmp_path / "ckpt")
    fresh = HeadModel(HeadBaseConfig())
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(fresh, tmp_path / "ckpt")

    assert not report.missing_keys and not report.unexpected_keys
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert "base_model_prefix 'base'" in caplog.text
    assert "'linear.weight' -> 'base.linear.weight'" in caplog.text

    theirs = HeadModel.from_pretrained(tmp_path / "ckpt")
    for key in ("base.linear_2.weight", "linear2.weight"):  # the unambiguous names load as from_pretrained loads them
        assert torch.equal(theirs.state_dict()[key], fresh.state_dict()[key]), key


def test_a_base_checkpoint_loads_into_the_head_model_through_the_prefix_as_from_pretrained(tmp_path, caplog):
    base = distinct(BaseModel(HeadBaseConfig()))
    base.save_pretrained(tmp_path / "base")
    theirs = HeadModel.from_pretrained(tmp_path / "base")
    ours = HeadModel(HeadBaseConfig())
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(ours, tmp_path / "base", rules=Rules(strict=False))

    assert sorted(report.missing_keys) == ["linear.bias", "linear.weight", "linear2.bias", "linear2.weight"]
    for key, value in base.state_dict().items():
        assert torch.equal(ours.state_dict()[f"base.{key}"], value), key
        assert torch.equal(theirs.state_dict()[f"base.{key}"], value), key
    assert "base_model_prefix 'base'" not in caplog.text  # nothing ambiguous: the prefix is added, as transformers does
