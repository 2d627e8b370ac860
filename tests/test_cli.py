"""The `regiontrace` command line, run for real as subprocesses (usage errors: most through its `main` in this
process, see :func:`in_process`).

`python -m loader` runs what the `regiontrace` console script runs (`loader.cli.main`: demo, trace, check,
plan); `python -m regiontrace` is the algebra's own command line (trace and check, without the loader).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points

import pytest

from loader.options import LoadOptions, SaveOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERTERS = textwrap.dedent("""
    import torch

    def gate_up(gate, up):
        return torch.cat([torch.stack(gate), torch.stack(up)], dim=1)

    def split_qkv(qkv):
        q, k, v = qkv.chunk(3, dim=0)
        return {"q": q, "k": k.t(), "v": v.float()}

    def scaled(w):
        return w * 2

    def summed(w):
        return w.sum(0)

    def split_kv(kv):
        k, v = kv.chunk(2, dim=0)
        return {"k": k, "v": v}

    def split_kv_swapped(kv):
        k, v = kv.chunk(2, dim=0)
        return {"k": v, "v": k}

    def split_heads(w, heads, order=(1, 0)):
        return w.reshape(heads, w.shape[0] // heads, -1).permute(*order, 2)

    def sneaky(w):
        # tracing runs on the meta device and sees this branch; a real run flips the rows
        return w if w.device.type == "meta" else w.flip(0)
""")


def _run(command: list[str], cwd: str | None, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    return subprocess.run(command, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def regiontrace(*args: str, cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `regiontrace` console script's command line (`python -m loader`: every command)."""
    return _run([sys.executable, "-m", "loader", *args], cwd, timeout)


def algebra(*args: str, cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The algebra's own command line (`python -m regiontrace`: trace and check)."""
    return _run([sys.executable, "-m", "regiontrace", *args], cwd, timeout)


def in_process(*args: str, cwd: pathlib.Path, algebra: bool = False) -> tuple[int, str]:
    """``loader.cli.main(args)`` (what the console script runs; ``algebra``: ``regiontrace.cli.main``, ``python -m
    regiontrace``'s) in this process from ``cwd``: its exit status (argparse's ``SystemExit`` too) and its stderr;
    ``sys.path``, the cwd and the user modules it imported are put back after. An exception escaping ``main`` fails
    the test (a subprocess would print a traceback)."""
    import contextlib
    import io

    import loader.cli
    import regiontrace.cli

    main = regiontrace.cli.main if algebra else loader.cli.main
    path, where, modules = list(sys.path), os.getcwd(), set(sys.modules)
    err = io.StringIO()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = main(list(args))
            except SystemExit as e:
                status = e.code
    finally:
        os.chdir(where)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith("_regiontrace_user_"):
                del sys.modules[name]
    return status, err.getvalue()


@pytest.fixture()
def converters(tmp_path):
    (tmp_path / "conv.py").write_text(CONVERTERS)
    return tmp_path


def test_trace_prints_map_blocks_and_dot(converters):
    dot = converters / "graph.dot"
    r = algebra(
        "trace",
        "conv.py:gate_up",
        "--input",
        "gate[2]=4x3:bf16",
        "--input",
        "up[2]=4x3:bf16",
        "--dot",
        str(dot),
        cwd=str(converters),
    )
    assert r.returncode == 0, r.stderr
    assert "out[0:1, 4:8, 0:3] <- up.0[i1 - 4, i2]" in r.stdout  # rt.explain
    assert "4 block(s) for out[0:2, 0:8, 0:3]" in r.stdout
    assert "up.1[0:4, 0:3]  ->  out[1:2, 4:8, 0:3]" in r.stdout
    text = dot.read_text()
    assert text.startswith("digraph") and text.count("->") == 6 and "cat(dim=1)" in text

    r = algebra("trace", f"{converters / 'conv.py'}:split_qkv", "--input", "qkv=12x4:bf16", "--box", "1:3,0:4")
    assert r.returncode == 0, r.stderr
    assert "out['k']" in r.stdout and "walked in dim order (1, 0)" in r.stdout and "as float32" in r.stdout


def test_trace_untraceable_names_the_op(converters):
    r = algebra("trace", "conv.py:summed", "--input", "w=4x4", cwd=str(converters))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Untraceable" in lines[0] and "aten.sum.dim_IntList" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_trace_pointwise_values_shows_each_operands_blocks(converters):
    r = algebra("trace", "conv.py:scaled", "--input", "w=4x4", "--box", "1:3,0:4", cwd=str(converters))
    assert r.returncode == 0, r.stderr
    assert "values mul(v0, 2)" in r.stdout and "#0   w[1:3, 0:4]  ->  v0[1:3, 0:4]" in r.stdout


def test_check_passes_pointwise_values(converters):
    r = algebra("check", "conv.py:scaled", "--input", "w=6x4:bfloat16", "--examples", "5", cwd=str(converters))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: 5 example(s) passed" in r.stdout


def test_check_finds_and_minimises_a_counterexample(converters):
    r = algebra("check", "conv.py:sneaky", "--input", "w=6x4", "--examples", "20", cwd=str(converters))
    assert r.returncode == 1, r.stdout + r.stderr
    # hypothesis's own report ("Falsifying example" / "Failing test case"), shrunk to the smallest seed
    assert "converter_is_exact(" in r.stdout and "seed=0" in r.stdout
    assert "materialize differs from the real result" in r.stdout
    assert "the trace reads w[0, 0], the real run holds w[5, 0]" in r.stdout
    assert not (converters / ".hypothesis").exists()


def test_check_a_converter_whose_arguments_are_named_like_the_kits_options(converters):
    """`check` passes the inputs to assert_converter_exact as one mapping: arguments named `seed` or `boxes` (a list
    here) are the converter's, not the kit's."""
    (converters / "named.py").write_text(
        "import torch\n\ndef f(seed, boxes):\n    return torch.cat([seed, torch.stack(boxes)])\n"
    )
    r = algebra(
        "check", "named.py:f", "--input", "seed=2x3", "--input", "boxes[2]=3", "--examples", "3", cwd=str(converters)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on seed=2x3:float32, boxes.0=3:float32, boxes.1=3:float32" in r.stdout and "OK: 3 example(s)" in r.stdout


def test_check_reference_catches_a_consistently_wrong_converter(converters):
    """k and v swapped trace exactly (trace and real run agree), so `check` alone passes; `--reference` with an
    independent implementation fails, status 1, naming the first differing element."""
    r = algebra("check", "conv.py:split_kv_swapped", "--input", "kv=8x3", "--examples", "5", cwd=str(converters))
    assert r.returncode == 0 and "OK: 5 example(s) passed" in r.stdout, r.stdout + r.stderr
    args = ("check", "conv.py:split_kv_swapped", "--input", "kv=8x3", "--examples", "5")
    r = algebra(*args, "--reference", "conv.py:split_kv", cwd=str(converters))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "against conv.py:split_kv" in r.stdout and "FAILED: counterexample" in r.stdout
    assert "AssertionError: output 0: the converter differs from the reference" in r.stdout
    assert "first difference: output 0[0, 0]: the converter reads kv[4, 0], the reference holds kv[0, 0]" in r.stdout
    r = regiontrace(
        "check", "conv.py:split_kv", "-i", "kv=8x3", "-n", "5", "--reference", "conv.py:split_kv", cwd=str(converters)
    )
    assert r.returncode == 0 and "the traced map equals the real run, which equals conv.py:split_kv's" in r.stdout
    r = regiontrace("check", "conv.py:split_kv", "-i", "kv=8x3", "--reference", "conv.py:scaled", cwd=str(converters))
    assert r.returncode == 2 and "do not match conv.py:scaled's parameters (w)" in r.stderr, r.stderr


def test_arg_passes_plain_values_to_trace_and_check(converters):
    """`--arg NAME=VALUE` passes a Python literal as is; as an `--input` the same number is a tensor, which the
    converter's `//` cannot trace with."""
    r = algebra("trace", "conv.py:split_heads", "-i", "w=8x3", "-i", "heads=4", cwd=str(converters))
    assert r.returncode == 1 and "Untraceable" in r.stderr and "floor_divide" in r.stderr, r.stderr
    r = algebra("trace", "conv.py:split_heads", "-i", "w=8x3", "-a", "heads=4", cwd=str(converters))
    assert r.returncode == 0, r.stderr
    assert "out: RegionTensor (2, 4, 3)" in r.stdout and "out[0:2, 0:4, 0:3] <- w[i0 + 2*i1, i2]" in r.stdout
    r = algebra(
        "trace", "conv.py:split_heads", "-i", "w=8x3", "-a", "heads=2", "--arg", "order=(0, 1)", cwd=str(converters)
    )
    assert r.returncode == 0 and "out: RegionTensor (2, 4, 3)" in r.stdout and "<- w[4*i0 + i1, i2]" in r.stdout
    r = regiontrace("check", "conv.py:split_heads", "-i", "w=8x3", "-a", "heads=4", "-n", "5", cwd=str(converters))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on w=8x3:float32, heads=4: 5 example(s)" in r.stdout and "OK: 5 example(s) passed" in r.stdout
    for bad, message in [
        (("-a", "heads=four"), "bad --arg 'heads=four': 'four' is no Python literal"),
        (("-a", "heads"), "bad --arg 'heads': write NAME=VALUE"),
        (("-a", "heads=4", "-a", "heads=2"), "--arg 'heads' given twice"),
        (("-a", "w=4"), "'w' is given both as --input (a tensor) and as --arg (a value)"),
        (("-a", "heads=4", "-a", "nope=1"), "do not match conv.py:split_heads's parameters"),
    ]:
        status, stderr = in_process("trace", "conv.py:split_heads", "-i", "w=8x3", *bad, cwd=converters, algebra=True)
        assert status == 2 and message in stderr and "Traceback" not in stderr, (bad, stderr)


def test_check_passes_a_correct_converter(converters):
    r = regiontrace("check", "conv.py:split_qkv", "--input", "qkv=6x4:bf16", "--examples", "15", cwd=str(converters))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: 15 example(s) passed" in r.stdout


def test_errors_are_one_line_and_verbose_shows_the_traceback(tmp_path):
    r = regiontrace("plan", str(tmp_path / "missing"), "--mesh", "2x2")
    missing = tmp_path / "missing"
    assert r.returncode != 0 and r.stderr.strip() == f"regiontrace plan: error: no such checkpoint: {missing}"
    r = regiontrace("trace", "nosuchmodule_xyz:f", "--input", "w=2x2")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = algebra("-v", "trace", "nosuchmodule_xyz:f", "--input", "w=2x2")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_usage_errors_exit_2_on_every_command(converters, tmp_path):
    """Exit status 1 is "the answer is no"; a wrong command line (argparse's own errors and ours) is 2: each case
    through ``loader.cli.main`` in this process, one of argparse's and one of ours through ``python -m loader``."""
    cases = [
        ("demo", "--world-size", "0"),
        ("demo", "--timeout", "0"),
        ("demo", "--mesh", "2xx"),
        ("demo", "--no-such-option"),
        ("trace", "conv.py:gate_up", "--input", "w=4x4"),  # gate_up takes gate and up
        ("trace", "conv.py:gate_up"),  # no --input
        ("check", "conv.py:scaled", "--input", "w=4x4", "--boxes", "-1"),
        ("check", "conv.py:scaled", "--input", "w=4x4", "--input", "v=2"),
        ("check", "conv.py:scaled", "--input", "w=4x4", "--boxes", "many"),
        ("plan", str(tmp_path), "--mesh", "0"),
        ("plan", str(tmp_path)),  # --mesh is required
        ("nosuchcommand",),
    ]
    for args in cases:
        status, stderr = in_process(*args, cwd=converters)
        assert status == 2, (args, status, stderr)
        assert "error" in stderr and "Traceback" not in stderr, (args, stderr)
    (converters / "broken.py").write_text("def f(w:\n")  # an error that is no answer either
    status, stderr = in_process("check", "broken.py:f", "--input", "w=4x4", cwd=converters)
    assert status == 2 and "SyntaxError" in stderr, stderr
    # the real entry point: argparse's error and one of ours, each a line on stderr and status 2
    r = regiontrace("nosuchcommand", cwd=str(converters))
    assert r.returncode == 2 and "invalid choice: 'nosuchcommand'" in r.stderr and "Traceback" not in r.stderr
    r = regiontrace("check", "broken.py:f", "--input", "w=4x4", cwd=str(converters))
    assert r.returncode == 2 and "SyntaxError" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_help_shows_defaults():
    from loader.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    helps = {name: " ".join(c.format_help().split()) for name, c in commands.items()}  # unwrapped
    assert (
        "--boxes K random boxes per output per example, besides the one hypothesis draws (default: 4)" in helps["check"]
    )
    assert "(default: 50)" in helps["check"] and "(default: 120)" in helps["demo"]
    assert "(default: 40)" in helps["trace"]
    assert not any("(default: None)" in h or "(default: False)" in h for h in helps.values())


def test_demo_timeout_bounds_the_whole_command(tmp_path):
    """--timeout counts from the command's start: one that expires before anything could finish ends the demo
    with one clear line naming the timeout, and status 1."""
    r = regiontrace("demo", "--world-size", "1", "--timeout", "0.001", "--out", str(tmp_path / "demo"), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("regiontrace demo: error: gave up after 0.001 s (--timeout) while ")
    assert "OK:" not in r.stdout


# a `transformers` that the demo imports (in its own process and in its fork server's) and that never finishes
# importing: each importing process writes its pid, then blocks (bounded, so that nothing outlives a failed test
# long); or, with BROKEN set, one whose import fails
HANGING_TRANSFORMERS = """
import os, time
if os.environ.get("BROKEN"):
    raise ImportError("this transformers is broken")
with open(os.environ["PIDS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(600)
"""


def _demo_env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    """The demo's environment: TMPDIR the test's own, and a `transformers` that never finishes importing."""
    (tmp_path / "site" / "transformers").mkdir(parents=True, exist_ok=True)
    (tmp_path / "site" / "transformers" / "__init__.py").write_text(HANGING_TRANSFORMERS)
    path = os.pathsep.join([str(tmp_path / "site"), ROOT, os.environ.get("PYTHONPATH", "")])
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp_path / "tmp"), "PIDS": str(tmp_path / "pids"), **extra}


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _pids(tmp_path: pathlib.Path) -> list[int]:
    path = tmp_path / "pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _left_behind(tmp: pathlib.Path) -> list[pathlib.Path]:
    """The demo's and multiprocessing's folders in the temporary directory ``tmp``."""
    return sorted([*tmp.glob("regiontrace-demo-*"), *tmp.glob("pymp-*")])


def _all_gone(pids: list[int]) -> bool:
    """Whether every process of ``pids`` has ended (killed: waits for the kernel to finish, as a hang guard)."""
    for _ in range(300):
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_demo_timeout_stops_a_hanging_import_and_every_process_it_started(tmp_path):
    """The timeout fires while the demo imports a module that never returns (the demo's own process and its fork
    server): the demo is stopped from outside, not by an exception raised inside the import, so the message
    names the timeout and the stage; no process it started is left, and --keep says where the folder is (the
    folder's removal without --keep: the SIGTERM test below; the timeout is far longer than reaching the import)."""
    env = _demo_env(tmp_path)
    command = [sys.executable, "-m", "loader", "demo", "--world-size", "1", "--timeout", "10", "--keep"]
    r = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    lines = r.stderr.strip().splitlines()
    (kept,) = _left_behind(tmp_path / "tmp")  # the demo's folder only: multiprocessing's is removed
    assert r.returncode == 1 and lines == [
        f"regiontrace demo: error: gave up after 10 s (--timeout) while importing transformers (output kept in {kept})"
    ], r.stdout + r.stderr
    pids = _pids(tmp_path)
    assert len(pids) >= 1 and _all_gone(pids), pids  # every importer (the demo's process, its fork server) killed


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_demo_sigterm_stops_every_process_it_started(tmp_path):
    """SIGTERM (as `timeout` sends) while the demo hangs in an import: status 130, every process it started ends,
    and its temporary folder is removed."""
    env = _demo_env(tmp_path)
    command = [sys.executable, "-m", "loader", "demo", "--world-size", "1", "--timeout", "600"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # hang guard: until the demo is inside the import that never returns
            if _pids(tmp_path) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert _pids(tmp_path), "the demo never reached the import"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().startswith("regiontrace demo: error: interrupted while "), err
    assert _all_gone(_pids(tmp_path)) and _left_behind(tmp_path / "tmp") == []


def test_demo_removes_its_temporary_folder_unless_keep(tmp_path):
    """Without --out the demo works in a `regiontrace-demo-*` folder of the temporary directory: removed at the end,
    after a success or a failure, unless --keep, which says where it is, in every outcome (here TMPDIR is the
    test's own); the plan picture's path is printed where it is kept, and said to be temporary otherwise."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))

    def demo(*args: str, env: dict[str, str] = env) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "loader", "demo", "--world-size", "1", *args]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)

    def left() -> list[pathlib.Path]:
        return sorted(tmp_path.glob("regiontrace-demo-*"))

    r = demo("--model", "builtin")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("output: ")]
    assert line.startswith(f"output: {tmp_path}/regiontrace-demo-") and "removed at exit: --keep keeps it" in line
    assert "plan picture: not kept (in the temporary folder, removed at exit: pass --keep or --out DIR)" in r.stdout
    assert left() == []
    r = demo("--timeout", "0.001")  # a failure, too, leaves nothing
    assert r.returncode == 1 and "gave up after 0.001 s (--timeout)" in r.stderr and left() == [], r.stderr
    r = demo("--timeout", "0.001", "--keep")
    (kept,) = left()
    assert r.returncode == 1 and r.stderr.strip().endswith(f"(output kept in {kept})"), r.stderr
    shutil.rmtree(kept)
    r = demo("--model", "builtin", "--keep")  # a success with --keep: the folder and the picture's path
    (kept,) = left()
    assert r.returncode == 0 and f"output: {kept}  (a temporary folder, kept: --keep)" in r.stdout, r.stdout
    assert f"plan picture: {kept / 'plan.svg'}\n" in r.stdout and (kept / "plan.svg").is_file()
    shutil.rmtree(kept)
    # an error inside the demo's work (here: --model transformers with a transformers that cannot be imported)
    r = demo("--model", "transformers", "--keep", env=_demo_env(tmp_path / "broken", BROKEN="1", TMPDIR=str(tmp_path)))
    (kept,) = left()
    assert r.returncode == 2 and "--model transformers needs transformers" in r.stderr, r.stderr
    assert r.stderr.strip().endswith(f"(output kept in {kept})"), r.stderr


def test_every_command_has_help():
    script = textwrap.dedent("""
        import contextlib, io
        import loader.cli, regiontrace.cli
        for main, commands in [(loader.cli.main, ["demo", "trace", "check", "plan"]),
                               (regiontrace.cli.main, ["trace", "check"])]:
            for argv in [[]] + [[c] for c in commands]:
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    try:
                        main(argv + ["--help"])
                    except SystemExit as e:
                        assert e.code == 0, (argv, e.code)
                assert "usage: regiontrace" in out.getvalue(), argv
                print("ok", argv)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok") == 8


def test_console_script_is_the_loaders_command_line(tmp_path):
    """`pip install -e .` installs `regiontrace` = loader.cli:main, with all four commands."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "regiontrace"]
    assert script.value == "loader.cli:main"
    path = pathlib.Path(sysconfig.get_path("scripts")) / "regiontrace"
    if not path.exists():
        pytest.skip(f"no console script at {path}: run `pip install -e .`")
    r = _run([str(path), "--help"], None, 120)
    assert r.returncode == 0, r.stderr
    assert all(f"    {command} " in r.stdout for command in ("demo", "trace", "check", "plan")), r.stdout
    r = _run([str(path), "plan", str(tmp_path / "missing"), "--mesh", "2"], None, 120)
    assert r.returncode == 2 and r.stderr.strip() == f"regiontrace plan: error: no such checkpoint: {tmp_path}/missing"


def test_transformers_extra_brings_what_tp_plan_models_need():
    """`pip install '.[transformers]'` installs accelerate, which transformers needs for models with a
    tensor-parallel plan (`from_pretrained(tp_plan=...)`) and `device_map=`; `bench` keeps it too."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for extra in ("transformers", "bench"):
        names = [re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in extras[extra]]
        assert "accelerate" in names and "transformers" in names, (extra, extras[extra])


def test_algebra_command_line_stands_alone():
    """`python -m regiontrace` runs trace and check without importing the loader; plan and demo point to it."""
    r = algebra("--help")
    assert r.returncode == 0 and "    trace " in r.stdout and "    plan " not in r.stdout, r.stdout
    for command in ("plan", "demo"):  # regiontrace.cli.main's pointer, in this process
        status, stderr = in_process(command, "--help", cwd=pathlib.Path(ROOT), algebra=True)
        assert status == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert f"`python -m loader {command} ...`" in stderr and "console script" in stderr
    script = textwrap.dedent("""
        import contextlib, io, sys
        from regiontrace.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["trace", "torch:flatten", "--input", "input=2x3"]) == 0
        assert not [m for m in sys.modules if m == "loader" or m.startswith("loader.")]
    """)
    r = _run([sys.executable, "-c", script], None, 120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_regiontrace_never_imports_loader():
    """Nothing under regiontrace/ imports the loader, not even inside a function."""
    offenders = []
    for path in sorted(pathlib.Path(ROOT, "regiontrace").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n == "loader" or n.startswith("loader.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


@pytest.fixture(scope="module")
def demo_then_plan(tmp_path_factory):
    """`regiontrace demo` on two ranks (load, check, save back), then `regiontrace plan --save` of its checkpoint
    with a picture."""
    pytest.importorskip("transformers")
    tmp_path = tmp_path_factory.mktemp("demo")
    out = tmp_path / "demo"
    demo = regiontrace("demo", "--world-size", "2", "--out", str(out), timeout=180)
    svg = tmp_path / "plan.svg"
    plan = None
    if demo.returncode == 0:
        plan = regiontrace("plan", str(out / "checkpoint"), "--mesh", "2x2", "--save", "--json", "--svg", str(svg))
    return demo, out, plan, svg


def test_demo_two_ranks_then_plan_its_checkpoint(demo_then_plan):
    r, out, plan_run, svg = demo_then_plan
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: every shard on every rank equals the single-process load" in r.stdout
    assert r.stdout.count("ok (25 tensors)") == 2
    ET.parse(out / "plan.svg")
    # the sharded save: each rank wrote its shard bytes (1.00), as its write plan says; the files are the original's
    assert "the sharded save wrote the original checkpoint back" in r.stdout
    saved = r.stdout[r.stdout.index("saved back with save_hf_checkpoint") :]
    rows = [line.split() for line in saved.splitlines()[3:5]]
    assert [row[0] for row in rows] == ["0", "1"] and all(
        row[6] == "1.00" and row[-2:] == ["=", "plan"] for row in rows
    )
    assert "config.json, generation_config.json, model.safetensors equal to the original's, byte for byte" in r.stdout
    assert (out / "saved" / "model.safetensors").read_bytes() == (out / "checkpoint" / "model.safetensors").read_bytes()

    r = plan_run
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mesh"] == [2, 2] and plan["model_type"] == "qwen3_moe" and not plan["deferred"]
    ranks = plan["ranks"]
    assert [f["rank"] for f in ranks] == [0, 1, 2, 3]
    assert [f["coordinate"] for f in ranks] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    for f in ranks:
        assert f["traced"] == 25 and f["blocks"] > 0
        assert f["shard_bytes"] <= f["bytes_read"] <= 1.02 * f["shard_bytes"], f
        assert f["bytes_read"] < f["whole_tensor_bytes"] <= plan["checkpoint_bytes"], f
    assert plan["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == "[S(0), S(1, strided x2)]"
    # --save: the write plan; every tensor byte written by exactly one rank, each rank its own shards
    writes = plan["save"]
    assert [f["rank"] for f in writes] == [0, 1, 2, 3]
    assert sum(f["bytes_written"] for f in writes) == plan["checkpoint_bytes"]
    for f in writes:
        assert f["bytes_written"] == f["shard_bytes"] <= f["local_bytes"] and f["writes"] > 0, f
        assert f["files"] == ["model.safetensors"]
    assert writes[0]["shard_bytes"] == writes[0]["local_bytes"] > writes[3]["shard_bytes"]  # replicas: rank 0
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg") and len(root) > 100


def test_plan_picture_renders_in_chromium(demo_then_plan, tmp_path):
    """Chromium renders the plan picture headless into a non-blank PNG."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium: the plan picture is not rendered (apt-get install chromium)")
    _, _, plan_run, svg = demo_then_plan
    assert plan_run is not None and plan_run.returncode == 0 and svg.exists(), "the plan wrote no picture"
    png = tmp_path / "plan.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            "--disable-sync",
            f"--screenshot={png}",
            "--window-size=1280,900",
            f"file://{svg}",
        ],
        capture_output=True,
        timeout=60,
    )
    assert png.exists() and png.stat().st_size > 20_000, "chromium rendered nothing"


def test_builtin_demo_model_loads_exactly(tmp_path):
    """The demo's model for machines without transformers: its checkpoint and rules load exactly."""
    import torch

    from loader import load_hf_checkpoint
    from loader.cli.demo_models import build_model, load_rules, write_checkpoint

    expected = write_checkpoint("builtin", str(tmp_path / "ckpt"))
    model = build_model("builtin", str(tmp_path / "ckpt")).to_empty(device="cpu")
    report = load_hf_checkpoint(
        model, str(tmp_path / "ckpt"), rules=load_rules("builtin"), options=LoadOptions(progress=False)
    )
    state = model.state_dict()
    assert set(state) == set(expected) and not report.deferred
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_write_plan_is_the_saves_own_and_prints_a_table(tmp_path):
    """`loader.save.plan_writes` (what `plan --save` prints) for a mesh, in one process: every checkpoint byte
    by one rank, replicas by the lowest holder; a 1-rank plan is what the real one-process save does."""
    from loader import save_hf_checkpoint
    from loader.cli.demo_models import build_model, load_rules, write_checkpoint
    from loader.cli.save_plan import write_plan, write_plan_text
    from loader.placements import plan_placements

    ckpt = str(tmp_path / "ckpt")
    write_checkpoint("builtin", ckpt)
    model = build_model("builtin", ckpt)
    rules = load_rules("builtin")
    placements, _ = plan_placements(model, (2, 2), experts="ep")
    figures = write_plan(model, (2, 2), placements, range(4), rules, ckpt)
    total = sum(f.bytes_written for f in figures)
    assert all(f.bytes_written == f.shard_bytes for f in figures)
    assert figures[3].shard_bytes < figures[3].local_bytes  # it holds replicas rank 0 writes
    text = write_plan_text(figures)
    assert "written/shard" in text and text.count(" 1.00 ") == 4

    real = build_model("builtin", ckpt).to_empty(device="cpu")
    (single,) = write_plan(real, (1,), {}, [0], rules, ckpt)
    report = save_hf_checkpoint(
        real, str(tmp_path / "saved"), rules=rules, options=SaveOptions(progress=False), source_shapes=ckpt
    )
    assert (report.bytes_written, report.writes) == (single.bytes_written, single.writes)
    assert report.bytes_written == total


def test_plan_transfer_prints_bytes_per_rank_pair(tmp_path):
    """`regiontrace plan CKPT --mesh 2x2 --transfer 4`: the checkpoint's model moved from FSDP over ranks 0-3
    into EP x TP on ranks 4-7 (simulated): each destination rank receives its shard bytes (1.000), the pair
    table and the JSON add up; `--colocated` puts the mesh on ranks 0-3; `--transfer-svg` draws the pairs."""
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_models import build

    _, model = build("qwen3_moe", 0, tie_word_embeddings=False)
    model.save_pretrained(str(tmp_path / "ckpt"))
    r = regiontrace("plan", str(tmp_path / "ckpt"), "--mesh", "2x2", "--transfer", "4")
    assert r.returncode == 0, r.stderr
    text = r.stdout[r.stdout.index("transfer plan") :]
    assert "Shard(0) over 4 rank(s) 0–3, into this sharding on ranks 4–7" in text
    assert text.count(" 1.000 ") == 4 and "bytes per rank pair" in text and "plan time" in text
    r = regiontrace("plan", str(tmp_path / "ckpt"), "--mesh", "2x2", "--transfer", "4", "--colocated", "--json")
    assert r.returncode == 0, r.stderr
    moved = json.loads(r.stdout)["transfer"]
    assert moved["world"] == 4 and moved["dst_ranks"] == [0, 1, 2, 3]
    for rank in moved["ranks"]:
        assert rank["received"] == rank["dst_shard_bytes"] > 0 and rank["local"] > 0
        assert rank["sent"] == sum(p["bytes"] for p in moved["pairs"] if p["src"] == rank["rank"])
    status, stderr = in_process("plan", str(tmp_path / "ckpt"), "--mesh", "2x2", "--transfer", "0", cwd=tmp_path)
    assert status == 2 and "--transfer 0" in stderr, stderr
    svg = tmp_path / "transfer.svg"
    r = regiontrace("plan", str(tmp_path / "ckpt"), "--mesh", "4", "--transfer", "2", "--transfer-svg", str(svg))
    assert r.returncode == 0 and f"wrote {svg}" in r.stdout, r.stderr
    cells = [e for e in ET.parse(svg).getroot() if e.tag.endswith("rect") and "→" in "".join(e.itertext())]
    assert len(cells) == 2 * 4  # one per (source rank, destination rank)


def test_the_demo_starts_its_fork_server_under_a_temporary_directory_too_deep_for_a_socket(tmp_path):
    """A deep TMPDIR (a test's own folder under xdist, a user's nested one) leaves no room for the fork server's
    socket path: the demo's multiprocessing folder then goes to /tmp, the fork server starts, and the folder is
    removed at exit."""
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    script = (
        "import multiprocessing, os\n"
        "from loader.cli.demo_process import _multiprocessing_temp_dir\n"
        "d = _multiprocessing_temp_dir()\n"
        "p = multiprocessing.get_context('forkserver').Process(target=os.getpid)\n"
        "p.start(); p.join()\n"
        "print(d, p.exitcode)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(deep))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    folder, code = r.stdout.split()
    assert code == "0" and folder.startswith("/tmp/pymp-") and not os.path.exists(folder)
