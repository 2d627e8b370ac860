"""Tracing a module's own ``load_weights`` into destination stand-ins, checkpoint key by checkpoint key.

Vocabulary (as in :mod:`regiontrace.writes`, plus):

- **engine loader**: a module's ``load_weights(weights)`` in vLLM's calling convention: ``weights`` is an iterable of
  ``(checkpoint key, tensor)`` pairs; the module maps names (``stacked_params_mapping``) and each parameter's
  ``weight_loader(param, loaded_weight, shard_id?)`` writes into the parameter in place.
- **stand-in**: a parameter replaced, while tracing, by a :func:`regiontrace.destination` named as the parameter,
  wrapped as an ``nn.Parameter`` keeping the original's Python attributes (``weight_loader``, ``output_dim`` …).
- **leaf**: a checkpoint key fed to the loader as ``RegionTensor.leaf(key, shape, dtype)`` (from the header: no
  byte read).
- **fallback key**: a key whose tracing raised :class:`~regiontrace.Untraceable` (``.item()``, data-dependent
  values, an unknown op): its writes are undone, and it is later loaded for real, read whole.

Each key is traced by its own ``load_weights([(key, leaf)])`` call, so only the keys that do not trace fall back.
With ``reuse``, the layers that repeat an earlier one are not traced: their parameters are **aliases** of the
first such layer's, renamed (:mod:`loader.engine.repeats`, which says when that is sound; when it is not, every
key is traced). Read a parameter's writes, region reads and keys through :class:`EngineTrace`'s methods, which
see the aliases. The real parameters are always put back, also when tracing fails.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import regiontrace as rt

from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from .repeats import Alias, aliases, repeated_units

__all__ = ["EngineTrace", "Fallback", "trace_load_weights", "stand_ins"]

log = logging.getLogger("loader")


@dataclass(frozen=True)
class Fallback:
    """A checkpoint key whose tracing stopped: the op (the Untraceable message), and the parameters it had
    written into before it stopped (its writes undone)."""

    key: str
    reason: str
    touched: tuple[str, ...]


@dataclass
class EngineTrace:
    """What a module's ``load_weights`` does with the checkpoint's keys, traced.

    Attributes:
        params: each parameter's (and buffer's) stand-in after every traced key (its content: a region over
            checkpoint keys, ``<prior NAME>`` where no write reached, constants), by its first name.
        real: each parameter and buffer by the same name (the module's own tensor, put back).
        buffers: the names in ``params`` that are buffers (one no key writes is not missing: a cache).
        writers: per parameter, the checkpoint key each of its writes came from (in write order).
        fallbacks: the keys that did not trace, in checkpoint order.
        unused: keys whose ``load_weights`` call wrote into no parameter.
        certificates: each parameter's coverage certificate, once checked (:mod:`loader.engine.check`).
        aliases: the parameters of repeated layers, not traced: each one's trace is another's, renamed (their
            stand-ins in ``params`` stay unwritten).
    """

    params: dict[str, rt.RegionTensor]
    real: dict[str, torch.Tensor]
    buffers: frozenset[str] = frozenset()
    writers: dict[str, list[str]] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    certificates: dict[str, Any] = field(default_factory=dict)  # rt.coverage's values
    aliases: dict[str, Alias] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._compiled: dict[str, tuple[rt.RemapBlock, ...]] = {}  # each traced parameter's blocks, once

    def keys_of(self, name: str) -> tuple[str, ...]:
        """The checkpoint keys parameter ``name``'s final content reads (its sources that are keys)."""
        alias = self.aliases.get(name)
        if alias is not None:
            return tuple(sorted(alias.names.get(k, k) for k in self.keys_of(alias.of)))
        return tuple(sorted(s for s in self.params[name].sources() if not s.startswith("<")))

    def writes_of(self, name: str) -> tuple[Any, ...]:
        """Parameter ``name``'s writes, in program order."""
        return self.params[self.aliases[name].of if name in self.aliases else name].writes

    def blocks(self, name: str) -> tuple[rt.RemapBlock, ...]:
        """The blocks of parameter ``name``'s final content, its whole box (compiled once per traced parameter)."""
        alias = self.aliases.get(name)
        if alias is not None:
            return tuple(alias.block(b) for b in self.blocks(alias.of))
        if name not in self._compiled:
            self._compiled[name] = tuple(self.params[name].remap_blocks())
        return self._compiled[name]


def _owners(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """``(owner module, attribute, full name, tensor)`` for every parameter and buffer slot (a tied one under each)."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            yield owner, attr, f"{prefix}.{attr}" if prefix else attr, tensor


def _stand_in(name: str, tensor: torch.Tensor) -> rt.RegionTensor:
    """A destination named ``name`` shaped as ``tensor``, with its Python attributes, an ``nn.Parameter`` for a
    parameter, and an instance of its class too when that is a subclass of ``nn.Parameter`` (vLLM's
    ``ModelWeightParameter``: its ``load_column_parallel_weight`` … and properties then work on the stand-in)."""
    dest = rt.destination(name, tuple(tensor.shape), tensor.dtype)
    if isinstance(tensor, torch.nn.Parameter):
        dest = torch.nn.Parameter(dest, requires_grad=False)
        if type(tensor) is not torch.nn.Parameter and issubclass(type(tensor), torch.nn.Parameter):
            dest.__class__ = _grafted(type(dest), type(tensor))
    own = set(vars(dest))
    for attr, value in vars(tensor).items():
        if attr not in own:
            setattr(dest, attr, value)
    return dest


@functools.cache
def _grafted(stand_in: type, cls: type) -> type:
    """A class that is a destination first (its dispatch, views and writes) and ``cls`` after (its methods)."""
    return type(f"StandIn{cls.__name__}", (stand_in, cls), {"__module__": __name__})


@contextlib.contextmanager
def stand_ins(module: torch.nn.Module) -> Iterator[tuple[dict[str, rt.RegionTensor], dict[str, torch.Tensor]]]:
    """Replace every parameter and buffer of ``module`` by a stand-in (a tied one by one stand-in under each name)
    for the ``with`` block; yields ``(stand-ins, real tensors)`` by each tensor's first name. The real tensors are
    put back on exit, also on an error."""
    slots = list(_owners(module))
    made: dict[int, tuple[str, rt.RegionTensor]] = {}
    params: dict[str, rt.RegionTensor] = {}
    real: dict[str, torch.Tensor] = {}
    for _, _, name, param in slots:
        if id(param) not in made:
            made[id(param)] = (name, _stand_in(name, param))
            params[name], real[name] = made[id(param)][1], param
    try:
        for owner, attr, _, param in slots:
            setattr(owner, attr, made[id(param)][1])
        yield params, real
    finally:
        for owner, attr, _, param in slots:
            setattr(owner, attr, param)


def trace_load_weights(
    module: torch.nn.Module, checkpoint: Checkpoint, keys: list[str] | None = None, *, reuse: bool = False
) -> EngineTrace:
    """Trace ``module.load_weights`` on ``checkpoint``'s keys (default: all, in checkpoint order), one call per key.

    A key that raises :class:`~regiontrace.Untraceable` becomes a :class:`Fallback`; when it had written into a
    parameter before it stopped, the trace starts again without it (its writes undone that way). With ``reuse``,
    repeated layers are aliases of the first (:mod:`loader.engine.repeats`); when a rule of reuse does not hold,
    the trace starts again without reuse.

    Raises:
        AttributeError: the module has no ``load_weights``.
        Exception: what ``load_weights`` raised on a key other than :class:`~regiontrace.Untraceable` (a note names
            the key).
    """
    keys = list(checkpoint.keys()) if keys is None else keys
    fallbacks: dict[str, Fallback] = {}
    groups = repeated_units(keys, checkpoint) if reuse else []
    while True:
        touched: dict[str, tuple[str, ...]] = {}
        skipped = {k for group in groups for unit in group[2:] for k in unit.keys}
        trace = _trace_once(module, checkpoint, [k for k in keys if k not in skipped], fallbacks, touched)
        if trace is None:
            continue
        if groups:
            made = aliases(groups, module, trace, touched)
            if made is None:
                log.debug("%s: repeated layers do not trace alike, every key traced", type(module).__name__)
                groups = []
                continue
            _add_aliases(trace, *made, keys)
        trace.fallbacks = [fallbacks[k] for k in keys if k in fallbacks]
        return trace


def _add_aliases(trace: EngineTrace, made: dict[str, Alias], renames: dict[str, str], keys: list[str]) -> None:
    """The aliases into ``trace``: their writers, and the keys not traced whose first unit's key wrote nothing."""
    trace.aliases = made
    for name, alias in made.items():
        trace.writers[name] = [alias.names[k] for k in trace.writers[alias.of]]
    unused = set(trace.unused)
    trace.unused = [k for k in keys if k in unused or renames.get(k) in unused]


def _trace_once(
    module: torch.nn.Module,
    checkpoint: Checkpoint,
    keys: list[str],
    fallbacks: dict[str, Fallback],
    touched: dict[str, tuple[str, ...]],
) -> EngineTrace | None:
    """One pass over ``keys`` but the known ``fallbacks`` (``touched``: the parameters each key wrote); None when a
    new fallback key had written something."""
    load_weights = module.load_weights
    with stand_ins(module) as (params, real):
        buffers = frozenset(n for n, t in real.items() if not isinstance(t, torch.nn.Parameter))
        trace = EngineTrace(params, real, buffers, {n: [] for n in params})
        for key in keys:
            if key in fallbacks:
                continue
            info = checkpoint[key]
            before = {n: len(p.writes) for n, p in params.items()}
            try:
                load_weights([(key, rt.RegionTensor.leaf(key, info.shape, info.dtype))])
            except rt.Untraceable as e:
                wrote = tuple(n for n, p in params.items() if len(p.writes) != before[n])
                fallbacks[key] = Fallback(key, str(e), wrote)
                if wrote:
                    return None
                continue
            except Exception as e:
                raise _misfit(module, key, info, e, params) from e
            added = {n: len(p.writes) - before[n] for n, p in params.items()}
            for n, count in added.items():
                trace.writers[n] += [key] * count
            touched[key] = tuple(n for n, count in added.items() if count)
            if not touched[key]:
                trace.unused.append(key)
    return trace


def _misfit(module: torch.nn.Module, key: str, info: Any, error: Exception, params: dict) -> CheckpointError:
    """What ``load_weights`` raised on ``key`` (often a bare ``AssertionError`` of a ``weight_loader``) as an error
    naming the checkpoint tensor, its shape and the parameter the loader was writing (the innermost frame holding a
    stand-in parameter)."""
    by_id = {id(p): n for n, p in params.items()}
    names = [
        by_id[id(v)]
        for frame, _ in traceback.walk_tb(error.__traceback__)
        for v in frame.f_locals.values()
        if id(v) in by_id
    ]
    into = f" into parameter {names[-1]!r}" if names else ""
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return CheckpointError(
        f"{info.file or 'the checkpoint'}: checkpoint tensor {key!r} ({list(info.shape)}, "
        f"{str(info.dtype).removeprefix('torch.')}) does not fit {type(module).__name__}: its load_weights raised "
        f"{what}{into}; nothing was written",
        path=info.file,
        key=key,
    )


def writer_keys(trace: EngineTrace, name: str, writes) -> tuple[str, ...]:
    """The checkpoint keys that made writes ``writes`` (indices) into parameter ``name``, distinct, in order."""
    keys = trace.writers[name]
    return tuple(dict.fromkeys(keys[i] for i in writes if i < len(keys)))
