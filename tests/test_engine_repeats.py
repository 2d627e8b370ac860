"""Repeated layers traced once: a vLLM-style module of five identical layers plans exactly as traced key by key
(region reads, fills, certificates, writers, unused keys), the later layers as aliases, and loads bit for bit as its
own ``load_weights``; a layer whose module differs, or a loader that treats the second layer otherwise, is traced
key by key."""

from __future__ import annotations

import pytest
import torch
from engine_models import TinyLlama
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import loader
from loader import SafetensorsCheckpoint
from loader.engine.api import plan_engine_load

CONFIG = dict(
    vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A five-layer LlamaForCausalLM saved by ``save_pretrained`` in bfloat16 over three shards."""
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    folder = tmp_path_factory.mktemp("llama5")
    model.save_pretrained(folder, max_shard_size="20KB")
    return config, folder


class SecondLayerOtherwise(TinyLlama):
    """Layer 1's input norm written in two halves: the same values by other writes."""

    def load_weights(self, weights):
        rest = []
        for name, tensor in weights:
            if name == "model.layers.1.input_layernorm.weight":
                param, half = dict(self.named_parameters())[name], tensor.shape[0] // 2
                param.data[:half].copy_(tensor[:half])
                param.data[half:].copy_(tensor[half:])
            else:
                rest.append((name, tensor))
        return super().load_weights(rest)


def planned(module, folder, tp, reuse):
    trace, plan = plan_engine_load(module, SafetensorsCheckpoint.open(str(folder)), tp, reuse=reuse)
    p = plan.plan
    certs = {
        n: (c.shape, c.unwritten, c.undefined, c.overwritten, c.constant, sorted(map(repr, c.written)))
        for n, c in trace.certificates.items()
    }
    writers = {n: sorted(k) for n, k in trace.writers.items()}
    value = (sorted(map(repr, p.reads)), sorted(map(repr, p.fills)), certs, writers, p.unexpected_keys, p.loaded_keys)
    return trace, value


def oracle(module, folder) -> dict[str, torch.Tensor]:
    tensors = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    module.load_weights(tensors.items())
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("tp", [1, 2])
def test_repeated_layers_plan_as_traced_key_by_key_and_load_bit_for_bit(llama, tp):
    config, folder = llama
    for rank in range(tp):
        reused, value = planned(TinyLlama(config, rank, tp), folder, tp, reuse=True)
        traced, expected = planned(TinyLlama(config, rank, tp), folder, tp, reuse=False)
        assert {n.split(".")[2] for n in reused.aliases} == {"2", "3", "4"} and not traced.aliases
        assert value == expected
        module = TinyLlama(config, rank, tp)
        report = loader.load_engine_weights(module, str(folder), tp_size=tp)
        want = oracle(TinyLlama(config, rank, tp), folder)
        assert all(torch.equal(p.detach(), want[n]) for n, p in module.named_parameters())
        assert all(c.exact for c in report.certificates.values())


def test_a_layer_whose_module_differs_is_traced(llama):
    config, folder = llama
    module = TinyLlama(config, 0, 2)
    module.model.layers[3].mlp.down_proj.tp_rank = 1  # this layer's loader takes the other rank's columns
    trace, _ = planned(module, folder, 2, reuse=True)
    assert not trace.aliases
    loader.load_engine_weights(module, str(folder), tp_size=2)
    other = TinyLlama(config, 0, 2)
    other.model.layers[3].mlp.down_proj.tp_rank = 1
    want = oracle(other, folder)
    assert all(torch.equal(p.detach(), want[n]) for n, p in module.named_parameters())


def test_a_loader_that_treats_the_second_layer_otherwise_is_traced(llama):
    config, folder = llama
    trace, _ = planned(SecondLayerOtherwise(config), folder, 1, reuse=True)
    assert not trace.aliases
    assert [w.op for w in trace.writes_of("model.layers.1.input_layernorm.weight")] == ["copy_", "copy_"]
    module = SecondLayerOtherwise(config)
    loader.load_engine_weights(module, str(folder))
    want = oracle(SecondLayerOtherwise(config), folder)
    assert all(torch.equal(p.detach(), want[n]) for n, p in module.named_parameters())
