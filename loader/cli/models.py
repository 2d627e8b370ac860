"""Building a checkpoint's transformers model on the meta device, from its config (for ``plan``, ``demo``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from regiontrace.cli.common import CLIError

from ..checkpoint import config_location
from ..checkpoint.config import MAX_CONFIG_BYTES
from ..errors import redact_url
from ..storage import Store


def read_config(checkpoint: str | Store, config_file: str | None, model_type: str | None) -> Any:
    """A transformers config: ``config_file`` or the checkpoint's ``config.json`` (``checkpoint``: a local path, or
    the :class:`~loader.storage.Store` of a remote one), optionally as ``model_type``."""
    from transformers import AutoConfig

    data: dict[str, Any] = {}
    if isinstance(checkpoint, str) or config_file:
        where = checkpoint if isinstance(checkpoint, str) else ""
        path = config_file or (
            os.path.join(where, "config.json")
            if os.path.isdir(where)
            else os.path.join(os.path.dirname(os.path.abspath(where)), "config.json")
        )
        found = os.path.isfile(path)
        if found:
            with open(path) as f:
                data = json.load(f)
    else:
        path = config_location(checkpoint)
        found = checkpoint.exists(path)
        if found:
            data = json.loads(checkpoint.read_small(path, MAX_CONFIG_BYTES, "config"))
    if not found and config_file:
        raise CLIError(f"no such config file: {config_file}")
    if not found and not model_type:
        named = checkpoint if isinstance(checkpoint, str) else checkpoint.root
        raise CLIError(f"no config.json next to {redact_url(named)}: pass --config FILE or --model-type TYPE")
    model_type = model_type or data.get("model_type")
    if not model_type:
        raise CLIError(f"{redact_url(path)} has no model_type: pass --model-type TYPE")
    data = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        raise CLIError(
            f"unknown model type {model_type!r} (transformers knows e.g. llama, mixtral, qwen3_moe, deepseek_v3)"
        ) from e


def model_class(config: Any) -> Any:
    """The class named by ``config.architectures`` (else the causal-LM auto class, else ``AutoModel``)."""
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            auto._model_mapping[type(config)]
            return auto
        except KeyError:
            continue
    return transformers.AutoModel


def build_meta_model(config: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model of ``config`` on the meta device (no memory, no initialisation)."""
    cls = model_class(config)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            return cls.from_config(config, **kwargs)
        return cls._from_config(config, **kwargs)
