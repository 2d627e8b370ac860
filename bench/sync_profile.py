"""Where the trainer's side of ``EngineSync.push`` spends its time: cProfile of replayed full pushes.

    /work/vllm-env/bin/python bench/sync_profile.py MODEL_FOLDER [PUSHES]

Run it with vLLM's environment and bench/sync_bench.py's environment variables (``VLLM_CPU_KVCACHE_SPACE=1
VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_WORKER_MULTIPROC_METHOD=spawn``, ``PYTHONPATH`` holding the repository,
bench/ and tests/vllm/), on a folder bench/sync_bench.py wrote (``/tmp/sync-bench/qwen3_moe``). One engine start
(tensor parallel 2), a float32 trainer from the folder, a first push, then ``PUSHES`` profiled pushes, each after a
step; prints each push's wall and its workers' rebuilds, then the profile's top functions by cumulative time.
Delta pushes after real AdamW steps: ``bench/sync_delta.py FOLDER --profile``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

from sync_engine import step
from vllm_engine import SETTINGS


def main(folder: str, pushes: int) -> None:
    import torch
    import transformers
    from vllm import LLM

    from loader.vllm import EngineSync

    torch.set_num_threads(1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    llm = LLM(model=folder, tensor_parallel_size=2, worker_extension_cls="loader.vllm.SyncWorker", **SETTINGS)
    sync = EngineSync(llm, trainer)
    step(trainer, 1)
    sync.push()
    profile = cProfile.Profile()
    for n in range(pushes):
        step(trainer, 2 + n)
        profile.enable()
        report = sync.push()
        profile.disable()
        print(f"push {report.seconds:.3f} s, workers' rebuilds {[round(s, 3) for s in report.worker_seconds]} s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue())
    sync.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
