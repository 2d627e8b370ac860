"""One vLLM engine start: ``python vllm_engine.py CTX_JSON`` writes a JSON object to ``CTX.out``.

The context either names the model folder, ``load_format``, ``model_loader_extra_config`` (``extra``),
``tensor_parallel_size`` (``tp``) and the prompts (token ids), and the engine generates greedily (``tokens``); or
names an ``example`` script and its ``argv``, run as ``__main__`` (it starts the engine as ``llm`` and prints its
own tokens). With ``swap``, every worker's model is then swapped for one vLLM's default loader builds
(:func:`vllm_swap.swap_in_default`) and the same prompts generate again (``default_tokens``; ``swapped``: each
worker's summary). A failing start exits non-zero with vLLM's own output.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

#: the settings every engine start shares (vLLM's CPU backend, a tiny model)
SETTINGS = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128)


def start(ctx: dict):
    """The engine ``ctx`` describes (an example script's ``llm``, once the script has run)."""
    if "example" in ctx:
        sys.argv = [ctx["example"], *ctx["argv"]]
        return runpy.run_path(ctx["example"], run_name="__main__")["llm"]
    from vllm import LLM

    llm = LLM(
        model=ctx["model"],
        load_format=ctx["load_format"],
        model_loader_extra_config=ctx.get("extra", {}),
        tensor_parallel_size=ctx["tp"],
        **SETTINGS,
    )
    return llm


def generate(llm, ctx: dict) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=ctx.get("max_tokens", 8))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in ctx["prompts"]], params)
    return [list(out.outputs[0].token_ids) for out in outputs]


def main(ctx: dict) -> None:
    if ctx.get("swap"):  # collective_rpc sends a function to the workers pickled
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    began = time.perf_counter()
    llm = start(ctx)
    out = {"start_seconds": time.perf_counter() - began}  # an example's includes its generation
    out["tokens"] = None if "example" in ctx else generate(llm, ctx)
    if ctx.get("swap"):
        from vllm_swap import swap_in_default

        out["swapped"] = llm.collective_rpc(swap_in_default)
        llm.reset_prefix_cache()  # no block the first model computed is reused
        out["default_tokens"] = generate(llm, ctx)
    Path(ctx["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
