"""``RegiontraceModelLoader``: vLLM's model loader for ``load_format="regiontrace"`` (imports vLLM).

vLLM builds each worker's model, calls :meth:`RegiontraceModelLoader.load_weights` on it, then runs
``process_weights_after_loading`` as for any loader (``BaseModelLoader.load_model``).
"""

from __future__ import annotations

import logging
import os

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader

from . import LOAD_FORMAT, load_weights

#: under vLLM's logger, so each worker's report is in vLLM's own log (vLLM configures its "vllm" loggers only)
log = logging.getLogger("vllm.regiontrace")
#: the keys ``model_loader_extra_config`` may hold for this load format
EXTRA_KEYS = frozenset({"path"})


def weights_path(model_config: ModelConfig) -> str:
    """Where a model's weights are when no ``path`` is given: its folder, or ``hf://`` of its repo id."""
    model = model_config.model
    if os.path.isdir(model) or "://" in model:
        return model
    revision = model_config.revision
    return f"hf://{model}@{revision}" if revision else f"hf://{model}"


@register_model_loader(LOAD_FORMAT)
class RegiontraceModelLoader(BaseModelLoader):
    """Loads each worker's parameters through :func:`loader.vllm.load_weights`, reading only their bytes."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config or {}
        if not isinstance(extra, dict) or set(extra) - EXTRA_KEYS:
            raise ValueError(
                f"model_loader_extra_config for load format {LOAD_FORMAT!r} takes only {sorted(EXTRA_KEYS)}, "
                f"got {extra!r}"
            )
        self.path: str | None = extra.get("path")

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the weights are read where they are, each worker its own bytes."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Load ``model``'s parameters; a parameter no checkpoint tensor wrote is an error, as with vLLM's
        default loader (the engine does not start on parameters holding what ``torch.empty`` left)."""
        path = self.path or weights_path(model_config)
        report = load_weights(model, path)
        log.info("%s", report)
        if report.missing_keys:
            raise ValueError(
                f"parameters no checkpoint tensor of {path} writes (the model's load_weights reached none of "
                f"their elements): {', '.join(report.missing_keys)}"
            )
