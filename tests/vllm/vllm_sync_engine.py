"""The engine's end of a torchrun weight sync: ``python vllm_sync_engine.py CTX_JSON`` writes a JSON object to
``CTX.out``.

Runs docs/vllm.md's engine script (``CTX.engine``, its functions): starts the engine and its endpoint (digests
recorded), generates, and serves two trainer groups at the same address, one after the other. The first (FSDP2)
pushes ``pushes`` times; after each push the engine waits for the trainers' full state dict of that version
(``work/step-V``) and records the report, the tokens and every worker's digests of what vLLM's own
``load_weights`` writes from it (``steps``). Then one more push, which a hung trainer rank breaks: the failure
(``failure``), the tokens generated after it and the versions the workers serve. The second group (tensor-parallel
DTensors) is then taken by the same endpoint and pushes ``pushes`` times, recorded likewise (``tp.steps``; then
``tp.versions``).
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from dataclasses import asdict
from pathlib import Path


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.2)


def main(ctx: dict) -> None:
    from loader.errors import PeerFailure

    work = Path(ctx["work"])
    docs = runpy.run_path(ctx["engine"], run_name="docs_sync_engine")
    llm, endpoint = docs["start"](ctx["model"], ctx["address"], digests=True, timeout=ctx["timeout"])
    out: dict = {"tokens": docs["generate"](llm), "steps": [], "tp": {"steps": []}}

    def recorder(steps: list):
        def after(version: int, tokens: list) -> None:
            folder = work / f"step-{version}"
            wait_for(folder / "done", ctx["timeout"])
            report = endpoint.report
            oracle = list(endpoint.verify(str(folder)))
            steps.append({**asdict(report), "ratios": report.ratios, "tokens": tokens, "oracle": oracle})

        return after

    docs["serve"](llm, endpoint, ctx["pushes"], recorder(out["steps"]))
    began = time.perf_counter()
    try:
        endpoint.receive()
    except PeerFailure as e:
        out["failure"] = {"type": type(e).__name__, "message": str(e), "reason": e.reason}
        out["failure"]["seconds"] = time.perf_counter() - began
        (work / "engine-failure.json").write_text(json.dumps(out["failure"]))  # the hung rank may leave now
    out["tokens_after_failure"] = docs["generate"](llm)
    out["versions"] = endpoint.versions()
    docs["serve"](llm, endpoint, ctx["pushes"], recorder(out["tp"]["steps"]))  # the next group, same address
    out["tp"]["versions"] = endpoint.versions()
    Path(ctx["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
