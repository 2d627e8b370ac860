"""Dtype checks of a plan: casts that cross value kinds (reported), FP8 codes that would load as values
(refused).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from ..rules import KeyPlan
from ..rules.fp8 import FLOAT8, SCALE_SUFFIX, scale_names, weight_of_scale
from .slots import TargetSlot


def value_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"int"``, ``"float"`` or ``"complex"``: casts within a kind keep values, across kinds not."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def kind_cast(name: str, produced: torch.dtype, model: torch.dtype) -> tuple[str, torch.dtype, torch.dtype] | None:
    """The cast record of a model tensor loaded from values of dtype ``produced``, when it crosses value kinds
    (integer <-> floating point, bool); None for casts within a kind (bf16 -> float32, int32 -> int64)."""
    return (name, produced, model) if value_kind(produced) != value_kind(model) else None


def check_float8(keyplan: KeyPlan, checkpoint: Checkpoint, slots: Mapping[str, TargetSlot]) -> None:
    """Refuse, before anything is read, a plan that would load FP8 codes as values.

    A float8 checkpoint tensor may load into float8 model tensors only (codes unchanged), unless its conversion
    also takes its own block scales (one of :func:`~loader.rules.fp8.scale_names`: a converter that dequantizes
    it; every float8 source of a conversion needs its own); and a float8 weight stored beside its block scales
    may load only if those load too.

    Raises:
        CheckpointError: naming the file and the float8 tensor.
    """
    infos = checkpoint.tensors
    if not any(info.dtype in FLOAT8 for info in infos.values()):
        return  # nothing to check (the usual case: planned per rank, this stays cheap)
    loaded: set[str] = set()
    for conv in keyplan.conversions:
        loaded.update(conv.sources)
        sources = set(conv.sources)
        for key in conv.sources:
            info = checkpoint[key]
            scale_of_a_source = weight_of_scale(key) in sources  # float8 (E8M0) scales
            if info.dtype not in FLOAT8 or any(n in sources for n in scale_names(key)) or scale_of_a_source:
                continue
            for t in conv.targets:
                slot = slots.get(t)
                if slot is not None and slot.dtype not in FLOAT8:
                    raise _fp8_error(
                        info.location,
                        key,
                        f"would load into {t!r} ({slot.dtype}) as the values of its {info.dtype} codes",
                    )
    for key in checkpoint.keys():
        weight = weight_of_scale(key)
        if weight in loaded and key not in loaded and checkpoint[weight].dtype in FLOAT8:
            raise _fp8_error(
                checkpoint[weight].location,
                weight,
                f"is stored with block scales {key!r}, which no model tensor loads: its codes would load as values",
            )


def _fp8_error(path: str, key: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: tensor {key!r}: float8 checkpoint tensor {what}; float8 weights dequantize on load only "
        f"with block scales stored beside them as '<weight>{SCALE_SUFFIX}' (quantization_config "
        "quant_method 'fp8'); load into float8 model tensors, or dequantize the checkpoint first",
        path=path,
        key=key,
    )
