"""The keys that did not trace: read whole and fed to the module's own ``load_weights`` on real tensors.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **fallback run**: ``load_weights([(key, tensor)])`` for each fallback key, in checkpoint order, after the traced
  reads (a fallback key's writes land after every traced key's: a loader whose untraceable key writes elements a
  later traced key writes too would see them the other way round), each key read whole.
- **written**: the parameters whose memory a fallback run wrote into, seen by a dispatch mode watching in-place
  ops (the check that a parameter left incomplete by the traced keys was completed by them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from .._torch import TorchDispatchMode, schema_arguments
from ..checkpoint import Checkpoint, read_tensor
from ..storage import RangeReader
from .trace import EngineTrace

__all__ = ["log_fallbacks", "run_fallbacks"]

log = logging.getLogger("loader")


def log_fallbacks(trace: EngineTrace, description: str) -> None:
    """One warning naming the keys read whole and the op that stopped each."""
    if trace.fallbacks:
        shown = "; ".join(f"{f.key!r}: {f.reason}" for f in trace.fallbacks[:8])
        more = f" and {len(trace.fallbacks) - 8} more" if len(trace.fallbacks) > 8 else ""
        log.warning(
            "%d checkpoint key(s) do not trace through %s and are read whole, then loaded for real: %s%s",
            len(trace.fallbacks),
            description,
            shown,
            more,
        )


def run_fallbacks(
    module: torch.nn.Module, trace: EngineTrace, checkpoint: Checkpoint, reader: RangeReader
) -> tuple[str, ...]:
    """Load each fallback key through ``module.load_weights`` on its real tensor; the parameters written.

    Raises:
        CheckpointError: a key's file is short, or changed since its header was read.
        Exception: what ``load_weights`` raised (a note names the key).
    """
    if not trace.fallbacks:
        return ()
    identities = checkpoint.identities
    for file in {c.location for f in trace.fallbacks for c in checkpoint[f.key].chunks}:
        reader.expect(file, identities.get(file))
    storages = {_storage(p): name for name, p in trace.real.items()}
    watch = _Writes(storages)
    for f in trace.fallbacks:
        tensor = read_tensor(checkpoint[f.key], reader)
        try:
            with watch:
                module.load_weights([(f.key, tensor)])
        except Exception as e:
            e.add_note(f"raised by {type(module).__name__}.load_weights loading checkpoint key {f.key!r} for real")
            raise
    return tuple(n for n in trace.real if n in watch.written)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Writes(TorchDispatchMode):
    """Records the parameters (by their storage) that an in-place op writes into."""

    def __init__(self, storages: Mapping[int, str]) -> None:
        super().__init__()
        self.storages, self.written = storages, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg, value in zip(schema_arguments(func), args):
            alias = arg.alias_info
            if alias is not None and alias.is_write and isinstance(value, torch.Tensor):
                name = self.storages.get(_storage(value))
                if name is not None:
                    self.written.add(name)
        return func(*args, **kwargs)
