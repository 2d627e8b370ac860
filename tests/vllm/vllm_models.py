"""vLLM model classes built in-process, without an engine: one process per tensor-parallel rank in a gloo world.

``tp_world(rank, world, init)`` sets up vLLM's own distributed state (``init_distributed_environment`` and
``initialize_model_parallel`` over gloo); ``build_model(folder)`` builds the architecture vLLM picks for the folder
with the config an engine would use; the oracle is vLLM's ``DefaultModelLoader.load_weights`` on such a model.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch

ENGINE_SETTINGS = dict(
    skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128, load_format="safetensors"
)


def engine_config(folder: str, tp: int, dtype: str = "bfloat16"):
    """The ``VllmConfig`` an engine would build for ``folder`` at ``tp`` ranks (device cpu)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=folder, tensor_parallel_size=tp, **{**ENGINE_SETTINGS, "dtype": dtype})
    return args.create_engine_config()


@contextlib.contextmanager
def tp_world(rank: int, world: int, init: str) -> Iterator[None]:
    """vLLM's distributed state for ``rank`` of a ``world``-rank gloo world, one tensor-parallel group of all."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world, rank, init, rank, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def build_model(folder: str, tp: int, dtype: str = "bfloat16") -> torch.nn.Module:
    """The vLLM model class for ``folder``, built on cpu as a worker builds it (parameters uninitialised)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = engine_config(folder, tp, dtype)
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=config)
    model.vllm_config = config  # the oracle and the loaders read the model config from here
    return model


def default_load(model: torch.nn.Module) -> None:
    """vLLM's own default loader (``DefaultModelLoader.load_weights``): the oracle."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import DefaultModelLoader

    config = model.vllm_config
    with set_current_vllm_config(config):
        DefaultModelLoader(config.load_config).load_weights(model, config.model_config)


def digests(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's ``dtype shape sha256`` of its bytes (before ``process_weights_after_loading``)."""
    out = {}
    for name, p in model.named_parameters():
        data = p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out[name] = f"{p.dtype} {tuple(p.shape)} {hashlib.sha256(data).hexdigest()}"
    return out


def zeroed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter zero (a parameter no loader writes then reads as zeros on every run)."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def needed_bytes(folder: str, tp: int) -> dict[str, int]:
    """Per checkpoint tensor, the bytes of its elements this rank's parameters hold, found by vLLM's own loader:
    a float32 model is loaded from tensors whose elements are their ids (1, 2, ... over the whole checkpoint), and
    every id found in a parameter counts once (replicated KV heads count on every rank that holds them)."""
    from safetensors import safe_open

    model = zeroed(build_model(folder, tp, dtype="float32"))
    ids, spans, itemsize, start = {}, {}, {}, 1
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                info = f.get_slice(key)
                shape, n = info.get_shape(), math.prod(info.get_shape())
                ids[key] = torch.arange(start, start + n, dtype=torch.float64).to(torch.float32).view(shape)
                spans[key], itemsize[key], start = (start, start + n), DTYPE_SIZES[info.get_dtype()], start + n
    assert start < 2**24, "ids must be exact in float32"
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config):
        model.load_weights(iter(ids.items()))
    held = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).unique()
    held = held[held >= 1].to(torch.int64)
    return {key: int(((held >= lo) & (held < hi)).sum()) * itemsize[key] for key, (lo, hi) in spans.items()}


#: safetensors dtype names -> bytes per element
DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
