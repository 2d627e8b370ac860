"""FP8 block-quantized checkpoints: dequantize on load where the model's tensor is not FP8.

Vocabulary:

- a **quantized weight** is a float8 checkpoint tensor ``<key>`` stored with its **block scales**
  ``<key>_scale_inv``: one scale per **quant block** (``quant_block`` in code; never a RemapBlock) of ``(bm, bn)``
  elements of the last two dims, on a **scale grid** of ``ceil(rows / bm) x ceil(cols / bn)`` (leading dims, e.g.
  experts, match).
- its value is ``w.float() * scale_inv[..., i // bm, j // bn]`` cast to the model tensor's dtype: the float32
  product and the cast of transformers' fine-grained FP8 dequantization (``Fp8Dequantize``), so the values are
  bit-identical to it wherever its quant block divides the shape (it infers the quant block from the grid; ours comes
  from ``quantization_config.weight_block_size``, so shapes the quant block does not divide dequantize exactly too).

:func:`dequantize_fp8` rewrites the conversions of a key plan: each one that reads a quantized weight into a
model tensor that is not FP8 reads the weight's scales too and dequantizes the weight before its own ops. The
dequantization is pointwise over index maps, so it traces (:mod:`regiontrace.values`): each rank reads its
weight elements and the scales of the quant blocks they touch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..checkpoint import Checkpoint, config_location, quantization_config
from ..errors import CheckpointError
from .conversion import Conversion, cast_like_transformers
from .keyplan import KeyPlan

#: float8 dtypes this torch build has: their elements are codes whose value needs the checkpoint's scales
FLOAT8 = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)

#: suffix of the block-scale tensor stored beside a float8 weight (``x.weight`` + ``x.weight_scale_inv``)
SCALE_SUFFIX = "_scale_inv"


def scale_names(key: str) -> tuple[str, ...]:
    """The names the block scales of float8 weight ``key`` may be stored under, in order: ``<key>_scale_inv``,
    and for ``<x>.weight`` also ``<x>.scale`` (DeepSeek-V4-Flash) and ``<x>.qscale_weight`` (Mistral Large 4),
    the names transformers' FP8 quantizer renames to ``_scale_inv``."""
    if not key.endswith(".weight"):
        return (key + SCALE_SUFFIX,)
    stem = key[: -len(".weight")]
    return key + SCALE_SUFFIX, stem + ".scale", stem + ".qscale_weight"


def weight_of_scale(key: str) -> str | None:
    """The float8 weight a scale name of :func:`scale_names` belongs to (None: not a scale name)."""
    for suffix, weight in ((SCALE_SUFFIX, ""), (".scale", ".weight"), (".qscale_weight", ".weight")):
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)] + weight
    return None


#: the largest side of a ``weight_block_size`` accepted (2**31 - 1: no tensor dimension is longer in practice)
MAX_QUANT_BLOCK = 2**31 - 1

#: scale dtypes whose cast to float32 is their value (``uint8`` E8M0 exponents need ``exp2``: not traceable)
_VALUE_SCALES = (torch.float32, torch.bfloat16, torch.float16, getattr(torch, "float8_e8m0fnu", torch.float32))


def dequantize_quant_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, quant_block: tuple[int, int], dtype: torch.dtype
) -> Any:
    """Dequantization by quant blocks: ``w.float() * scale_inv`` broadcast over each ``quant_block`` of the last two
    dims, cast to ``dtype``. Works on real tensors and on RegionTensors (it is index maps and exact pointwise ops).

    Args:
        w: float8 codes ``(..., rows, cols)``.
        scale_inv: scales ``(..., ceil(rows / bm), ceil(cols / bn))``, or one scale (0-d or one element) for the
            whole weight; ``uint8`` holds E8M0 exponents (``2 ** (b - 127)``, as transformers reads them).
        quant_block: ``(bm, bn)``, the elements one scale covers.
        dtype: the result's dtype.
    """
    rows, cols = w.shape[-2:]
    bm, bn = quant_block
    if scale_inv.dim() < 2:  # a per-tensor scale: one quant block of the whole weight
        scale_inv = scale_inv.reshape((1,) * w.dim())
    if scale_inv.dtype == torch.uint8:
        s = (scale_inv.to(torch.float32) - 127.0).exp2()
    else:
        s = scale_inv.to(torch.float32)
    # each scale repeated over its quant block (expand + reshape: plain movement ops), then cut to the weight's shape
    *lead, sr, sc = s.shape
    s = s[..., :, None, :, None].expand(*lead, sr, bm, sc, bn).reshape(*lead, sr * bm, sc * bn)
    return (w.to(torch.float32) * s[..., :rows, :cols]).to(dtype)


@dataclass(frozen=True)
class QuantBlockScheme:
    """How a checkpoint's FP8 weights are quantized.

    Attributes:
        quant_block: ``(bm, bn)`` from ``quantization_config.weight_block_size``; None: inferred per weight from
            its scale grid (only where the grid divides the shape, as transformers does).
        where: where it was read from, for messages.
    """

    quant_block: tuple[int, int] | None
    where: str


def quant_block_scheme(quantization_config: Mapping[str, Any] | None, where: str) -> QuantBlockScheme:
    """The FP8 quant block scheme a ``quantization_config`` declares (none, or ``quant_method: fp8``).

    Raises:
        CheckpointError: another quantization method with float8 weights, or a malformed or unreasonable
            (over :data:`MAX_QUANT_BLOCK`) ``weight_block_size`` (naming ``where``).
    """
    if not quantization_config:
        return QuantBlockScheme(None, where)
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"{where}: quantization_config.quant_method is {method!r}; only block-quantized 'fp8' checkpoints "
            "dequantize on load (load into a model quantized the same way, or dequantize the checkpoint first)",
            path=where,
        )
    quant_block = quantization_config.get("weight_block_size")
    if quant_block is None:
        return QuantBlockScheme(None, where)
    ok = isinstance(quant_block, list | tuple) and len(quant_block) == 2
    if not ok or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in quant_block):
        raise CheckpointError(
            f"{where}: quantization_config.weight_block_size must be two positive integers, got {quant_block!r}",
            path=where,
        )
    if max(quant_block) > MAX_QUANT_BLOCK:
        raise CheckpointError(
            f"{where}: quantization_config.weight_block_size {list(quant_block)!r} is unreasonable: each side must be "
            f"at most {MAX_QUANT_BLOCK} (real checkpoints use blocks such as [128, 128])",
            path=where,
        )
    return QuantBlockScheme((quant_block[0], quant_block[1]), where)


def dequantize_fp8(
    conversions: list[Conversion],
    checkpoint: Checkpoint,
    model_dtypes: Mapping[str, torch.dtype],
    scheme: QuantBlockScheme,
) -> tuple[list[Conversion], list[str]]:
    """Rewrite the conversions that load quantized weights into model tensors that are not FP8.

    Args:
        conversions: a key plan's conversions.
        checkpoint: the checkpoint headers.
        model_dtypes: each model tensor's dtype, by name.
        scheme: the checkpoint's quant block scheme (:func:`quant_block_scheme`).

    Returns:
        The conversions (rewritten ones read each weight's scales too — the first of :func:`scale_names` in the
        checkpoint that no conversion loads — after their own sources), and the scale keys they consume.

    Raises:
        CheckpointError: a scale grid that does not fit its weight or the declared quant block, or a scale dtype
            that cannot scale (naming the file and tensor).
    """
    out, consumed = [], []
    loaded = {k for conv in conversions for k in conv.sources}
    for conv in conversions:
        scales = {}
        for k in conv.sources:
            if checkpoint[k].dtype in FLOAT8:
                found = [n for n in scale_names(k) if n in checkpoint and n not in loaded]
                if found:
                    scales[k] = found[0]
        dtype = model_dtypes.get(conv.targets[0])
        if not scales or dtype is None or dtype in FLOAT8 or any(s in conv.sources for s in scales.values()):
            out.append(conv)
            continue
        quant_blocks = {k: _quant_block_of(checkpoint, k, s, scheme) for k, s in scales.items()}
        out.append(_dequantizing(conv, scales, quant_blocks, dtype))
        consumed += scales.values()
    return out, consumed


def dequantized_keyplan(keyplan: KeyPlan, checkpoint: Checkpoint, model: torch.nn.Module) -> KeyPlan:
    """``keyplan`` with FP8 dequantization wherever a quantized weight loads into a tensor that is not FP8.

    The scheme is read from the ``quantization_config`` of the checkpoint's ``config.json``, else of the model's
    config. Scale keys the rewritten conversions read are no longer unexpected.

    Raises:
        CheckpointError: see :func:`quant_block_scheme` and :func:`dequantize_fp8`.
    """
    if not any(info.dtype in FLOAT8 for info in checkpoint.tensors.values()):
        return keyplan  # the usual case: nothing to read or rewrite
    quant = quantization_config(checkpoint.store)
    where = config_location(checkpoint.store)
    if quant is None:
        config = getattr(getattr(model, "config", None), "quantization_config", None)
        quant = config.to_dict() if hasattr(config, "to_dict") else config
        where = f"the model's config ({type(model).__name__}.config)"
    dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    conversions, consumed = dequantize_fp8(keyplan.conversions, checkpoint, dtypes, quant_block_scheme(quant, where))
    if not consumed:
        return keyplan
    used = set(consumed)
    unexpected = [k for k in keyplan.unexpected_keys if k not in used]
    return replace(keyplan, conversions=conversions, unexpected_keys=unexpected)


def _quant_block_of(checkpoint: Checkpoint, key: str, scale_key: str, scheme: QuantBlockScheme) -> tuple[int, int]:
    """The quant block of one quantized weight, checked against its scale grid."""
    w, s = checkpoint[key], checkpoint[scale_key]

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{s.file}: tensor {scale_key!r}: {what}", path=s.file, key=scale_key)

    if s.dtype not in _VALUE_SCALES and s.dtype != torch.uint8:
        raise refuse(f"block scales of dtype {s.dtype} are not understood")
    if len(s.shape) < 2 and math.prod(s.shape) == 1 and len(w.shape) >= 2:
        return w.shape[-2], w.shape[-1]  # one scale for the whole weight (as transformers reads it)
    if len(w.shape) < 2 or len(s.shape) != len(w.shape) or s.shape[:-2] != w.shape[:-2]:
        raise refuse(f"scale grid {s.shape} does not fit the float8 weight {key!r} of shape {w.shape}")
    (rows, cols), (sr, sc) = w.shape[-2:], s.shape[-2:]
    if scheme.quant_block is not None:
        bm, bn = scheme.quant_block
        if (sr, sc) != (math.ceil(rows / bm), math.ceil(cols / bn)):
            raise refuse(
                f"scale grid {(sr, sc)} does not fit weight {key!r} {w.shape} in blocks of {scheme.quant_block} "
                f"(weight_block_size of {scheme.where})"
            )
        return bm, bn
    if sr == 0 or sc == 0 or rows % sr or cols % sc:
        raise refuse(
            f"cannot infer the block size of weight {key!r} {w.shape} from scale grid {(sr, sc)}: "
            f"set quantization_config.weight_block_size in {scheme.where}"
        )
    return rows // sr, cols // sc


def _dequantizing(
    conv: Conversion, scales: Mapping[str, str], quant_blocks: Mapping[str, tuple[int, int]], dtype: torch.dtype
) -> Conversion:
    """``conv`` reading its quantized weights' scales too and dequantizing them to ``dtype`` first."""

    def run(tensors: Mapping[str, Any]) -> dict[str, Any]:
        given = {
            k: dequantize_quant_blocks(tensors[k], tensors[scales[k]], quant_blocks[k], dtype)
            if k in quant_blocks
            else tensors[k]
            for k in conv.sources
        }
        return conv.run(cast_like_transformers(conv.rule, given, dtype))

    scale_keys = tuple(scales[k] for k in quant_blocks)
    where = tuple(
        (conv.sources.index(k), quant_block) for k, quant_block in quant_blocks.items()
    )  # which sources, which quant blocks
    signature = None if conv.signature is None else ("fp8", conv.signature, where, dtype)
    return replace(
        conv,
        sources=conv.sources + scale_keys,
        description=f"{conv.description} (FP8 block dequantization)",
        is_rename=False,
        rule=Fp8Dequantization(conv.rule),
        meta=None,
        signature=signature,
        runner=run,
    )


@dataclass(frozen=True)
class Fp8Dequantization:
    """The rule of a rewritten conversion: ``rule`` applied to dequantized weights."""

    rule: Any
