"""Inside a running engine, each worker's model swapped for one vLLM's default loader builds: the reference tokens.

``llm.collective_rpc(swap_in_default)`` has every worker build a fresh model with ``load_model`` of the
``safetensors`` loader (vLLM's ``DefaultModelLoader``, what a worker runs at its start), then put it where the
running one was: the model runner's ``model`` and the layers registered by name in
``compilation_config.static_forward_context`` (attention and fused-MoE layers, which the forward pass looks up by
name). Each new attention layer is bound to its predecessor's KV cache and the attention metadata builders are made
again, as ``initialize_kv_cache`` makes them at the start (they set per-layer state, the CPU backend's ``isa``).
Generating again then runs the default loader's weights in the same engine, on the same KV cache.
"""

from __future__ import annotations

import copy
import dataclasses

#: the load format whose loader builds the reference model (vLLM's DefaultModelLoader)
DEFAULT_FORMAT = "safetensors"


def swap_in_default(worker, folder: str | None = None) -> dict:
    """Replace ``worker``'s model by a fresh one the default loader loads (from ``folder``, a checkpoint of the
    same architecture, else the engine's own); what was swapped (rank, model class, the layer names rebound, and
    whether every registered layer is now the new model's)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader import get_model_loader

    runner, config = worker.model_runner, worker.vllm_config
    registered = config.compilation_config.static_forward_context
    old = dict(registered)
    registered.clear()  # the new layers register under the names the running ones hold
    load_config = dataclasses.replace(config.load_config, load_format=DEFAULT_FORMAT, model_loader_extra_config={})
    model_config = copy.copy(config.model_config)
    if folder is not None:  # the default loader reads the weights from model_config.model
        model_config.model = folder
    try:
        with set_current_vllm_config(config):
            model = get_model_loader(load_config).load_model(vllm_config=config, model_config=model_config)
    except BaseException:
        registered.clear()
        registered.update(old)
        raise
    new = dict(registered)
    if new.keys() != old.keys():
        raise RuntimeError(f"the default-loaded model registers {sorted(new)}, the running one {sorted(old)}")
    for name, layer in new.items():
        if isinstance(old[name], AttentionLayerBase):
            layer.bind_kv_cache(old[name].kv_cache)
    runner.model = model
    # the attention metadata builders set per-layer state on the layers they serve (the CPU backend's isa)
    runner.initialize_metadata_builders(runner.kv_cache_config, runner._kernel_block_sizes)
    modules = {id(m) for m in model.modules()}
    return {
        "rank": get_tensor_model_parallel_rank(),
        "model": type(model).__name__,
        "layers": sorted(new),
        "all_new": runner.model is model and all(id(layer) in modules for layer in registered.values()),
    }
