"""Exceptions raised by the checkpoint loader, and :func:`redact_url`, which keeps secrets out of their messages."""

from __future__ import annotations

import re

#: ``scheme://user:password@``: a URL's user info
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@'\"<>]*@")
#: a query parameter whose name says it holds a secret (presigned URLs: S3's ``X-Amz-Signature`` /
#: ``X-Amz-Credential`` / ``X-Amz-Security-Token``, GCS's ``X-Goog-Signature``, Azure's ``sig``, CloudFront's
#: ``Signature`` / ``Policy`` / ``Key-Pair-Id``; ``token``, ``access_token``, ``api_key``, ...)
_SECRET_PARAM = re.compile(
    r"(?i)([?&;])([\w.%-]*(?:sig|credential|token|secret|passw|pwd|auth|key|policy|session)[\w.%-]*)=[^&;#\s'\"<>]*?(?=[&;#\s'\"<>]|:\s|:?$)"
)
#: what a redacted secret reads as
REDACTED = "REDACTED"


def redact_url(text: str) -> str:
    """``text`` (a URL, or a message naming URLs or a request's path and query) with every URL's user info dropped
    and the values of query parameters that hold secrets replaced by ``REDACTED``; the rest is kept (the host, the
    path, ``X-Amz-Date`` and ``X-Amz-Expires``: what an error should tell). Every error, log line and report of
    the project that names a location passes through it (:class:`CheckpointError` does it itself)."""
    if not isinstance(text, str) or ("@" not in text and "=" not in text):
        return text  # not text (a caller's odd path value is kept for the error to report as it can)
    return _SECRET_PARAM.sub(rf"\1\2={REDACTED}", _USERINFO.sub(r"\1", text))


class CheckpointError(ValueError):
    """A checkpoint file or index is malformed, truncated or inconsistent.

    The message always names the offending file and, where relevant, the tensor key.
    The same values are available as the ``path`` and ``key`` attributes (``None`` when not applicable).
    A URL's user info and signatures are redacted from both (:func:`redact_url`).

    Args:
        message: Full human-readable message (already naming the file and key).
        path: The offending file, if any.
        key: The offending tensor key, if any.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(redact_url(message))  # a URL's credentials never reach a message, a log or another rank
        self.path = None if path is None else redact_url(path)
        self.key = key

    def __reduce__(self):  # keep path/key (and a re-raised error's rank, traceback) across pickling
        return (_rebuild_checkpoint_error, (type(self), str(self), self.path, self.key), self.__dict__)


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
        return (_rebuild_peer_failure, (type(self), str(self), self.stage, self.ranks, self.reason), self.__dict__)


def _rebuild_peer_failure(
    cls: type[PeerFailure], message: str, stage: str, ranks: tuple[int, ...], reason: str
) -> PeerFailure:
    return cls(message, stage=stage, ranks=ranks, reason=reason)


class RemoteError(RuntimeError):
    """Another rank of a distributed load or save failed with an exception type that is neither a builtin nor
    one of the project's, nor derived from one (those are re-raised as themselves on every rank).

    Like every error re-raised from another rank it carries ``rank`` (the failed rank), ``stage``,
    ``remote_type`` (the original type's qualified name, also named in the message) and ``remote_traceback``
    (the formatted traceback on that rank, its last 16 KiB; also a note of the exception on Python >= 3.11).

    Args:
        message: Full human-readable message (names the stage, the rank and the original type).
        remote_type: ``module.qualname`` of the original exception type.
    """

    def __init__(self, message: str, *, remote_type: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for: not a file, not a folder, and not a (cached) Hub repo id.

    Both a :class:`CheckpointError` (``path`` is what was asked for) and a :class:`FileNotFoundError`.
    The message names everything that was tried.
    """
