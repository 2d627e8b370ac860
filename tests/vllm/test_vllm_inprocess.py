"""vLLM's model classes built in-process (no engine), at TP 1, 2 and 4: every worker's parameters loaded by
``loader.vllm.load_weights`` are bit-identical to vLLM's default loader's, and each worker reads the bytes its
parameters need. Checkpoints by transformers' ``save_pretrained``; padded vocabularies, KV heads fewer than ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from vllm_checkpoints import FAMILIES, add_rows, drop_tensor, write_checkpoint
from vllm_world import run_world

#: the tensor-parallel sizes every family loads at (llama's 2 KV heads and gemma's 1 are fewer than 4 ranks)
WORLDS = (1, 2, 4)
#: what a read may add to the bytes a worker needs, per tensor it reads: a page at each end
PAGE = 4096


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    return {family: str(write_checkpoint(family, root / family)) for family in FAMILIES}


#: checkpoints that do not fit their model: (what grows, by 64 rows) -> (checkpoint tensor, the parameter it loads)
MISFITS = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    "layers.0.self_attn.q_proj.weight": (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
    ),
}


#: a checkpoint missing this tensor (the parameter of the same name): no loader may leave it as torch.empty left it
MISSING = "model.layers.1.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def misfits(tmp_path_factory) -> dict[str, str]:
    """Llama checkpoints with 64 rows too many in one tensor (the vocabulary, a q_proj), by what grew."""
    root = tmp_path_factory.mktemp("vllm-misfits")
    folders = {}
    for i, suffix in enumerate(MISFITS):
        folders[suffix] = str(write_checkpoint("llama", root / f"misfit{i}"))
        assert add_rows(Path(folders[suffix]), suffix) == MISFITS[suffix][0]
    folders[MISSING] = str(write_checkpoint("llama", root / "missing"))
    drop_tensor(Path(folders[MISSING]), MISSING)
    return folders


@pytest.fixture(scope="module")
def worlds(checkpoints, misfits, tmp_path_factory):
    """``worlds(tp)``: every rank's results of one world over every family (and, at TP 2, the misfits), run once
    per ``tp``."""
    done: dict[int, list[dict]] = {}

    def results(tp: int) -> list[dict]:
        if tp not in done:
            out = tmp_path_factory.mktemp(f"world{tp}")
            done[tp] = run_world(tp, checkpoints, out, misfits=misfits if tp == 2 else {})
        return done[tp]

    return results


def family_results(worlds, family: str, tp: int) -> list[dict]:
    per_rank = [ranks[family] for ranks in worlds(tp)]
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank}: {res['error']}\n{res.get('traceback', '')}"
    return per_rank


def test_the_checkpoints_are_what_vllm_pads_and_replicates(checkpoints):
    import json

    configs = {family: json.loads((Path(folder) / "config.json").read_text()) for family, folder in checkpoints.items()}
    for family, config in configs.items():
        assert config["vocab_size"] % 64, family  # vLLM pads the vocabulary
        assert (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]) == 64, family
    assert min(config["num_key_value_heads"] for config in configs.values()) < max(WORLDS)


@pytest.mark.parametrize("tp", WORLDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_workers_parameters_are_the_default_loaders_bit_for_bit(worlds, family, tp):
    for rank, res in enumerate(family_results(worlds, family, tp)):
        differ = sorted(name for name in res["default"] if res["ours"].get(name) != res["default"][name])
        assert set(res["ours"]) == set(res["default"]) and not differ, (rank, differ)
        assert not res["missing"], (rank, res["report"])


@pytest.mark.parametrize("tp", WORLDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_parameters_certificate_says_each_element_written_once_padding_by_a_constant(worlds, family, tp):
    """The coverage certificate of every loaded parameter is exact (buffers no key writes are caches); the
    worker holding the vocabulary's padding rows (the last) has them as a constant (vLLM's ``fill_(0)``), the
    others none in the embedding."""
    for rank, res in enumerate(family_results(worlds, family, tp)):
        inexact = {n: c for n, c in res["inexact"].items() if n in res["default"]}  # parameters (not buffers)
        assert set(res["default"]) <= set(res["certified"]) and not inexact, (rank, inexact)
        padded = "model.embed_tokens.weight" in res["constant"]
        assert padded == (rank == tp - 1), (rank, res["constant"])


@pytest.mark.parametrize("tp", WORLDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_worker_reads_the_bytes_its_parameters_need(worlds, family, tp):
    for rank, res in enumerate(family_results(worlds, family, tp)):
        needed = res["needed"]
        total, tensors = sum(needed.values()), sum(1 for n in needed.values() if n)
        assert res["planned_bytes"] == total, (rank, res["report"])
        assert total <= res["bytes_read"] <= total + 2 * PAGE * tensors, (rank, res["report"], total)
        if tp > 1:  # a worker holds less than the checkpoint
            assert res["bytes_read"] < sum(needed_whole(worlds, family).values())


def needed_whole(worlds, family: str) -> dict[str, int]:
    """The bytes of every checkpoint tensor (one rank holds all of them)."""
    return worlds(1)[0][family]["needed"]


@pytest.mark.parametrize("grown", sorted(MISFITS))
def test_a_checkpoint_that_does_not_fit_is_refused_naming_tensor_and_parameter_before_any_write(worlds, grown):
    """Ours refuses, on every worker, naming the checkpoint tensor and the parameter, with the model untouched.
    vLLM's default loader narrows a q_proj with 64 rows too many and loads it; a vocabulary 64 rows too large its
    own loader refuses with a bare AssertionError, which ours reports naming the tensor and the parameter."""
    tensor, parameter = MISFITS[grown]
    for rank, ranks in enumerate(worlds(2)):
        res = ranks[grown]
        assert res["ours"] and tensor in res["ours"] and parameter in res["ours"], (rank, res)
        assert res["ours_untouched"], (rank, res)
        if grown.endswith("q_proj.weight"):  # what vLLM's own loader does with it: no error, the model written
            assert res["default"] is None and not res["default_untouched"], (rank, res)


@pytest.fixture
def nginx(checkpoints):
    """nginx serving the checkpoints' folder (tests/servers.py; skipped where nginx is not installed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/servers.py
    import servers

    yield from servers.serve(servers.nginx(Path(checkpoints["llama"]).parent))


def test_over_http_every_worker_fetches_about_the_bytes_its_parameters_need(checkpoints, nginx, tmp_path):
    """Llama and Qwen3-MoE at TP 2 from nginx: bit-identical to the default loader (which reads the folder); each
    worker plans exactly what it needs and fetches at most 5 % more (less where its peers send it the bytes they
    share: exchanged reads), and the server's own log says the same of all of them."""
    families = {f: checkpoints[f] for f in ("llama", "qwen3_moe")}
    urls = {f: f"{nginx}/{Path(folder).name}" for f, folder in families.items()}
    ranks = run_world(2, families, tmp_path, urls=urls)
    served = sum(r.bytes for r in nginx.requests() if r.path.endswith(".safetensors"))
    needed_all = 0
    for rank, results in enumerate(ranks):
        for family, res in results.items():
            assert "error" not in res, (rank, family, res["error"], res.get("traceback"))
            assert res["ours"] == res["default"], (rank, family)
            needed = sum(res["needed"].values())
            assert res["planned_bytes"] == needed, (rank, family, res["report"])
            assert res["bytes_read"] <= 1.05 * needed <= 1.05 * (res["bytes_read"] + res["bytes_exchanged"])
            needed_all += needed
    assert served <= 1.05 * needed_all, (served, needed_all)


def test_a_checkpoint_missing_a_tensor_fails_the_model_loader_naming_the_parameter(worlds):
    """As vLLM's default loader does: the model loader refuses parameters no checkpoint tensor wrote."""
    for rank, ranks in enumerate(worlds(2)):
        res = ranks[MISSING]
        assert res["ours"] and "no checkpoint tensor" in res["ours"] and MISSING in res["ours"], (rank, res)
        assert res["default"] and MISSING in res["default"], (rank, res)
