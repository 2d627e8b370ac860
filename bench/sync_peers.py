"""The peers of bench/sync_bench.py: a vLLM worker extension (``worker_extension_cls="sync_peers.PeerWorker"``)
receiving whole trainer tensors and loading them through the model's own ``load_weights``, as RL frameworks do.

Vocabulary:
    verl way: the trainer gathers its full state dict and sends every tensor whole to every worker, one message
        per tensor; each worker, once all arrived, runs its model's ``load_weights`` over them, then the layers'
        post-load processing (vLLM's reload path: the model's loaders narrow each tensor to the worker's shard).
    checkpoint-engine way: the trainer's tensors packed into buckets (whole tensors, a bucket at most
        ``bucket`` bytes unless one tensor is larger) sent to every worker; each worker runs ``load_weights`` on
        each bucket as it arrives, then the post-load processing.
    layers: the ones our sync rebuilds (its plan's ``layers``), each made fresh before loading (vLLM's CPU layers
        keep a oneDNN handle and an empty ``weight`` after processing: loading into them again is not possible),
        then processed as on a first load, as :func:`loader.vllm.sync_layers.rebuild` does for our push.

Tensors travel over a gloo group of the trainer (rank 0) and the workers (``1 + rank``) joined through a
``TCPStore`` the trainer hosts (:mod:`loader.vllm.sync_wire`); ``collective_rpc`` carries only names and shapes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch

from loader.vllm import SyncWorker
from loader.vllm.sync_wire import Wire, join_store
from loader.vllm.sync_worker import digest

#: one tensor's description over collective_rpc: (key, shape, dtype name)
Spec = tuple[str, list[int], str]


def buckets(specs: list[Spec], bucket: int) -> list[list[int]]:
    """The checkpoint-engine way's buckets: indices into ``specs``, in order, each at most ``bucket`` bytes
    (a larger tensor alone); ``bucket=0``: one tensor a message (the verl way)."""
    out: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(specs):
        n = math.prod(shape) * getattr(torch, dtype).itemsize
        if not out or bucket == 0 or size + n > bucket:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def nbytes(spec: Spec) -> int:
    return math.prod(spec[1]) * getattr(torch, spec[2]).itemsize


class PeerWorker(SyncWorker):
    """Our :class:`~loader.vllm.SyncWorker` plus the peers' ``peer_*`` methods (see the module)."""

    def peer_connect(self, address: str, world: int, seconds: float) -> dict:
        """Join the trainer's peer group at ``address`` (``host:port``) as rank ``1 + this worker's rank``."""
        self._peer_wire = Wire(join_store(address, seconds), 1 + self.rank, world, seconds)
        return {"rank": self.rank}

    def peer_receive(self, sync: str, specs: list[Spec], bucket: int, streamed: bool, digests: bool) -> dict:
        """One peer push: receive ``specs``' tensors whole in :func:`buckets`, load them through the model's
        ``load_weights`` (per bucket when ``streamed``, else all at the end), process the layers of our sync
        ``sync``'s plan. Returns ``rank``, ``bytes`` received, ``shard_bytes``, ``seconds`` (from the first
        byte to the processed layers), ``load_seconds`` and ``digests`` (each rebuilt parameter's, before
        processing, when asked for)."""
        plan = self._regiontrace(sync)["plan"]
        model = self.get_model()
        started, received, loading = None, 0, 0.0
        with torch.no_grad():
            fresh_layers(model, plan.layers)
            held: list[tuple[str, torch.Tensor]] = []
            for group in buckets(specs, bucket):
                size = sum(nbytes(specs[i]) for i in group)
                packet = torch.empty(size, dtype=torch.uint8)
                self._peer_wire.exchange([], [(packet, 0)])
                started = started or time.perf_counter()
                received += size
                tensors = list(split(packet, [specs[i] for i in group]))
                if streamed:
                    t = time.perf_counter()
                    model.load_weights(iter(tensors))
                    loading += time.perf_counter() - t
                else:
                    held.extend(tensors)
            t = time.perf_counter()
            if held:
                model.load_weights(iter(held))
            loading += time.perf_counter() - t
            params = {n: model.get_parameter(n) for n in plan.blocks} if digests else {}
            recorded = {n: digest(p) for n, p in params.items()} if digests else None
            process_layers(model, plan.layers, self.vllm_config)
        self._peer_wire.agree(True)
        out = {"rank": self.rank, "bytes": received, "shard_bytes": plan.shard_bytes, "digests": recorded}
        return {**out, "seconds": time.perf_counter() - (started or time.perf_counter()), "load_seconds": loading}


def split(packet: torch.Tensor, specs: list[Spec]) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole tensors of one message, each a view of ``packet``."""
    at = 0
    for key, shape, dtype in specs:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        yield key, packet[at : at + n].view(dt).reshape(shape)
        at += n


def fresh_layers(model: torch.nn.Module, layers: dict[str, list[str]]) -> None:
    """Each of ``layers`` holding fresh load-time parameters (vLLM's reload metadata: shapes, classes,
    ``weight_loader``s), its other buffers kept, ready for ``load_weights``."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor, restore_layer_on_meta

    for owner, attrs in layers.items():
        module = model.get_submodule(owner)
        buffers = dict(module.named_buffers(recurse=False))
        restore_layer_on_meta(module, LAYERWISE_INFO[module])
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta and name in buffers:
                setattr(module, name, buffers[name])
        for attr in attrs:
            setattr(module, attr, materialize_meta_tensor(module.get_parameter(attr)))


def process_layers(model: torch.nn.Module, layers: dict[str, list[str]], vllm_config) -> None:
    """Each of ``layers``' post-load processing, as on a first load (a fused-MoE method's kernel built anew)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for owner in layers:
        module = model.get_submodule(owner)
        if hasattr(module, "_already_called_process_weights_after_loading"):
            delattr(module, "_already_called_process_weights_after_loading")
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            if "moe_kernel" in vars(method):
                method.moe_kernel = None
            with set_current_vllm_config(vllm_config):
                method.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
