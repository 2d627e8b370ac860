"""Exception types of regiontrace."""


class Untraceable(RuntimeError):
    """An op is not a pure index mapping (or has no compact exact form); the message names the op."""


class TraceMismatch(RuntimeError):
    """A traced output differs in shape or dtype from the same code run on meta tensors."""


class NotInvertible(Untraceable):
    """A traced conversion is not a bijection between its sources and outputs; the message names the source.

    Attributes:
        source: the source whose elements are dropped, read twice or cast inexactly (None if not one source).
        reason: ``"dropped"``, ``"duplicate"``, ``"broadcast"``, ``"cast"``, ``"computed"`` or ``"unverifiable"``.
    """

    def __init__(self, message: str, source: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.reason = reason
