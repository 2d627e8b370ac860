"""One rank of an in-process vLLM world: ``python vllm_worker.py RANK WORLD CTX_JSON``.

For every family folder in the context it builds the vLLM model twice as a worker builds it, loads one with
vLLM's default loader (the oracle) and one with ``loader.vllm.load_weights`` (from ``urls[family]`` where the
context has one), and saves to ``OUT/rank{RANK}.json`` per family: both models' parameter digests, the report's
bytes, and the bytes this rank's parameters need (:func:`vllm_models.needed_bytes`); a family that fails saves its
error instead. For each checkpoint in ``misfits`` (one that does not fit its model) it saves each loader's error
and whether the model was left untouched.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def load_family(folder: str, world: int, result: dict, path: str | None = None) -> None:
    """The oracle's digests and needed bytes, then ours (from ``path``: by default the folder), into ``result``
    (what ran before a failure is kept)."""
    from vllm.config import set_current_vllm_config
    from vllm_models import build_model, default_load, digests, needed_bytes, zeroed

    import loader.vllm

    oracle = zeroed(build_model(folder, world))
    default_load(oracle)
    result.update(default=digests(oracle), needed=needed_bytes(folder, world))
    ours = zeroed(build_model(folder, world))
    with set_current_vllm_config(ours.vllm_config):  # as inside a worker
        report = loader.vllm.load_weights(ours, path or folder)
    result.update(ours=digests(ours), bytes_read=report.bytes_read, planned_bytes=report.planned_bytes)
    result.update(bytes_exchanged=report.bytes_exchanged, missing=list(report.missing_keys))
    certificates = report.certificates  # per parameter: what wrote each element (exact: all once, or a constant)
    result.update(certified=sorted(certificates), inexact={n: repr(c) for n, c in certificates.items() if not c.exact})
    result.update(constant=sorted(n for n, c in certificates.items() if c.constant))
    result.update(deferred=list(report.deferred), report=str(report))


def regiontrace_load(model) -> None:
    """The model loader vLLM picks for ``load_format="regiontrace"``, as an engine's worker runs it."""
    from vllm.config.load import LoadConfig

    from loader.vllm.model_loader import RegiontraceModelLoader

    RegiontraceModelLoader(LoadConfig(load_format="regiontrace")).load_weights(model, model.vllm_config.model_config)


def misfit(folder: str, world: int) -> dict:
    """What vLLM's default loader and ours (the model loader) do with a checkpoint that does not fit: each one's
    error, or None."""
    from vllm.config import set_current_vllm_config
    from vllm_models import build_model, default_load, zeroed

    errors = {}
    for name in ("default", "ours"):
        model = zeroed(build_model(folder, world))
        try:
            with set_current_vllm_config(model.vllm_config):
                default_load(model) if name == "default" else regiontrace_load(model)
            errors[name] = None
        except Exception as e:  # its text with its notes (the key a trace stopped at, a peer's traceback)
            errors[name] = "".join(traceback.format_exception_only(type(e), e))
        errors[f"{name}_untouched"] = all(not p.any() for p in model.parameters())
    return errors


def main(rank: int, world: int, ctx: dict) -> None:
    from vllm_models import tp_world

    out, results = Path(ctx["out"]) / f"rank{rank}.json", {}
    with tp_world(rank, world, ctx["init"]):
        for family, folder in ctx["folders"].items():
            results[family] = {}
            try:
                load_family(folder, world, results[family], ctx.get("urls", {}).get(family))
            except Exception as e:  # saved for the test to show; the other families still run
                results[family].update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            out.write_text(json.dumps(results))
        for name, folder in ctx.get("misfits", {}).items():
            results[name] = misfit(folder, world)
            out.write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
