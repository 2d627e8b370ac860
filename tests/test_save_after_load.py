"""A save after a load reverses exactly what the load applied: the rules the load used are recorded on the model,
a save without rules reverses them, and a save given rules reverses only those the load applied."""

from __future__ import annotations

import torch
from hf_models import build
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.core_model_loading import WeightRenaming

from loader import Rename, load_hf_checkpoint, save_hf_checkpoint
from loader.options import LoadOptions, Rules, SaveOptions


def assert_same_files(a, b) -> None:
    """Two single-file checkpoints hold the same keys with bit-identical values."""
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)), k


# ----------------------------------------------------------------------------------------------- transformers

#: the checkpoint calls every ``mlp.gate_proj`` ``mlp.w1``; the second rule matches no key of the checkpoint
HF_RULES = [WeightRenaming(r"mlp\.w1", "mlp.gate_proj"), WeightRenaming(r"self_attn\.qq", "self_attn.q_proj")]


def write_renamed_llama(folder) -> None:
    _, model = build("llama", seed=0)
    state = {k.replace("mlp.gate_proj", "mlp.w1"): v.contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight")  # tied to the embedding: save_pretrained leaves it out too
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_transformers_model_saved_without_rules_reverses_what_its_load_applied(tmp_path):
    write_renamed_llama(tmp_path / "ckpt")
    _, model = build("llama", seed=1)
    load_hf_checkpoint(
        model, tmp_path / "ckpt", rules=Rules(weights_mapping=HF_RULES), options=LoadOptions(progress=False)
    )
    save_hf_checkpoint(model, tmp_path / "resaved", options=SaveOptions(progress=False))
    assert_same_files(tmp_path / "ckpt", tmp_path / "resaved")


def test_a_transformers_model_saved_with_its_rules_reverses_only_those_applied(tmp_path):
    write_renamed_llama(tmp_path / "ckpt")
    _, model = build("llama", seed=1)
    load_hf_checkpoint(
        model, tmp_path / "ckpt", rules=Rules(weights_mapping=HF_RULES), options=LoadOptions(progress=False)
    )
    save_hf_checkpoint(
        model, tmp_path / "resaved", rules=Rules(weights_mapping=HF_RULES), options=SaveOptions(progress=False)
    )
    assert_same_files(tmp_path / "ckpt", tmp_path / "resaved")  # no ``self_attn.qq`` keys


# ----------------------------------------------------------------------------------------------- plain modules


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.norm = nn.Parameter(torch.randn(8, generator=g))
        self.lin = nn.Linear(8, 4)


#: the checkpoint holds ``norm0.weight`` and ``lin.*``; the second rule matches none of its keys
PLAIN_RULES = [Rename(r"^norm0\.weight", "norm"), Rename(r"^lin_old\.", "lin.")]


def write_plain(folder) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tensors = {"norm0.weight": torch.randn(8, generator=g), "lin.weight": torch.randn(4, 8, generator=g)}
    tensors["lin.bias"] = torch.randn(4, generator=g)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_a_plain_module_saved_after_a_load_writes_the_keys_it_came_from(tmp_path):
    tensors = write_plain(tmp_path / "ckpt")
    net = Net()
    load_hf_checkpoint(
        net, tmp_path / "ckpt", rules=Rules(weights_mapping=PLAIN_RULES[:1]), options=LoadOptions(progress=False)
    )
    assert torch.equal(net.norm.data, tensors["norm0.weight"])
    save_hf_checkpoint(net, tmp_path / "plain", options=SaveOptions(progress=False))
    assert_same_files(tmp_path / "ckpt", tmp_path / "plain")
    save_hf_checkpoint(
        net, tmp_path / "given", rules=Rules(weights_mapping=PLAIN_RULES), options=SaveOptions(progress=False)
    )
    assert_same_files(tmp_path / "ckpt", tmp_path / "given")  # ``lin_old.*`` never renamed: not reversed


def test_without_a_load_the_rules_given_are_reversed_as_before(tmp_path):
    """A fresh model (no load recorded) saved with rules: every rename given is reversed."""
    net = Net()
    save_hf_checkpoint(
        net, tmp_path / "out", rules=Rules(weights_mapping=PLAIN_RULES), options=SaveOptions(progress=False)
    )
    saved = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert saved == {"norm0.weight", "lin_old.weight", "lin_old.bias"}
