"""Shared pieces of the command line: errors, help format, argument parsing helpers, user-function import."""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CLIError",
    "HelpFormatter",
    "add_function_arguments",
    "dtype_name",
    "flat_specs",
    "format_box",
    "load_function",
    "parse_box",
    "parse_dtype",
    "parse_inputs",
    "parse_shape",
    "parse_values",
    "regroup",
]


class CLIError(Exception):
    """A user-facing error: printed as one line on stderr, exit status 2 (or ``status``: 1 is "the answer is no")."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions and epilogs as written; adds ``(default: X)`` to options whose help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if shown and action.option_strings and "default" not in text:
            return text + " (default: %(default)s)"
        return text


# ---------------------------------------------------------------------------------------------------
# dtypes, shapes, boxes

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "f32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "f64": torch.float64,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "i8": torch.int8,
    "int8": torch.int8,
    "u8": torch.uint8,
    "uint8": torch.uint8,
    "i16": torch.int16,
    "int16": torch.int16,
    "i32": torch.int32,
    "int32": torch.int32,
    "int": torch.int32,
    "i64": torch.int64,
    "int64": torch.int64,
    "long": torch.int64,
    "bool": torch.bool,
    "f8e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "f8e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}


def parse_dtype(text: str) -> torch.dtype:
    key = text.strip().lower().removeprefix("torch.")
    if key in DTYPES:
        return DTYPES[key]
    raise CLIError(f"unknown dtype {text!r} (use e.g. bf16, float32, int64)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_shape(text: str) -> tuple[int, ...]:
    """``8x4`` (also ``8,4``); an empty string or ``()`` is a scalar."""
    text = text.strip()
    if text in ("", "()", "scalar"):
        return ()
    parts = re.split(r"[x,×]", text.lower())
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise CLIError(f"bad shape {text!r}: write sizes separated by 'x', e.g. 8x4") from None
    if any(n < 0 for n in shape):
        raise CLIError(f"bad shape {text!r}: negative size")
    return shape


def parse_inputs(specs: Sequence[str]) -> dict[str, Any]:
    """``NAME=SHAPE[:DTYPE]`` (or ``NAME[N]=SHAPE[:DTYPE]`` for a list of N tensors) → ``{name: spec}``.

    A spec is ``(shape, dtype)``, or a list of them for the list form; list elements are named ``NAME.i``.
    """
    out: dict[str, Any] = {}
    for spec in specs:
        m = re.fullmatch(r"\s*([A-Za-z_]\w*)(?:\[(\d+)\])?\s*=\s*([^:]*)(?::(.+))?", spec)
        if not m:
            raise CLIError(f"bad --input {spec!r}: write NAME=SHAPE[:DTYPE], e.g. w=8x4:bf16 or ws[4]=8x4")
        name, count, shape, dtype = m.groups()
        if name in out:
            raise CLIError(f"--input {name!r} given twice")
        one = (parse_shape(shape), parse_dtype(dtype) if dtype else torch.float32)
        out[name] = [one] * int(count) if count is not None else one
    if not out:
        raise CLIError("give the function's tensors with --input NAME=SHAPE[:DTYPE] (one per argument)")
    return out


def parse_values(specs: Sequence[str], tensors: Sequence[str] = ()) -> dict[str, Any]:
    """``NAME=VALUE`` (``--arg``: a plain Python value, read by :func:`ast.literal_eval`) → ``{name: value}``.

    ``tensors`` are the ``--input`` names, which an ``--arg`` may not repeat.
    """
    out: dict[str, Any] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise CLIError(f"bad --arg {spec!r}: write NAME=VALUE, e.g. heads=4, dims='(0, 1)' or mode=\"'sum'\"")
        if name in out:
            raise CLIError(f"--arg {name!r} given twice")
        if name in tensors:
            raise CLIError(f"{name!r} is given both as --input (a tensor) and as --arg (a value)")
        try:
            out[name] = ast.literal_eval(text.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise CLIError(
                f"bad --arg {spec!r}: {text.strip()!r} is no Python literal (a number, True/False/None, a string "
                f"in quotes such as {name}=\"'{text.strip()}'\", or a tuple, list or dict of them)"
            ) from None
    return out


def flat_specs(inputs: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every source tensor of ``inputs`` by source name (list elements are ``NAME.i``)."""
    out = {}
    for name, spec in inputs.items():
        if isinstance(spec, list):
            out.update({f"{name}.{i}": s for i, s in enumerate(spec)})
        else:
            out[name] = spec
    return out


def regroup(inputs: dict[str, Any], tensors: dict[str, Any], values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for the user's function from tensors named like :func:`flat_specs`, and a fresh copy of
    the ``--arg`` ``values`` (a function that changes a list it is given changes only its own)."""
    kwargs = {
        name: [tensors[f"{name}.{i}"] for i in range(len(spec))] if isinstance(spec, list) else tensors[name]
        for name, spec in inputs.items()
    }
    return {**kwargs, **copy.deepcopy(values or {})}


def parse_box(text: str) -> tuple[tuple[int, int], ...]:
    """``0:4,0:8`` → ``((0, 4), (0, 8))``."""
    box = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if not m:
            raise CLIError(f"bad --box {text!r}: write START:STOP per dim, comma separated, e.g. 0:4,0:8")
        box.append((int(m.group(1)), int(m.group(2))))
    return tuple(box)


def format_box(box: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


# ---------------------------------------------------------------------------------------------------
# importing the user's function


def load_function(ref: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION`` where MODULE is a dotted module name or a path to a ``.py`` file."""
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise CLIError(f"bad function {ref!r}: write MODULE:FUNCTION, e.g. convert.py:gate_up or pkg.mod:fn")
    if module_ref.endswith(".py") or os.sep in module_ref or "/" in module_ref:
        path = os.path.abspath(module_ref)
        if not os.path.isfile(path):
            raise CLIError(f"no such file: {module_ref}")
        name = "_regiontrace_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.path.insert(0, os.path.dirname(path))
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_ref)
        except ModuleNotFoundError as e:
            if e.name and module_ref.startswith(e.name):
                raise CLIError(f"cannot import module {module_ref!r}: {e}") from e
            raise
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CLIError(f"{module_ref} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CLIError(f"{ref} is not callable")
    return _checked_call(obj, ref)


def _checked_call(fn: Callable[..., Any], ref: str) -> Callable[..., Any]:
    """``fn``, wrapped so that arguments that do not fit its signature are a usage error (exit status 2): the
    ``--input`` and ``--arg`` names must be its parameters. Errors raised inside ``fn`` pass through unchanged."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check against (some builtins)
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            params = ", ".join(signature.parameters) or "none"
            raise CLIError(f"--input/--arg do not match {ref}'s parameters ({params}): {e}") from None
        return fn(*args, **kwargs)

    return call


def add_function_arguments(p: Any) -> None:
    """The ``MODULE:FUNCTION``, ``--input`` and ``--arg`` arguments shared by ``trace`` and ``check``."""
    p.add_argument(
        "function",
        metavar="MODULE:FUNCTION",
        help="a dotted module or a path to a .py file, then ':' and the function name",
    )
    p.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=SHAPE[:DTYPE]",
        help="one per tensor argument of FUNCTION, e.g. w=8x4:bf16 (dtype default float32; NAME[N]=... for a "
        "list of N)",
    )
    p.add_argument(
        "--arg",
        "-a",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a non-tensor argument of FUNCTION, passed as is: a Python literal (ast.literal_eval), e.g. heads=4, "
        "dims='(0, 1)', mode=\"'sum'\"",
    )
