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
from loader.distributed.remote import MAX_PAYLOAD, decode_failure, encode_failure, remote_error
from loader.distributed.session import peer_errors, timeout_seconds
from loader.errors import RemoteError
from loader.options import LoadOptions, Rules
from regiontrace import NotInvertible


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


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as e:
        return e


def _across(*errors: tuple[int, BaseException], stage: str = "planning") -> BaseException:
    """What every rank raises when these ranks published these errors (through JSON, as in the store)."""
    failed = sorted((decode_failure(encode_failure(_raised(e), r).encode()) for r, e in errors), key=lambda f: f.rank)
    return remote_error(failed, "Planning the load", stage)


class NotOurs(Exception):
    """Neither a builtin nor one of the project's error types."""


class OddValue(ValueError):
    """A foreign ValueError: arrives as a ValueError (the nearest allowed base class)."""


def test_carried_checkpoint_error_has_the_failing_ranks_path_and_key():
    e = _across((2, CheckpointError("bad header", path="/ckpt/a.safetensors", key="w")), (3, KeyError("x")))
    assert type(e) is CheckpointError and (e.path, e.key, e.rank, e.stage) == (
        "/ckpt/a.safetensors",
        "w",
        2,
        "planning",
    )
    assert str(e) == "Planning the load failed on rank 2: CheckpointError: bad header (and on rank(s) 3)"
    assert e.remote_type == "loader.errors.CheckpointError" and "CheckpointError: bad header" in e.remote_traceback
    back = pickle.loads(pickle.dumps(e))  # dcp.load gathers exceptions between ranks by pickling
    assert (back.path, back.key, back.rank, back.remote_traceback) == (e.path, e.key, 2, e.remote_traceback)


@pytest.mark.parametrize(
    "error, kind",
    [
        (KeyError("w"), KeyError),
        (ValueError("v"), ValueError),
        (FileNotFoundError("f"), FileNotFoundError),
        (RuntimeError("r"), RuntimeError),
        (NotInvertible("n", source="s", reason="dropped"), NotInvertible),
        (PeerFailure("p", stage="reading", ranks=(1,), reason="died"), PeerFailure),
        (OddValue("o"), ValueError),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), UnicodeError),  # needs more than a message
        (NotOurs("n"), RemoteError),
        (StopIteration("s"), RemoteError),  # never re-raised as itself
    ],
)
def test_a_failure_keeps_its_type_where_it_is_a_builtin_or_ours(error, kind):
    e = _across((1, error))
    assert type(e) is kind and e.rank == 1 and e.remote_type.endswith(type(error).__qualname__)
    exact = type(error) is kind
    assert f"failed on rank 1: {type(error).__name__ if exact else e.remote_type}: " in str(e)
    assert "in _raised" in e.remote_traceback  # the failing rank's frames
    back = pickle.loads(pickle.dumps(e))  # as dcp.load gathers it
    assert (type(back), str(back), back.rank, back.remote_traceback) == (kind, str(e), 1, e.remote_traceback)
    if sys.version_info >= (3, 11):
        assert e.__notes__ == [f"--- the traceback on rank 1 (planning) ---\n{e.remote_traceback.rstrip()}"]
    if kind is NotInvertible:
        assert (e.source, e.reason) == ("s", "dropped")
    if kind is PeerFailure:
        assert (e.stage, e.ranks, e.reason) == ("reading", (1,), "died")  # its own attributes, not the agreement's


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000, "not JSON"),  # nesting deep enough for a RecursionError
        (b"[1, 2]", "not a JSON object"),
        (b'{"rank": "0; rm -rf /", "types": ["builtins.KeyError"], "message": "m"}', "not a rank number"),
        (b'{"rank": 1, "types": "builtins.KeyError", "message": "m"}', "no list of type names"),
        (b'{"rank": 1, "types": ["builtins.KeyError"], "message": 5}', "of the wrong kind"),
        (b"{" + b" " * MAX_PAYLOAD + b"}", "over the"),
    ],
)
def test_a_corrupt_failure_report_is_a_remote_error_saying_so(raw, says):
    failure = decode_failure(raw)
    assert (failure.rank, failure.types) == (None, ())
    e = remote_error([failure], "Planning the load", "planning")
    assert type(e) is RemoteError and e.rank is None and says in str(e)
    assert str(e).startswith("Planning the load failed on an unknown rank: (its failure report could not be read")


def test_a_type_name_is_never_imported(monkeypatch):
    imported = []
    monkeypatch.setattr("builtins.__import__", lambda *a, **k: imported.append(a[0]))
    hostile = [
        b'{"rank": 1, "types": ["os.system"], "message": "echo pwned"}',
        b'{"rank": 1, "types": ["subprocess.Popen", "builtins.Exception"], "message": "x"}',
        b'{"rank": 1, "types": ["loader.errors.PeerFailure"], "message": "m", "attributes": {"stage": {"a": 1}}}',
    ]
    errors = [remote_error([decode_failure(raw)], "Planning the load", "planning") for raw in hostile]
    monkeypatch.undo()
    assert imported == []
    assert [type(e) for e in errors] == [RemoteError] * 3  # a PeerFailure without its attributes cannot be built
    assert [e.remote_type for e in errors] == ["os.system", "subprocess.Popen", "loader.errors.PeerFailure"]
    assert str(errors[0]) == "Planning the load failed on rank 1: os.system: echo pwned"


def test_a_huge_failure_is_published_within_bounds():
    message = "é" * 1_000_000 + "\N{GRINNING FACE}" * 100_000  # non-ASCII: up to 12 bytes each as JSON
    payload = encode_failure(_raised(ValueError(message)), 0)
    assert len(payload.encode()) <= MAX_PAYLOAD
    e = remote_error([decode_failure(payload.encode())], "Reading the checkpoint", "reading")
    assert type(e) is ValueError and "characters cut" in str(e) and "in _raised" in e.remote_traceback


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
        load_hf_checkpoint(
            dm.Layout(),
            path,
            rules=Rules(weights_mapping=dm.RULES),
            options=LoadOptions(progress=False, timeout=timeout),
        )


class Unprintable(CheckpointError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ fails")


def test_a_failure_that_cannot_print_itself_is_still_published():
    e = _across((3, Unprintable("m", path=10**5000, key="k")))  # the path's int is too long to print
    assert type(e) is CheckpointError and e.rank == 3 and e.key == "k" and e.path == "<unprintable>"
    assert str(e).endswith("Unprintable: <Unprintable with an unprintable message>")
