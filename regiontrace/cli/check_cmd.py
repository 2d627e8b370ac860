"""``regiontrace check MODULE:FUNCTION --input ...``: property-test a converter against real runs."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import traceback
from typing import Any

import torch

import regiontrace as rt

from .common import (
    CLIError,
    HelpFormatter,
    add_function_arguments,
    dtype_name,
    flat_specs,
    load_function,
    parse_inputs,
    parse_values,
    regroup,
)

HELP = "property-test a conversion function: traced map vs real runs on random data and boxes"
DESCRIPTION = """\
For N hypothesis examples (random seeds, data and output boxes): trace FUNCTION, run it for real, and
check that the traced map reproduces the real result exactly — whole outputs (materialize), RemapBlocks of
random boxes, random values and unique per-element codes (regiontrace.testing.assert_converter_exact).
With --reference, also that FUNCTION computes what an independent implementation computes on the same data
(a converter that is consistently wrong, e.g. with k and v swapped, traces exactly but differs from it).
Exit status 1 on a counterexample, printed minimised; 1 also when the function is not traceable; 2 for a
wrong command line (e.g. --input names that are not the function's parameters)."""
EPILOG = """\
examples:
  regiontrace check convert.py:gate_up --input 'gate[4]=8x16:bf16' --input 'up[4]=8x16:bf16'
  regiontrace check mypkg.conv:permute_qk --input w=64x32 --arg heads=4 --examples 200
  regiontrace check convert.py:split_qkv --input qkv=12x4 --reference reference.py:split_qkv"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check", help=HELP, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    add_function_arguments(p)
    p.add_argument("--examples", "-n", type=int, default=50, metavar="N", help="hypothesis examples")
    p.add_argument(
        "--boxes",
        type=int,
        default=4,
        metavar="K",
        help="random boxes per output per example, besides the one hypothesis draws",
    )
    p.add_argument(
        "--reference",
        metavar="MODULE:FUNCTION",
        help="an independent implementation, called like FUNCTION (same --input and --arg): each example's "
        "real outputs must equal its outputs bit for bit",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError:
        raise CLIError("`check` needs hypothesis: pip install hypothesis") from None
    from regiontrace.testing import assert_converter_exact, boxes, check_values, random_tensor  # hypothesis
    from regiontrace.testing.checks import output_tensors

    if args.examples < 1:
        raise CLIError("--examples must be at least 1")
    if args.boxes < 0:
        raise CLIError("--boxes must be at least 0")
    inputs = parse_inputs(args.input)
    values = parse_values(args.arg, inputs)
    specs = flat_specs(inputs)
    fn = load_function(args.function)
    reference = load_function(args.reference) if args.reference else None

    def call(**tensors: Any) -> Any:
        return fn(**regroup(inputs, tensors, values))

    def call_reference(**tensors: Any) -> Any:
        return reference(**regroup(inputs, tensors, values))

    # a function that does not trace fails the same way on every example: say so once, plainly
    try:
        rt.trace(call, **{n: rt.RegionTensor.leaf(n, s, d) for n, (s, d) in specs.items()})
    except (rt.Untraceable, rt.TraceMismatch) as e:
        raise CLIError(f"not traceable: {type(e).__name__}: {e}", status=1) from e

    shown = ", ".join(
        [f"{n}={'x'.join(map(str, s)) or '()'}:{dtype_name(d)}" for n, (s, d) in specs.items()]
        + [f"{n}={v!r}" for n, v in values.items()]
    )
    against = f", against {args.reference}" if reference else ""
    print(f"checking {args.function} on {shown}: {args.examples} example(s), {args.boxes} random box(es) each{against}")

    @settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(seed=st.integers(0, 2**31 - 1), data=st.data())
    def converter_is_exact(seed: int, data: Any) -> None:
        traced = assert_converter_exact(
            call, specs, boxes=args.boxes, seed=seed, reference=call_reference if reference else None
        )
        # one more box per output, drawn by hypothesis so that a failure shrinks to the smallest box
        gen = torch.Generator().manual_seed(seed + 1)
        sources = {n: random_tensor(s, d, gen) for n, (s, d) in specs.items()}
        real = output_tensors(call(**{n: t.clone() for n, t in sources.items()}))
        for i, (t, r) in enumerate(zip(output_tensors(traced), real)):
            box = data.draw(boxes(tuple(t.shape)), label=f"box of output {i}")
            check_values(t, box, sources, r[tuple(slice(a, b) for a, b in box)])

    home = tempfile.mkdtemp(prefix="regiontrace-hypothesis-")  # leave no .hypothesis/ in the user's folder
    previous, set_home = None, None
    try:
        from hypothesis import configuration

        set_home = configuration.set_hypothesis_home_dir
        previous = vars(configuration).get("__hypothesis_home_directory")
        set_home(home)
    except (ImportError, AttributeError):
        pass
    try:
        converter_is_exact()
    except (AssertionError, rt.Untraceable, rt.TraceMismatch) as e:
        _report_counterexample(e)
        if "first difference:" not in str(e):  # e.g. a box's blocks differ: say where whole outputs differ
            where = whole_output_difference(call, specs)
            if where:
                print(f"  {where}")
        return 1
    finally:
        if set_home is not None:
            set_home(previous)
        shutil.rmtree(home, ignore_errors=True)
    also = f", which equals {args.reference}'s" if reference else ""
    print(f"OK: {args.examples} example(s) passed — the traced map equals the real run{also}")
    return 0


def _report_counterexample(e: BaseException) -> None:
    notes = [n for n in getattr(e, "__notes__", []) if n.strip()]
    print("FAILED: counterexample (minimised by hypothesis):")
    for note in notes:
        for line in note.splitlines():
            print(f"  {line}")
    first, *more = (str(e) or "(no message)").splitlines()
    print(f"  {type(e).__name__}: {first}")
    frame = _user_frame(e)
    if frame:
        print(f"  raised at {frame}")
    for line in more:  # the kit's "first difference: ..."
        print(f"  {line}")


def _user_frame(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for f in reversed(frames):
        if "hypothesis" not in f.filename:
            name = f.filename
            if os.path.abspath(name).startswith(package + os.sep):
                name = os.path.relpath(name, package)
            return f"{name}:{f.lineno} ({f.name})"
    return ""


def whole_output_difference(call: Any, specs: dict) -> str:
    """``first difference: ...``: where the traced map and a real run first disagree on whole outputs, in the
    words of :func:`regiontrace.testing.assert_converter_exact` (``""`` when they agree or it cannot tell)."""
    from regiontrace.testing import assert_converter_exact

    try:
        assert_converter_exact(call, specs, boxes=0)
    except AssertionError as e:
        return next((line for line in str(e).splitlines() if line.startswith("first difference: ")), "")
    except Exception:
        return ""
    return ""
