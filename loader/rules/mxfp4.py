"""MXFP4 checkpoints (gpt-oss, ``quant_method: mxfp4``): dequantize on load into a dense model.

Vocabulary:

- an **MXFP4 weight** ``<x>`` (a gpt-oss expert projection, dense ``[E, K, out]``) is stored as ``<x>_blocks``:
  uint8 bytes of two E2M1 **codes** each, low nibble first, along the input dim K, ``[E, out, K / 32, 16]``, and
  ``<x>_scales``: one uint8 E8M0 **exponent** per **block** of 32 codes, ``[E, out, K / 32]``.
- its value is transformers' ``convert_moe_packed_tensors`` (the ``Mxfp4Config(dequantize=True)`` load): the E2M1
  value of each code times ``2 ** (scale - 127)`` (``torch.ldexp``: exact, rounded once), cast to the model
  tensor's dtype, then ``[E, out, K]`` transposed to ``[E, K, out]``.

:func:`mxfp4_keyplan` plans the keys as if each MXFP4 weight were a plain ``<x>`` of its dense shape, then rewrites
the conversions that read one to read its blocks and scales and decode them first. The decoding is shifts, masks,
casts and exact products (powers of two built from the exponent's bits: ``pow`` does not trace), so it traces
(:mod:`regiontrace.values`): a rank reads the bytes that hold its codes and the exponents of the blocks they touch —
a cut on 32-code blocks reads exactly its codes and exponents; a cut through a byte or a block reads it whole.
Layouts not decoded that way are refused naming the file and tensor before any byte is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..checkpoint import Checkpoint, config_location, quantization_config
from ..errors import CheckpointError
from .conversion import Conversion, decoding
from .keyplan import KeyPlan

#: the suffixes of an MXFP4 weight's tensors (``<x>`` is stored as these two)
BLOCKS, SCALES = "_blocks", "_scales"
#: codes per block (one exponent each), and bytes per block
BLOCK, BLOCK_BYTES = 32, 16


@dataclass(frozen=True)
class Mxfp4Weight:
    """One MXFP4 weight: its tensors' keys and its dense shape ``[E, K, out]``."""

    blocks: str
    scales: str
    shape: tuple[int, int, int]


def is_mxfp4(config: Mapping[str, Any] | None) -> bool:
    """Whether a ``quantization_config`` declares MXFP4 (``quant_method: mxfp4``)."""
    return bool(config) and config.get("quant_method") == "mxfp4"


def mxfp4_weights(checkpoint: Checkpoint, where: str) -> dict[str, Mxfp4Weight]:
    """Every MXFP4 weight of ``checkpoint``, by the dense key ``<x>`` it stands for.

    Raises:
        CheckpointError: blocks without scales, dtypes or shapes that do not fit ``[E, out, K / 32, 16]`` and
            ``[E, out, K / 32]``, or a dense ``<x>`` stored too (naming the file and tensor).
    """
    out = {}
    for key in checkpoint.keys():
        if key.endswith(BLOCKS):
            dense = key[: -len(BLOCKS)]
            out[dense] = _mxfp4_weight(checkpoint, dense, where)
    return out


def _mxfp4_weight(checkpoint: Checkpoint, dense: str, where: str) -> Mxfp4Weight:
    blocks = checkpoint[dense + BLOCKS]

    def refuse(what: str, key: str = dense + BLOCKS) -> CheckpointError:
        return CheckpointError(f"{blocks.location}: tensor {key!r}: {what} ({where})", path=blocks.location, key=key)

    if dense in checkpoint:
        raise refuse(f"is stored beside a dense {dense!r}: which one loads is ambiguous")
    if dense + SCALES not in checkpoint:
        raise refuse(f"is stored without its exponents {dense + SCALES!r}")
    scales = checkpoint[dense + SCALES]
    if blocks.dtype != torch.uint8 or len(blocks.shape) != 4 or blocks.shape[-1] != BLOCK_BYTES:
        raise refuse(
            f"MXFP4 blocks must be uint8 [experts, out, K / {BLOCK}, {BLOCK_BYTES}], got {blocks.dtype} "
            f"{tuple(blocks.shape)} (only gpt-oss expert layouts are decoded)"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise refuse(f"E8M0 exponents {scales.dtype} {tuple(scales.shape)} do not fit blocks", dense + SCALES)
    experts, rows, groups, _ = blocks.shape
    return Mxfp4Weight(dense + BLOCKS, dense + SCALES, (experts, groups * BLOCK, rows))


def _filled(like: Any, value: int) -> Any:
    """A column of ``value`` beside ``like``'s rows: a constant operand that traces (as in :mod:`.int4`)."""
    return torch.nn.functional.pad(like[..., :0], (0, 1), value=value)


def e2m1_values(blocks: Any) -> Any:
    """The float32 values of the two E2M1 codes of each byte (low nibble first), ``[..., bytes * 2]``: sign bit 3,
    exponent ``e`` bits 1-2, mantissa ``m`` bit 0; four times the magnitude is ``(2 + m) << e``, or ``2m`` for
    ``e == 0`` (``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, ``-0.0`` for code 8)."""
    codes = torch.stack([(blocks >> _filled(blocks, k)) & 15 for k in (0, 4)], -1).to(torch.int32)
    m, e, sign = codes & 1, (codes >> 1) & 3, codes >> 3
    quad = ((m + 2) << e) - (e == 0).to(torch.int32) * (2 - m)
    values = quad.float() * (1 - 2 * sign).float() * 0.25
    return values.reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)


def e8m0_halves(scales: Any) -> Any:
    """``2 ** (s - 128)`` in float32 for uint8 exponents ``s``, exactly (never inf; ``2 ** -128`` is subnormal):
    the product of ``2 ** (2 ** k)`` over the set bits ``k < 7`` of ``s``, times ``2 ** -128`` unless bit 7 is set.
    Half the scale, so that ``x * half * 2`` is ``torch.ldexp(x, s - 127)``: exact, even for ``s = 255``."""
    value = None
    for k in range(8):
        bit = ((scales >> _filled(scales, k)) & 1).float()
        on, off = (1.0, 2.0**-128) if k == 7 else (2.0 ** (2**k), 1.0)
        factor = bit * on + (1 - bit) * off
        value = factor if value is None else value * factor
    return value


def dequantize_mxfp4(blocks: Any, scales: Any, dtype: torch.dtype) -> Any:
    """An MXFP4 weight's dense ``[E, K, out]`` values of ``dtype``, as transformers' ``convert_moe_packed_tensors``
    makes them (see the module). Works on real tensors and on RegionTensors."""
    experts, rows, groups, nbytes = blocks.shape
    values = (e2m1_values(blocks) * e8m0_halves(scales)[..., None] * 2.0).to(dtype)
    return values.reshape(experts, rows, groups * nbytes * 2).transpose(1, 2)


def mxfp4_keyplan(
    checkpoint: Checkpoint, model: torch.nn.Module, plan: Callable[[Mapping[str, Any], Mapping[str, Any]], KeyPlan]
) -> KeyPlan | None:
    """The key plan of an MXFP4 ``checkpoint`` with every MXFP4 weight decoded on load; None: not MXFP4 (no
    ``<x>_blocks`` tensors, no ``mxfp4`` config, or a model that keeps the blocks itself).

    ``plan(shapes, dtypes)`` plans the keys of a table where each MXFP4 weight is a plain ``<x>`` of its dense
    shape (and the model tensor's dtype); its conversions are then rewritten to decode it.

    Raises:
        CheckpointError: see :func:`mxfp4_weights`.
    """
    infos = checkpoint.tensors
    if not any(k.endswith(BLOCKS) for k in infos):
        return None
    config, where = quantization_config(checkpoint.store), config_location(checkpoint.store)
    if config is None:
        config = getattr(getattr(model, "config", None), "quantization_config", None)
        config = config.to_dict() if hasattr(config, "to_dict") else config
        where = f"the model's config ({type(model).__name__}.config)"
    if not is_mxfp4(config) or any(name.endswith(BLOCKS) for name, _ in model.named_parameters()):
        return None
    weights = mxfp4_weights(checkpoint, where)
    model_dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    shapes = {k: info.shape for k, info in infos.items()}
    dtypes = {k: info.dtype for k, info in infos.items()}
    for dense, w in weights.items():
        for k in (w.blocks, w.scales):
            shapes.pop(k)
            dtypes.pop(k)
        shapes[dense], dtypes[dense] = w.shape, torch.bfloat16
    keyplan = plan(shapes, dtypes)
    return replace(keyplan, conversions=[_decoding(c, weights, model_dtypes) for c in keyplan.conversions])


def _decoding(
    conv: Conversion, weights: Mapping[str, Mxfp4Weight], model_dtypes: Mapping[str, torch.dtype]
) -> Conversion:
    """``conv`` reading the blocks and exponents of its MXFP4 sources instead, and decoding them first."""
    packed = {k: weights[k] for k in conv.sources if k in weights}
    if not packed:
        return conv
    dtype = model_dtypes.get(conv.targets[0], torch.bfloat16)
    stored = tuple(n for w in packed.values() for n in (w.blocks, w.scales))

    def decoder(w: Mxfp4Weight) -> Callable[[Mapping[str, Any]], Any]:
        return lambda tensors: dequantize_mxfp4(tensors[w.blocks], tensors[w.scales], dtype)

    layout = tuple((conv.sources.index(k), w.shape) for k, w in packed.items())
    return decoding(
        conv,
        {k: decoder(w) for k, w in packed.items()},
        stored,
        dtype,
        rule=Mxfp4Dequantization(conv.rule),
        description="MXFP4 dequantization",
        key=("mxfp4", layout, dtype),
    )


@dataclass(frozen=True)
class Mxfp4Dequantization:
    """The rule of a rewritten conversion: ``rule`` applied to decoded MXFP4 weights."""

    rule: Any
