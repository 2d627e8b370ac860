"""A worker's sync plan: which boxes of which trainer tensors its model's ``load_weights`` reads, and where they go.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **load-time parameters**: a layer's parameters as vLLM created them, before ``process_weights_after_loading``
  packed them into its kernels' format (vLLM's CPU linear layers keep a oneDNN handle and an empty ``weight``);
  vLLM records their shapes, classes and ``weight_loader``s on the meta device when it builds the model
  (``record_metadata_for_reloading``), and :func:`load_time_view` puts them back on meta for a ``with`` block.
- **want**: one box of one trainer tensor a worker needs, ``(key, offsets, lengths)``; the trainer sends each
  worker exactly its wants, packed one after another, in the engine's dtype.
- **layer**: a module owning parameters a push writes; a push rebuilds its load-time parameters from the wants
  and re-runs its post-load processing (:mod:`loader.vllm.sync_layers`).
- **tie**: a parameter under two names (a tied ``lm_head.weight``); as vLLM's ``AutoWeightsLoader``, the plan
  writes the first name only (a trainer tensor writing the other is not sent), and the other name's layer follows
  it, rebuilt last.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import torch

import regiontrace as rt
from regiontrace.executor import is_constant

from ..checkpoint.chunks import TensorInfo
from ..engine.check import certificates, check_coverage, check_shapes
from ..engine.trace import trace_load_weights
from .sync_layers import follow, load_time_params, load_time_view, ties

__all__ = ["Want", "WorkerPlan", "plan_sync", "wire_dtype"]

log = logging.getLogger("vllm.regiontrace")


@dataclass(frozen=True)
class Want:
    """One box of a trainer tensor a worker needs: ``key[offsets : offsets + lengths]``, sent as ``dtype``."""

    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * self.dtype.itemsize


@dataclass
class WorkerPlan:
    """What one worker's push receives and writes.

    Attributes:
        wants: the boxes it receives, in wire order.
        blocks: per load-time parameter (by its name in the model), the blocks writing it, each reading a want
            (its source named by the want's index) or a constant.
        layers: per layer (module name), the attribute names of its load-time parameters the push writes (a
            layer following a tie last, its attribute rebuilt from the canonical one's).
        shard_bytes: the bytes of the load-time parameters the push writes (this worker's shard).
    """

    wants: list[Want]
    blocks: dict[str, list[rt.RemapBlock]]
    layers: dict[str, list[str]] = field(default_factory=dict)
    shard_bytes: int = 0


def wire_dtype(dtype: torch.dtype, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype a trainer tensor travels in: the engine's for floating-point tensors, its own otherwise."""
    return engine_dtype if dtype.is_floating_point else dtype


def plan_sync(model: torch.nn.Module, keys: dict[str, tuple[tuple[int, ...], torch.dtype]], tp_size: int) -> WorkerPlan:
    """Trace ``model.load_weights`` (over its load-time parameters) on stand-ins of the trainer's ``keys``
    (name -> (shape, wire dtype)) and plan this worker's wants and writes.

    Raises:
        ValueError: a trainer tensor that does not fit (its shape, a key that does not trace), a parameter written
            in part or twice, a layer the push touches with a load-time parameter no trainer tensor writes, or
            a tied parameter written only under its second name (naming the tensor, the parameter or the layer);
            nothing was sent or written.
    """
    tied = ties(model)  # before the load-time view, whose layers hold their own meta tensors
    checkpoint = {k: TensorInfo(k, None, dtype, tuple(shape), None, None) for k, (shape, dtype) in keys.items()}
    with load_time_view(model):
        trace = trace_load_weights(model, checkpoint)
        if trace.fallbacks:
            f = trace.fallbacks[0]
            raise ValueError(f"trainer tensor {f.key!r} does not trace through load_weights ({f.reason})")
        trace.certificates = certificates(trace)
        missing = set(check_coverage(trace, trace.certificates))
        check_shapes(trace, checkpoint, tp_size)
        written = {n for n, dest in trace.params.items() if n not in missing and dest.writes}
        followers = _untied(trace, written, tied)
        plan = WorkerPlan([], {})
        index: dict[tuple, int] = {}
        for name in sorted(written):
            plan.blocks[name] = [_rebased(b, checkpoint, plan.wants, index) for b in trace.params[name].remap_blocks()]
            plan.shard_bytes += trace.real[name].numel() * trace.real[name].dtype.itemsize
        plan.layers = _layers(model, written, followers)
    for alias, canonical in followers.items():
        follow(model, alias, canonical)
    return plan


def _untied(trace, written: set[str], tied: dict[str, str]) -> dict[str, str]:
    """Drop the second names of ties from ``written`` (vLLM loads the first only); the ties whose first name is
    written (their followers, alias -> canonical).

    Raises:
        ValueError: a second name written while its first is not (naming the trainer tensors and both names).
    """
    followers = {}
    for alias, canonical in tied.items():
        keys = sorted(set(trace.writers.get(alias, ()))) if alias in written else []
        if keys and canonical not in written:
            raise ValueError(
                f"trainer tensor(s) {', '.join(map(repr, keys))} write {alias!r}, tied to {canonical!r} in the "
                f"engine's model, and no trainer tensor writes {canonical!r}: vLLM loads a tie under its first name"
            )
        written.discard(alias)
        if canonical in written:
            followers[alias] = canonical
            if keys:
                log.info("weight sync: %s tied to %s, trainer tensor(s) %s not sent", alias, canonical, keys)
    return followers


def _rebased(block: rt.RemapBlock, checkpoint: dict, wants: list[Want], index: dict) -> rt.RemapBlock:
    """``block`` reading its want (added to ``wants`` once per distinct box), its source named by the want's index."""
    if is_constant(block.source):
        return block
    box = block.source_box()
    info = checkpoint[block.source]
    if box is None:  # not one box of the key: the key is wanted whole
        offsets, lengths, rel = (0,) * len(info.shape), tuple(info.shape), block
    else:
        offsets, lengths, rel = tuple(box[0]), tuple(box[1]), block.box_relative()
    want = Want(block.source, offsets, lengths, info.dtype)
    if want not in index:
        index[want] = len(wants)
        wants.append(want)
    return replace(rel, source=str(index[want]))


def _layers(model: torch.nn.Module, written: set[str], followers: dict[str, str]) -> dict[str, list[str]]:
    """Per module owning a written or following parameter, its load-time parameter names (the layers holding a
    follower last: their canonical layers are rebuilt before them).

    Raises:
        ValueError: a load-time parameter of such a module that no trainer tensor writes (the push rebuilds the
            whole layer: the old values of a packed parameter cannot be read back).
    """
    layers: dict[str, list[str]] = {}
    for name in sorted(written):
        owner, _, attr = name.rpartition(".")
        layers.setdefault(owner, []).append(attr)
    for alias in sorted(followers):
        owner, _, attr = alias.rpartition(".")
        layers[owner] = [*layers.pop(owner, []), attr]
    for owner, attrs in layers.items():
        needed = sorted(load_time_params(model.get_submodule(owner)))
        left = [a for a in needed if a not in attrs]
        if left:
            raise ValueError(
                f"layer {owner!r}: parameter(s) {', '.join(f'{owner}.{a}' for a in left)} are written by no trainer "
                f"tensor, while {', '.join(f'{owner}.{a}' for a in attrs)} are: a push rebuilds the whole layer "
                "and re-runs its post-load processing"
            )
    return layers
