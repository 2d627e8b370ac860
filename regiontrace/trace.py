"""``trace``: run a conversion function on RegionTensors and check it against a meta-tensor run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._torch import TorchDispatchMode, tree_flatten, tree_map_only
from .errors import TraceMismatch, Untraceable
from .tensor import RegionTensor


class _StayOnMeta(TorchDispatchMode):
    """During the meta run, device moves (``.cpu()``, ``.to("cuda")``) keep tensors on meta, as RegionTensors do."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and "device" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
        return func(*args, **kwargs)


def run_on_meta(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` on meta tensors the way :func:`trace` does: device moves keep tensors on meta.

    Args:
        fn: any function written against the torch API.
        *args, **kwargs: its arguments, meta tensors anywhere in them.

    Returns:
        ``fn``'s output.
    """
    with _StayOnMeta():
        return fn(*args, **kwargs)


def check_trace(out: Any, meta_out: Any) -> None:
    """Check a RegionTensor run's output against the same call's output on meta tensors.

    Args:
        out: the output of a function run on RegionTensors.
        meta_out: the output of the same function run on meta tensors of the same shapes and dtypes
            (:func:`run_on_meta`).

    Raises:
        TraceMismatch: an output's structure, shape or dtype differs from the meta run.
        Untraceable: an output is a real tensor not derived from the inputs.
    """
    flat, spec = tree_flatten(out)
    meta_flat, meta_spec = tree_flatten(meta_out)
    if spec != meta_spec:
        raise TraceMismatch(f"output structure {spec} differs from the meta run's {meta_spec}")
    for i, (a, m) in enumerate(zip(flat, meta_flat)):
        if isinstance(a, RegionTensor):
            if not isinstance(m, torch.Tensor):
                raise TraceMismatch(f"output {i}: traced a tensor, the meta run returned {type(m).__name__}")
            if tuple(a.shape) != tuple(m.shape) or a.dtype != m.dtype:
                raise TraceMismatch(
                    f"output {i}: traced {tuple(a.shape)} {a.dtype}, meta run {tuple(m.shape)} {m.dtype}"
                )
        elif isinstance(a, torch.Tensor):
            raise Untraceable(f"output {i} is a real tensor not derived from the inputs (shape {tuple(a.shape)})")


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on RegionTensors and verify every output against the same call on meta tensors.

    Args:
        fn: any function written against the torch API.
        *args, **kwargs: its arguments; RegionTensors may sit anywhere in nested lists, tuples and dicts.

    Returns:
        ``fn``'s output structure, with RegionTensors as its tensors.

    Raises:
        Untraceable: ``fn`` used an op that is not a pure index mapping, or returned a tensor not derived
            from the inputs.
        TraceMismatch: an output's structure, shape or dtype differs from the meta run.
    """
    # build the meta arguments first: fn may consume its containers (transformers' ops pop input dicts)
    meta_args, meta_kwargs = tree_map_only(
        RegionTensor,
        lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta"),
        (args, kwargs),
    )
    out = fn(*args, **kwargs)
    check_trace(out, run_on_meta(fn, *meta_args, **meta_kwargs))
    return out
