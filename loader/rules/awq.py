"""AWQ GEMM checkpoints (``quant_method: awq``, ``version: gemm``): dequantize on load into a dense model.

Vocabulary:

- an AWQ linear ``<x>`` stores ``<x>.qweight [in, out / 8]`` and ``<x>.qzeros [in / group_size, out / 8]``: int32
  words of eight 4-bit codes along the output dim in AWQ's interleaved order (output ``8w + order[k]`` in bits
  ``4k`` of word ``w``, ``order = (0, 2, 4, 6, 1, 3, 5, 7)``), and ``<x>.scales [in / group_size, out]``.
- its value is AutoAWQ's ``dequantize_gemm``: ``(q - z) * scales`` (an integer times the scales' dtype),
  transposed to ``[out, in]``, then cast to the model tensor's dtype.

The shared machinery (planning, rewriting, refusals) is :mod:`.gptq`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .gptq import LinearScheme, QuantLinear, refuse_config, unpack_last

#: the output each code position of a word holds: AWQ packs outputs ``(0, 2, 4, 6, 1, 3, 5, 7)`` into bits 0, 4, …
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: the bit position (in codes) of each output of a word: the inverse of :data:`AWQ_ORDER`
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(k) for k in range(8))


def awq_scheme(config: Mapping[str, Any], where: str) -> LinearScheme:
    """The scheme of a ``quant_method: awq`` config.

    Raises:
        CheckpointError: a version, code width, group size or zero-point setting not decoded here.
    """
    bits, group_size = config.get("bits", config.get("w_bit")), config.get("group_size", config.get("q_group_size"))
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse_config(where, f"has AWQ version {version!r} (GEMM packing is decoded)")
    if bits != 4:
        raise refuse_config(where, f"has AWQ bits {bits!r} (4-bit AWQ is decoded)")
    if not config.get("zero_point", True):
        raise refuse_config(where, "has zero_point false (symmetric AWQ stores no qzeros)")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise refuse_config(where, f"has group_size {group_size!r}")
    return LinearScheme("awq", 4, None if group_size == -1 else group_size, 0, decode_awq, where)


def decode_awq(
    qweight: Any, qzeros: Any, scales: Any, linear: QuantLinear, scheme: LinearScheme, g_idx: Any = None
) -> Any:
    """An AWQ linear's dense ``[out, in]`` in the scales' dtype (see the module)."""
    out, cols = linear.shape
    groups = scales.shape[0]
    q = unpack_last(qweight, 4, AWQ_REVERSE_ORDER)  # [in, out]
    z = unpack_last(qzeros, 4, AWQ_REVERSE_ORDER)  # [groups, out]
    ints = q.reshape(groups, linear.group_size, out) - z[:, None, :]
    return (ints.to(scales.dtype) * scales[:, None, :]).reshape(cols, out).transpose(0, 1)
