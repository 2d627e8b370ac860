"""``SyncWorker``: vLLM's worker extension (``worker_extension_cls="loader.vllm.SyncWorker"``) that receives a
trainer's weights into a running engine (the worker side of :class:`~loader.vllm.EngineSync`).

vLLM mixes this class into each worker's class; :class:`~loader.vllm.SyncEndpoint` calls its
``regiontrace_sync_*`` methods through ``LLM.collective_rpc`` (between engine steps: the model serves no request
meanwhile). A push receives this worker's packets from the trainer ranks (:mod:`loader.vllm.sync_push`), rebuilds
every layer its plan touches (:func:`~loader.vllm.sync_layers.rebuild`; a delta push only the layers whose wants
changed, and those following their ties: any other is the layer its unchanged bits built), and keeps the new
layers only when every worker built its own (the wire's agreement); otherwise every worker puts its old layers
back (and a delta's in-place writes are undone): the engine serves the old weights or the new, never a mix.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import time
from typing import Any

import torch

from regiontrace.executor import constant_value, execute_blocks, is_constant

from ..errors import PeerFailure
from .sync_layers import FOLLOWS, load_time_view, put_back, rebuild, snapshot
from .sync_pieces import plan_pieces
from .sync_plan import WorkerPlan, plan_sync, wire_dtype
from .sync_push import header, receive_wants, stats
from .sync_wire import Wire, join_store

__all__ = ["SyncWorker", "digest"]

log = logging.getLogger("vllm.regiontrace")


def digest(tensor: torch.Tensor) -> str:
    """A tensor's bytes' sha256 (with its dtype and shape)."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SyncWorker:
    """The worker side of weight syncs (see the module); each sync's state (by the id its
    :class:`~loader.vllm.EngineSync` chose) lives in ``_regiontrace_syncs``."""

    def _regiontrace(self, sync: str) -> dict:
        return self._regiontrace_syncs[sync]

    def regiontrace_sync_prepare(self, sync: str, keys: list[tuple[str, list[int], str]], digests: bool) -> dict:
        """Plan this worker's pushes of sync ``sync`` for the trainer's tensors ``(key, shape, dtype name)``: its
        wants (the boxes the trainer sends it, with their wire dtypes) and its shard bytes; ``{"error": ...}``
        when a tensor does not fit (nothing was changed)."""
        engine_dtype = self.model_config.dtype
        shapes = {k: (tuple(shape), wire_dtype(getattr(torch, d), engine_dtype)) for k, shape, d in keys}
        try:
            with torch.no_grad():
                plan = plan_sync(self.get_model(), shapes, self.parallel_config.tensor_parallel_size)
        except ValueError as e:
            return {"rank": self.rank, "error": str(e)}
        constants = {b.source for bs in plan.blocks.values() for b in bs if is_constant(b.source)}
        if not hasattr(self, "_regiontrace_syncs"):
            self._regiontrace_syncs = {}
        self._regiontrace_syncs[sync] = {
            "plan": plan,
            "constants": {c: constant_value(c) for c in constants},
            "digests": digests,
            "version": 0,
            "wire": None,
            "wants": None,  # the wants last received (a delta's base: sync_push.Received)
            "reads": _reads(plan),
            "digested": {},  # the digests of the parameters as last built (a layer a delta leaves alone keeps them)
        }
        wants = [(w.key, w.offsets, w.lengths, str(w.dtype).removeprefix("torch.")) for w in plan.wants]
        return {"rank": self.rank, "wants": wants, "shard_bytes": plan.shard_bytes}

    def regiontrace_sync_connect(self, sync: str, address: str, trainers: int, parts: list, seconds: float) -> dict:
        """Join the sync's rendezvous at ``address`` and its gloo group as member ``trainers + this worker's rank``;
        ``parts``: every trainer rank's boxes (:func:`~loader.vllm.sync_pieces.plan_pieces` of this worker's wants)."""
        state = self._regiontrace(sync)
        world = trainers + self.parallel_config.world_size
        state["pieces"] = plan_pieces(state["plan"].wants, parts)
        state["trainers"], state["store"] = trainers, join_store(address, seconds)
        state["wire"] = Wire(state["store"], trainers + self.rank, world, seconds)
        return {"rank": self.rank}

    def regiontrace_sync_receive(self, sync: str, attempt: int) -> dict:
        """One push: the header, this worker's packets from every trainer rank, the rebuild of the touched layers,
        agreement, keep or put back (see the module), the stats. Returns this worker's ``rank``, ``version`` (the
        one it serves), ``bytes`` on the wire and ``changed`` bytes (all trainer ranks'), ``shard_bytes``,
        ``seconds``, ``digests`` (when asked for at prepare), ``error`` where it failed, ``refused`` where a
        trainer rank refused the push, ``peer`` where a peer failed (the sync is over; the old weights kept)."""
        state = self._regiontrace(sync)
        out = {"rank": self.rank, "version": state["version"], "shard_bytes": state["plan"].shard_bytes}
        out.update(refused=False, peer=None, error=None, bytes=0, changed=0, seconds=0.0, digests=None)
        kept: list = []
        try:
            self._regiontrace_push(state, out, kept)
        except PeerFailure as e:
            for module, old in reversed(kept):
                put_back(module, old)
            log.error("weight sync: worker %d: %s", self.rank, e)
            out["peer"], out["reason"], out["version"] = str(e), e.reason, state["version"]
        return out

    def _regiontrace_push(self, state: dict, out: dict, kept: list) -> None:
        plan: WorkerPlan = state["plan"]
        wire, trainers = state["wire"], state["trainers"]
        refused, full, version = header(wire, False, state["wants"] is None, 0)
        out["delta"] = not full
        if refused:
            out["refused"] = True
            return
        started = time.perf_counter()
        model, error, digests, new = self.get_model(), None, {}, None
        try:
            try:
                new, _ = receive_wants(wire, trainers, state["pieces"], plan.wants, state["wants"], full)
                sources = {**{str(i): t for i, t in enumerate(new)}, **state["constants"]}
                rebuilt: set[int] = set()
                with torch.no_grad():
                    for owner, attrs in plan.layers.items():
                        module = model.get_submodule(owner)
                        if not _touched(module, state["reads"][owner], new.changed, rebuilt):
                            continue  # its wants are the bits it was built from: the same layer
                        kept.append((module, snapshot(module)))
                        rebuild(module, attrs, _writer(state, owner, sources, digests), self.vllm_config)
                        rebuilt.add(id(module))
            except PeerFailure:
                raise
            except Exception as e:  # any failure: this rank says no, every rank puts its old layers back
                log.exception("weight sync: worker %d failed to build version %d", self.rank, version)
                error = f"worker {self.rank}: {type(e).__name__}: {e}"
                state["store"].set(f"failed/{version}/{self.rank}", error)
            agreed = wire.agree(error is None)
        except BaseException:
            if new is not None and not full:
                new.undo()  # the deltas applied in place: the wants last kept again
            raise
        digests = {**state["digested"], **digests}  # a layer not rebuilt: its parameters' digests as last built
        if not agreed:
            for module, old in reversed(kept):
                put_back(module, old)
            if new is not None and not full:
                new.undo()
            error = error or f"worker {self.rank}: another rank failed; the old weights are kept"
        else:
            state["version"], state["wants"], state["digested"] = version, new, digests
        kept.clear()
        sent, changed = stats(wire, [0] * self.parallel_config.world_size, [0] * self.parallel_config.world_size)
        out.update(version=state["version"], bytes=sent[self.rank], changed=changed[self.rank], error=error)
        out.update(seconds=time.perf_counter() - started, digests=digests if state["digests"] else None)

    def regiontrace_sync_verify(self, sync: str, folder: str) -> dict[str, str]:
        """The digests of the load-time parameters a push writes as vLLM's own ``model.load_weights`` writes them
        from ``folder``'s safetensors files (into fresh zeroed tensors; the running layers are left as they are)."""
        from safetensors.torch import load_file

        model = self.get_model()
        names = self._regiontrace(sync)["plan"].blocks
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        with torch.no_grad(), load_time_view(model):
            for module in model.modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    if p.is_meta:
                        setattr(module, name, _zeros_like(p))
            model.load_weights((k, v) for f in files for k, v in load_file(f).items())
            params = dict(model.named_parameters(remove_duplicate=False))
            return {n: digest(params[n]) for n in names}

    def regiontrace_sync_version(self, sync: str) -> int:
        """The version of sync ``sync`` this worker serves (0: none pushed)."""
        return self._regiontrace(sync)["version"]

    def regiontrace_sync_close(self, sync: str) -> None:
        """Leave sync ``sync``'s group and forget its plan."""
        self._regiontrace_syncs.pop(sync, None)


def _writer(state: dict, owner: str, sources: dict, digests: dict):
    """What writes each load-time parameter of layer ``owner`` from the unpacked boxes (recording its digest
    when the sync records them)."""
    blocks, record = state["plan"].blocks, state["digests"]

    def write(attr: str, tensor: torch.Tensor) -> None:
        execute_blocks(blocks[f"{owner}.{attr}"], sources, tensor.data)
        if record:
            digests[f"{owner}.{attr}"] = digest(tensor)

    return write


def _reads(plan: WorkerPlan) -> dict[str, frozenset[int]]:
    """Per layer, the wants its written parameters' blocks read (constants read none)."""
    out = {}
    for owner, attrs in plan.layers.items():
        blocks = [b for a in attrs for b in plan.blocks.get(f"{owner}.{a}", ())]
        out[owner] = frozenset(int(b.source) for b in blocks if not is_constant(b.source))
    return out


def _touched(module: torch.nn.Module, reads: frozenset[int], changed: set[int] | None, rebuilt: set[int]) -> bool:
    """Whether a push changes ``module``: every layer in a full push (``changed`` None); in a delta push, a layer
    reading a changed want, or following a tie of a layer rebuilt before it."""
    if changed is None or not reads.isdisjoint(changed):
        return True
    return any(id(source) in rebuilt for source, _ in FOLLOWS.get(module, {}).values())


def _zeros_like(meta: torch.Tensor) -> Any:
    fresh = torch.zeros(tuple(meta.shape), dtype=meta.dtype)
    fresh.__class__ = meta.__class__
    fresh.__dict__ = meta.__dict__.copy()
    return fresh
