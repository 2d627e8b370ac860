"""Benchmark: 4 ranks loading their TP / EP shards from an HTTP server and an S3 server, each connection
held to a bandwidth limit; bytes on the wire per rank against its shard bytes, requests, walls, against peers.

    python bench/remote_bench.py [--out DIR] [--layers N] [--rate MB_PER_S] [--rounds N] [--layouts tp,ep]
                                 [--servers http,s3] [--methods ours,ours_bounded,ours_overread,download,runai]
                                 [--bound F] [--overread F] [--max-requests N] [--log DIR] [--markdown]

A Qwen3-MoE-shaped checkpoint (bench/common.py's shape with ``--layers`` layers, default 2: about 235 MiB bf16,
``save_pretrained``'s layout: per-expert tensors, 4 shards + index) is written once to ``DIR/hf`` and served on
127.0.0.1 by

* ``http``: Debian's nginx (tests/servers.py) with ``limit_rate`` (bytes per second per connection), single and
  multi-range (``multipart/byteranges``) answers;
* ``s3``: moto's S3 server behind ``servers.throttle`` (an nginx proxy with the same per-connection limit).

Each rank reads its own copy of the folder (``/rK/`` over HTTP: links to the same files; ``s3://BUCKET/rK``: a
copy per rank), so that the server's log tells the ranks apart. Four ranks (spawned, gloo, one torch thread each)
build the model on the meta device with tp_bench's placements (``tp``: attention rows/columns, experts'
``gate_up_proj`` ``Shard(1)`` and ``down_proj`` ``Shard(2)``, vocab-parallel embedding and head; ``ep``: whole
experts, ``Shard(0)``), then per round, layout and server, run the methods one after another, all ranks at once
(the order of the methods turns by one each round):

* ``ours``: ``load_hf_checkpoint(model, URL)`` (each rank fetches its byte ranges: loader/storage/remote);
* ``ours_bounded``: the same with ``RequestCosts(max_overread=BOUND)`` (``--bound``, default 0.01): the
  over-read bounded tighter than the default 0.05 (for egress billed per byte);
* ``ours_overread``: the same with ``RequestCosts(max_overread=OVERREAD)`` (``--overread``, default 3.0): the
  cost model may read gaps through up to that fraction of the bytes wanted — a column shard's in a few requests;
* ``download``: every file to a local folder, then ``load_hf_checkpoint`` from there (bench/remote_peers.py);
* ``runai``: runai-model-streamer streams every tensor whole from ``s3://``, each rank cuts its shard (vLLM-style;
  S3 only).

Reported per rank: bytes on the wire (the server's log: body bytes sent, multipart part headers included; the
bench's marker requests split the log between measurements) ÷ the rank's shard bytes (its local tensors,
replicated ones included), the method's own count where it has one (``LoadReport.bytes_read``) ÷ shard bytes,
requests (log), and the wall of the slowest rank. After each load every rank checks its shards bit for bit
against the first method's. Target for ours: wire ÷ shard ≤ 1.05 on every rank. With 2 CPUs for 4 ranks
and both servers, walls are CPU-bound and contended; ``--markdown`` prints the tables docs/benchmarks.md holds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from datetime import timedelta

from loader.options import LoadOptions, RemoteOptions, RequestCosts, StorageOptions

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
WORLD = 4
MIB = 1 << 20
BUCKET = "bench"
METHODS = ("ours", "ours_bounded", "ours_own_runs", "ours_overread", "download", "runai")
#: the user agent a rank's requests carry (HTTP: a header in StorageOptions.backend; S3: botocore's app id, from the
#: environment), so that ranks loading the same URL are told apart in the server's log
AGENT = re.compile(r"regiontrace-bench-rank(\d+)")
SERVERS = ("http", "s3")
LAYOUTS = ("tp", "ep")


def ours_available() -> str | None:
    """Why ``ours`` cannot load from URLs in this checkout, or ``None`` when it can."""
    try:
        from loader.storage.remote import remote_store  # noqa: F401
    except ImportError as e:
        return f"loader.storage.remote is not importable here ({e})"
    return None


def generate(out: str, layers: int) -> str:
    """The checkpoint in ``out/hf`` (kept when already there); returns the folder."""
    folder = os.path.join(out, "hf")
    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        return folder
    import torch
    from common import QWEN3_MOE
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **{**QWEN3_MOE, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=f"{total // 4 // 1_000_000 + 2}MB")
    return folder


# ---------------------------------------------------------------------------------------------------
# one rank


def load_ours(model, url: str, options: dict | None = None, exchange: bool | None = None) -> dict:
    from loader import load_hf_checkpoint

    backend = {}
    if url.startswith("http"):  # this rank's requests told apart in the log (S3: AWS_SDK_UA_APP_ID)
        backend["headers"] = {"User-Agent": f"regiontrace-bench-rank{dist_rank()}"}
    storage = StorageOptions(backend=backend, remote=RemoteOptions(costs=RequestCosts(**(options or {}))))
    report = load_hf_checkpoint(
        model, url, options=LoadOptions(progress=False, exchange_reads=exchange), storage=storage
    )
    return {"bytes_read": report.bytes_read, "requests": report.requests, "exchanged": report.bytes_exchanged}


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def ours_options(method: str, spec: dict) -> dict:
    """The request costs (:class:`~loader.options.RequestCosts` fields) of an ``ours`` method: none for ``ours``,
    ``max_overread`` for ``ours_bounded`` and ``ours_overread``."""
    bound = {"ours_bounded": spec.get("bound"), "ours_overread": spec.get("overread")}.get(method)
    return {} if bound is None else {"max_overread": bound}


def ours_exchange(method: str) -> bool | None:
    """``exchange_reads`` of an ``ours`` method: the default (on for URLs) for ``ours`` and ``ours_bounded``, off for
    the others."""
    return None if method in ("ours", "ours_bounded") else False


def planned(model, folder: str, multi_range: bool, options: dict) -> dict:
    """The requests and bytes ours would fetch for this rank's shards (the plan's byte runs through the remote
    store's request planner with ``options``; headers, index and config left out), without fetching."""
    from loader import HFLoadPlanner, SafetensorsCheckpoint
    from loader.storage.remote.requests_plan import plan_requests

    checkpoint = SafetensorsCheckpoint.open(folder)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for r in HFLoadPlanner(model).build_plan(checkpoint).reads:
        info = checkpoint[r.block.source]
        for a, n in r.block.source_runs():
            start = info.data_start + a * info.itemsize
            by_file.setdefault(info.file, []).append((start, start + n * info.itemsize))
    o = RequestCosts(**options)
    requests = [
        q
        for ranges in by_file.values()
        for q in plan_requests(
            ranges,
            gap_bytes=o.gap_bytes,
            max_request_bytes=o.max_request_bytes,
            multi_range=multi_range,
            max_ranges=o.max_ranges,
            max_overread=o.max_overread,
        )
    ]
    return {"requests": len(requests), "bytes": sum(q.nbytes for q in requests)}


def method_for(method: str, server: str, spec: dict):
    """The loader of ``method`` from ``server``, or the reason it cannot run there (a string)."""
    import remote_peers

    if method.startswith("ours"):
        return ours_available() or functools.partial(
            load_ours, options=ours_options(method, spec), exchange=ours_exchange(method)
        )
    if server not in remote_peers.PEERS[method]:
        return remote_peers.WHY_NOT[(method, server)]
    return remote_peers.PEERS[method][server]


def measure(fn, model, url: str) -> dict:
    import torch
    import torch.distributed as dist
    from tp_bench import _poison

    _poison(model)
    dist.barrier()
    t = time.perf_counter()
    try:
        out = fn(model, url)
    except Exception as e:  # a method that fails here: its reason goes in the table
        out = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    out["seconds"] = time.perf_counter() - t
    failed = torch.tensor([int("error" in out)])
    dist.all_reduce(failed)
    if failed.item():
        out.setdefault("error", "failed on another rank")
    dist.barrier()  # every rank's requests are answered (and logged) before the next marker
    return out


def rank_main(rank: int, world: int, spec: dict) -> None:
    sys.path[:0] = [HERE, TESTS]
    import remote_peers
    import servers
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from tp_bench import build_sharded_model, locals_of, shard_bytes
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    if "s3" in spec["urls"]:
        os.environ.update(servers.s3_env(spec["urls"]["s3"]))  # boto3, ours and runai read the endpoint from here
        os.environ["AWS_SDK_UA_APP_ID"] = f"regiontrace-bench-rank{rank}"  # botocore's user agent: app/...
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=900)
    )
    mesh = init_device_mesh("cpu", (world,))
    folders = {"http": f"{spec['urls'].get('http')}/r{rank}", "s3": f"s3://{BUCKET}/r{rank}"}
    shared = {"http": f"{spec['urls'].get('http')}/r0", "s3": f"s3://{BUCKET}/r0"}  # ours: one URL, as torchrun
    result: dict = {"rank": rank, "shard_bytes": {}, "runs": []}
    for layout in spec["layouts"]:
        model = build_sharded_model(spec["folder"], mesh, False, layout)
        result["shard_bytes"][layout] = shard_bytes(model)
        if spec["warmup"] and not isinstance(method_for("ours", spec["servers"][0], spec), str):
            if rank == 0:
                remote_peers.mark(spec["urls"][spec["servers"][0]], f"warmup/{layout}")  # not in the tables
            measure(load_ours, model, shared[spec["servers"][0]])  # imports, transformers' mapping: unmeasured
        reference, plans = None, {}
        for n in range(spec["rounds"]):
            turn = n % len(spec["methods"])
            for server in spec["servers"]:
                for method in spec["methods"][turn:] + spec["methods"][:turn]:
                    tag = f"{n}/{layout}/{server}/{method}"
                    fn = method_for(method, server, spec)
                    if isinstance(fn, str):
                        result["runs"].append({"tag": tag, "error": fn})
                        continue
                    if method.startswith("ours") and ours_exchange(method) is False:  # a request per run
                        if (server, method) not in plans:  # one decision for every rank
                            plan = planned(model, spec["folder"], server == "http", ours_options(method, spec))
                            most = torch.tensor([plan["requests"]])
                            dist.all_reduce(most, op=dist.ReduceOp.MAX)
                            plans[server, method] = {**plan, "most": int(most.item())}
                        plan = plans[server, method]
                        if plan["most"] > spec["max_requests"]:
                            result["runs"].append({"tag": tag, "skipped": plan})
                            continue
                    if rank == 0:
                        remote_peers.mark(spec["urls"][server], tag)
                    profile = spec.get("profile") == method and rank == 0 and n == 0
                    if profile:
                        import cProfile

                        prof = cProfile.Profile()
                        prof.enable()
                    url = (shared if method.startswith("ours") else folders)[server]
                    run = {"tag": tag, **measure(fn, model, url)}
                    if profile:
                        import pstats

                        prof.disable()
                        print(f"--- rank 0, {tag}", file=sys.stderr)
                        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
                        if os.environ.get("REMOTE_BENCH_PROFILE"):  # the whole profile, for pstats
                            prof.dump_stats(os.environ["REMOTE_BENCH_PROFILE"])
                    if "error" not in run:
                        values = {k: v.clone() for k, v in locals_of(model).items()}
                        if reference is None:
                            reference = values
                            run["equal"] = not any(bool(torch.isnan(v.float()).any()) for v in values.values())
                        else:
                            run["equal"] = all(torch.equal(values[k], reference[k]) for k in reference)
                    result["runs"].append(run)
        del model
    with open(os.path.join(spec["results"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# the servers


def serve(stack, folder: str, kinds: list[str], rate: int) -> dict:
    """Start the servers of ``kinds`` on ``folder`` (a copy per rank); ``{kind: ServerUrl}`` (S3: the proxy)."""
    import servers

    urls = {}
    if "http" in kinds:
        root = tempfile.mkdtemp(prefix="remote_bench_www_")
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        for r in range(WORLD):
            os.symlink(os.path.abspath(folder), os.path.join(root, f"r{r}"))
        urls["http"] = stack.enter_context(servers.nginx(root, limit_rate=rate))
    if "s3" in kinds:
        endpoint = stack.enter_context(servers.s3_server())
        servers.put_folder(endpoint, BUCKET, "r0", folder)
        client = servers.s3_client(endpoint)
        for name in os.listdir(folder):
            for r in range(1, WORLD):
                source = {"Bucket": BUCKET, "Key": f"r0/{name}"}
                client.copy_object(Bucket=BUCKET, Key=f"r{r}/{name}", CopySource=source)
        urls["s3"] = stack.enter_context(servers.throttle(endpoint, rate))
    return urls


def wire(urls: dict) -> dict:
    """``{server: {tag: {rank: {"bytes", "requests"}}}}`` from the servers' logs."""
    import remote_peers

    patterns = {"http": re.compile(r"^/r(\d+)/"), "s3": re.compile(rf"^/{BUCKET}/r(\d+)/")}
    out = {}
    for server, url in urls.items():

        def rank_of(request, pattern=patterns[server]) -> int | None:
            m = AGENT.search(request.agent) or pattern.match(request.path)
            return int(m.group(1)) if m else None

        out[server] = remote_peers.split_log(url.requests(), rank_of)
    return out


# ---------------------------------------------------------------------------------------------------
# tables


def per_rank(values: list[float | None], fmt: str = "{:.3f}") -> str:
    """``a / b / c / d`` over ranks (``–`` where a rank has none)."""
    return " / ".join("–" if v is None else fmt.format(v) for v in values)


def worst(values: list[list[float | None]]) -> list[float | None]:
    """Per rank, the largest value over rounds."""
    return [None if any(v is None for v in col) else max(col) for col in zip(*values)]


def table_rows(ranks: list[dict], logs: dict, layout: str, spec: dict) -> list[list[str]]:
    import mdtable

    shard = [res["shard_bytes"][layout] for res in ranks]
    rows = []
    for server in spec["servers"]:
        for method in spec["methods"]:
            tags = [f"{n}/{layout}/{server}/{method}" for n in range(spec["rounds"])]
            runs = [[next(r for r in res["runs"] if r["tag"] == tag) for res in ranks] for tag in tags]
            if any("skipped" in r for rs in runs for r in rs):
                plans = [r["skipped"] for r in runs[0]]
                rows.append(
                    [
                        server,
                        method,
                        per_rank([p["bytes"] / shard[r] for r, p in enumerate(plans)]) + " (planned)",
                        "–",
                        "–",
                        per_rank([p["requests"] for p in plans], "{:.0f}") + " (planned)",
                        f"not run: over --max-requests {spec['max_requests']} per rank",
                        "–",
                    ]
                )
                continue
            errors = [r["error"] for rs in runs for r in rs if r.get("error")]
            if errors:
                own = [e for e in errors if e != "failed on another rank"] or errors
                rows.append([server, method, f"could not run: {own[0]}", "–", "–", "–", "–", "–"])
                continue
            cells = [logs.get(server, {}).get(tag, {}) for tag in tags]
            on_wire = worst([[c.get(r, {}).get("bytes", 0) / shard[r] for r in range(WORLD)] for c in cells])
            own = worst(
                [
                    [None if rs[r].get("bytes_read") is None else rs[r]["bytes_read"] / shard[r] for r in range(WORLD)]
                    for rs in runs
                ]
            )
            got = [
                [None if rs[r].get("exchanged") is None else rs[r]["exchanged"] / shard[r] for r in range(WORLD)]
                for rs in runs
            ]
            exchanged = worst(got)
            requests = worst([[c.get(r, {}).get("requests", 0) for r in range(WORLD)] for c in cells])
            walls = [max(r["seconds"] for r in rs) for rs in runs]
            equal = all(r.get("equal", False) for rs in runs for r in rs)
            check = "first method" if method == spec["methods"][0] else f"= {spec['methods'][0]}"
            rows.append(
                [
                    server,
                    method,
                    per_rank(on_wire),
                    per_rank(own),
                    per_rank(exchanged),
                    per_rank(requests, "{:.0f}"),
                    mdtable.spread(walls),
                    check if equal else "**differ**",
                ]
            )
    return rows


HEADERS = [
    "server",
    "method",
    "wire ÷ shard, per rank (server log)",
    "bytes_read ÷ shard, per rank (method's own count)",
    "received from peers ÷ shard (ours: bytes_exchanged)",
    "requests per rank (server log)",
    "wall (slowest rank)",
    "shards",
]


def print_tables(ranks: list[dict], logs: dict, spec: dict, load: str, markdown: bool) -> None:
    import mdtable

    if markdown:
        print(mdtable.run_line(load, ("torch", "transformers", "runai-model-streamer", "moto", "boto3", "requests")))
        print()
    for layout in spec["layouts"]:
        shard = " / ".join(f"{res['shard_bytes'][layout] / MIB:.2f}" for res in ranks)
        print(
            f"**{layout.upper()}** ({spec['describe'][layout]}); checkpoint {spec['size'] / MIB:.1f} MiB; shard bytes "
            f"per rank {shard} MiB; {spec['rate'] / 1e6:.0f} MB/s per connection; {spec['rounds']} round(s), "
            "ratios: the worst round per rank, walls: "
            + ("best–worst [median] of the slowest rank per round." if spec["rounds"] > 1 else "the slowest rank.")
        )
        print()
        print(mdtable.table(HEADERS, table_rows(ranks, logs, layout, spec)))
        print()
    if not markdown:
        print(f"load average (1 min) during the run: {load}")


DESCRIBE = {
    "tp": "experts TP: gate_up_proj Shard(1), down_proj Shard(2); attention rows/columns; vocab-parallel",
    "ep": "experts EP: whole experts, Shard(0); attention rows/columns; vocab-parallel",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="checkpoint folder (generated there if absent; default: a temp folder)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2: about 235 MiB)")
    parser.add_argument("--rate", type=float, default=50.0, help="MB/s per connection (default 50)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every method (default 2)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--max-requests",
        type=int,
        default=5000,
        help="ours is not run where it plans more requests per rank (its plan is shown instead); default 5000",
    )
    parser.add_argument(
        "--bound",
        type=float,
        default=0.01,
        help="ours_bounded's max_overread storage option (default 0.01: the over-read bounded tighter than 0.05)",
    )
    parser.add_argument(
        "--overread",
        type=float,
        default=3.0,
        help="ours_overread's max_overread storage option (default 3.0: a quarter-column shard's gaps read through)",
    )
    parser.add_argument("--profile", metavar="METHOD", help="cProfile rank 0's first load with METHOD (to stderr)")
    parser.add_argument("--log", metavar="DIR", help="write each server's request log there (JSON)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured first load of ours")
    parser.add_argument("--markdown", action="store_true", help="print the tables docs/benchmarks.md holds")
    args = parser.parse_args(argv)
    for value, allowed, what in (
        (args.layouts, LAYOUTS, "layout"),
        (args.servers, SERVERS, "server"),
        (args.methods, METHODS, "method"),
    ):
        for v in value.split(","):
            if v not in allowed:
                parser.error(f"unknown {what} {v!r} (choose from {', '.join(allowed)})")
    sys.path[:0] = [HERE, TESTS]
    import contextlib

    import mdtable
    import torch.multiprocessing as mp

    say = (lambda *a: None) if args.markdown else functools.partial(print, flush=True)
    watch = mdtable.LoadWatch()
    out = args.out or tempfile.mkdtemp(prefix="remote_bench_")
    t0 = time.perf_counter()
    folder = generate(out, args.layers)
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    say(f"checkpoint: {folder} ({size / MIB:.1f} MiB, ready in {time.perf_counter() - t0:.1f} s)")
    if ours_available():
        say(f"NOTE: ours cannot run: {ours_available()}")
    rate = int(args.rate * 1e6)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        urls = serve(stack, folder, args.servers.split(","), rate)
        say(f"servers: {dict(urls)} (ready in {time.perf_counter() - t0:.1f} s)")
        spec = {
            "folder": folder,
            "urls": {k: str(v) for k, v in urls.items()},
            "servers": args.servers.split(","),
            "methods": args.methods.split(","),
            "layouts": args.layouts.split(","),
            "rounds": args.rounds,
            "max_requests": args.max_requests,
            "overread": args.overread,
            "bound": args.bound,
            "profile": args.profile,
            "warmup": not args.no_warmup,
            "store": os.path.join(tmp, "store"),
            "results": tmp,
        }
        t0 = time.perf_counter()
        mp.start_processes(rank_main, args=(WORLD, spec), nprocs=WORLD, join=True, start_method="spawn")
        say(f"ranks ran in {time.perf_counter() - t0:.1f} s")
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        logs = wire(urls)
        if args.log:
            os.makedirs(args.log, exist_ok=True)
            for server, url in urls.items():
                with open(os.path.join(args.log, f"{server}.json"), "w") as f:
                    json.dump([r._asdict() for r in url.requests()], f)
    spec.update(size=size, rate=rate, describe=DESCRIBE)
    print_tables(ranks, logs, spec, watch.stop(), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
