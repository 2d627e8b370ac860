"""tests/vllm: the vLLM integration, run in an environment with vLLM (``.ci/run`` builds one).

vLLM pins its own transformers, so these tests have their own environment; where ``import vllm`` fails (the main
suite's environment) every test here is skipped, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
try:  # (not a bare `import vllm`: with tests/ on sys.path that finds this folder as a namespace package)
    from vllm import LLM  # noqa: F401

    MISSING = None
except Exception as e:  # ImportError, or a vLLM that cannot start here
    MISSING = f"vLLM is not importable ({type(e).__name__}: {e}); tests/vllm run in the vLLM environment (.ci/run)"


def pytest_collection_modifyitems(config, items):
    if MISSING:
        skip = pytest.mark.skip(reason=MISSING)
        for item in items:
            if HERE in Path(str(item.fspath)).resolve().parents:
                item.add_marker(skip)
