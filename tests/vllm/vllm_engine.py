"""One vLLM engine start: ``python vllm_engine.py CTX_JSON`` writes ``{"tokens", "start_seconds"}`` to ``CTX.out``.

The context names the model folder, ``load_format``, ``model_loader_extra_config``, ``tensor_parallel_size`` and
the prompts (token ids); generation is greedy. A failing start exits non-zero with vLLM's own output.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

#: the settings every engine start shares (vLLM's CPU backend, a tiny model)
SETTINGS = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128)


def main(ctx: dict) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=ctx["model"],
        load_format=ctx["load_format"],
        model_loader_extra_config=ctx.get("extra", {}),
        tensor_parallel_size=ctx["tp"],
        **SETTINGS,
    )
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=ctx.get("max_tokens", 8))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in ctx["prompts"]], params)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    Path(ctx["out"]).write_text(json.dumps({"tokens": tokens, "start_seconds": started}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
