"""vLLM integration: ``load_format="regiontrace"``, each tensor-parallel worker reading only its parameters' bytes.

Vocabulary:
    load format: the name vLLM's ``LLM(load_format=...)`` picks a model loader by; this package registers
        :data:`LOAD_FORMAT` through vLLM's plugin entry point (group ``vllm.general_plugins``, :func:`register`).
    worker: one vLLM process holding one tensor-parallel rank's model; its model's own ``load_weights`` narrows
        every checkpoint tensor by its ``tp_rank``, and :func:`load_weights` reads exactly what that narrowing keeps.
    weight sync: a trainer's weights pushed into a running engine (:class:`EngineSync`, on every trainer rank;
        :class:`SyncEndpoint`, in the engine's process; :class:`SyncWorker`, the
        ``worker_extension_cls="loader.vllm.SyncWorker"`` of the engine's workers).
    path: where the weights are read from, ``model_loader_extra_config={"path": ...}``: a folder, an ``http(s)://``,
        ``s3://`` or ``hf://`` URL; by default the model's own folder (or ``hf://`` of its repo id).

vLLM is imported only here, when used: by :mod:`loader.vllm.model_loader` (when vLLM loads the plugin) and by
:func:`load_weights`; ``import loader`` and ``import loader.vllm`` never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..options import LoadOptions, StorageOptions
    from ..report import LoadReport

#: the ``load_format`` this package's model loader answers to
LOAD_FORMAT = "regiontrace"

__all__ = ["LOAD_FORMAT", "EngineSync", "SyncEndpoint", "SyncReport", "SyncWorker", "load_weights", "register"]

#: the names this package imports when first used (each module imports vLLM only inside its functions)
LAZY = {
    "EngineSync": "engine_sync",
    "SyncEndpoint": "sync_endpoint",
    "SyncReport": "sync_report",
    "SyncWorker": "sync_worker",
}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM's general plugin (entry point ``regiontrace`` in group ``vllm.general_plugins``): registers the model
    loader for :data:`LOAD_FORMAT`. vLLM calls it in every process it starts; registering twice is a no-op."""
    from . import model_loader  # noqa: F401  (importing it registers the loader, once per process)


def load_weights(
    model: torch.nn.Module,
    path: str,
    *,
    options: LoadOptions | None = None,
    storage: StorageOptions | None = None,
) -> LoadReport:
    """Load ``path``'s checkpoint into a vLLM model object inside its worker, through the model's own
    ``load_weights``: this worker reads only the bytes its parameters hold; returns the worker's ``LoadReport``.

    A checkpoint that does not fit the model (a shape the model's loader would narrow) is a ``ValueError``
    naming the checkpoint tensor and the parameter, raised before any parameter is written; a bad file is a
    :class:`~loader.CheckpointError`. Parameters no checkpoint tensor writes are left as they are and named in
    the report's ``missing_keys`` (the model loader refuses them). vLLM's ``process_weights_after_loading`` is
    the caller's to run afterwards.
    """
    from vllm.distributed import get_tensor_model_parallel_world_size

    from ..engine import load_engine_weights

    tp_size = get_tensor_model_parallel_world_size()  # what the model's loaders narrow by; the group: vLLM's world
    return load_engine_weights(model, path, options=options, storage=storage, tp_size=tp_size)
