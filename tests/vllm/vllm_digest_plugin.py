"""A test-only vLLM general plugin: each worker writes its parameters' digests before
``process_weights_after_loading`` (which, on CPU, packs linear weights into oneDNN handles and empties them).

The engine tests make it discoverable by writing a ``.dist-info`` with its entry point onto ``PYTHONPATH``;
``VLLM_TEST_DIGESTS`` names the folder each worker writes ``rank{tp_rank}-load{n}.json`` into, ``n`` counting the
models that worker has loaded (0 at the engine start, 1 for a model :mod:`vllm_swap` builds in the running engine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: file name of a worker's digests
FILE = "rank{rank}-load{load}.json"
#: the entry point the tests put on PYTHONPATH (a dist-info's entry_points.txt)
ENTRY_POINTS = "[vllm.general_plugins]\nregiontrace_test_digests = vllm_digest_plugin:register\n"


def register() -> None:
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "digests_first", False):  # plugins load more than once per process
        return
    loads = iter(range(1 << 30))

    def process_weights_after_loading(model, model_config, target_device):
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm_models import digests

        out = Path(os.environ["VLLM_TEST_DIGESTS"])
        out.mkdir(parents=True, exist_ok=True)
        name = FILE.format(rank=get_tensor_model_parallel_rank(), load=next(loads))
        (out / name).write_text(json.dumps(digests(model)))
        return original(model, model_config, target_device)

    process_weights_after_loading.digests_first = True
    base_loader.process_weights_after_loading = process_weights_after_loading


def read(folder: Path) -> dict[int, dict[int, dict[str, str]]]:
    """The digests the workers wrote into ``folder``: load -> rank -> parameter name -> digest."""
    found: dict[int, dict[int, dict[str, str]]] = {}
    for path in sorted(folder.glob("rank*-load*.json")):
        rank, load = (int(part) for part in path.stem[len("rank") :].split("-load"))
        found.setdefault(load, {})[rank] = json.loads(path.read_text())
    return found


def install(folder: Path) -> Path:
    """``folder`` holding the plugin's dist-info (put ``folder`` and this file's folder on ``PYTHONPATH``)."""
    info = folder / "regiontrace_test_digests-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: regiontrace-test-digests\nVersion: 0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return folder
