"""Tiny compressed-tensors ``pack-quantized`` checkpoints made with the ``compressed-tensors`` package itself: its
qparams, its quantizer and its ``PackedQuantizationCompressor.compress`` (``weight_packed`` int32 words,
``weight_scale``, ``weight_shape``, packed ``weight_zero_point`` when asymmetric), and its own config.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def scheme_of(num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True):
    """A compressed-tensors weight-only scheme on every ``Linear`` (``group`` strategy, or ``channel`` for None)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "group" if group_size is not None else "channel"
    args = QuantizationArgs(
        num_bits=num_bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def compress(weight: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """One Linear's serialized tensors, as compressed-tensors writes them (qparams from the weight's min/max)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    rows, cols = weight.shape
    grouped = weight.reshape(rows, -1, args.group_size) if args.group_size else weight.reshape(rows, 1, cols)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype)}
    if not args.symmetric:
        state["weight_zero_point"] = zero_point.to(torch.int8)
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def quantization_config(scheme, ignore=("lm_head",)) -> dict:
    """The ``quantization_config`` compressed-tensors writes for ``scheme``."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=list(ignore))
    return config.to_dict()


def write_pack_quantized(folder, tensors: dict[str, torch.Tensor], scheme, quantize=None) -> dict[str, torch.Tensor]:
    """Write ``tensors`` with each 2-d ``*proj.weight`` (or ``quantize(name, t)``) compressed, and the config."""
    quantize = quantize or (lambda name, t: t.dim() == 2 and name.endswith("proj.weight"))
    os.makedirs(folder, exist_ok=True)
    stored = {}
    for name, t in tensors.items():
        if quantize(name, t):
            stem = name[: -len("weight")]
            stored.update({stem + k: v.contiguous() for k, v in compress(t, scheme).items()})
        else:
            stored[name] = t.contiguous()
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path)) if os.path.exists(config_path) else {}
    config["quantization_config"] = quantization_config(scheme)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return stored
