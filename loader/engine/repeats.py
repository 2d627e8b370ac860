"""Repeated layers: a layer's traced writes reused, renamed, for every later layer whose keys repeat it.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **unit**: the checkpoint keys sharing a prefix and their first all-digit name component, the *index*
  (``model.layers.7.mlp.experts.3.up_proj.weight``: the unit ``model.layers`` 7); a key without one is in none.
- **signature**: a unit's keys with the index left out, with their shapes and dtypes (a set: shards may order
  them differently).
- **renaming**: a name's first all-digit component replaced by another index (a key's, a parameter's).
- **reference units**: the first two units of a signature, traced key by key. The later units of that
  signature are not traced: each parameter their keys would write is an **alias** of the first unit's
  parameter renamed to it, whose writes, certificate and region reads are that parameter's, each source renamed.

A unit is reused only when (else the whole module is traced again key by key):

1. both reference units traced without a fallback, and each writes only parameters that carry its index (their
   first all-digit component) and that no other key writes;
2. the second traces as the first renamed: the same writes (each key's, through the same addresses, writing the
   same boxes), the same certificates, the same region reads with every source renamed (the loader depended on the
   index through names alone); a unit whose keys come in another order than the first's: no two of the first's
   writes overlap (writes that do not overlap commute);
3. the reused unit's parameters exist, renamed, with the first unit's shapes, dtypes, classes and plain
   attributes, no traced key wrote them, and no traced parameter reads what they held before;
4. its layer module (the parameters' name up to the index) is a module tree of the same classes, plain
   attributes equal (strings up to the renaming) to the first unit's.

The loader's writes into a layer are then a function of the layer's names, its module's attributes and the
keys' shapes: what the renamed writes say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

import regiontrace as rt

__all__ = ["Alias", "Unit", "aliases", "repeated_units"]

#: the attribute values a module or parameter fingerprint compares (others: methods, submodules … left out)
PLAIN = (int, float, bool, str, type(None), torch.dtype)


@dataclass(frozen=True)
class Unit:
    """The keys of one layer, in checkpoint order: their common prefix and index."""

    prefix: str
    index: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Alias:
    """A parameter whose trace is parameter ``of``'s with each source name renamed by ``names``."""

    of: str
    names: Mapping[str, str]

    def block(self, block: rt.RemapBlock) -> rt.RemapBlock:
        """``block`` reading the renamed source."""
        return replace(block, source=self.names.get(block.source, block.source))


def renamed(name: str, index: str, to: str) -> str | None:
    """``name`` with its first all-digit component, which must be ``index``, replaced by ``to`` (else None)."""
    parts = name.split(".")
    at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if at is None or parts[at] != index:
        return None
    return ".".join([*parts[:at], to, *parts[at + 1 :]])


def repeated_units(keys: Iterable[str], checkpoint: Any) -> list[list[Unit]]:
    """The units of ``keys``, grouped by signature, in order of first key; only groups of three or more."""
    found: dict[tuple[str, str], list[str]] = {}
    for key in keys:
        parts = key.split(".")
        at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if at is not None:
            found.setdefault((".".join(parts[:at]), parts[at]), []).append(key)
    groups: dict[tuple, list[Unit]] = {}
    for (prefix, index), unit_keys in found.items():
        cut = len(prefix) + len(index) + 1
        sig = (
            prefix,
            tuple(sorted((k[cut:], tuple(checkpoint[k].shape), str(checkpoint[k].dtype)) for k in unit_keys)),
        )
        groups.setdefault(sig, []).append(Unit(prefix, index, tuple(unit_keys)))
    return [g for g in groups.values() if len(g) >= 3]


def aliases(
    groups: list[list[Unit]], module: torch.nn.Module, trace: Any, touched: Mapping[str, tuple[str, ...]]
) -> tuple[dict[str, Alias], dict[str, str]] | None:
    """Per parameter of every unit after the reference units of each group, its alias, and per key of those units
    the first unit's key it renames; None when a rule (see the module) does not hold.

    Args:
        groups: :func:`repeated_units`; the keys of every unit after the first two were not traced.
        module, trace: the traced module and its :class:`~loader.engine.trace.EngineTrace` (no aliases yet).
        touched: per traced key, the parameters it wrote (a key that fell back: absent).
    """
    out: dict[str, Alias] = {}
    keys: dict[str, str] = {}
    for first, second, *later in groups:
        names = _unit_params(first, touched, trace.writers)
        if names is None or _unit_params(second, touched, trace.writers) is None:
            return None
        if not _traces_as(first, second, names, module, trace, touched):
            return None
        for unit in later:
            made = _aliased(first, unit, names, module, trace)
            if made is None:
                return None
            out.update(made)
            keys.update({renamed(k, first.index, unit.index): k for k in first.keys})
    if _reads_an_alias(trace.params, out):
        return None
    return out, keys


def _unit_params(unit: Unit, touched: Mapping, writers: Mapping) -> set[str] | None:
    """The parameters ``unit``'s keys wrote, when rule 1 holds for them."""
    if any(k not in touched for k in unit.keys):
        return None
    names = {n for k in unit.keys for n in touched[k]}
    own = set(unit.keys)
    for name in names:
        if renamed(name, unit.index, unit.index) is None or not set(writers[name]) <= own:
            return None
    return names


def _renames(first: Unit, to: Unit, names: set[str]) -> dict[str, str] | None:
    """The source renaming from ``first`` to ``to``: its keys and the parameters' prior contents."""
    out = {k: renamed(k, first.index, to.index) for k in first.keys}
    for name in names:
        out[f"<prior {name}>"] = f"<prior {renamed(name, first.index, to.index)}>"
    return out


def _traces_as(first: Unit, second: Unit, names: set[str], module: torch.nn.Module, trace: Any, touched) -> bool:
    """Rule 2: ``second`` traced as ``first`` renamed (and rules 3, 4 between them)."""
    made = _aliased(first, second, names, module, trace, written=True)
    if made is None or {k: bool(touched[k]) for k in first.keys} != {
        renamed(k, second.index, first.index): bool(touched[k]) for k in second.keys
    }:
        return False
    for name, alias in made.items():
        mine = _canonical(trace, name, trace.blocks(name), {})
        if _canonical(trace, alias.of, [alias.block(b) for b in trace.blocks(alias.of)], alias.names) != mine:
            return False
        if any(b.source not in alias.names and not b.source.startswith("<constant ") for b in trace.blocks(alias.of)):
            return False  # a source that is neither the unit's key, its parameters' prior, nor a constant
    return True


def _canonical(trace: Any, name: str, blocks: list, names: Mapping[str, str]) -> tuple:
    """Parameter ``name``'s trace with sources and keys renamed by ``names``, as a value independent of the order of
    the writes: each write's key, op, addresses and boxes it wrote; the certificate's other boxes; the blocks."""
    cov = rt.coverage(trace.params[name])
    keys = [names.get(k, k) for k in trace.writers[name]]
    writes = sorted(repr((k, w.op, w.addresses, boxes)) for k, w, boxes in zip(keys, cov.writes, cov.written))
    boxes = (cov.unwritten, cov.undefined, cov.overwritten, cov.constant)
    return len(keys), writes, boxes, sorted(repr(b) for b in blocks)


def _commutes(first: Unit, unit: Unit, names: set[str], trace: Any) -> bool:
    """Whether ``unit``'s keys may come in another order than ``first``'s: no two writes of ``first`` overlap."""
    if [k[len(first.prefix) + len(first.index) + 1 :] for k in first.keys] == [
        k[len(unit.prefix) + len(unit.index) + 1 :] for k in unit.keys
    ]:
        return True
    return not any(rt.coverage(trace.params[n]).overwritten for n in names)


def _aliased(first: Unit, unit: Unit, names: set[str], module: torch.nn.Module, trace: Any, written: bool = False):
    """Rules 3 and 4 for ``unit`` (its parameters written when it is a reference unit); its aliases."""
    params, real = trace.params, trace.real
    if not _commutes(first, unit, names, trace):
        return None
    renames = _renames(first, unit, names)
    out = {}
    for name in names:
        other = renamed(name, first.index, unit.index)
        if other not in params or bool(params[other].writes) != written:
            return None
        a, b = real[name], real[other]
        if (type(a), a.shape, a.dtype) != (type(b), b.shape, b.dtype) or _plain(a, "") != _plain(b, ""):
            return None
        out[other] = Alias(name, renames)
    for path in {n.split(f".{first.index}.", 1)[0] + f".{first.index}" for n in names}:
        other = renamed(path, first.index, unit.index)
        try:
            if _tree(module.get_submodule(path), path) != _tree(module.get_submodule(other), other):
                return None
        except AttributeError:
            return None
    return out


def _tree(layer: torch.nn.Module, path: str) -> list:
    """Rule 4's fingerprint of a layer module: each submodule's name, class and plain attributes."""
    return [(rel, type(sub), _plain(sub, path)) for rel, sub in layer.named_modules()]


def _plain(obj: Any, path: str) -> dict:
    """``obj``'s plain attributes (strings with ``path`` left out, tensors by value)."""
    out = {}
    for key, value in vars(obj).items():
        if isinstance(value, str) and path:
            value = value.replace(path, "{unit}")
        if isinstance(value, torch.Tensor) and not isinstance(value, rt.RegionTensor) and value.device.type != "meta":
            value = (value.dtype, tuple(value.shape), value.detach().cpu().flatten().tolist())
        elif isinstance(value, (tuple, list)) and all(isinstance(v, PLAIN) for v in value):
            value = tuple(value)
        elif not isinstance(value, PLAIN) or key in ("_parameters", "_buffers", "_modules"):
            continue
        out[key] = value
    return out


def _reads_an_alias(params: Mapping[str, Any], made: Mapping[str, Alias]) -> bool:
    """Rule 3's last part: a traced parameter reading what an alias held before (its prior)."""
    priors = {f"<prior {name}>" for name in made}
    return any(priors & dest.sources() for name, dest in params.items() if name not in made and dest.writes)
