"""A torchtitan Llama DCP checkpoint (torchtitan's names and q/k row layout, ``dcp.save``) loaded into vLLM's
Llama built in-process at TP 2 through the traced engine loader (tests/vllm/vllm_dcp_worker.py): each worker's
parameters are bit-identical to vLLM's default loading of the same weights converted for real (torchtitan's
``to_hf``, saved as safetensors), and each worker reads the bytes its parameters need."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from ranks import run_ranks  # noqa: E402
from vllm_checkpoints import write_checkpoint  # noqa: E402
from vllm_world import ENV, LIMIT, REPO, tails  # noqa: E402

#: what a read may add to the bytes a worker needs, per tensor it reads: a page at each end
PAGE = 4096
TP = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[list[dict], int]:
    """Every rank's results, and the number of tensors in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    import torchtitan_llama as tt
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("vllm-titan")
    folder = write_checkpoint("llama", root / "hf")
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = load_file(folder / "model.safetensors")
    titan = tt.from_hf(state, heads, kv_heads)
    converted = tt.to_hf(titan, heads, kv_heads)
    assert all(torch.equal(converted[k], v) for k, v in state.items())
    save_file(converted, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dcp.save(titan, checkpoint_id=str(root / "titan"), no_dist=True)
    out = root / "out"
    out.mkdir()
    ctx = {"out": str(out), "init": f"file://{out / 'store'}", "hf": str(folder), "titan": str(root / "titan")}
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    worker = str(HERE / "vllm_dcp_worker.py")
    argv = [[sys.executable, worker, str(r), str(TP), json.dumps(ctx)] for r in range(TP)]
    codes = run_ranks(argv, [out / f"rank{r}.log" for r in range(TP)], cwd=HERE, env=env, limit=LIMIT)
    assert codes == [0] * TP, f"exit codes {codes}\n" + tails(out, TP)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(TP)], len(titan)


def test_titan_dcp_loads_into_vllm_like_the_default_loader(world):
    results, tensors = world
    for rank, res in enumerate(results):
        assert res["ours"] == res["default"], (rank, res["report"])
        assert res["deferred"] == [] and res["missing"] == [], (rank, res["report"])
        needed = sum(res["needed"].values())
        assert needed <= res["planned_bytes"] <= needed + 2 * PAGE * tensors, (rank, needed, res["report"])
        assert res["bytes_read"] == res["planned_bytes"], (rank, res["report"])
    assert results[0]["ours"] != results[1]["ours"]  # each worker its own slots
