"""The peers of bench/load_bench.py and bench/tp_bench.py that read whole tensors and copy them into the model.

Each loader takes a built model (plain tensors, or DTensors whose local shards exist) and a folder in the
Hugging Face layout (per-expert tensors), reads every tensor whole, cuts out what this rank owns and copies it
into the model's parameters, as vLLM's loaders do; it returns the bytes it asked for (its logical read).

* ``vllm``: ``safetensors.safe_open`` of every file, ``get_tensor`` whole (from the mmap).
* ``runai``: runai-model-streamer's ``SafetensorsStreamer`` over all files (its own C++ reader threads;
  ``RUNAI_STREAMER_CONCURRENCY`` unset = its default).
* ``fastsafetensors``: fastsafetensors' ``SafeTensorsFileLoader`` on ``"cpu"`` with ``nogds=True`` (its
  ``pread`` + bounce-buffer path, ``max_threads=16`` by default), one process group of one (each rank reads
  every file, as the other peers do).
"""

from __future__ import annotations

import json
import os

#: what each peer imports, for the reports
PACKAGES = {"runai": "runai-model-streamer", "fastsafetensors": "fastsafetensors"}


def hf_key_region(key: str, shapes: dict) -> tuple[str, tuple] | None:
    """Where an HF checkpoint tensor lands in the model: (parameter name, global index tuple)."""
    parts = key.split(".")
    if "experts" in parts:
        i = parts.index("experts")
        expert, proj = int(parts[i + 1]), parts[i + 2]
        prefix = ".".join(parts[: i + 1])
        if proj == "down_proj":
            return prefix + ".down_proj", (expert,)
        rows = shapes[prefix + ".gate_up_proj"][1] // 2
        sl = slice(0, rows) if proj == "gate_proj" else slice(rows, 2 * rows)
        return prefix + ".gate_up_proj", (expert, sl)
    return (key, ()) if key in shapes else None


class Placer:
    """Copies whole checkpoint tensors into the part of the model this rank owns (its local shard boxes)."""

    def __init__(self, model) -> None:
        from loader.placements import slot_for

        sd = model.state_dict(keep_vars=True)
        self.shapes = {n: tuple(t.shape) for n, t in sd.items()}
        self.slots = {n: slot_for(n, t) for n, t in sd.items()}

    def place(self, key: str, full) -> None:
        """Narrow ``full`` (checkpoint tensor ``key``) to each box this rank owns and copy it there."""
        import torch

        where = hf_key_region(key, self.shapes)
        if where is None:
            return
        param, index = where
        region = []  # the region of the parameter this tensor fills, as per-dim (start, stop)
        for d, n in enumerate(self.shapes[param]):
            s = index[d] if d < len(index) else slice(0, n)
            region.append((s, s + 1) if isinstance(s, int) else (s.start, s.stop))
        drop = [d for d in range(len(index)) if isinstance(index[d], int)]
        slot = self.slots[param]
        with torch.no_grad():
            for g, lb in slot.boxes:
                lo = [max(a, ra) for (a, _), (ra, _) in zip(g, region)]
                hi = [min(b, rb) for (_, b), (_, rb) in zip(g, region)]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue
                src = full
                for d, (l, h) in enumerate(zip(lo, hi)):
                    if d not in drop:
                        src = src.narrow(d - sum(1 for x in drop if x < d), l - region[d][0], h - l)
                dst = slot.local
                for d, (l, h) in enumerate(zip(lo, hi)):
                    dst = dst.narrow(d, lb[d][0] + l - g[d][0], h - l)
                dst.copy_(src.reshape(dst.shape))


def _files(directory: str) -> list[str]:
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        return [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]


def load_vllm(model, directory: str, placer: Placer | None = None) -> int:
    """Every file, every tensor whole (``get_tensor``), narrowed to this rank's shard and copied."""
    from safetensors import safe_open

    placer = placer or Placer(model)
    logical = 0
    for path in _files(directory):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                full = f.get_tensor(key)  # the whole tensor, read from the mmap
                logical += full.numel() * full.element_size()
                placer.place(key, full)
                del full
    return logical


def load_runai(model, directory: str, placer: Placer | None = None) -> int:
    """runai-model-streamer's ``SafetensorsStreamer`` over every file; each tensor placed as it arrives."""
    from runai_model_streamer import SafetensorsStreamer

    placer = placer or Placer(model)
    logical = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(_files(directory), device="cpu")
        for key, full in streamer.get_tensors():
            logical += full.numel() * full.element_size()
            placer.place(key, full)
            del full
    return logical


def load_fastsafetensors(model, directory: str, placer: Placer | None = None) -> int:
    """fastsafetensors' CPU path (``nogds=True``): every file into its buffers, then each tensor placed."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    placer = placer or Placer(model)
    logical = 0
    reader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    try:
        reader.add_filenames({0: _files(directory)})
        buffers = reader.copy_files_to_device()
        try:
            for key in reader.get_keys():
                full = buffers.get_tensor(key)
                logical += full.numel() * full.element_size()
                placer.place(key, full)
                del full
        finally:
            buffers.close()
    finally:
        reader.close()
    return logical


LOADERS = {"vllm": load_vllm, "runai": load_runai, "fastsafetensors": load_fastsafetensors}
