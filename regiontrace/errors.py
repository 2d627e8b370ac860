"""Exception types of regiontrace."""


class Untraceable(RuntimeError):
    """An op is not a pure index mapping (or has no compact exact form); the message names the op."""


class TraceMismatch(RuntimeError):
    """A traced output differs in shape or dtype from the same code run on meta tensors."""
