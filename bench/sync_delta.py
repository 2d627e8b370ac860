"""The delta rows of bench/sync_bench.py: ``EngineSync.push(delta=True)`` after real AdamW steps of the trainer.

Vocabulary:
    learning rate of a target: the one at which a first AdamW step (its update ``lr * g / (|g| + eps)`` plus the
        decoupled weight decay) changes the target share of the trainer's bf16-cast elements (0.1, 1, 10 %),
        found by bisection over a 1 % sample of every tensor's elements, with the gradient of one batch.
    a row: for one target, ``steps`` real steps (random batches of token ids, ``loss.backward()``,
        ``AdamW.step()``), each followed by a delta push of a sync recording digests, then a full push of the
        same weights by the check's sync: the delta-built parameters must equal the full push's bit for bit.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

#: the shares of changed bf16 elements the rows aim at
TARGETS = (0.001, 0.01, 0.1)
#: token ids a batch holds
TOKENS = 64


def batch(trainer, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, trainer.config.vocab_size, (1, TOKENS), generator=generator)


def gradients(trainer, seed: int) -> None:
    trainer.zero_grad(set_to_none=True)
    ids = batch(trainer, seed)
    trainer(input_ids=ids, labels=ids).loss.backward()


def changed_share(samples: list[tuple[torch.Tensor, torch.Tensor]], lr: float, decay: float, eps: float) -> float:
    """The share of sampled bf16 elements a first AdamW step at ``lr`` changes."""
    changed = total = 0
    for w, g in samples:
        new = w - lr * decay * w - lr * g / (g.abs() + eps)
        changed += int((new.to(torch.bfloat16) != w.to(torch.bfloat16)).sum())
        total += w.numel()
    return changed / total


def learning_rates(trainer, decay: float = 0.01, eps: float = 1e-8) -> list[float]:
    """Per target of :data:`TARGETS`, its learning rate (see the module)."""
    gradients(trainer, 0)
    generator = torch.Generator().manual_seed(1)
    samples = []
    for p in trainer.parameters():
        if p.grad is None:
            continue
        pick = torch.randint(0, p.numel(), (max(1, p.numel() // 100),), generator=generator)
        samples.append((p.detach().reshape(-1)[pick].clone(), p.grad.reshape(-1)[pick].clone()))
    trainer.zero_grad(set_to_none=True)
    out = []
    for target in TARGETS:
        lo, hi = math.log(1e-10), math.log(1e-1)
        for _ in range(24):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if changed_share(samples, math.exp(mid), decay, eps) < target else (lo, mid)
        out.append(math.exp((lo + hi) / 2))
    return out


def delta_rows(llm, trainer, checker, steps: int = 2, profile=None) -> list[dict]:
    """The delta rows (see the module); ``checker``: a sync recording digests (full pushes); ``profile``: a
    ``cProfile.Profile`` enabled around each delta push, if any."""
    from loader.vllm import EngineSync

    sync = EngineSync(llm, trainer, digests=True)
    sync.push()  # the first push is full: the base of the deltas
    rates = learning_rates(trainer)
    rows = [_row(sync, checker, trainer, list(trainer.parameters()), lr, steps, profile) for lr in rates]
    for row, target in zip(rows, TARGETS):
        row.update(target=target, what="every parameter")
    mlp = [p for n, p in trainer.named_parameters() if ".layers.0.mlp." in n]  # the rest frozen
    if mlp:
        rows.append({**_row(sync, checker, trainer, mlp, rates[1], steps, profile), "what": "layer 0's MLP only"})
    sync.close()
    return rows


def _row(sync, checker, trainer, params: list, lr: float, steps: int, profile) -> dict:
    """``steps`` AdamW steps of ``params`` at ``lr``, each pushed as a delta and checked against a full push."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    walls, full, workers, full_workers, wire, changed, shard, same = [], [], [], [], 0, 0, 0, True
    for s in range(steps):
        gradients(trainer, 10 + s)
        optimizer.step()
        if profile is not None:
            profile.enable()
        report = sync.push(delta=True)
        if profile is not None:
            profile.disable()
        check = checker.push()
        walls.append(report.seconds)
        workers.append(max(report.worker_seconds, default=0.0))
        full_workers.append(max(check.worker_seconds, default=0.0))
        full.append(check.seconds)
        wire, changed, shard = (
            wire + sum(report.bytes_sent),
            changed + sum(report.changed_bytes),
            shard + sum(report.shard_bytes),
        )
        same &= report.delta and all(d == c for d, c in zip(report.digests, check.digests))
    trainer.zero_grad(set_to_none=True)
    return {"lr": lr, "changed": changed / shard, "walls": walls, "full_walls": full,
            "worker_walls": workers, "full_worker_walls": full_workers,
            "wire_over_changed": wire / changed if changed else math.inf, "same": same,
            "count": sum(len(d) for d in check.digests)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="the delta rows of bench/sync_bench.py alone")
    parser.add_argument("folder", help="a model folder bench/sync_bench.py wrote")
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps (delta pushes) per target")
    parser.add_argument("--profile", action="store_true", help="cProfile the trainer's side of the delta pushes")
    args = parser.parse_args()
    import cProfile
    import io
    import pstats

    import transformers
    from vllm import LLM
    from vllm_engine import SETTINGS

    from loader.vllm import EngineSync

    torch.set_num_threads(1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    llm = LLM(model=args.folder, tensor_parallel_size=2, worker_extension_cls="loader.vllm.SyncWorker", **SETTINGS)
    checker = EngineSync(llm, trainer, digests=True)
    checker.push()
    profile = cProfile.Profile() if args.profile else None
    for row in delta_rows(llm, trainer, checker, args.steps, profile):
        walls = " ".join(f"{w:.3f}" for w in row["walls"])
        full = " ".join(f"{w:.3f}" for w in row["full_walls"])
        workers = " ".join(f"{w:.3f}" for w in row["worker_walls"])
        full_workers = " ".join(f"{w:.3f}" for w in row["full_worker_walls"])
        print(f"{row['what']}, changed {100 * row['changed']:.2f} %: delta {walls} s (slowest worker {workers} s), "
              f"full {full} s "
              f"(slowest worker {full_workers} s), "
              f"wire/changed "
              f"{row['wire_over_changed']:.3f}, same {row['same']}", flush=True)  # fmt: skip
    if profile is not None:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
        print(out.getvalue())
    checker.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
