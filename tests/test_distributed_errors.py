"""The distributed failure types and the timeout argument, in one process (the faults themselves are
exercised on real gloo worlds in tests/test_distributed.py)."""

from __future__ import annotations

import datetime
import os
import pickle
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import dist_models as dm

from loader import CheckpointError, PeerFailure, load_hf_checkpoint
from loader.distributed.session import _make_error, peer_errors, timeout_seconds


def test_peer_failure_is_a_runtime_error_that_keeps_its_attributes_across_pickling():
    e = PeerFailure("Reading the checkpoint failed: a peer died", stage="reading", ranks=(2, 5), reason="died")
    assert isinstance(e, RuntimeError)
    back = pickle.loads(pickle.dumps(e))  # dcp.load gathers exceptions between ranks by pickling
    assert (type(back), str(back), back.stage, back.ranks, back.reason) == (
        PeerFailure,
        str(e),
        "reading",
        (2, 5),
        "died",
    )


def test_carried_checkpoint_error_has_the_failing_ranks_path_and_key():
    e = _make_error("checkpoint", "Planning the load failed on rank 2: ...", "/ckpt/a.safetensors", "w")
    assert isinstance(e, CheckpointError) and (e.path, e.key) == ("/ckpt/a.safetensors", "w")
    assert type(_make_error("value", "x")) is ValueError and type(_make_error("runtime", "x")) is RuntimeError


def test_peer_errors_translates_a_broken_collective_only():
    with pytest.raises(PeerFailure, match="a peer died or left the process group while broadcasting") as info:
        with peer_errors("reading", "broadcasting"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert (info.value.stage, info.value.ranks, info.value.reason) == ("reading", (), "connection")
    assert "Connection closed by peer" in str(info.value)
    with pytest.raises(KeyError), peer_errors("reading", "broadcasting"):
        raise KeyError("not a collective failure")


@pytest.mark.parametrize(
    "timeout, seconds", [(None, None), (2, 2.0), (0.5, 0.5), (datetime.timedelta(minutes=1), 60.0)]
)
def test_timeout_seconds(timeout, seconds):
    assert timeout_seconds(timeout) == seconds


@pytest.mark.parametrize("timeout", [0, -1, datetime.timedelta(0)])
def test_a_non_positive_timeout_is_refused_even_in_one_process(tmp_path, timeout):
    path = str(tmp_path / "layout.safetensors")
    dm.write_checkpoint(path)
    with pytest.raises(ValueError, match="timeout must be positive"):
        load_hf_checkpoint(dm.Layout(), path, weights_mapping=dm.RULES, progress=False, timeout=timeout)
