"""Torch's private names the algebra uses, in one place: a torch upgrade touches this module only.

Every other module of ``regiontrace`` imports these from here, never from ``torch``'s private modules or attributes
(tests/test_architecture.py checks it). Each name says what public API would replace it; "none yet" was checked
against torch 2.13 and 2.14. ATen operator names (``torch.ops.aten._to_copy``) are operator names, not private
Python API, and stay where they are used.
"""

from __future__ import annotations

from typing import Any

import torch

# public: none yet; ``torch.utils._python_dispatch`` is the only home of the dispatch-mode base class
from torch.utils._python_dispatch import TorchDispatchMode

# public: none yet (``torch.utils.pytree`` does not exist in 2.13/2.14); the Python implementation, kept on purpose
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_map_only, tree_unflatten

__all__ = [
    "DISABLED_TORCH_FUNCTION",
    "TorchDispatchMode",
    "TreeSpec",
    "keystr",
    "make_wrapper_subclass",
    "op_schema",
    "schema_arguments",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map_only",
    "tree_unflatten",
]

#: public: none yet; the idiom torch's subclass docs give for a wrapper subclass that skips ``__torch_function__``
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls: type, size: Any, **kwargs: Any) -> torch.Tensor:
    """A new ``cls`` instance with no storage of its own (``torch.Tensor._make_wrapper_subclass``).

    Public: none yet (torch 2.14); the documented way to build a ``__torch_dispatch__`` wrapper subclass.
    """
    return torch.Tensor._make_wrapper_subclass(cls, size, **kwargs)


def op_schema(func: Any) -> Any:
    """The ``torch.FunctionSchema`` of an ``OpOverload`` (``func._schema``; public: none yet, torch 2.14)."""
    return func._schema


def schema_arguments(func: Any) -> list:
    """The schema's arguments of an ``OpOverload``, in order (``func._schema.arguments``; public: none yet)."""
    return func._schema.arguments
