"""Pushes of a trainer with tied embeddings into a vLLM model built in-process (one rank, no engine):
``python vllm_sync_tied.py CTX_JSON`` writes a JSON object to ``CTX.out``.

A Llama-shaped checkpoint with ``tie_word_embeddings`` (vLLM's ``lm_head.weight`` is ``model.embed_tokens.weight``;
the trainer's ``state_dict`` holds both keys) is built as a worker builds it, loaded by vLLM's default loader and
processed. The sync is planned for the trainer's tensors; two trainer steps are each pushed as a worker pushes
(packed, unpacked, every planned layer rebuilt). After each push the model is compared with the oracle: a fresh
model of the same config into which vLLM's own ``load_weights`` loads the trainer's whole ``state_dict``, then
processed. Reported: the plan (wants, layers), whether the tie holds, the embedding's and lm_head's bytes and the
logits the lm_head computes against the oracle's, a failed push's put-back (the tie and the old embedding
again), and the refusal of a trainer writing the tie only under
``lm_head.weight``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def tied_checkpoint(folder: Path) -> Path:
    """A tiny Llama with tied embeddings (bf16, values far from the initialiser's), as ``save_pretrained`` writes."""
    import transformers
    from vllm_checkpoints import COMMON

    config = transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32).mul_(0.5).to(p.dtype))
    model.save_pretrained(folder)
    return folder


def processed(model: torch.nn.Module) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(model.vllm_config):
        process_weights_after_loading(model, model.vllm_config.model_config, torch.device("cpu"))
    return model


def push(model: torch.nn.Module, plan, state: dict, failing: str | None = None) -> None:
    """One push as a worker does it: each want's box of the trainer's tensors in its wire dtype (what a worker
    receives), every planned layer rebuilt from them; with ``failing``, writing that layer raises, and every layer
    rebuilt is put back (as a worker does when a push fails), then the error is raised."""
    from loader.vllm.sync_layers import put_back, rebuild, snapshot
    from regiontrace.executor import constant_value, execute_blocks, is_constant

    sources = {}
    for i, want in enumerate(plan.wants):
        box = state[want.key].detach()
        for d, (o, n) in enumerate(zip(want.offsets, want.lengths)):
            box = box.narrow(d, o, n)
        sources[str(i)] = box.to(want.dtype).contiguous()
    constants = {b.source for bs in plan.blocks.values() for b in bs if is_constant(b.source)}
    sources.update({c: constant_value(c) for c in constants})
    kept = []
    try:
        with torch.no_grad():
            for owner, attrs in plan.layers.items():

                def write(attr: str, tensor: torch.Tensor, owner: str = owner) -> None:
                    if owner == failing:
                        raise RuntimeError(f"a write into {owner} failed")
                    execute_blocks(plan.blocks[f"{owner}.{attr}"], sources, tensor.data)

                module = model.get_submodule(owner)
                kept.append((module, snapshot(module)))
                rebuild(module, attrs, write, model.vllm_config)
    except RuntimeError:
        for module, old in reversed(kept):
            put_back(module, old)
        raise


def logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What ``model``'s lm_head computes for ``hidden`` (its processed kernel, as the engine's sampler calls it)."""
    return model.lm_head.quant_method.apply(model.lm_head, hidden)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.int16)


def compare(model: torch.nn.Module, oracle: torch.nn.Module, hidden: torch.Tensor, before: torch.Tensor) -> dict:
    """The tie, the bytes of the embedding and the lm_head, and the logits of ``hidden``, against the oracle's
    (``before``: the logits before the push)."""
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    return {
        "tied": head is embed,
        "oracle_tied": oracle.lm_head.weight is oracle.model.embed_tokens.weight,
        "embed_equal": torch.equal(bits(embed), bits(oracle.model.embed_tokens.weight)),
        "head_equal": torch.equal(bits(head), bits(oracle.lm_head.weight)),
        "logits_equal": torch.equal(bits(logits(model, hidden)), bits(logits(oracle, hidden))),
        "logits_changed": not torch.equal(logits(model, hidden), before),
    }


def main(ctx: dict) -> None:
    import transformers
    from vllm.config import set_current_vllm_config
    from vllm_models import build_model, default_load, tp_world
    from vllm_sync import step
    from vllm_sync_layers import free_port

    from loader.vllm.sync_plan import plan_sync

    folder = tied_checkpoint(Path(ctx["work"]) / "tied")
    trainer = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = trainer.state_dict()
    out: dict = {"trainer_keys": sorted(k for k in state if "embed" in k or "lm_head" in k)}
    out["trainer_tied"] = state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    shapes = {k: (tuple(t.shape), torch.bfloat16) for k, t in state.items()}
    with tp_world(0, 1, f"tcp://127.0.0.1:{free_port()}"):
        model = build_model(str(folder), 1)
        default_load(model)
        processed(model)
        plan = plan_sync(model, shapes, 1)
        out["wants"] = sorted({w.key for w in plan.wants if "embed" in w.key or "lm_head" in w.key})
        out["layers"] = list(plan.layers)
        out["wire_bytes"], out["shard_bytes"] = sum(w.nbytes for w in plan.wants), plan.shard_bytes
        out["state_bytes"] = sum(t.numel() * 2 for t in state.values())
        out["embed_bytes"] = state["model.embed_tokens.weight"].numel() * 2
        hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        out["pushes"] = []
        for n in (1, 2):
            step(trainer, n)
            before = logits(model, hidden)
            push(model, plan, trainer.state_dict())
            oracle = build_model(str(folder), 1)
            with set_current_vllm_config(oracle.vllm_config), torch.no_grad():
                oracle.load_weights(iter(trainer.state_dict().items()))  # vLLM's own, the whole state dict
            out["pushes"].append(compare(model, processed(oracle), hidden, before))
        # a push failing after the embedding was rebuilt: every layer put back, the tie the old one
        step(trainer, 3)
        before, weight = logits(model, hidden), model.model.embed_tokens.weight
        last = [o for o in plan.layers if o != "lm_head"][-1]
        try:
            push(model, plan, trainer.state_dict(), failing=last)
        except RuntimeError as e:
            out["failed"] = str(e)
        out["put_back"] = {
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "embed_same": model.model.embed_tokens.weight is weight,
            "logits_same": torch.equal(bits(logits(model, hidden)), bits(before)),
            "last": last,
        }
        lone = {k: v for k, v in shapes.items() if k != "model.embed_tokens.weight"}
        try:
            plan_sync(model, lone, 1)
        except ValueError as e:
            out["lone_error"] = str(e)
    Path(ctx["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
