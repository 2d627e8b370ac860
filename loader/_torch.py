"""Torch's private names the loader uses, in one place: a torch upgrade touches this module only.

Every other module of ``loader`` imports these from here, never from ``torch``'s private modules or attributes
(tests/test_architecture.py checks it; ``regiontrace`` keeps its own in ``regiontrace/_torch.py``). Each name says
what public API would replace it; "none yet" was checked against torch 2.13 and 2.14. Code that must differ
between torch versions lives here too. This module imports nothing of the project: it is the loader's bottom layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# public: none yet; a placement DTensor's tensor parallel plans make (fused gate_up: ``Shard`` with a split factor)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# public: none yet; ``torch.utils._python_dispatch`` is the only home of the dispatch-mode base class
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "StridedShard",
    "TorchDispatchMode",
    "default_store",
    "gloo_backend",
    "local_shape",
    "nccl_backend",
    "local_tensor",
    "root_mesh",
    "schema_arguments",
    "shard_size_and_offsets",
    "storage_key",
    "tensor_tables",
]


def default_store() -> dist.Store:
    """The default process group's store (``distributed_c10d._get_default_store``).

    Public: none yet (torch 2.14); the alternative is creating a ``TCPStore`` of our own from the rendezvous
    environment, which a user's ``init_process_group(store=...)`` would not share.
    """
    return dist.distributed_c10d._get_default_store()


def gloo_backend(store: dist.Store, rank: int, world: int, seconds: float) -> Any:
    """A gloo backend of ``world`` ranks over ``store``, outside the default group: its ``send``/``recv``/
    ``allreduce`` take tensor lists (``torch.distributed.distributed_c10d.ProcessGroupGloo``, as vLLM's stateless
    groups build one).

    Public: ``torch.distributed.new_group`` needs the default group of the same processes (a trainer and a vLLM
    engine's workers share none); none yet for a group of its own store (torch 2.14).
    """
    from datetime import timedelta

    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world, timedelta(seconds=seconds))


def nccl_backend(store: dist.Store, rank: int, world: int, seconds: float) -> Any:
    """An NCCL backend of ``world`` ranks over ``store``, outside the default group, as :func:`gloo_backend`
    (``torch.distributed.ProcessGroupNCCL``, its ``Options._timeout``); the caller's current CUDA device is its.

    Public: as :func:`gloo_backend`, none yet (torch 2.14); absent from CPU builds of torch.
    """
    from datetime import timedelta

    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=seconds)
    return ProcessGroupNCCL(store, rank, world, options)


def root_mesh(mesh: Any) -> Any:
    """The root mesh a submesh was sliced from (``DeviceMesh._get_root_mesh``); ``mesh`` itself when it is one.

    Public: none yet (torch 2.14).
    """
    return mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh


def local_tensor(t: Any) -> torch.Tensor | None:
    """A DTensor's local shard without going through autograd (``DTensor._local_tensor``); None for a plain tensor.

    Public: ``DTensor.to_local()``, which is an autograd function call (slow per tensor and, on a parameter's
    ``.data``, not the same object whose memory the loader writes into).
    """
    return getattr(t, "_local_tensor", None)


def local_shape(global_shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> tuple[int, ...]:
    """The shape of this rank's local shard (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``).

    Public: none yet (torch 2.14).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(tuple(global_shape), mesh, list(placements))
    return tuple(shape)


def shard_size_and_offsets(
    local_size: int, mesh_dim_size: int, coordinate: int, placement: Any, previous: Any, global_size: int
) -> tuple[int, torch.Tensor]:
    """The size of one mesh coordinate's shard on one tensor dim and its global indices, after the shardings of
    earlier mesh dims (``previous``) — DTensor's own arithmetic (``_utils._get_shard_size_and_offsets``, with
    offsets). Public: none yet (torch 2.14)."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    return _get_shard_size_and_offsets(local_size, mesh_dim_size, coordinate, placement, previous, global_size, False)


def schema_arguments(func: Any) -> list:
    """The schema's arguments of an ``OpOverload``, in order (``func._schema.arguments``; public: none yet)."""
    return func._schema.arguments


def tensor_tables(mod: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own parameter and buffer tables (``mod._parameters``, ``mod._buffers``), to replace entries in
    place (tied tensors stay tied, a DTensor may replace a Parameter). Public: ``named_parameters(recurse=False)``
    reads them; ``register_parameter``/``register_buffer`` write one but check types and cannot be undone as is."""
    return mod._parameters, mod._buffers


def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity for a storage that holds across tensors viewing it (``UntypedStorage._cdata``).

    Public: ``data_ptr()``, which is 0 for every meta storage and so cannot tell two meta tensors apart.
    """
    return storage._cdata
