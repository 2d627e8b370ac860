"""Weight sync of a trainer with tied embeddings, in-process (:mod:`vllm_sync_tied`, one rank, no engine).

vLLM's Llama with ``tie_word_embeddings`` holds one parameter as ``model.embed_tokens.weight`` and
``lm_head.weight`` and its ``load_weights`` loads the first only; the trainer's ``state_dict`` has both keys. The
sync sends the embedding once (not ``lm_head.weight``), and a push's rebuilt lm_head takes the new embedding (the
tie holds, its kernel processed over it): after each push the embedding, the lm_head and the logits it computes
are bit for bit those of a model vLLM's own ``load_weights`` loads from the trainer's whole ``state_dict``; a
push failing after the embedding's rebuild leaves the old embedding and tie. A trainer writing the tie only under
``lm_head.weight`` is refused naming it.
"""

from __future__ import annotations

import pytest
from test_vllm_sync import run


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tied")
    return run("vllm_sync_tied.py", {"work": str(tmp)}, tmp)


def test_the_tied_embedding_is_sent_once(tied):
    assert tied["trainer_keys"] == ["lm_head.weight", "model.embed_tokens.weight"] and tied["trainer_tied"]
    assert tied["wants"] == ["model.embed_tokens.weight"]
    assert tied["layers"][-1] == "lm_head" and "model.embed_tokens" in tied["layers"]  # the follower rebuilt last
    # every trainer tensor but lm_head.weight, in bf16; vLLM's 1024-row padding of the 1000 rows is not sent
    assert tied["wire_bytes"] == tied["state_bytes"] - tied["embed_bytes"]
    assert tied["shard_bytes"] == tied["wire_bytes"] + 24 * 64 * 2


def test_after_each_push_the_lm_head_follows_the_embedding_as_vllms_own_load(tied):
    assert len(tied["pushes"]) == 2
    for push in tied["pushes"]:
        assert push["oracle_tied"] and push["tied"], push
        assert push["embed_equal"] and push["head_equal"] and push["logits_equal"], push
        assert push["logits_changed"], push


def test_a_push_failing_after_the_embedding_puts_back_the_old_tie(tied):
    back = tied["put_back"]
    assert back["last"] != "model.embed_tokens" and tied["failed"] == f"a write into {back['last']} failed"
    assert back["tied"] and back["embed_same"] and back["logits_same"], back


def test_a_trainer_writing_the_tie_only_under_its_second_name_is_refused(tied):
    error = tied["lone_error"]
    assert "'lm_head.weight'" in error and "'model.embed_tokens.weight'" in error and "tied" in error, error
