"""Benchmark: load a ~400 MB Qwen3-MoE-shaped bf16 checkpoint (3 shards, per-expert HF layout).

    python bench/load_bench.py [--out DIR] [--repeat 3]

Methods, each in its own subprocess (so that peak-memory figures do not mix):

* ``ours``: ``loader.load_hf_checkpoint`` into an already-built bf16 ``Qwen3MoeForCausalLM`` (building the
  model is not timed; the load merges the per-expert tensors into the fused expert tensors).
* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16)``.
* ``copy``: the copy limit, ``safetensors.torch.load_file`` of every shard + ``clone()`` of every tensor.

Each method runs ``--repeat`` times after one untimed pass that warms the page cache; the best time is
reported. Peak memory beyond the model's own tensors: before each timed run the worker resets its peak RSS
(``/proc/self/clear_refs`` = 5, Linux) and notes its RSS; after the run ``VmHWM`` (peak RSS since the reset)
minus that RSS is the memory the load needed on top of what the process already held, and for
``from_pretrained``/``copy`` (which allocate the model's tensors during the run) the bytes of the model's
tensors are subtracted. RSS counts file pages mapped by ``safetensors``' mmap too (``copy``,
``from_pretrained``); ``ours`` reads with ``pread`` into anonymous memory only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

HIDDEN, LAYERS, EXPERTS, MOE_INTERMEDIATE = 1024, 4, 32, 512
CONFIG = dict(
    hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_experts=EXPERTS, moe_intermediate_size=MOE_INTERMEDIATE,
    num_experts_per_tok=4, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
    vocab_size=8192, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
)
MIB = 1 << 20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS; return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux / not permitted: the peak then includes earlier phases
        pass
    return _status()["VmRSS"]


def _peak() -> int:
    return _status()["VmHWM"]


def generate(out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        return
    config = AutoConfig.for_model("qwen3_moe", **CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # save_pretrained writes the original per-expert layout; 180 MB shards give 3 files (~108/174/179 MB)
    model.save_pretrained(out, max_shard_size="180MB")
    del model


def _warm(directory: str) -> int:
    size = 0
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb", buffering=0) as f:
                while chunk := f.read(64 * MIB):
                    size += len(chunk)
    return size


def worker(method: str, directory: str, repeat: int) -> dict:
    """Run ``method``: one untimed pass that measures memory (the first allocation of the model's tensors in
    this process, so freed-but-retained heap cannot hide it), then ``repeat`` timed passes."""
    import torch
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 - imports out of the timings
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    files_bytes = _warm(directory)
    config = AutoConfig.from_pretrained(directory)
    result: dict = {"method": method, "files_bytes": files_bytes, "threads": torch.get_num_threads()}

    if method == "ours":
        from loader import load_hf_checkpoint

        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # built (and touched) once
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())

        def run():
            return load_hf_checkpoint(model, directory, progress=False)

        own = 0  # the model's tensors exist before the load: the RSS baseline already holds them
    elif method == "from_pretrained":
        model_bytes = 0

        def run():
            return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)

        own = None  # the run allocates the model's tensors: subtract them
    elif method == "copy":
        from safetensors.torch import load_file

        files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))

        def run():
            out = {}
            for f in files:
                out.update({k: v.clone() for k, v in load_file(f).items()})
            return out

        own = None
    else:
        raise ValueError(method)

    gc.collect()
    rss = _reset_peak()
    out = run()
    peak = _peak() - rss
    if method == "from_pretrained":
        model_bytes = sum(t.numel() * t.element_size() for t in out.state_dict().values())
    elif method == "copy":
        model_bytes = sum(t.numel() * t.element_size() for t in out.values())
    if own is None:
        peak -= model_bytes
    if method == "ours":
        result.update(bytes_read=out.bytes_read, traced=len(out.traced), deferred=len(out.deferred),
                      blocks=out.blocks)
    del out
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        del out
    result.update(times=times, best=min(times), peak_extra=peak, model_bytes=model_bytes)
    if method == "ours":
        result.update(plan=min(_timed(lambda: _plan_only(model, directory)) for _ in range(repeat)),
                      read_floor=min(_read_floor(directory) for _ in range(repeat)))
    return result


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _plan_only(model, directory: str) -> None:
    """Open the headers and plan (rules, traces, blocks): everything ``load_hf_checkpoint`` does but read."""
    from loader import HFLoadPlanner, SafetensorsCheckpoint

    HFLoadPlanner(model).build_plan(SafetensorsCheckpoint.open(directory))


def _read_floor(directory: str) -> float:
    """``pread`` every shard whole into one already-touched buffer: what any copying reader must pay."""
    import torch

    files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    sizes = [os.path.getsize(f) for f in files]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    view = memoryview(buf.numpy())
    t0 = time.perf_counter()
    for f, size in zip(files, sizes):
        fd = os.open(f, os.O_RDONLY)
        try:
            pos = 0
            while pos < size:
                pos += os.preadv(fd, [view[pos:size]], pos)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="checkpoint folder (generated there if absent; default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", default="copy,ours,from_pretrained")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.out, args.repeat)))
        return 0

    directory = args.out or tempfile.mkdtemp(prefix="load_bench_")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    generate(directory)
    shards = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in shards)
    print(f"checkpoint: {directory} ({len(shards)} shards, {size / MIB:.1f} MiB, ready in "
          f"{time.perf_counter() - t0:.1f} s)")
    print(f"  qwen3_moe hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts, moe_intermediate {MOE_INTERMEDIATE}, "
          f"bf16; {os.cpu_count()} CPUs; best of {args.repeat} warm-page-cache runs per method")
    results = {}
    for method in args.methods.split(","):
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", method, "--out", directory,
             "--repeat", str(args.repeat)],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            raise SystemExit(f"{method} failed")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[method] = r
        times = ", ".join(f"{t:.3f}" for t in r["times"])
        print(f"{method:>16}: best {r['best']:.3f} s of [{times}]  "
              f"{r['model_bytes'] / MIB / r['best']:.0f} MiB/s  peak beyond model {r['peak_extra'] / MIB:.1f} MiB")
        if method == "ours":
            print(f"{'':>16}  read {r['bytes_read'] / MIB:.1f} MiB, {r['traced']} tensors traced, "
                  f"{r['deferred']} deferred, {r['blocks']} blocks; planning alone {r['plan']:.3f} s")
            print(f"{'read floor':>16}: {r['read_floor']:.3f} s  (pread of every shard whole into a touched "
                  "buffer, no planning, no model)")
    if "ours" in results and "copy" in results:
        ratio = results["ours"]["best"] / results["copy"]["best"]
        print(f"ours / copy limit: {ratio:.2f}x (target <= 3)")
    if "ours" in results and "from_pretrained" in results:
        ratio = results["from_pretrained"]["best"] / results["ours"]["best"]
        print(f"from_pretrained / ours: {ratio:.1f}x (target >= 10)")
        floor = results["from_pretrained"]["best"] / results["ours"]["read_floor"]
        print(f"from_pretrained / read floor: {floor:.1f}x (the most any copying loader could reach here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
