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
