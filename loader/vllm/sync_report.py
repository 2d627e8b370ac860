"""``SyncReport``: what one push of a weight sync did, per worker (by vLLM rank)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncReport"]


@dataclass(frozen=True)
class SyncReport:
    """One push.

    Attributes:
        version: the version every worker serves now (1 after the first push).
        bytes_sent: per worker, the bytes put on the wire to it by all trainer ranks (a delta push: the deltas).
        shard_bytes: per worker, the bytes of the parameters the push rebuilt there (its shard).
        seconds: the push's wall time, packing to the workers' answer.
        worker_seconds: per worker, its rebuild's time (unpack, write, post-load processing); empty where the
            trainer does not hear it (a trainer rank of another process).
        digests: per worker, each rebuilt parameter's digest before processing (when the sync records them).
        changed_bytes: per worker, the bytes of its wants whose bits changed since the last push (a delta
            push); a full push compares nothing and counts all of them.
        delta: whether the push sent deltas (else every wanted byte).
    """

    version: int
    bytes_sent: tuple[int, ...]
    shard_bytes: tuple[int, ...]
    seconds: float
    worker_seconds: tuple[float, ...] = ()
    digests: tuple[dict[str, str], ...] | None = None
    changed_bytes: tuple[int, ...] = ()
    delta: bool = False

    @property
    def ratios(self) -> tuple[float, ...]:
        """Per worker, bytes sent ÷ its shard bytes (1.0: exactly its parameters' bytes)."""
        return tuple(b / s if s else 0.0 for b, s in zip(self.bytes_sent, self.shard_bytes))
