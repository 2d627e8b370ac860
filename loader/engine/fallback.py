"""The keys that did not trace: read whole and fed to the module's own ``load_weights`` on real tensors.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **fallback run**: ``load_weights([(key, tensor)])`` for each fallback key, in checkpoint order, after the traced
  reads, each key read whole.
- **written**: the parameters whose memory a fallback run wrote into, seen by a dispatch mode watching in-place
  ops (the check that a parameter left incomplete by the traced keys was completed by them).
- **replayed key**: a traced key that comes after a fallback key in checkpoint order and writes a parameter that
  fallback key wrote: the module's order has the later key's writes win, so after the fallback runs it is loaded
  again for real (read whole, logged), with every later key writing such a parameter, in checkpoint order.
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
    by_key: dict[str, set[str]] = {}
    for f in trace.fallbacks:
        by_key[f.key] = _load_for_real(module, f.key, read_tensor(checkpoint[f.key], reader), watch)
    replayed = replayed_keys(trace, list(checkpoint), by_key)
    if replayed:
        log.warning(
            "%d traced key(s) come after a key loaded for real and write what it wrote: loaded again for real, "
            "in checkpoint order: %s",
            len(replayed),
            ", ".join(replayed[:8]) + (f" and {len(replayed) - 8} more" if len(replayed) > 8 else ""),
        )
        for file in {c.location for k in replayed for c in checkpoint[k].chunks}:
            reader.expect(file, identities.get(file))
    for key in replayed:
        _load_for_real(module, key, read_tensor(checkpoint[key], reader), watch)
    return tuple(n for n in trace.real if n in watch.written)


def replayed_keys(trace: EngineTrace, order: list[str], written: Mapping[str, set[str]]) -> list[str]:
    """The keys to load again after the fallback runs, in checkpoint order: for each parameter a fallback key
    wrote, every key after the first such fallback key that writes it (traced or not)."""
    position = {k: i for i, k in enumerate(order)}
    first: dict[str, int] = {}
    for key, params in written.items():
        for name in params:
            first[name] = min(first.get(name, len(order)), position[key])
    again = {
        k
        for name, start in first.items()
        for k in (*trace.writers.get(name, ()), *(f for f, ps in written.items() if name in ps))
        if position.get(k, -1) > start
    }
    return sorted(again, key=position.__getitem__)


def _load_for_real(module: torch.nn.Module, key: str, tensor: torch.Tensor, watch: _Writes) -> set[str]:
    """``module.load_weights([(key, tensor)])`` watched; the parameters it wrote."""
    before = set(watch.written)
    watch.written = set()
    try:
        with watch:
            module.load_weights([(key, tensor)])
    except Exception as e:
        e.add_note(f"raised by {type(module).__name__}.load_weights loading checkpoint key {key!r} for real")
        raise
    mine = watch.written
    watch.written = before | mine
    return mine


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
