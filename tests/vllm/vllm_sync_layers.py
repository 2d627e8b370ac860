"""A push's rebuild and put-back on a vLLM model built in-process (one rank, no engine):
``python vllm_sync_layers.py CTX_JSON`` writes a JSON object to ``CTX.out``.

The model is built as a worker builds it, loaded by vLLM's default loader and processed
(``process_weights_after_loading``: its linear layers then hold an empty ``weight`` and a oneDNN handle). The sync
plan is traced; every planned layer is rebuilt from the trainer's values (the checkpoint's own, here) with a
writer that fails at the third layer; every layer is put back. Reported: the planned layers, whether each
module's attributes are the very objects they were before (``same``), and what the failure said.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(ctx: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm_models import build_model, default_load, tp_world

    from loader.vllm.sync_layers import put_back, rebuild, snapshot
    from loader.vllm.sync_plan import plan_sync

    with tp_world(0, 1, f"tcp://127.0.0.1:{free_port()}"):
        model = build_model(ctx["model"], 1)
        default_load(model)
        config = model.vllm_config
        with set_current_vllm_config(config):
            process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        state = {k: v for f in sorted(Path(ctx["model"]).glob("*.safetensors")) for k, v in load_file(f).items()}
        plan = plan_sync(model, {k: (tuple(t.shape), t.dtype) for k, t in state.items()}, 1)
        before = {name: _ids(m) for name, m in model.named_modules()}
        kept, error = [], None
        try:
            with torch.no_grad():
                for i, (owner, attrs) in enumerate(plan.layers.items()):
                    module = model.get_submodule(owner)
                    kept.append((module, snapshot(module)))
                    rebuild(module, attrs, _failing_at(2, i), config)
        except RuntimeError as e:
            error = str(e)
        for module, old in reversed(kept):
            put_back(module, old)
        after = {name: _ids(m) for name, m in model.named_modules()}
    out = {"layers": list(plan.layers), "rebuilt": len(kept), "error": error}
    out["same"] = sorted(n for n in before if before[n] == after[n])
    out["differ"] = sorted(n for n in before if before[n] != after[n])
    Path(ctx["out"]).write_text(json.dumps(out))


def _ids(module) -> dict[str, int]:
    """Each attribute of ``module`` (its parameters and buffers one by one, the non-persistent buffers' names by
    content) and of its quant method, by identity."""
    containers = ("_parameters", "_buffers", "_non_persistent_buffers_set")
    ids = {k: id(v) for k, v in vars(module).items() if k not in containers}
    ids["non-persistent buffers"] = hash(tuple(sorted(module._non_persistent_buffers_set)))
    ids.update({f"param {k}": id(v) for k, v in module.named_parameters(recurse=False)})
    ids.update({f"buffer {k}": id(v) for k, v in module.named_buffers(recurse=False)})
    method = vars(module).get("quant_method")
    ids.update({f"method {k}": id(v) for k, v in vars(method).items()} if method is not None else {})
    return ids


def _failing_at(n: int, i: int):
    def write(attr, tensor) -> None:
        if i == n:
            raise RuntimeError(f"a write into layer {i} failed")
        tensor.data.zero_()

    return write


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
