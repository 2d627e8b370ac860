"""What one rank did in a transfer: :class:`TransferReport`, and how the call ran (:class:`TransferRun`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransferReport", "TransferRun"]


@dataclass(frozen=True)
class TransferRun:
    """How one call of a transfer ran on this rank.

    Attributes:
        seconds: wall time of the call.
        planned: whether the call planned (``transfer_weights`` always; a prepared transfer's run when the models
            changed on some rank since it planned).
        version: the run of a prepared transfer this was (1 for its first; ``transfer_weights``: 1).
        plan_seconds: the part of ``seconds`` spent planning (0 for a replay).
        check_seconds: the part spent checking that the models are the ones planned and agreeing on it.
        exchange_seconds: the part spent in the rounds' copies and collectives (and fallback conversions).
    """

    seconds: float
    planned: bool = True
    version: int = 1
    plan_seconds: float = 0.0
    check_seconds: float = 0.0
    exchange_seconds: float = 0.0


@dataclass(frozen=True)
class TransferReport:
    """What one rank did in a transfer.

    Attributes:
        bytes_sent: payload bytes this rank sent (tensor data, no padding or headers), to itself included.
        bytes_received: payload bytes this rank received, from itself included.
        bytes_local: the part of both that stayed on this rank (a strided copy, no message).
        transferred: destination tensors this rank received region by region.
        fallback: destination tensors this rank computed from checkpoint keys moved whole (their conversion
            does not trace).
        messages: segments this rank sent to other ranks (one per peer and round).
        rounds: exchange rounds (every rank runs the same number).
        run: how the call ran (:class:`TransferRun`: wall time, whether it planned, the prepared transfer's
            version); :attr:`seconds`, :attr:`planned` and :attr:`version` are its.
    """

    bytes_sent: int
    bytes_received: int
    bytes_local: int
    transferred: tuple[str, ...]
    fallback: tuple[str, ...]
    messages: int
    rounds: int
    run: TransferRun

    @property
    def seconds(self) -> float:
        """Wall time of the call on this rank."""
        return self.run.seconds

    @property
    def planned(self) -> bool:
        """Whether the call planned (:attr:`TransferRun.planned`)."""
        return self.run.planned

    @property
    def version(self) -> int:
        """The prepared transfer's run this was (:attr:`TransferRun.version`)."""
        return self.run.version

    def __str__(self) -> str:
        fb = f" ({len(self.fallback)} moved whole)" if self.fallback else ""
        how = "planned" if self.planned else "replayed"
        return (
            f"transfer: {len(self.transferred) + len(self.fallback)} tensor(s){fb}, received {self.bytes_received} B, "
            f"sent {self.bytes_sent} B ({self.bytes_local} B local) in {self.messages} message(s), "
            f"{self.rounds} round(s), {self.seconds:.3f} s ({how}, version {self.version})"
        )
