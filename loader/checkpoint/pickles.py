"""Reading a pickle without executing it: the opcodes of data (protocols 0-5's binary forms) and an allow-list of
globals, each mapped to a pure constructor the caller gives.

Vocabulary: a *global* is a ``(module, qualname)`` pair a pickle names (``GLOBAL`` / ``STACK_GLOBAL``); the
*allow-list* maps each global a pickle may name to the value pushed in its place (a constructor, or a marker such
as a storage type). Only those values may be called (``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``), only objects whose
class defines ``__setstate__`` take a ``BUILD`` (the caller's records; :class:`PickledObject`), and a persistent id
(``BINPERSID``) goes to the caller's ``persistent_load``. Anything else — a global off the list (``os.system``,
``builtins.eval``), ``INST`` / ``OBJ``, the extension registry (``EXT*``), out-of-band buffers, an opcode this
reader does not know — is a :class:`~loader.errors.CheckpointError` naming the file, the byte and what was asked
for; nothing the pickle names is imported or run. :mod:`.torchzip` reads ``torch.save``'s ``data.pkl`` with it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError
from ..storage.untrusted import err, short

#: a global a pickle names: ``(module, qualname)``
Global = tuple[str, str]
#: the highest pickle protocol read
MAX_PROTOCOL = 5
#: tuples and frozensets nested deeper than this are refused (hashing them recurses)
MAX_DEPTH = 1000
#: what opcodes are refused as, rather than "unknown"
_REFUSED = {
    **dict.fromkeys((b"i", b"o"), "INST / OBJ (builds an instance of a class it names)"),
    **dict.fromkeys((b"\x82", b"\x83", b"\x84"), "EXT1 / EXT2 / EXT4 (the extension registry)"),
    **dict.fromkeys((b"\x97", b"\x98"), "NEXT_BUFFER / READONLY_BUFFER (an out-of-band buffer)"),
    **dict.fromkeys((b"S", b"T", b"U"), "STRING / BINSTRING / SHORT_BINSTRING (a Python 2 string)"),
    b"P": "PERSID (a text persistent id)",
}


class PickledObject:
    """A plain record of an object a pickle builds: the global it names, the arguments it was built with and
    the state a ``BUILD`` gave it (None: none). What :func:`as_object` constructors return."""

    __slots__ = ("name", "args", "kwargs", "state")

    def __init__(self, name: Global, args: tuple, kwargs: Mapping[str, Any] | None = None) -> None:
        self.name, self.args, self.kwargs, self.state = name, args, dict(kwargs or {}), None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"PickledObject({'.'.join(self.name)}, args={short.repr(self.args)}, state={short.repr(self.state)})"


def as_object(name: Global) -> Callable[..., PickledObject]:
    """A constructor for the allow-list that records what ``name`` was built with as a :class:`PickledObject`."""

    def construct(*args: Any, **kwargs: Any) -> PickledObject:
        return PickledObject(name, args, kwargs)

    construct.__qualname__ = f"as_object({'.'.join(name)})"
    return construct


_MARK = object()  # the stack's mark (``MARK``): where a ``TUPLE``, ``LIST``, ``SETITEMS``, … takes its items from
_Stop = StopIteration


class _Machine:
    """The unpickling machine over one pickle's bytes; :func:`read_pickle` runs it."""

    def __init__(self, data: bytes, allowed: Mapping[Global, Any], persistent_load: Callable | None, name: str):
        self.raw, self.pos, self.at = bytes(data), 0, 0
        self.size = len(self.raw)
        self.allowed, self.persistent_load, self.name = allowed, persistent_load, name or "<pickle>"
        self.callables = {id(v) for v in allowed.values()}
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.depths: dict[int, tuple[Any, int]] = {}  # id -> (tuple or frozenset, kept alive; its nesting depth)

    def fail(self, message: str) -> CheckpointError:
        return err(self.name, f"pickle byte {self.at}: {message}")

    def take(self, n: int) -> bytes:
        pos = self.pos
        end = pos + n
        if n < 0 or end > self.size:
            raise self.fail(f"truncated: wants {n} bytes, {self.size - pos} left")
        self.pos = end
        return self.raw[pos:end]

    def unpack(self, form: struct.Struct) -> Any:
        pos = self.pos
        if pos + form.size > self.size:
            raise self.fail(f"truncated: wants {form.size} bytes, {self.size - pos} left")
        self.pos = pos + form.size
        return form.unpack_from(self.raw, pos)[0]

    def line(self, codec: str = "utf-8") -> str:
        end = self.raw.find(b"\n", self.pos)
        if end < 0:
            raise self.fail("truncated: a text argument without its newline")
        return self.decode(self.take(end + 1 - self.pos)[:-1], codec)

    def text(self, n: int) -> str:
        return self.decode(self.take(n), "utf-8")

    def decode(self, raw: bytes, codec: str) -> str:
        try:
            return raw.decode(codec, "surrogatepass")
        except UnicodeDecodeError:
            raise self.fail(f"text {short.repr(raw)} is not {codec}") from None

    def pop(self) -> Any:
        value = self.top()
        self.stack.pop()
        return value

    def top(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.fail("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1 :]
                del self.stack[i:]
                return items
        raise self.fail("no MARK on the stack")

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def nested(self, made: Any, items: list[Any]) -> Any:
        """``made`` (a tuple or frozenset of ``items``), refused nested deeper than :data:`MAX_DEPTH`: hashing or
        comparing it would overflow the interpreter's stack."""
        depth = 1 + max((self.depths[id(i)][1] for i in items if id(i) in self.depths), default=0)
        if depth > MAX_DEPTH:
            raise self.fail(f"tuples or frozensets nested deeper than {MAX_DEPTH}")
        self.depths[id(made)] = (made, depth)
        return made

    def memo_get(self, index: int) -> Any:
        if index not in self.memo:
            raise self.fail(f"memo entry {index} was never stored")
        return self.memo[index]

    def memo_put(self, index: int) -> None:
        self.memo[index] = self.top()

    def find(self, module: object, qualname: object) -> Any:
        if not isinstance(module, str) or not isinstance(qualname, str):
            raise self.fail(f"global named by {short.repr(module)}, {short.repr(qualname)}: not two strings")
        if (module, qualname) not in self.allowed:
            what = f"{module}.{qualname}"
            names = sorted(".".join(g) for g in self.allowed)
            known = ", ".join(names[:6]) + (f", … ({len(names)} in all)" if len(names) > 6 else "") or "none"
            raise self.fail(f"global {what!r} is not allowed: refused without importing it (allowed: {known})")
        return self.allowed[(module, qualname)]

    def call(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        if id(func) not in self.callables or not callable(func):
            raise self.fail(f"calls {short.repr(func)}, which is not an allowed global")
        if not isinstance(args, tuple) or not (kwargs is None or isinstance(kwargs, dict)):
            raise self.fail(f"calls {short.repr(func)} with arguments {short.repr(args)}: not a tuple")
        try:
            return func(*args, **(kwargs or {}))
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
            raise self.fail(f"{short.repr(func)}{short.repr(args)} refused: {e}") from None

    def build(self) -> None:
        state, obj = self.pop(), self.top()
        setstate = getattr(type(obj), "__setstate__", None)
        if setstate is None:
            raise self.fail(f"BUILD on a {type(obj).__name__}, which takes no state")
        try:
            setstate(obj, state)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise self.fail(f"BUILD on a {type(obj).__name__} refused: {e}") from None

    def persistent(self) -> None:
        pid = self.pop()
        if self.persistent_load is None:
            raise self.fail(f"persistent id {short.repr(pid)} and no persistent_load")
        self.push(self.persistent_load(pid))

    def run(self) -> Any:
        ops, raw, size = _OPS, self.raw, self.size
        while True:
            at = self.at = self.pos
            if at >= size:
                raise self.fail("truncated: no STOP")
            self.pos = at + 1
            op = raw[at : at + 1]
            handler = ops.get(op)
            if handler is None:
                what = _REFUSED.get(op, f"unknown opcode {op!r}")
                raise self.fail(f"{what} is not read (this reader executes nothing)")
            try:
                handler(self)
            except _Stop:
                break
        if self.pos != self.size:
            raise self.fail(f"{self.size - self.pos} bytes after STOP")
        if len(self.stack) != 1 or self.stack[0] is _MARK:
            raise self.fail(f"STOP with {len(self.stack)} items on the stack, not 1")
        return self.stack[0]


def _proto(m: _Machine) -> None:
    version = m.take(1)[0]
    if version > MAX_PROTOCOL:
        raise m.fail(f"pickle protocol {version} (this reader knows up to {MAX_PROTOCOL})")


def _stop(m: _Machine) -> None:
    raise _Stop


def _number_line(m: _Machine, parse: Callable[[str], Any]) -> None:
    text = m.line()
    try:  # protocol 0's False / True are INT 00 / 01
        m.push(text == "01" if text in ("00", "01") else parse(text.rstrip("L")))
    except ValueError:
        raise m.fail(f"INT/LONG/FLOAT argument {short.repr(text)} is not a number") from None


def _long(m: _Machine, size_form: struct.Struct) -> None:
    n = m.unpack(size_form)
    m.push(int.from_bytes(m.take(n), "little", signed=True))


def _tuple(m: _Machine, items: list[Any]) -> None:
    m.push(m.nested(tuple(items), items))


def _set_items(m: _Machine, items: list[Any], target: Any = None) -> None:
    """Set ``items`` (key, value, key, …) in ``target`` (default: the top of the stack)."""
    target = m.top() if target is None else target
    if not isinstance(target, dict):
        raise m.fail(f"SETITEM(S) on a {type(target).__name__}, not a dict")
    if len(items) % 2:
        raise m.fail("SETITEMS with an odd number of items")
    try:
        for i in range(0, len(items), 2):
            dict.__setitem__(target, items[i], items[i + 1])
    except TypeError as e:
        raise m.fail(f"dict key refused: {e}") from None


def _dict(m: _Machine) -> None:
    d: dict = {}
    _set_items(m, m.pop_mark(), d)
    m.push(d)


def _setitem(m: _Machine) -> None:
    value, key = m.pop(), m.pop()
    _set_items(m, [key, value])


def _append(m: _Machine, items: list[Any]) -> None:
    target = m.top()
    if not isinstance(target, list):
        raise m.fail(f"APPEND(S) on a {type(target).__name__}, not a list")
    list.extend(target, items)


def _hashed(m: _Machine, make: Callable[[list[Any]], Any], items: list[Any]) -> Any:
    """``make(items)`` (a frozenset, or the set ADDITEMS updates), refusing unhashable items."""
    try:
        return make(items)
    except TypeError as e:
        raise m.fail(f"unhashable item: {e}") from None


def _frozenset(m: _Machine, items: list[Any]) -> None:
    m.push(m.nested(_hashed(m, frozenset, items), items))


def _add_items(m: _Machine, items: list[Any]) -> None:
    target = m.top()
    if not isinstance(target, set):
        raise m.fail(f"ADDITEMS on a {type(target).__name__}, not a set")
    _hashed(m, target.update, items)


def _global(m: _Machine) -> None:
    m.push(m.find(m.line(), m.line()))


def _stack_global(m: _Machine) -> None:
    qualname = m.pop()
    m.push(m.find(m.pop(), qualname))


def _reduce(m: _Machine) -> None:  # REDUCE and NEWOBJ alike: ``func(*args)``
    args = m.pop()
    m.push(m.call(m.pop(), args))


def _newobj_ex(m: _Machine) -> None:
    kwargs, args = m.pop(), m.pop()
    m.push(m.call(m.pop(), args, kwargs))


_U8, _U32, _U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
_I32, _U16, _F64 = struct.Struct("<i"), struct.Struct("<H"), struct.Struct(">d")
_OPS: dict[bytes, Callable[[_Machine], None]] = {
    b"\x80": _proto,
    b"\x95": lambda m: m.take(8),  # FRAME: a buffering hint
    b".": _stop,
    b"(": lambda m: m.push(_MARK),
    b"0": lambda m: m.stack.pop() if m.stack and m.stack[-1] is _MARK else m.pop(),  # as pickle: drops a mark
    b"1": lambda m: m.pop_mark() and None,
    b"2": lambda m: m.push(m.top()),
    b"N": lambda m: m.push(None),
    b"\x88": lambda m: m.push(True),
    b"\x89": lambda m: m.push(False),
    b"I": lambda m: _number_line(m, int),
    b"L": lambda m: _number_line(m, int),
    b"F": lambda m: _number_line(m, float),
    b"J": lambda m: m.push(m.unpack(_I32)),
    b"K": lambda m: m.push(m.unpack(_U8)),
    b"M": lambda m: m.push(m.unpack(_U16)),
    b"\x8a": lambda m: _long(m, _U8),
    b"\x8b": lambda m: _long(m, _I32),
    b"G": lambda m: m.push(m.unpack(_F64)),
    b"V": lambda m: m.push(m.line("raw-unicode-escape")),
    b"X": lambda m: m.push(m.text(m.unpack(_U32))),
    b"\x8c": lambda m: m.push(m.text(m.unpack(_U8))),
    b"\x8d": lambda m: m.push(m.text(m.unpack(_U64))),
    b"B": lambda m: m.push(m.take(m.unpack(_U32))),
    b"C": lambda m: m.push(m.take(m.unpack(_U8))),
    b"\x8e": lambda m: m.push(m.take(m.unpack(_U64))),
    b"\x96": lambda m: m.push(bytearray(m.take(m.unpack(_U64)))),
    b")": lambda m: m.push(()),
    b"t": lambda m: _tuple(m, m.pop_mark()),
    b"\x85": lambda m: _tuple(m, [m.pop()]),
    b"\x86": lambda m: _tuple(m, [m.pop() for _ in range(2)][::-1]),
    b"\x87": lambda m: _tuple(m, [m.pop() for _ in range(3)][::-1]),
    b"]": lambda m: m.push([]),
    b"l": lambda m: m.push(m.pop_mark()),
    b"a": lambda m: _append(m, [m.pop()]),
    b"e": lambda m: _append(m, m.pop_mark()),
    b"}": lambda m: m.push({}),
    b"d": _dict,
    b"s": _setitem,
    b"u": lambda m: _set_items(m, m.pop_mark()),
    b"\x8f": lambda m: m.push(set()),
    b"\x90": lambda m: _add_items(m, m.pop_mark()),
    b"\x91": lambda m: _frozenset(m, m.pop_mark()),
    b"p": lambda m: m.memo_put(_memo_index(m, m.line())),
    b"q": lambda m: m.memo_put(m.unpack(_U8)),
    b"r": lambda m: m.memo_put(m.unpack(_U32)),
    b"\x94": lambda m: m.memo_put(len(m.memo)),
    b"g": lambda m: m.push(m.memo_get(_memo_index(m, m.line()))),
    b"h": lambda m: m.push(m.memo_get(m.unpack(_U8))),
    b"j": lambda m: m.push(m.memo_get(m.unpack(_U32))),
    b"c": _global,
    b"\x93": _stack_global,
    b"R": _reduce,
    b"\x81": _reduce,
    b"\x92": _newobj_ex,
    b"b": lambda m: m.build(),
    b"Q": lambda m: m.persistent(),
}


def _memo_index(m: _Machine, text: str) -> int:
    if not text.isdigit():
        raise m.fail(f"memo index {short.repr(text)} is not a number")
    return int(text)


def read_pickle(
    data: bytes,
    *,
    allowed: Mapping[Global, Any],
    persistent_load: Callable[[Any], Any] | None = None,
    name: str = "",
) -> Any:
    """The value a pickle builds, read without importing or running anything it names.

    Args:
        data: The pickle's bytes (exactly one pickle: bytes after its ``STOP`` are refused).
        allowed: ``{(module, qualname): value}``: what each global the pickle may name stands for. A callable
            value is what ``REDUCE`` / ``NEWOBJ`` of that global calls (a pure constructor of a plain record);
            a ``BUILD`` reaches only objects whose class defines ``__setstate__``.
        persistent_load: What a persistent id (``BINPERSID``) becomes; None: persistent ids are refused.
        name: The file named in errors.

    Returns:
        The pickled value: plain Python data and the records the constructors built.

    Raises:
        CheckpointError: a global off the list, a refused or unknown opcode, a call of anything but an allowed
            value, a malformed or truncated pickle (naming ``name`` and the byte); a constructor's own
            :class:`CheckpointError` as raised.
    """
    return _Machine(bytes(data), allowed, persistent_load, name).run()
