"""Tiny GPTQ and AWQ checkpoints, packed here as GPTQModel and AutoAWQ pack them, and their published torch
dequantizations, ported as the oracle (neither package installs on this CPU-only machine's torch):

- GPTQ: GPTQModel's ``dequantize_weight`` (ModelCloud/GPTQModel, ``gptqmodel/nn_modules/qlinear/__init__.py``):
  codes unpacked with ``bitwise_right_shift`` by ``wf = arange(0, 32, bits)`` along dim 0 of ``qweight``, zero
  points along dim 1 of ``qzeros`` (plus one for the v1 ``gptq`` format), ``scales[g_idx] * (weight -
  zeros[g_idx])`` in int8 (int16 for 8 bits) then the scales' dtype.
- AWQ: AutoAWQ's ``dequantize_gemm`` (casper-hansen/AutoAWQ, ``awq/utils/packing_utils.py``): ``unpack_awq``
  (shifts along dim 1, int8), ``reverse_awq_order`` (``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``), masks,
  ``scales``/``izeros`` ``repeat_interleave(group_size, 0)``, ``(iweight - izeros) * scales``.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's ``qweight``: codes ``[in, out]`` packed ``32 // bits`` a word along dim 0."""
    p = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0] // p, p, codes.shape[1])
    return _int32(sum(c[:, k] << (bits * k) for k in range(p)))


def pack_cols(codes: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Codes ``[n, out]`` packed along dim 1: output ``p * w + order[k]`` in bits ``bits * k`` of word ``w``."""
    p = 32 // bits
    order = order or list(range(p))
    c = codes.to(torch.int64).reshape(codes.shape[0], codes.shape[1] // p, p)
    return _int32(sum(c[:, :, order[k]] << (bits * k) for k in range(p)))


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v1: bool = True) -> torch.Tensor:
    """GPTQModel's ``dequantize_weight``, ported (see the module): the dense ``[out, in]``."""
    p, maxq = 32 // bits, 2**bits - 1
    dequant_dtype = torch.int16 if bits == 8 else torch.int8
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, p), wf.unsqueeze(0))
    zeros = torch.bitwise_and(zeros.to(dequant_dtype), maxq).reshape(scales.shape)
    if v1:
        zeros = zeros + 1  # GPTQModel's convert_gptq_v1_to_v2_format
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, p, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight.to(dequant_dtype), maxq)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return (scales[g_idx.long()] * (weight - zeros[g_idx.long()])).t()


def awq_dequantize(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AutoAWQ's ``dequantize_gemm``, ported (see the module): the dense ``[out, in]``."""
    bits = 4
    shifts = torch.arange(0, 32, bits)
    iweight = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweight = iweight.view(iweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    order = torch.arange(iweight.shape[-1], dtype=torch.int32).view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER].view(-1)
    iweight, izeros = iweight[:, order], izeros[:, order]
    iweight, izeros = torch.bitwise_and(iweight, 2**bits - 1), torch.bitwise_and(izeros, 2**bits - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweight - izeros) * scales).t()


def random_linear(method: str, out: int, cols: int, bits: int, group_size: int, generator) -> dict[str, torch.Tensor]:
    """One linear's tensors (``qweight``, ``qzeros``, ``scales`` and for GPTQ ``g_idx``) from random codes."""
    groups = cols // group_size
    codes = torch.randint(0, 2**bits, (cols, out), generator=generator)
    zeros = torch.randint(0, 2**bits - 1, (groups, out), generator=generator)
    scales = (torch.rand(groups, out, generator=generator) * 0.02 + 1e-3).to(torch.float16)
    if method == "gptq":  # v1: zero points stored minus one
        g_idx = torch.arange(cols, dtype=torch.int32) // group_size
        return {"qweight": pack_rows(codes, bits), "qzeros": pack_cols(zeros, bits), "scales": scales, "g_idx": g_idx}
    return {"qweight": pack_cols(codes, 4, AWQ_ORDER), "qzeros": pack_cols(zeros, 4, AWQ_ORDER), "scales": scales}


def dequantized(method: str, t: dict, bits: int, group_size: int) -> torch.Tensor:
    if method == "gptq":
        return gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    return awq_dequantize(t["qweight"], t["qzeros"], t["scales"], group_size)


def quant_config(method: str, bits: int, group_size: int) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}  # fmt: skip
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def write_linears(folder, linears: dict[str, dict], config: dict, extra=None) -> dict[str, torch.Tensor]:
    """Save ``{stem: tensors}`` as ``<stem>.qweight`` … with ``config`` as the ``quantization_config``."""
    os.makedirs(folder, exist_ok=True)
    stored = {f"{stem}.{k}": v.contiguous() for stem, t in linears.items() for k, v in t.items()}
    stored.update(extra or {})
    save_file(stored, os.path.join(folder, "model.safetensors"))
    config_path = os.path.join(folder, "config.json")
    full = json.load(open(config_path)) if os.path.exists(config_path) else {}
    full["quantization_config"] = config
    with open(config_path, "w") as f:
        json.dump(full, f)
    return stored
