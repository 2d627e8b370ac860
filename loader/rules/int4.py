"""Packed integer checkpoints (compressed-tensors ``pack-quantized``): dequantize on load into a dense model.

Vocabulary:

- a **packed weight** ``<x>.weight`` is stored as ``<x>.weight_packed``: int32 **words** of ``32 // num_bits``
  **codes** each along the input (last) dim, code ``i`` of a row in bits ``num_bits * (i % per_word)`` of word
  ``i // per_word`` (compressed-tensors' ``pack_to_int32``), unsigned (``code + 2 ** (num_bits - 1)``); beside it
  ``<x>.weight_scale`` (one scale per **group** of ``group_size`` input elements, ``(rows, cols // group_size)``;
  one per row for the ``channel`` strategy), ``<x>.weight_shape`` and, when asymmetric, ``<x>.weight_zero_point``
  (codes packed the same way along the output dim, ``(ceil(rows / per_word), groups)``).
- its value is compressed-tensors' ``PackedQuantizationCompressor.decompress`` cast as transformers'
  ``CompressedTensorsDequantize`` casts it: ``((q.to(s.dtype) - z.to(s.dtype)) * s).to(s.dtype)``, then to the
  model tensor's dtype, per group.

:func:`unpacked_keyplan` plans the keys as if each packed weight were a plain ``<x>.weight`` of its dense shape, then
rewrites the conversions that read one to read its words, scales and zero points instead and decode them first. The
decoding is shifts, masks and products over index maps, so it traces (:mod:`regiontrace.values`): a rank reads the
words that hold its codes and the scales of the groups they touch — a cut on word and group boundaries reads exactly
its codes and scales, any other cut the words and groups it cuts through, whole, and is exact all the same.
Layouts that cannot be decoded that way (activation-ordered groups, codes straddling words, other formats) are
refused naming the tensor or the config before any byte is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..checkpoint import Checkpoint, config_location, quantization_config
from ..errors import CheckpointError
from .conversion import Conversion, decoding
from .keyplan import KeyPlan

#: the suffixes of a packed weight's tensors (``<x>.weight`` is stored as ``<x>.weight_packed`` and these)
PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX = "_packed", "_scale", "_shape", "_zero_point", "_g_idx"
#: the compressed-tensors formats a dense model loads: packed codes decoded here, and unquantized tensors
FORMATS = frozenset({"pack-quantized", "dense"})
#: the weight strategies decoded here: a scale per group of input elements, or per output row
STRATEGIES = frozenset({"group", "channel"})
#: code widths that never straddle an int32 word
NUM_BITS = frozenset({1, 2, 4, 8})


@dataclass(frozen=True)
class PackScheme:
    """How a checkpoint's packed weights are quantized (one compressed-tensors weight scheme).

    Attributes:
        num_bits: bits per code.
        strategy: ``"group"`` or ``"channel"``.
        group_size: input elements per scale (``group``); None for ``channel``.
        symmetric: no zero points.
        where: the config it was read from, for messages.
    """

    num_bits: int
    strategy: str
    group_size: int | None
    symmetric: bool
    where: str

    @property
    def per_word(self) -> int:
        """Codes per int32 word."""
        return 32 // self.num_bits


@dataclass(frozen=True)
class PackedWeight:
    """One packed weight: its tensors' keys, its dense shape and the scale dtype it decompresses to."""

    packed: str
    scale: str
    zero_point: str | None
    shape: tuple[int, int]
    group_size: int
    dtype: torch.dtype


def pack_scheme(config: Mapping[str, Any] | None, where: str) -> PackScheme | None:
    """The packed-weight scheme a ``quantization_config`` declares; None: not compressed-tensors, or nothing packed.

    Raises:
        CheckpointError: a format, strategy, code width or activation ordering not decoded here, or config groups
            that quantize weights differently (naming ``where``).
    """
    if not config or config.get("quant_method") != "compressed-tensors":
        return None

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(
            f"{where}: compressed-tensors quantization_config {what}; a dense model loads 'pack-quantized' int "
            f"weights with {sorted(STRATEGIES)} scales of {sorted(NUM_BITS)} bits (load into a compressed model, "
            "or decompress the checkpoint first)",
            path=where,
        )

    schemes = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = (group or {}).get("weights")
        fmt = (group or {}).get("format") or config.get("format")
        if weights is None:
            continue
        if fmt not in FORMATS:
            raise refuse(f"group {name!r} has format {fmt!r}")
        args = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"), weights.get("group_size"))
        if args[1] != "int" or args[0] not in NUM_BITS or args[2] not in STRATEGIES:
            raise refuse(f"group {name!r} quantizes weights as {args[:3]}")
        if weights.get("actorder") == "group":
            raise refuse(f"group {name!r} orders groups by activation (actorder 'group': a gather by g_idx)")
        group_size = args[3] if args[2] == "group" else None
        if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
            raise refuse(f"group {name!r} has group_size {group_size!r}")
        schemes.add((args[0], args[2], group_size, bool(weights.get("symmetric", True))))
    if len(schemes) > 1:
        raise refuse(f"groups quantize weights in {len(schemes)} ways {sorted(schemes, key=repr)}")
    return PackScheme(*schemes.pop(), where) if schemes else None


def packed_weights(checkpoint: Checkpoint, scheme: PackScheme) -> dict[str, PackedWeight]:
    """Every packed weight of ``checkpoint``, by the dense key ``<x>.weight`` it stands for.

    Raises:
        CheckpointError: words, scales or zero points that do not fit the scheme or one another, activation-order
            indices, or a dense key stored too (naming the file and tensor).
    """
    out = {}
    for key in checkpoint.keys():
        if key.endswith("weight" + PACKED):
            weight = key[: -len(PACKED)]
            out[weight] = _packed_weight(checkpoint, weight, scheme)
    return out


def _packed_weight(checkpoint: Checkpoint, weight: str, scheme: PackScheme) -> PackedWeight:
    packed = checkpoint[weight + PACKED]

    def refuse(what: str, key: str = weight + PACKED) -> CheckpointError:
        return CheckpointError(
            f"{packed.location}: tensor {key!r}: {what} ({scheme.where})", path=packed.location, key=key
        )

    for suffix, what in (("", "a dense weight"), (G_IDX, "activation-order group indices")):
        if weight + suffix in checkpoint:
            raise refuse(f"is stored with {what} {weight + suffix!r}: a packed weight that cannot be decoded alone")
    if weight + SCALE not in checkpoint:
        raise refuse(f"is stored without its scales {weight + SCALE!r}")
    scale = checkpoint[weight + SCALE]
    if packed.dtype != torch.int32 or len(packed.shape) != 2:
        raise refuse(f"packed codes must be 2-d int32 words, got {packed.dtype} {packed.shape}")
    if len(scale.shape) != 2 or scale.shape[0] != packed.shape[0] or not scale.dtype.is_floating_point:
        raise refuse(f"scales {scale.dtype} {scale.shape} do not fit words {packed.shape}", weight + SCALE)
    rows, words = packed.shape
    groups = scale.shape[1]
    if scheme.strategy == "group":
        cols = groups * scheme.group_size  # compressed-tensors requires groups to divide the input dim
        if math.ceil(cols / scheme.per_word) != words:
            raise refuse(f"{words} words per row do not hold {groups} groups of {scheme.group_size} codes")
    else:  # channel: the packed width tells the input dim only up to a word; a dense model's shape must match
        if groups != 1:
            raise refuse(f"per-channel scales must be one per row, got {scale.shape}", weight + SCALE)
        cols = words * scheme.per_word
    zero_point = None
    if not scheme.symmetric:
        zero_point = weight + ZERO_POINT
        if zero_point not in checkpoint:
            raise refuse(f"an asymmetric scheme stores zero points {zero_point!r}: missing")
        z = checkpoint[zero_point]
        if z.dtype != torch.int32 or tuple(z.shape) != (math.ceil(rows / scheme.per_word), groups):
            raise refuse(f"packed zero points {z.dtype} {z.shape} do not fit scales {scale.shape}", zero_point)
    return PackedWeight(weight + PACKED, weight + SCALE, zero_point, (rows, cols), cols // groups, scale.dtype)


def unpack_codes(words: Any, count: int, num_bits: int) -> Any:
    """The signed codes packed in int32 ``words`` along the last dim, the first ``count`` of each row (int32):
    compressed-tensors' ``unpack_from_int32``. Works on real tensors and on RegionTensors."""
    per_word = 32 // num_bits
    mask = (1 << num_bits) - 1
    shifted = [words >> _filled(words, num_bits * k) for k in range(per_word)]
    codes = torch.stack([s & mask for s in shifted], -1).reshape(*words.shape[:-1], words.shape[-1] * per_word)
    return codes[..., :count] - (1 << (num_bits - 1))


def _filled(like: Any, value: int) -> Any:
    """A column of ``value`` beside ``like``'s rows (``like[..., :1]``'s shape and dtype): padding, which traces as a
    constant (a real tensor would not follow ``like`` onto the meta device, a new tensor would not trace)."""
    return torch.nn.functional.pad(like[..., :0], (0, 1), value=value)


def dequantize_packed(
    words: Any, scale: Any, zero_point: Any | None, weight: PackedWeight, num_bits: int, dtype: torch.dtype
) -> Any:
    """A packed weight's dense values of ``dtype``, as compressed-tensors decompresses it and transformers casts
    it (see the module). Works on real tensors and on RegionTensors."""
    rows, cols = weight.shape
    groups = scale.shape[-1]
    q = unpack_codes(words, cols, num_bits).reshape(rows, groups, weight.group_size).to(scale.dtype)
    if zero_point is not None:
        z = unpack_codes(zero_point.transpose(0, 1), rows, num_bits).transpose(0, 1)
        q = q - z.to(scale.dtype)[..., None]
    return (q * scale[..., None]).to(scale.dtype).reshape(rows, cols).to(dtype)


def unpacked_keyplan(
    checkpoint: Checkpoint, model: torch.nn.Module, plan: Callable[[Mapping[str, Any], Mapping[str, Any]], KeyPlan]
) -> KeyPlan:
    """The key plan of ``checkpoint`` with every packed weight decoded on load.

    ``plan(shapes, dtypes)`` plans the keys of a checkpoint table; it is given the checkpoint's own, or — for a
    compressed-tensors checkpoint loading into a model without packed tensors — one where each packed weight is a
    plain ``<x>.weight`` of its dense shape and scale dtype, and its conversions are rewritten to decode it.

    Raises:
        CheckpointError: see :func:`pack_scheme` and :func:`packed_weights`.
    """
    infos = checkpoint.tensors
    shapes = {k: info.shape for k, info in infos.items()}
    dtypes = {k: info.dtype for k, info in infos.items()}
    if not any(k.endswith("weight" + PACKED) for k in infos) or _holds_packed(model):
        return plan(shapes, dtypes)
    config, where = quantization_config(checkpoint.store), config_location(checkpoint.store)
    if config is None:
        config = getattr(getattr(model, "config", None), "quantization_config", None)
        config = config.to_dict() if hasattr(config, "to_dict") else config
        where = f"the model's config ({type(model).__name__}.config)"
    scheme = pack_scheme(config, where)
    if scheme is None:
        return plan(shapes, dtypes)
    weights = packed_weights(checkpoint, scheme)
    for dense, w in weights.items():
        for k in (w.packed, w.scale, w.zero_point, dense + SHAPE):
            shapes.pop(k, None)
            dtypes.pop(k, None)
        shapes[dense], dtypes[dense] = w.shape, w.dtype
    keyplan = plan(shapes, dtypes)
    model_dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    conversions = [_decoding(c, weights, scheme, model_dtypes) for c in keyplan.conversions]
    return replace(keyplan, conversions=conversions)


def _holds_packed(model: torch.nn.Module) -> bool:
    """Whether the model keeps packed tensors itself (a compressed model: codes load as they are)."""
    return any(name.endswith("weight" + PACKED) for name, _ in model.named_parameters())


def _decoding(
    conv: Conversion, weights: Mapping[str, PackedWeight], scheme: PackScheme, model_dtypes: Mapping[str, torch.dtype]
) -> Conversion:
    """``conv`` reading the packed tensors of its packed sources instead, and decoding them first."""
    packed = {k: weights[k] for k in conv.sources if k in weights}
    if not packed:
        return conv
    dtype = model_dtypes.get(conv.targets[0], next(iter(packed.values())).dtype)
    stored = tuple(n for w in packed.values() for n in (w.packed, w.scale, w.zero_point) if n is not None)

    def decoder(w: PackedWeight) -> Callable[[Mapping[str, Any]], Any]:
        def decode(tensors: Mapping[str, Any]) -> Any:
            z = tensors[w.zero_point] if w.zero_point is not None else None
            return dequantize_packed(tensors[w.packed], tensors[w.scale], z, w, scheme.num_bits, dtype)

        return decode

    layout = tuple(
        (conv.sources.index(k), w.shape, w.group_size, w.dtype, w.zero_point is not None) for k, w in packed.items()
    )
    return decoding(
        conv,
        {k: decoder(w) for k, w in packed.items()},
        stored,
        dtype,
        rule=PackedDequantization(conv.rule),
        description=f"{scheme.num_bits}-bit pack-quantized dequantization",
        key=("packed", layout, scheme.num_bits, dtype),
    )


@dataclass(frozen=True)
class PackedDequantization:
    """The rule of a rewritten conversion: ``rule`` applied to decoded packed weights."""

    rule: Any
