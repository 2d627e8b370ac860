"""The settings as values: ``Rules`` and ``LoadOptions`` built once and validated once; nothing given twice (a
``planner=`` with rules or ``strict``); the hooks as a strategy object; the checkpoint root in ``storage_data``."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loader import HFLoadPlanner, Rename, SafetensorsReader, load_hf_checkpoint
from loader.dcpload import checkpoint_from_metadata
from loader.hooks import PlanHooks
from loader.options import DEFAULT_TIMEOUT, STAGING_BYTES, LoadOptions, Rules, SaveOptions


@pytest.fixture
def folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    save_file(
        {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)},
        os.path.join(tmp_path, "model.safetensors"),
    )
    return str(tmp_path)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 3))
        self.bias = nn.Parameter(torch.zeros(4))


RULES = [Rename("w", "weight"), Rename("b", "bias")]


def test_defaults_are_typed_once():
    assert LoadOptions().timeout == DEFAULT_TIMEOUT == 300.0
    assert LoadOptions().staging_bytes == STAGING_BYTES == 64 << 20
    assert Rules(extra_weights_mapping=[1]).extra_weights_mapping == (1,)  # frozen all the way down
    assert not Rules().given and Rules(key_mapping={"a": "b"}).given and not Rules(key_mapping={}).given


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0},
        {"timeout": -1.0},
        {"timeout": datetime.timedelta(0)},
        {"staging_bytes": 0},
        {"exchange_reads": "yes"},
        {"exchange_round_bytes": 0},
    ],
)
def test_options_are_validated_once_where_they_are_built(kwargs, folder):
    with pytest.raises(ValueError, match="timeout|staging_bytes|exchange_reads|exchange_round_bytes"):
        LoadOptions(**kwargs)
    if "timeout" in kwargs:
        with pytest.raises(ValueError, match="timeout"):
            SaveOptions(timeout=kwargs["timeout"])


@pytest.mark.parametrize(
    "given",
    [
        {"weights_mapping": RULES},
        {"extra_weights_mapping": RULES},
        {"key_mapping": {"^w$": "weight"}},
        {"strict": True},
    ],
)
def test_a_planner_with_rules_or_strict_beside_it_is_an_error(given, folder):
    net = Net()
    with pytest.raises(ValueError, match="planner"):
        load_hf_checkpoint(
            net, folder, planner=HFLoadPlanner(net, rules=Rules(weights_mapping=RULES)), rules=Rules(**given)
        )
    assert not net.weight.any()  # nothing was read


def test_the_planner_carries_rules_and_strict(folder):
    net = Net()
    report = load_hf_checkpoint(
        net, folder, planner=HFLoadPlanner(net, rules=Rules(weights_mapping=RULES[:1], strict=False))
    )
    assert report.missing_keys == ("bias",)
    assert torch.equal(net.weight.detach(), load_file(os.path.join(folder, "model.safetensors"))["w"])


def test_hooks_are_a_strategy_object(folder):
    class Defer(PlanHooks):
        def supports_symbolic(self, conversion):
            return False

    net = Net()
    planner = HFLoadPlanner(net, hooks=Defer(), rules=Rules(weights_mapping=RULES))
    report = load_hf_checkpoint(net, folder, planner=planner)
    assert report.deferred_reasons == {
        "bias": "rejected by supports_symbolic",
        "weight": "rejected by supports_symbolic",
    }
    assert net.weight.any()


def test_the_checkpoint_root_travels_in_storage_data(folder):
    metadata = SafetensorsReader(folder).read_metadata()
    assert not hasattr(metadata, "_root")  # nothing attached to dcp's Metadata
    assert checkpoint_from_metadata(metadata).root == os.path.abspath(folder)
