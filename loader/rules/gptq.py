"""GPTQ checkpoints (``quant_method: gptq``): dequantize on load into a dense model; the shared machinery of packed
``Linear`` layouts (:mod:`.awq` too).

Vocabulary:

- a **quantized linear** ``<x>`` stores its dense ``<x>.weight`` ``[out, in]`` as ``<x>.qweight`` (int32 **words**
  of ``32 // bits`` **codes**), ``<x>.qzeros`` (packed zero points, one per **group** of ``group_size`` inputs and
  output) and ``<x>.scales`` (``[in / group_size, out]``); GPTQ also stores ``<x>.g_idx`` (each input's group).
- GPTQ packs codes along the input dim, ``qweight [in / per_word, out]``, code of input ``i`` in bits
  ``bits * (i % per_word)`` of word ``i // per_word``; zero points along the output dim, ``qzeros
  [groups, out / per_word]``; the ``gptq`` (v1) checkpoint format stores each zero point minus one.
- its value is gptqmodel's torch ``dequantize_weight``: ``scales[g] * (q - z)`` with ``q - z`` an integer and the
  product in the scales' dtype, transposed to ``[out, in]``, then cast to the model tensor's dtype.

:func:`qlinear_keyplan` plans each quantized linear as a plain ``<x>.weight`` of its dense shape, then rewrites the
conversions that read one to read its words, zero points and scales and decode them (shifts, masks and products:
traced, so a rank reads the words and groups its box touches). ``g_idx`` is not read with ``desc_act: false``: it
is ``i // group_size`` by construction. Activation order (``desc_act: true``) gathers each input's scale and zero
point by ``g_idx``: a gather by values does not trace, so that conversion is deferred (its tensors read whole,
logged by name) and exact. Code widths that straddle words are refused by name.
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

#: the suffixes of a quantized linear's tensors (``<x>.weight`` is stored as these)
QWEIGHT, QZEROS, SCALES, G_IDX = ".qweight", ".qzeros", ".scales", ".g_idx"
#: code widths that never straddle an int32 word
BITS = frozenset({2, 4, 8})


@dataclass(frozen=True)
class LinearScheme:
    """How a checkpoint's linears are packed.

    Attributes:
        method: ``"gptq"`` or ``"awq"``.
        bits: bits per code.
        group_size: inputs per scale (``-1`` in a config: all of them; stored here as None).
        zero_offset: added to each stored zero point (1 for GPTQ's v1 format).
        decode: ``decode(qweight, qzeros, scales, linear, scheme, g_idx)``: the dense ``[out, in]`` in the scales'
            dtype.
        where: the config it was read from, for messages.
        act_order: groups are ordered by activation (GPTQ ``desc_act``): each input's group is read from ``g_idx``.
    """

    method: str
    bits: int
    group_size: int | None
    zero_offset: int
    decode: Callable[..., Any]
    where: str
    act_order: bool = False

    @property
    def per_word(self) -> int:
        """Codes per int32 word."""
        return 32 // self.bits


@dataclass(frozen=True)
class QuantLinear:
    """One quantized linear: its tensors' keys, dense shape ``(out, in)``, inputs per group and scale dtype."""

    qweight: str
    qzeros: str
    scales: str
    shape: tuple[int, int]
    group_size: int
    dtype: torch.dtype
    g_idx: str | None = None


def filled(like: Any, value: int) -> Any:
    """A column of ``value`` beside ``like``'s rows: a constant operand that traces (as in :mod:`.int4`)."""
    return torch.nn.functional.pad(like[..., :0], (0, 1), value=value)


def unpack_last(words: Any, bits: int, order: tuple[int, ...] | None = None) -> Any:
    """The codes packed in int32 ``words`` along the last dim (int32, ``[..., n * per_word]``): code ``k`` of a word
    in bits ``bits * order[k]`` (default ``order[k] = k``). Works on real tensors and on RegionTensors."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    order = order or tuple(range(per_word))
    codes = torch.stack([(words >> filled(words, bits * p)) & mask for p in order], -1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def refuse_config(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: quantization_config {what}; a dense model loads GPTQ (desc_act false) and AWQ GEMM linears "
        f"of {sorted(BITS)} bits (load into a quantized model, or dequantize the checkpoint first)",
        path=where,
    )


def gptq_scheme(config: Mapping[str, Any], where: str) -> LinearScheme:
    """The scheme of a ``quant_method: gptq`` config.

    Raises:
        CheckpointError: activation order, a code width or group size not decoded here (naming ``where``).
    """
    bits, group_size = config.get("bits"), config.get("group_size", 128)
    if bits not in BITS:
        raise refuse_config(where, f"has bits {bits!r}")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise refuse_config(where, f"has group_size {group_size!r}")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse_config(where, f"has checkpoint_format {fmt!r}")
    offset = 1 if fmt == "gptq" else 0
    group = None if group_size == -1 else group_size
    return LinearScheme("gptq", bits, group, offset, decode_gptq, where, bool(config.get("desc_act")))


def decode_gptq(
    qweight: Any, qzeros: Any, scales: Any, linear: QuantLinear, scheme: LinearScheme, g_idx: Any = None
) -> Any:
    """A GPTQ linear's dense ``[out, in]`` in the scales' dtype (see the module); with ``g_idx`` (activation
    order) each input's scale and zero point are gathered by its group, which does not trace: the conversion is
    deferred (read whole)."""
    out, cols = linear.shape
    groups = scales.shape[0]
    q = unpack_last(qweight.transpose(0, 1), scheme.bits).transpose(0, 1)  # [in, out]
    z = unpack_last(qzeros, scheme.bits) + scheme.zero_offset  # [groups, out]
    if g_idx is not None:
        index = g_idx.long()
        return (scales[index] * (q - z[index]).to(scales.dtype)).transpose(0, 1)
    ints = q.reshape(groups, linear.group_size, out) - z[:, None, :]
    return (scales[:, None, :] * ints.to(scales.dtype)).reshape(cols, out).transpose(0, 1)


def quant_linears(checkpoint: Checkpoint, scheme: LinearScheme) -> dict[str, QuantLinear]:
    """Every quantized linear of ``checkpoint``, by the dense key ``<x>.weight`` it stands for.

    Raises:
        CheckpointError: a missing or misshapen tensor, or a dense weight stored too (naming the file and tensor).
    """
    out = {}
    for key in checkpoint.keys():
        if key.endswith(QWEIGHT):
            stem = key[: -len(QWEIGHT)]
            out[stem + ".weight"] = _quant_linear(checkpoint, stem, scheme)
    return out


def _quant_linear(checkpoint: Checkpoint, stem: str, scheme: LinearScheme) -> QuantLinear:
    qweight = checkpoint[stem + QWEIGHT]

    def refuse(what: str, key: str = stem + QWEIGHT) -> CheckpointError:
        return CheckpointError(
            f"{qweight.location}: tensor {key!r}: {what} ({scheme.where})", path=qweight.location, key=key
        )

    if stem + ".weight" in checkpoint:
        raise refuse(f"is stored beside a dense {stem + '.weight'!r}: which one loads is ambiguous")
    for suffix in (QZEROS, SCALES):
        if stem + suffix not in checkpoint:
            raise refuse(f"is stored without {stem + suffix!r}")
    qzeros, scales = checkpoint[stem + QZEROS], checkpoint[stem + SCALES]
    if qweight.dtype != torch.int32 or len(qweight.shape) != 2 or len(scales.shape) != 2:
        raise refuse(f"packed codes must be 2-d int32 words, got {qweight.dtype} {tuple(qweight.shape)}")
    groups, out = scales.shape
    p = scheme.per_word
    cols = qweight.shape[0] * p if scheme.method == "gptq" else qweight.shape[0]
    if (qweight.shape[1] if scheme.method == "gptq" else qweight.shape[1] * p) != out:
        raise refuse(f"words {tuple(qweight.shape)} do not fit scales {tuple(scales.shape)}")
    group_size = scheme.group_size or cols
    if groups * group_size != cols or not scales.dtype.is_floating_point:
        raise refuse(f"scales {scales.dtype} {tuple(scales.shape)} are not one per {group_size} of {cols} inputs")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, out // p) or out % p:
        raise refuse(f"packed zero points {qzeros.dtype} {tuple(qzeros.shape)} do not fit scales", stem + QZEROS)
    g_idx = None
    if scheme.act_order:
        g_idx = stem + G_IDX
        if g_idx not in checkpoint:
            raise refuse(f"desc_act true orders groups by {g_idx!r}: missing")
        if checkpoint[g_idx].dtype != torch.int32 or tuple(checkpoint[g_idx].shape) != (cols,):
            raise refuse(
                f"g_idx {checkpoint[g_idx].dtype} {tuple(checkpoint[g_idx].shape)} is not one per input", g_idx
            )
    return QuantLinear(stem + QWEIGHT, stem + QZEROS, stem + SCALES, (out, cols), group_size, scales.dtype, g_idx)


def qlinear_keyplan(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    plan: Callable[[Mapping[str, Any], Mapping[str, Any]], KeyPlan],
    schemes: Mapping[str, Callable[[Mapping[str, Any], str], LinearScheme]],
) -> KeyPlan | None:
    """The key plan of a packed-linear ``checkpoint`` with every quantized linear decoded on load; None: not one
    (no ``.qweight`` tensors, no ``quant_method`` in ``schemes`` — e.g. ``{"gptq": gptq_scheme, "awq":
    awq_scheme}`` —, or a model that keeps the packed tensors itself).

    Raises:
        CheckpointError: see :func:`gptq_scheme`, :func:`~.awq.awq_scheme` and :func:`quant_linears`.
    """
    infos = checkpoint.tensors
    if not any(k.endswith(QWEIGHT) for k in infos):
        return None
    if any(name.endswith(QWEIGHT) for name, _ in model.named_buffers()):
        return None
    config, where = quantization_config(checkpoint.store), config_location(checkpoint.store)
    if config is None:
        config = getattr(getattr(model, "config", None), "quantization_config", None)
        config = config.to_dict() if hasattr(config, "to_dict") else config
        where = f"the model's config ({type(model).__name__}.config)"
    method = (config or {}).get("quant_method")
    if method not in schemes:
        return None
    scheme = schemes[method](config, where)
    linears = quant_linears(checkpoint, scheme)
    shapes = {k: info.shape for k, info in infos.items()}
    dtypes = {k: info.dtype for k, info in infos.items()}
    for dense, q in linears.items():
        for k in (q.qweight, q.qzeros, q.scales, dense[: -len(".weight")] + G_IDX):
            shapes.pop(k, None)
            dtypes.pop(k, None)
        shapes[dense], dtypes[dense] = q.shape, q.dtype
    keyplan = plan(shapes, dtypes)
    model_dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    return replace(keyplan, conversions=[_decoding(c, linears, scheme, model_dtypes) for c in keyplan.conversions])


def _decoding(
    conv: Conversion, linears: Mapping[str, QuantLinear], scheme: LinearScheme, model_dtypes: Mapping[str, Any]
) -> Conversion:
    """``conv`` reading the packed tensors of its quantized sources instead, and decoding them first."""
    packed = {k: linears[k] for k in conv.sources if k in linears}
    if not packed:
        return conv
    dtype = model_dtypes.get(conv.targets[0], next(iter(packed.values())).dtype)
    stored = tuple(n for q in packed.values() for n in (q.qweight, q.qzeros, q.scales, q.g_idx) if n is not None)

    def decoder(q: QuantLinear) -> Callable[[Mapping[str, Any]], Any]:
        def decode(tensors: Mapping[str, Any]) -> Any:
            g_idx = tensors[q.g_idx] if q.g_idx is not None else None
            return scheme.decode(tensors[q.qweight], tensors[q.qzeros], tensors[q.scales], q, scheme, g_idx).to(dtype)

        return decode

    layout = tuple(
        (conv.sources.index(k), q.shape, q.group_size, q.dtype, q.g_idx is not None) for k, q in packed.items()
    )
    return decoding(
        conv,
        {k: decoder(q) for k, q in packed.items()},
        stored,
        dtype,
        rule=QuantLinearDequantization(conv.rule),
        description=f"{scheme.bits}-bit {scheme.method} dequantization",
        key=("qlinear", layout, (scheme.method, scheme.bits, scheme.zero_offset), dtype),
    )


@dataclass(frozen=True)
class QuantLinearDequantization:
    """The rule of a rewritten conversion: ``rule`` applied to decoded quantized linears."""

    rule: Any
