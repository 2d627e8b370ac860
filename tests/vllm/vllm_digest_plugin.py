"""A test-only vLLM general plugin: each worker writes its parameters' digests before
``process_weights_after_loading`` (which, on CPU, packs linear weights into oneDNN handles and empties them).

The engine tests make it discoverable by writing a ``.dist-info`` with its entry point onto ``PYTHONPATH``;
``VLLM_TEST_DIGESTS`` names the folder each worker writes ``rank{tp_rank}.json`` into.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: the entry point the tests put on PYTHONPATH (a dist-info's entry_points.txt)
ENTRY_POINTS = "[vllm.general_plugins]\nregiontrace_test_digests = vllm_digest_plugin:register\n"


def register() -> None:
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "digests_first", False):  # plugins load more than once per process
        return

    def process_weights_after_loading(model, model_config, target_device):
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm_models import digests

        out = Path(os.environ["VLLM_TEST_DIGESTS"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{get_tensor_model_parallel_rank()}.json").write_text(json.dumps(digests(model)))
        return original(model, model_config, target_device)

    process_weights_after_loading.digests_first = True
    base_loader.process_weights_after_loading = process_weights_after_loading


def install(folder: Path) -> Path:
    """``folder`` holding the plugin's dist-info (put ``folder`` and this file's folder on ``PYTHONPATH``)."""
    info = folder / "regiontrace_test_digests-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: regiontrace-test-digests\nVersion: 0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return folder
