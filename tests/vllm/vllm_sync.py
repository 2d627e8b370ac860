"""One engine start with a weight sync: ``python vllm_sync.py CTX_JSON`` writes a JSON object to ``CTX.out``.

The context names the model folder (``model``), ``tp``, the prompts (token ids), ``steps`` and a scratch folder
(``work``). A float32 trainer is loaded from the folder; the engine (``worker_extension_cls=
"loader.vllm.SyncWorker"``) generates greedily; then each step changes the trainer's weights (the first every
element; the later ones, where the sync has ``push(delta=True)`` (``delta``), a tenth of each tensor's elements,
pushed as deltas), pushes, saves the trainer to ``work/step-N`` and records the report, every worker's digests of
what the push wrote and of what vLLM's own ``load_weights`` writes from the saved folder, and the tokens
generated. Then a trainer of the config
changes ``bad`` is refused (``error``), a push of a trainer whose ``model.norm.weight`` grew is refused
(``push_error``), and the engine generates again (``tokens_after_error``). With ``reload``,
vLLM's own ``reload_weights`` then loads the last step's saved trainer (``tokens_reloaded``). Last, the trainer
is saved in the engine's dtype (bf16, ``saved``) and every worker's model swapped for a fresh one vLLM's default
loader loads from that folder (:func:`vllm_swap.swap_in_default`, in the same engine): its tokens
(``tokens_default``) are a fresh engine's of the trainer's checkpoint.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from vllm_engine import SETTINGS, generate
from vllm_swap import swap_in_default

#: the fraction of each tensor's elements a step after the first changes (those steps push deltas)
DELTA_FRACTION = 0.1


def trainer_from(folder: str, **changes):
    """A float32 transformers model of ``folder`` (its weights; with ``changes`` to its config, random)."""
    import torch
    import transformers

    if changes:
        config = transformers.AutoConfig.from_pretrained(folder, **changes)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def step(trainer, seed: int, fraction: float = 1.0) -> None:
    """Change the weights of ``trainer`` (a training step's size): every element a little, or a random
    ``fraction`` of each tensor's elements by as much in all (the rest keep their bits: what a delta push leaves
    off the wire)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            change = torch.randn(p.shape, generator=generator, dtype=p.dtype) * (0.05 / fraction)
            if fraction < 1.0:
                change *= torch.rand(p.shape, generator=generator) < fraction
            p.add_(change)


def main(ctx: dict) -> None:
    import torch
    from vllm import LLM

    from loader.vllm import EngineSync

    torch.set_num_threads(1)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends swap_in_default pickled
    work = Path(ctx["work"])
    trainer = trainer_from(ctx["model"])
    began = time.perf_counter()
    extension = "loader.vllm.SyncWorker"
    llm = LLM(model=ctx["model"], tensor_parallel_size=ctx["tp"], worker_extension_cls=extension, **SETTINGS)
    out: dict = {"start_seconds": time.perf_counter() - began, "tokens": generate(llm, ctx), "steps": []}
    began = time.perf_counter()
    sync = EngineSync(llm, trainer, digests=True)
    out["prepare_seconds"] = time.perf_counter() - began
    out["delta"] = "delta" in inspect.signature(sync.push).parameters  # a sync that sends what changed
    for n in range(1, ctx["steps"] + 1):
        delta = out["delta"] and n > 1
        step(trainer, n, DELTA_FRACTION if delta else 1.0)
        report = sync.push(delta=True) if delta else sync.push()
        folder = work / f"step-{n}"
        trainer.save_pretrained(folder)
        oracle = sync.verify(str(folder))
        record = {**asdict(report), "ratios": report.ratios, "oracle": list(oracle), "folder": str(folder)}
        out["steps"].append({**record, "tokens": generate(llm, ctx)})
    try:
        EngineSync(llm, trainer_from(ctx["model"], **ctx.get("bad", {"intermediate_size": 128})))
    except ValueError as e:
        out["error"] = str(e)
    norm = trainer.model.norm.weight  # a trainer tensor of another shape after preparing: refused at the push
    trainer.model.norm.weight = torch.nn.Parameter(torch.ones(norm.shape[0] + 1))
    try:
        sync.push()
    except ValueError as e:
        out["push_error"] = str(e)
    trainer.model.norm.weight = norm
    out["tokens_after_error"] = generate(llm, ctx)
    out["version"] = sync.versions()
    sync.close()
    if ctx.get("reload"):  # vLLM's own in-place reload of the last step's saved trainer
        llm.collective_rpc("reload_weights", kwargs={"weights_path": out["steps"][-1]["folder"]})
        llm.reset_prefix_cache()
        out["tokens_reloaded"] = generate(llm, ctx)
    saved = work / "saved"  # the trainer's checkpoint as a trainer saves it for serving: bf16, as the engine
    trainer.to(torch.bfloat16).save_pretrained(saved)
    out["saved"] = str(saved)
    out["swapped"] = llm.collective_rpc(swap_in_default, args=(str(saved),))
    llm.reset_prefix_cache()
    out["tokens_default"] = generate(llm, ctx)
    Path(ctx["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
