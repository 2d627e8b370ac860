"""One rank of tests/test_engine_loader.py's gloo world: a TinyLlama of this rank's TP slot loaded through its own
``load_weights`` in the process group (``python engine_worker.py RANK WORLD CTX_JSON``, run by
``gloo_world.run_world``): plain, with exchanged reads, and a loader broken on one rank refused on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from engine_models import TinyLlama
from gloo_world import worker_main
from safetensors.torch import load_file
from transformers import LlamaConfig

import loader
from loader.options import LoadOptions


def _config(ctx: dict) -> LlamaConfig:
    return LlamaConfig(**ctx["config"])


def _equal(module: torch.nn.Module, ctx: dict) -> bool:
    reference = TinyLlama(_config(ctx), dist.get_rank(), dist.get_world_size())
    reference.load_weights(load_file(ctx["file"]).items())
    return all(torch.equal(p, dict(reference.named_parameters())[n]) for n, p in module.named_parameters())


def scenario_load(ctx: dict, exchange: bool) -> dict:
    module = TinyLlama(_config(ctx), dist.get_rank(), dist.get_world_size())
    options = LoadOptions(progress=False, exchange_reads=exchange)
    report = loader.load_engine_weights(module, ctx["folder"], options=options)
    return {
        "equal": _equal(module, ctx),
        "bytes_read": report.bytes_read,
        "planned": report.planned_bytes,
        "exchanged": report.bytes_exchanged,
        "exact": all(c.exact for c in report.certificates.values()),
    }


class HalfQKV(TinyLlama):
    def load_weights(self, weights):
        return super().load_weights((n, t) for n, t in weights if "v_proj" not in n)


def scenario_broken_on_rank_1(ctx: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    module = (HalfQKV if rank == 1 else TinyLlama)(_config(ctx), rank, world)
    try:
        loader.load_engine_weights(module, ctx["folder"], options=LoadOptions(progress=False))
    except ValueError as e:
        return {"error_message": str(e), "untouched": all(p.isnan().all() for p in module.parameters())}
    return {"error_message": "", "untouched": False}


class Gapped(torch.nn.Module):
    """Ranks 0-2 read their quarter of the final norm, rank 3 zeroes its own: each rank's reads fit a share, and
    only their union shows the last quarter read by no rank."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.rank, self.n = rank, hidden // 4
        self.w = torch.nn.Parameter(torch.full((self.n,), float("nan")), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name == "model.norm.weight":
                self.w.data.copy_(t.narrow(0, self.rank * self.n, self.n)) if self.rank < 3 else self.w.data.zero_()


def scenario_shares_that_do_not_meet(ctx: dict) -> dict:
    module = Gapped(ctx["config"]["hidden_size"], dist.get_rank())
    try:
        loader.load_engine_weights(module, ctx["folder"], options=LoadOptions(progress=False), tp_size=4)
    except ValueError as e:
        return {"error_message": str(e), "untouched": bool(module.w.isnan().all())}
    return {"error_message": "", "untouched": False}


SCENARIOS = [
    ("load", lambda ctx: scenario_load(ctx, False)),
    ("exchanged", lambda ctx: scenario_load(ctx, True)),
    ("broken_on_rank_1", scenario_broken_on_rank_1),
    ("shares_that_do_not_meet", scenario_shares_that_do_not_meet),
]


if __name__ == "__main__":  # run by tests/test_engine_loader.py: engine_worker.py RANK WORLD CTX_JSON
    worker_main(SCENARIOS, lost_a_rank=False)
