"""One vLLM worker of bench/vllm_bench.py: ``python bench/vllm_ranks.py RANK WORLD CTX_JSON``.

The worker sets up vLLM's own tensor-parallel state for ``RANK`` of a ``WORLD``-rank gloo world and, per family,
builds the vLLM model class as an engine's worker builds it (tests/vllm/vllm_models.py), from its own copy of the
checkpoint (``OUT/r{RANK}/{family}``: workers share no page-cache pages). Each load method then loads the model
three times, all workers at once (a barrier before and after each): a first pass (unmeasured: lazy imports), cold
(this worker's files dropped from the page cache first, ``posix_fadvise(POSIX_FADV_DONTNEED)``) and warm. Per
pass it saves the wall, the bytes the method asked for (its logical read: for vLLM's loaders the ``nbytes`` of
every tensor their weights iterator yields, for ours ``LoadReport.bytes_read``) and the bytes this process read
from the block device (``read_bytes`` of ``/proc/self/io``); after the last pass, whether every parameter equals
vLLM's default loader's bit for bit (sha256 digests). Parameters are zeroed before every pass.

Methods: ``default`` (vLLM's ``DefaultModelLoader``: every file, every tensor whole, ``load_format="safetensors"``),
``runai_streamer`` (vLLM's ``RunaiModelStreamerLoader``), ``ours`` (``loader.vllm.load_weights`` from the folder)
and ``ours_http`` (the same from nginx: ``{url}/r0/{family}``, worker 0's copy for every worker, as the ranks of a
remote load agree on one URL and version of each file; a User-Agent per worker and pass, so that nginx's log tells
them apart; before the cold pass every worker drops the served copy from the page cache). After the passes, ours'
planning alone (``loader.engine.plan_engine_load``: the traced ``load_weights``, its checks and the plan, no byte
read) is timed once.

Then the coverage: ours' (the certificates of its last load, ``LoadReport.certificates``) and vLLM's
``sharded_rdt`` bake (its ``ShardedRDTWeightTransferEngine._bake``, run as ``init_transfer_engine`` runs it: on the
model loaded by the default loader and processed by ``process_weights_after_loading``).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "vllm")]

from common import drop_cache, read_bytes, resident_bytes, safetensors_files  # noqa: E402

PASSES = ("first", "cold", "warm")


# ---------------------------------------------------------------------------------------------------
# the load methods (each returns the bytes it asked for)


@contextlib.contextmanager
def counted(model) -> Iterator[list[int]]:
    """``model.load_weights`` counting the bytes of every tensor its weights iterator yields, for the block."""
    original, total = model.load_weights, [0]

    def load_weights(weights):
        def counting():
            for name, tensor in weights:
                total[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        return original(counting())

    model.load_weights = load_weights
    try:
        yield total
    finally:
        del model.load_weights


def _vllm_loader(load_format: str) -> Callable:
    def load(model, where: str) -> dict:
        from vllm.config import set_current_vllm_config
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        config = model.vllm_config
        loader = get_model_loader(LoadConfig(load_format=load_format))
        with counted(model) as total, set_current_vllm_config(config):
            loader.load_weights(model, config.model_config)
        return {"bytes": total[0]}

    return load


def load_ours(model, where: str, agent: str | None = None) -> dict:
    from vllm.config import set_current_vllm_config

    import loader.vllm
    from loader.options import StorageOptions

    storage = StorageOptions(backend={"headers": {"User-Agent": agent}}) if agent else None
    with set_current_vllm_config(model.vllm_config):
        report = loader.vllm.load_weights(model, where, storage=storage)
    exact = sorted(n for n, c in report.certificates.items() if c.writes and c.exact)
    constant = sum(_box_elements(c.constant) for c in report.certificates.values())
    return {
        "bytes": report.bytes_read,
        "requests": report.requests,
        "deferred": list(report.deferred),
        "exact": exact,
        "constant": constant,
    }


def planning_seconds(model, folder: str, world: int) -> float:
    """Wall of ours' planning alone: the model's ``load_weights`` traced key by key, checked and planned."""
    from vllm.config import set_current_vllm_config

    from loader import SafetensorsCheckpoint
    from loader.engine import plan_engine_load

    start = time.perf_counter()
    with set_current_vllm_config(model.vllm_config):
        plan_engine_load(model, SafetensorsCheckpoint.open(folder), world)
    return time.perf_counter() - start


def _box_elements(boxes) -> int:
    return sum(math.prod(b - a for a, b in box) for box in boxes)


LOADERS = {
    "default": _vllm_loader("safetensors"),
    "runai_streamer": _vllm_loader("runai_streamer"),
    "ours": load_ours,
    "ours_http": load_ours,
}


def where(method: str, ctx: dict, rank: int, family: str) -> str:
    """The folder or URL ``method`` loads from."""
    if method == "ours_http":
        return f"{ctx['url']}/r0/{family}"
    return f"{ctx['out']}/r{rank}/{family}"


def agent(rank: int, family: str, phase: str) -> str:
    """The User-Agent of a worker's HTTP requests in a pass (nginx logs it: the wire bytes per worker)."""
    return f"vllm-bench/{phase}/r{rank}/{family}"


def one_pass(model, method: str, target: str, files: list[str], phase: str, tag: str | None = None) -> dict:
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    if phase == "cold":
        drop_cache(files)
    left = resident_bytes(files) if phase == "cold" else None
    dist.barrier()
    before, start = read_bytes(), time.perf_counter()
    out = LOADERS[method](model, target, tag) if tag else LOADERS[method](model, target)
    out.update(wall=time.perf_counter() - start, device=read_bytes() - before, resident_before=left)
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------------
# coverage: ours' certificates and vLLM's sharded_rdt bake


def ours_coverage(runs: dict, params: dict[str, tuple[int, ...]]) -> dict:
    """Ours' coverage, from the certificates of its last load (``LoadReport.certificates``): parameters whose
    certificate is exact (every element written once, or a constant: padding), their elements, the constant ones."""
    if "error" in runs:
        return {"error": runs["error"]}
    last = runs[PASSES[-1]]
    exact = [n for n in last["exact"] if n in params]
    return {
        "covered": len(exact),
        "elements": sum(math.prod(params[n]) for n in exact),
        "constant": last["constant"],
        "not_exact": sorted(set(params) - set(exact)),
        "deferred": last["deferred"],
    }


def bake_coverage(model, folder: str, params: dict[str, tuple[int, ...]]) -> dict:
    """vLLM's ``sharded_rdt`` dry-run bake on this worker: the parameters of the leaf modules it baked (their
    copies' numel reached the module's loadable size), their elements, and its fallbacks (modules it recorded but
    did not bake, which take the plain load)."""
    import types

    import torch
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer import sharded_rdt_engine as engine_module
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_layer_size
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    names, dtypes, shapes = [], [], []
    for file in safetensors_files(folder):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                info = f.get_slice(key)
                names.append(key)
                shapes.append(list(info.get_shape()))
                dtypes.append({"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[info.get_dtype()])
    sinks = []

    class Sink(engine_module.BakeSink):  # the bake's own recorder, kept to read what it recorded
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            sinks.append(self)

    config = model.vllm_config
    with set_current_vllm_config(config):
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        engine = engine_module.ShardedRDTWeightTransferEngine.__new__(engine_module.ShardedRDTWeightTransferEngine)
        engine.model, engine.device = model, torch.device("cpu")
        engine._name_to_plan, engine._name_meta, engine._live_names = {}, {}, set()
        engine_module.BakeSink, original = Sink, engine_module.BakeSink
        try:
            engine._bake(types.SimpleNamespace(names=names, dtype_names=dtypes, shapes=shapes))
        except NotImplementedError as e:
            return {"covered": 0, "elements": 0, "error": f"{type(e).__name__}: {e}"[:300], "fallbacks": []}
        finally:
            engine_module.BakeSink = original
    prefix = {id(m): p for p, m in model.named_modules()}
    baked = {id(c.layer) for plan in engine._name_to_plan.values() for c in plan}
    covered = set()
    for layer_id in baked:
        layer = next(m for m in model.modules() if id(m) == layer_id)
        for attr in layer._parameters:
            name = f"{prefix[layer_id]}.{attr}" if prefix[layer_id] else attr
            if attr not in SKIP_LOAD_TENSORS and name in params:
                covered.add(name)
    fallbacks = []
    for layer, copies in sinks[-1].copies_by_layer.items():
        if id(layer) in baked:
            continue
        copied = sum(int(torch.Size(c.shape).numel()) for c in copies if c is not None)
        fallbacks.append(f"{prefix[id(layer)]} ({copied} of {get_layer_size(layer)} elements copied)")
    unbaked = sorted(set(engine._live_names) - set(engine._name_to_plan))
    return {
        "covered": len(covered),
        "elements": sum(math.prod(params[n]) for n in covered),
        "fallbacks": sorted(fallbacks),
        "unbaked_keys": unbaked,
        "scatters": scatter_counts(engine, prefix, params),
    }


def scatter_counts(engine, prefix: dict[int, str], params: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """What the baked scatters write, element by element (each destination region marked): elements written
    once, never (in baked parameters) and more than once."""
    import torch

    marks = {}
    for plan in engine._name_to_plan.values():
        for c in plan:
            name = f"{prefix[id(c.layer)]}.{c.param_name}" if prefix[id(c.layer)] else c.param_name
            if name not in params:
                continue
            if name not in marks:
                marks[name] = (torch.zeros(params[name], dtype=torch.int8), set())
            mark, seen = marks[name]
            if id(c) not in seen:  # the modules' names share one scatter list
                seen.add(id(c))
                mark.as_strided(c.shape, c.stride, c.offset).add_(1)
    out = {"once": 0, "never": 0, "twice": 0}
    for mark, _ in marks.values():
        out["once"] += int((mark == 1).sum())
        out["never"] += int((mark == 0).sum())
        out["twice"] += int((mark > 1).sum())
    return out


# ---------------------------------------------------------------------------------------------------
# one worker


def family(rank: int, world: int, name: str, ctx: dict) -> dict:
    from vllm_models import build_model, digests

    folder = f"{ctx['out']}/r{rank}/{name}"
    files = safetensors_files(folder)
    served = safetensors_files(f"{ctx['out']}/r0/{name}")  # the copy nginx serves every worker
    model = build_model(folder, world)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    result = {
        "params": len(params),
        "elements": sum(math.prod(s) for s in params.values()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "checkpoint_bytes": sum(Path(f).stat().st_size for f in files),
        "methods": {},
    }
    reference = None
    for method in ctx["methods"]:
        runs = result["methods"][method] = {}
        try:
            read, target = (served if method == "ours_http" else files), where(method, ctx, rank, name)
            for phase in PASSES:
                tag = agent(rank, name, phase) if method == "ours_http" else None
                runs[phase] = one_pass(model, method, target, read, phase, tag)
        except Exception as e:  # the method is reported with its reason; the others still run
            runs["error"] = f"{type(e).__name__}: {e}"[:400]
            runs["traceback"] = traceback.format_exc()[-3000:]
            continue
        found = digests(model)
        reference = reference or (found if method == "default" else None)
        if reference is not None:
            runs["differ"] = sorted(n for n in reference if found.get(n) != reference[n])
        if method == "ours":
            runs["planning"] = planning_seconds(model, folder, world)
    result["ours"] = ours_coverage(result["methods"].get("ours", {"error": "ours not run"}), params)
    try:
        if "default" in ctx["methods"]:
            one_pass(model, "default", folder, files, "warm")  # loaded as vLLM loads it before the bake
        result["sharded_rdt"] = bake_coverage(model, folder, params)
    except Exception as e:
        result["sharded_rdt"] = {"error": f"{type(e).__name__}: {e}"[:400], "traceback": traceback.format_exc()[-3000:]}
    return result


def main(rank: int, world: int, ctx: dict) -> None:
    import torch
    from vllm_models import tp_world

    torch.set_num_threads(1)
    out, results = Path(ctx["out"]) / "results" / f"tp{world}-rank{rank}.json", {}
    with tp_world(rank, world, ctx["init"]):
        for name in ctx["families"]:
            try:
                results[name] = family(rank, world, name, ctx)
            except Exception as e:
                results[name] = {"error": f"{type(e).__name__}: {e}"[:400], "traceback": traceback.format_exc()}
            out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
