"""Exceptions raised by the checkpoint loader."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file or index is malformed, truncated or inconsistent.

    The message always names the offending file and, where relevant, the tensor key.
    The same values are available as the ``path`` and ``key`` attributes (``None`` when not applicable).

    Args:
        message: Full human-readable message (already naming the file and key).
        path: The offending file, if any.
        key: The offending tensor key, if any.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.key = key

    def __reduce__(self):  # keep path/key across pickling (e.g. multiprocessing)
        return (_rebuild_checkpoint_error, (type(self), str(self), self.path, self.key))


def _rebuild_checkpoint_error(
    cls: type[CheckpointError], message: str, path: str | None, key: str | None
) -> CheckpointError:
    return cls(message, path=path, key=key)


class PeerFailure(RuntimeError):
    """A distributed load stopped because another rank hung, died or left the process group.

    Raised on every rank still running (and, best effort, on a hung rank when it resumes). With
    ``rollback=True`` each rank has restored the tensors it wrote before this is raised.

    Args:
        message: Full human-readable message (names the stage and, where known, the ranks).
        stage: ``"planning"`` or ``"reading"``: where the load stopped.
        ranks: The ranks that did not arrive or died (empty when unknown).
        reason: ``"timeout"`` (ranks did not arrive within the timeout), ``"died"`` (their heartbeat
            stopped) or ``"connection"`` (a collective reported a broken connection).
    """

    def __init__(self, message: str, *, stage: str, ranks: tuple[int, ...] = (), reason: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.ranks = tuple(ranks)
        self.reason = reason

    def __reduce__(self):  # keep the attributes across pickling (dcp gathers exceptions between ranks)
        return (_rebuild_peer_failure, (type(self), str(self), self.stage, self.ranks, self.reason))


def _rebuild_peer_failure(
    cls: type[PeerFailure], message: str, stage: str, ranks: tuple[int, ...], reason: str
) -> PeerFailure:
    return cls(message, stage=stage, ranks=ranks, reason=reason)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for: not a file, not a folder, and not a (cached) Hub repo id.

    Both a :class:`CheckpointError` (``path`` is what was asked for) and a :class:`FileNotFoundError`.
    The message names everything that was tried.
    """
