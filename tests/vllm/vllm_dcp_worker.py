"""One rank of the in-process vLLM world of tests/vllm/test_vllm_dcp.py: ``python vllm_dcp_worker.py RANK WORLD
CTX_JSON``. Builds vLLM's Llama twice as a worker builds it; the oracle loads the transformers folder with vLLM's
default loader, ours loads the torchtitan DCP folder through ``load_engine_weights``, tracing :class:`FromTitan`'s
``load_weights`` (torchtitan's names and q/k rows turned into transformers' on the way into vLLM's own
``load_weights``). Saves both models' digests, the report's bytes and the bytes this rank's parameters need."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


class FromTitan(torch.nn.Module):
    """A vLLM model whose ``load_weights`` takes torchtitan's keys: each renamed to transformers' and ``wq`` /
    ``wk`` permuted per head as torchtitan's state-dict adapter's ``to_hf`` does."""

    def __init__(self, model: torch.nn.Module, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.model, self.heads, self.kv_heads = model, heads, kv_heads

    def _hf(self, key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        import torchtitan_llama as tt

        abstract, layer = tt.abstract_key(key)
        if abstract.endswith("attention.wq.weight"):
            tensor = tt.permute(tensor, self.heads)
        elif abstract.endswith("attention.wk.weight"):
            tensor = tt.permute(tensor, self.kv_heads)
        back = {v: k for k, v in tt.FROM_HF.items()}
        return back[abstract].format(layer), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.model.load_weights(self._hf(k, t) for k, t in weights)
        return {f"model.{n}" for n in loaded}


def main(rank: int, world: int, ctx: dict) -> None:
    from vllm.config import set_current_vllm_config
    from vllm_models import build_model, default_load, digests, needed_bytes, tp_world, zeroed

    from loader.engine import load_engine_weights
    from loader.options import LoadOptions

    result: dict = {}
    with tp_world(rank, world, ctx["init"]):
        folder = ctx["hf"]
        oracle = zeroed(build_model(folder, world))
        default_load(oracle)
        result.update(default=digests(oracle), needed=needed_bytes(folder, world))
        ours = zeroed(build_model(folder, world))
        cfg = ours.vllm_config.model_config.hf_config
        wrapped = FromTitan(ours, cfg.num_attention_heads, cfg.num_key_value_heads)
        with set_current_vllm_config(ours.vllm_config):
            report = load_engine_weights(wrapped, ctx["titan"], options=LoadOptions(progress=False), tp_size=world)
        result.update(ours=digests(ours), bytes_read=report.bytes_read, planned_bytes=report.planned_bytes)
        result.update(deferred=list(report.deferred), missing=list(report.missing_keys), report=str(report))
    (Path(ctx["out"]) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
