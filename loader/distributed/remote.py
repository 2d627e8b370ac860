"""Failures across ranks: what a failed rank publishes through the store (its exception's type, message, key
attributes and traceback text, as bounded JSON) and the exception every other rank raises from it.

The type is kept where it is a builtin exception or one of the project's error types, found by name in an
allow-list (:data:`ALLOWED`: nothing is ever imported by name), with the attributes its constructor takes
(``CheckpointError.path``/``.key``...). A type that is neither arrives as its nearest allowed base class
(a ``ValueError`` subclass as a ``ValueError``), else as :class:`~loader.errors.RemoteError`; the message
names the original type. Every re-raised exception carries ``rank``, ``stage``, ``remote_type`` and
``remote_traceback`` (the failed rank's formatted traceback), also shown as a note (PEP 678, Python >= 3.11).
A corrupt, hostile or oversized payload decodes to a :class:`Failure` that says so, never to code.
"""

from __future__ import annotations

import builtins
import json
import traceback
from dataclasses import dataclass, field
from typing import Any

from regiontrace import NotInvertible, TraceMismatch, Untraceable

from ..errors import CheckpointError, CheckpointNotFoundError, PeerFailure, RemoteError

MAX_MESSAGE = 8 * 1024
"""Characters of a failed rank's message that are published (its head)."""

MAX_TRACEBACK = 16 * 1024
"""Characters of a failed rank's formatted traceback that are published (its tail: the innermost frames)."""

MAX_ATTRIBUTE = 1024
"""Characters of each published string attribute (``path``, ``key``...)."""

MAX_TYPES = 16
"""Classes of a failed rank's exception (its MRO, most derived first) that are published."""

MAX_PAYLOAD = 256 * 1024
"""Bytes of one published failure a rank reads at most; a longer one is not parsed."""

#: the project's error types, rebuilt as ``cls(message, **{name: value for these attribute names})``
OURS: dict[type[BaseException], tuple[str, ...]] = {
    CheckpointError: ("path", "key"),
    CheckpointNotFoundError: ("path", "key"),
    PeerFailure: ("stage", "ranks", "reason"),
    Untraceable: (),
    TraceMismatch: (),
    NotInvertible: ("source", "reason"),
}

#: builtin exceptions never re-raised as themselves (they change control flow inside generators)
_NOT_RERAISED = (StopIteration, StopAsyncIteration)


def qualified_name(cls: type) -> str:
    """``module.qualname`` of a class: how a type travels between ranks."""
    return f"{cls.__module__}.{cls.__qualname__}"


#: every type a payload may name and get back, by qualified name: builtins' exceptions and the project's errors
ALLOWED: dict[str, type[BaseException]] = {
    **{
        qualified_name(c): c
        for c in vars(builtins).values()
        if isinstance(c, type) and issubclass(c, Exception) and not issubclass(c, _NOT_RERAISED)
    },
    **{qualified_name(c): c for c in OURS},
}


@dataclass(frozen=True)
class Failure:
    """One rank's failure as published.

    Attributes:
        rank: the rank that failed (None: the payload did not say, or could not be read).
        types: qualified names of its exception's classes, most derived first (empty: unreadable).
        message: ``str(exception)``, its head.
        attributes: the attributes the project's error types are rebuilt with (plain JSON values).
        traceback: the formatted traceback on that rank, its tail.
    """

    rank: int | None
    types: tuple[str, ...]
    message: str
    attributes: dict[str, Any] = field(default_factory=dict)
    traceback: str = ""

    @property
    def type_name(self) -> str:
        """The qualified name of the exception's type (``"?"`` when unreadable)."""
        return self.types[0] if self.types else "?"


# -- publishing ------------------------------------------------------------------------------------------


def encode_failure(error: BaseException, rank: int) -> str:
    """The JSON text rank ``rank`` publishes for ``error``: at most :data:`MAX_PAYLOAD` bytes (ASCII). Never
    raises: an exception whose ``__str__`` or attributes fail is published without them."""
    types = [qualified_name(c)[:256] for c in type(error).__mro__ if c is not object][:MAX_TYPES]
    message = _safely(lambda: str(error), f"<{type(error).__name__} with an unprintable message>")
    text = _safely(lambda: _traceback_text(error), "")
    attributes = _safely(lambda: {n: _plain(getattr(error, n, None)) for n in _attributes_of(type(error))}, {})
    for cut in (1, 4, 16, 64, 1024):  # non-ASCII text grows up to 12 times as JSON escapes
        payload = json.dumps(
            {
                "rank": rank,
                "types": types,
                "message": _head(message, MAX_MESSAGE // cut),
                "attributes": {n: _head(v, MAX_ATTRIBUTE // cut) for n, v in attributes.items()},
                "traceback": _tail(text, MAX_TRACEBACK // cut),
            }
        )
        if len(payload) <= MAX_PAYLOAD:
            break
    return payload


def _safely(compute: Any, default: Any) -> Any:
    try:
        return compute()
    except Exception:  # a hostile __str__ or property must not hide the failure
        return default


def _traceback_text(error: BaseException) -> str:
    """The formatted traceback (chained exceptions included), each frame and message at most
    :data:`MAX_ATTRIBUTE` characters: a huge message leaves room for the frames."""
    chunks = traceback.TracebackException.from_exception(error).format()
    return "".join(c if len(c) <= MAX_ATTRIBUTE else _head(c, MAX_ATTRIBUTE) + "\n" for c in chunks)


def _attributes_of(cls: type) -> tuple[str, ...]:
    """The attribute names of the project's nearest error type ``cls`` derives from (none: no such type)."""
    return next((OURS[c] for c in cls.__mro__ if c in OURS), ())


def _plain(value: Any) -> Any:
    """A JSON value for an attribute: scalars as they are, a sequence of ints as a list, anything else as text."""
    if value is None or isinstance(value, (bool, float, str)) or _small(value):
        return value
    if isinstance(value, (tuple, list)) and all(_small(v) for v in value):
        return list(value)[:4096]
    return _head(_safely(lambda: repr(value), "<unprintable>"), MAX_ATTRIBUTE)


def _small(value: Any) -> bool:
    """An int JSON carries exactly (a huge one would not even print)."""
    return isinstance(value, int) and -(2**63) <= value < 2**63


def _head(value: Any, limit: int) -> Any:
    if not isinstance(value, str) or len(value) <= limit:
        return value
    return value[:limit] + f"... ({len(value) - limit} characters cut)"


def _tail(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"... ({len(text) - limit} characters cut)\n" + text[len(text) - limit :]


# -- reading ---------------------------------------------------------------------------------------------


def decode_failure(raw: bytes | str) -> Failure:
    """A published failure read back; anything unreadable (not UTF-8 JSON, wrong fields, over
    :data:`MAX_PAYLOAD` bytes) is a :class:`Failure` of an unknown rank and type whose message says so."""
    if len(raw) > MAX_PAYLOAD:
        return _unreadable(f"{len(raw)} bytes, over the {MAX_PAYLOAD}-byte limit")
    try:
        data = json.loads(raw)
    except Exception as e:  # bad UTF-8, bad JSON, nesting deep enough for a RecursionError
        return _unreadable(f"not JSON ({type(e).__name__})")
    if not isinstance(data, dict):
        return _unreadable("not a JSON object")
    rank, types, message = data.get("rank"), data.get("types"), data.get("message")
    attributes, text = data.get("attributes", {}), data.get("traceback", "")
    if not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0)):
        return _unreadable("a rank that is not a rank number")
    if not (isinstance(types, list) and 0 < len(types) <= MAX_TYPES and all(isinstance(t, str) for t in types)):
        return _unreadable("no list of type names")
    if not (isinstance(message, str) and isinstance(text, str) and isinstance(attributes, dict)):
        return _unreadable("a message, traceback or attributes of the wrong kind")
    plain = {str(n): v for n, v in list(attributes.items())[:MAX_TYPES] if _is_plain(v)}
    cut = tuple(t[:256] for t in types)  # lenient limits: a publisher's own cuts add a few characters
    return Failure(rank, cut, _head(message, 2 * MAX_MESSAGE), plain, _tail(text, 2 * MAX_TRACEBACK))


def _unreadable(why: str) -> Failure:
    return Failure(None, (), f"(its failure report could not be read: {why})")


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) <= 2 * MAX_ATTRIBUTE
    return isinstance(value, list) and len(value) <= 4096 and all(type(v) is int for v in value)


# -- raising ---------------------------------------------------------------------------------------------


def remote_error(failures: list[Failure], what: str, stage: str) -> Exception:
    """The exception every rank raises when ``failures`` (sorted, lowest rank first) failed ``stage``.

    ``what`` is the stage in words (``"Planning the load"``); the message reads ``"{what} failed on rank
    {r}: {Type}: {message}"`` (the qualified name when the type raised is not the original) and lists the
    other failed ranks.
    """
    first = failures[0]
    where = "an unknown rank" if first.rank is None else f"rank {first.rank}"
    others = ", ".join("?" if f.rank is None else str(f.rank) for f in failures[1:])
    tail = f" (and on rank(s) {others})" if others else ""
    for cls in (*_candidates(first.types), RemoteError):
        exact = qualified_name(cls) == first.type_name
        shown = first.type_name.rpartition(".")[2] if exact else first.type_name
        about = f"{shown}: {first.message}" if first.types else first.message
        exc = _construct(cls, f"{what} failed on {where}: {about}{tail}", first)
        if exc is not None:
            break
    for name, value in (
        ("rank", first.rank),
        ("stage", stage),
        ("remote_type", first.type_name),
        ("remote_traceback", first.traceback),
    ):
        if name not in exc.__dict__:  # a rebuilt PeerFailure keeps its own stage
            setattr(exc, name, value)
    if first.traceback and hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"--- the traceback on {where} ({stage}) ---\n{first.traceback.rstrip()}")
    return exc


def _candidates(types: tuple[str, ...]) -> list[type[BaseException]]:
    """The types to rebuild, best first: the exact type when allowed, then its allowed base classes other
    than ``Exception`` (a builtin that needs more than a message, e.g. ``UnicodeDecodeError``, falls back)."""
    found = [ALLOWED.get(name) for name in types]
    return [c for i, c in enumerate(found) if c is not None and (i == 0 or c is not Exception)]


def _construct(cls: type[BaseException], text: str, failure: Failure) -> Exception | None:
    """``cls`` built from the message and the attributes it takes (None: it cannot be, e.g. attributes a
    hostile payload got wrong)."""
    if cls is RemoteError:
        return RemoteError(text, remote_type=failure.type_name)
    names = OURS.get(cls, ())
    kwargs = {n: tuple(v) if isinstance(v, list) else v for n, v in failure.attributes.items() if n in names}
    try:
        exc = cls(text, **kwargs)
    except Exception:
        return None
    return exc if isinstance(exc, Exception) else None
