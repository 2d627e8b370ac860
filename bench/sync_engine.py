"""One engine start of bench/sync_bench.py: ``python sync_engine.py CTX_JSON`` writes a JSON object to ``CTX.out``.

The context names the model folder (``model``), the replayed ``pushes`` per way and the checkpoint-engine way's
``bucket`` bytes. The engine (tensor parallel 2, ``worker_extension_cls="sync_peers.PeerWorker"``) serves the
folder; a float32 trainer loaded from it is pushed ours, the verl way and the checkpoint-engine way (see
bench/sync_bench.py), then each is checked against ours by digests and greedy tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

from vllm_engine import SETTINGS, generate

#: the prompts of the tokens check (token ids)
PROMPTS = [[1, 2, 3, 4], [17, 99, 5]]


def step(trainer, seed: int) -> None:
    """Move every weight of ``trainer`` a little (a training step's size)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.002)


class Peers:
    """The trainer's side of the peers (bench/sync_peers.py): its gloo group with the engine's workers."""

    def __init__(self, llm, trainer, sync: str, timeout: float = 600.0):
        from loader.vllm.sync_wire import HOST, Wire, host_store

        self.llm, self.trainer, self.sync, self.timeout = llm, trainer, sync, timeout
        self.workers = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        world = 1 + self.workers
        store = host_store(0, timeout)
        address = f"{HOST}:{store.port}"
        self.wire = beside(llm, "peer_connect", (address, world, timeout), lambda: Wire(store, 0, world, timeout))[1]

    def push(self, bucket: int, streamed: bool, digests: bool = False) -> dict:
        """One peer push (``bucket=0``: one tensor a message); its wall, per worker answers, bytes sent."""
        import torch
        from sync_peers import buckets

        started = time.perf_counter()
        with torch.no_grad():
            state = self.trainer.state_dict()
            tensors = [(k, t.detach().to(torch.bfloat16) if t.is_floating_point() else t) for k, t in state.items()]
        specs = [(k, list(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors]
        sent = [0]

        def send() -> None:
            for group in buckets(specs, bucket):
                parts = [tensors[i][1].contiguous().reshape(-1).view(torch.uint8) for i in group]
                packet = parts[0] if len(parts) == 1 else torch.cat(parts)
                self.wire.exchange([(packet, 1 + w) for w in range(self.workers)], [])
                sent[0] += packet.numel() * self.workers
            self.wire.agree(True)

        answers, _ = beside(self.llm, "peer_receive", (self.sync, specs, bucket, streamed, digests), send)
        self.llm.reset_prefix_cache()
        return {"wall": time.perf_counter() - started, "answers": answers, "sent": sent[0]}


def beside(llm, method: str, args: tuple, work):
    """The workers' ``method`` (by rank) driven in a thread while ``work()`` runs here; (answers, its result)."""
    answers, failed = [], []

    def drive() -> None:
        try:
            answers.extend(llm.collective_rpc(method, args=args))
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    result = work()
    thread.join()
    if failed:
        raise RuntimeError(f"the workers failed in {method}") from failed[0]
    return sorted(answers, key=lambda a: a["rank"]), result


def report_row(label: str, walls: list[float], reports: list) -> dict:
    """One of our rows from its pushes' :class:`~loader.vllm.SyncReport`."""
    return {
        "label": label,
        "walls": walls,
        "worker_seconds": [max(r.worker_seconds) for r in reports],
        "received": list(reports[0].bytes_sent),
        "shard_bytes": list(reports[0].shard_bytes),
        "sent": sum(reports[0].bytes_sent),
    }


def report_rows(planning: float, first, reports: list, pushes: int) -> list[dict]:
    """Our rows: first push with and without planning, replayed pushes."""
    return [
        report_row("ours, first push incl. planning (EngineSync construction)", [planning + first.seconds], [first]),
        report_row("ours, first push excl. planning", [first.seconds], [first]),
        report_row(f"ours, replayed push (×{pushes})", [r.seconds for r in reports], reports),
    ]


def peer_row(label: str, results: list[dict]) -> dict:
    answers = results[0]["answers"]
    return {
        "label": label,
        "walls": [r["wall"] for r in results],
        "worker_seconds": [max(a["seconds"] for a in r["answers"]) for r in results],
        "received": [a["bytes"] for a in answers],
        "shard_bytes": [a["shard_bytes"] for a in answers],
        "sent": results[0]["sent"],
    }


def main(ctx: dict) -> None:
    import torch
    import transformers
    from vllm import LLM

    from loader.vllm import EngineSync

    torch.set_num_threads(1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(ctx["model"], dtype=torch.float32)
    began = time.perf_counter()
    llm = LLM(model=ctx["model"], tensor_parallel_size=2, worker_extension_cls="sync_peers.PeerWorker", **SETTINGS)
    out = {"start_seconds": time.perf_counter() - began}
    state = trainer.state_dict()
    out["params"] = sum(t.numel() for t in state.values())
    out["model_bytes"] = 2 * out["params"]
    out["tensors"] = len(state)
    began = time.perf_counter()
    sync = EngineSync(llm, trainer)
    out["planning_seconds"] = planning = time.perf_counter() - began
    step(trainer, 1)
    first = sync.push()
    out["shard_bytes"] = list(first.shard_bytes)
    peers = Peers(llm, trainer, sync.endpoint.id)
    ways = {
        "verl": ("verl way: full state dict, every tensor whole to every worker", 0, False),
        "ckpt": (f"checkpoint-engine way: {ctx['bucket'] >> 20} MiB buckets to every worker", ctx["bucket"], True),
    }
    reports, results = [], {key: [] for key in ways}
    for n in range(ctx["pushes"]):  # the ways take turns: a load spike falls on all of them alike
        step(trainer, 100 + n)
        reports.append(sync.push())
        for i, (key, (_, bucket, streamed)) in enumerate(ways.items()):
            step(trainer, 200 + 10 * n + i)
            results[key].append(peers.push(bucket, streamed))
    rows = report_rows(planning, first, reports, ctx["pushes"])
    for key, (label, _, _) in ways.items():
        rows.append({**peer_row(f"{label} (×{ctx['pushes']})", results[key]), "key": key})
    # the check: the same trainer weights pushed by ours (digests recorded) and by each peer
    step(trainer, 999)
    checker = EngineSync(llm, trainer, digests=True)
    mine = checker.push()
    tokens = generate(llm, {"prompts": PROMPTS})
    out["tokens_equal"] = True
    for row in rows:
        row["same"] = "(ours)" if "key" not in row else None
    for row in rows[3:]:
        _, bucket, streamed = ways[row["key"]]
        theirs = peers.push(bucket, streamed, digests=True)
        same = [a["digests"] == d for a, d in zip(theirs["answers"], mine.digests)]
        count = sum(len(d) for d in mine.digests)
        differ = sorted({n for a, d in zip(theirs["answers"], mine.digests) for n in d if a["digests"].get(n) != d[n]})
        row["same"] = f"yes ({count} parameters)" if all(same) else f"NO: {', '.join(differ[:4])} ({len(differ)})"
        out["tokens_equal"] &= generate(llm, {"prompts": PROMPTS}) == tokens
    from sync_delta import delta_rows

    out["delta"] = delta_rows(llm, trainer, checker, steps=ctx.get("delta_steps", 2))
    checker.close()
    sync.close()
    out["ways"] = rows
    out["median_replayed"] = statistics.median(rows[2]["walls"])
    Path(ctx["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
