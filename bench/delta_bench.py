"""Benchmark: only what changed (``loader.transfer.delta``): bytes on the wire ÷ the changed bytes, for real
optimizer steps and synthetic changes, against a full send, a generic compressor and PULSE-style indices.

    python bench/delta_bench.py [--size 4096] [--repeat 2] [--markdown]

Cases, each at 0.1 %, 1 % and 10 % of the bf16 elements changed:

* ``AdamW, MLP``: two ``nn.Linear(size, size)`` (with a GELU between, biases included) with float32 master
  weights, trained with ``torch.optim.AdamW`` (weight decay 0.01) on an MSE loss of random data: three warm-up
  steps (lr 1e-4), then from that same state one more real step per density, its lr found by bisection on the
  step's direction (AdamW's step is linear in lr) so that the wanted fraction of the bf16 casts changes. The
  buffers sent are every parameter's bf16 cast: base before the step, new after it.
* ``AdamW, tiny Llama``: the same with a transformers ``LlamaForCausalLM`` (hidden 256, 2 layers, vocabulary
  2048, untied) on a causal-LM loss of random tokens.
* ``scattered ±1 ulp``: one ``[size, size]`` bf16 buffer (normal, std 0.02), elements at uniformly random places
  moved one ulp up or down (as integers).
* ``scattered random bits``: the same places given random bits: the bound for this case is the entropy of the
  places, about ``H(p) / p`` bits a change (11.4, 8.1, 4.7 bits at 0.1, 1, 10 %) besides its 16 value bits:
  1.71, 1.50, 1.29 x the changed bytes at best, for any encoding.
* ``row-clustered``: whole rows (a fraction of them) given new normal values: an embedding's touched rows.

Measured per case, all in this one process: ours (``len(encode_delta(base, new).to_bytes())`` per buffer, its
40-byte header included), which value encoding it chose (``diff``: Rice-coded integer differences, ``raw``:
the elements, ``full``: the whole buffer), a full send (every buffer's bytes), ``zlib`` level 1 and ``zstd``
level 3 (if ``zstandard`` is installed) of ``base XOR new`` (what a receiver holding base can decode), and
PULSE-style (an int32 index and the raw element per change), each divided by the changed bytes (changed
elements x 2); then ours' encode and apply CPU seconds (the process's, all threads: steadier than the wall on
a shared machine) per GB of buffer (best of ``--repeat``) and zstd's encode CPU seconds.
Every applied delta is compared with new bit for bit; a difference exits with status 1.

``--markdown`` prints the table docs/benchmarks.md holds.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import mdtable  # noqa: E402
import torch  # noqa: E402

from loader.transfer.delta import apply_delta, encode_delta  # noqa: E402

DENSITIES = (0.001, 0.01, 0.1)
try:
    import zstandard
except ImportError:  # the zstd column says so
    zstandard = None


def _bf16(params) -> list[torch.Tensor]:
    return [p.detach().to(torch.bfloat16) for p in params]


def _fraction(old: list[torch.Tensor], new: list[torch.Tensor]) -> float:
    changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(old, new))
    return changed / sum(a.numel() for a in old)


class Trainer:
    """A model, its AdamW and one batch's gradients: real steps from one saved state."""

    def __init__(self, model: torch.nn.Module, loss) -> None:
        self.model, self.params = model, [p for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01)
        for _ in range(3):  # warm-up: Adam's moments are no longer the first step's
            self.opt.zero_grad()
            loss(model).backward()
            self.opt.step()
        self.opt.zero_grad()
        loss(model).backward()  # the gradients every step below takes
        self.saved = ([p.detach().clone() for p in self.params], copy.deepcopy(self.opt.state_dict()))

    def _restore(self) -> None:
        with torch.no_grad():
            for p, s in zip(self.params, self.saved[0]):
                p.copy_(s)
        self.opt.load_state_dict(copy.deepcopy(self.saved[1]))

    def step(self, lr: float) -> list[torch.Tensor]:
        """The float32 master weights after one real AdamW step at ``lr`` from the saved state."""
        self._restore()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        return [p.detach().clone() for p in self.params]

    def pairs(self, density: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """bf16 (base, new) per parameter for the step whose lr changes ``density`` of the bf16 elements."""
        old = self.saved[0]
        base = _bf16(old)
        direction = [o - n for o, n in zip(old, self.step(1.0))]  # AdamW's step is linear in lr
        lo, hi = 1e-12, 1.0
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            moved = _bf16(o - mid * d for o, d in zip(old, direction))
            lo, hi = (mid, hi) if _fraction(base, moved) < density else (lo, mid)
        return list(zip(base, _bf16(self.step(hi))))


def mlp(size: int) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(size, size), torch.nn.GELU(), torch.nn.Linear(size, size))
    x, y = torch.randn(32, size), torch.randn(32, size)
    return Trainer(model, lambda m: torch.nn.functional.mse_loss(m(x), y))


def llama() -> Trainer:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=2048, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 2048, (4, 64))
    return Trainer(model, lambda m: m(input_ids=tokens, labels=tokens).loss)


def synthetic(kind: str, size: int, density: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(size, size, generator=g) * 0.02).to(torch.bfloat16)
    new = base.clone()
    ints = new.view(torch.int16)
    if kind == "row-clustered":
        rows = torch.randperm(size, generator=g)[: max(1, round(density * size))]
        new[rows] = (torch.randn(rows.numel(), size, generator=g) * 0.02).to(torch.bfloat16)
        return [(base, new)]
    mask = torch.rand(size, size, generator=g) < density
    if kind == "scattered ±1 ulp":
        ints[mask] += (torch.randint(0, 2, (int(mask.sum()),), generator=g) * 2 - 1).to(torch.int16)
    else:
        ints[mask] = torch.randint(-(2**15), 2**15, (int(mask.sum()),), generator=g, dtype=torch.int16)
    return [(base, new)]


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def measure(pairs, repeat: int) -> dict:
    """The row's figures for one case's (base, new) buffers."""
    wire = full = zl = zs = changed = 0
    encode_s = apply_s = zstd_s = 0.0
    kinds = set()
    for base, new in pairs:
        seconds, delta = _best(lambda b=base, n=new: encode_delta(b, n), repeat)
        encode_s += seconds
        data = delta.to_bytes()
        wire += data.numel()
        changed += delta.changed
        kinds.add("full" if delta.full else "diff" if delta.diff else "raw")
        targets = [base.clone() for _ in range(repeat)]
        seconds, _ = _best(lambda t=targets, d=delta: apply_delta(t.pop(), d), repeat)
        apply_s += seconds
        target = base.clone()
        apply_delta(target, type(delta).from_bytes(data))
        if not torch.equal(target.view(torch.int16), new.view(torch.int16)):
            sys.exit(f"a delta applied to its base differs from new ({tuple(base.shape)})")
        xor = (base.view(torch.int16) ^ new.view(torch.int16)).view(torch.uint8).numpy().tobytes()
        full += len(xor)
        zl += len(zlib.compress(xor, 1))
        if zstandard is not None:
            seconds, packed = _best(lambda x=xor: zstandard.ZstdCompressor(level=3).compress(x), 1)
            zs, zstd_s = zs + len(packed), zstd_s + seconds
    cb = 2 * changed
    gb = full / 1e9
    return {
        "changed": changed, "ours": wire / cb, "kind": "+".join(sorted(kinds)), "full": full / cb, "zlib": zl / cb,
        "zstd": zs / cb if zstandard else None, "pulse": 6 * changed / cb, "encode": encode_s / gb,
        "apply": apply_s / gb, "zstd_s": zstd_s / gb if zstandard else None, "bytes": full,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="the MLP's width and the synthetic buffer's side")
    parser.add_argument("--repeat", type=int, default=2, help="timed encodes and applies per buffer (best kept)")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args()
    load = mdtable.LoadWatch()
    cases = [(f"AdamW, MLP 2×{args.size}²", lambda: mlp(args.size)), ("AdamW, tiny Llama", llama)]
    rows = []
    for name, make in cases:
        trainer = make()
        for p in DENSITIES:
            rows.append((name, p, measure(trainer.pairs(p), args.repeat)))
            print(f"# {name} {p:.1%}: {rows[-1][2]['ours']:.3f}", file=sys.stderr)
        del trainer
    for kind in ("scattered ±1 ulp", "scattered random bits", "row-clustered"):
        for p in DENSITIES:
            rows.append((kind, p, measure(synthetic(kind, args.size, p), args.repeat)))
            print(f"# {kind} {p:.1%}: {rows[-1][2]['ours']:.3f}", file=sys.stderr)
    na = "not installed"
    body = [
        [name, f"{p:.1%} ({m['changed'] / (m['bytes'] / 2):.2%}, {m['bytes'] / 2**20:.0f} MiB)",
         f"**{m['ours']:.3f}**", m["kind"], f"{m['full']:.1f}", f"{m['zlib']:.2f}",
         f"{m['zstd']:.2f}" if m["zstd"] else na, f"{m['pulse']:.2f}", f"{m['encode']:.2f}", f"{m['apply']:.2f}",
         f"{m['zstd_s']:.2f}" if m["zstd_s"] else na]
        for name, p, m in rows
    ]  # fmt: skip
    headers = [
        "case", "wanted changed (measured, buffers)", "ours ÷ changed", "values", "full ÷ changed",
        "zlib-1(XOR) ÷ changed", "zstd-3(XOR) ÷ changed", "PULSE (int32 + value) ÷ changed",
        "ours encode CPU s/GB", "ours apply CPU s/GB", "zstd-3 encode CPU s/GB",
    ]  # fmt: skip
    mdtable.emit(args.markdown, load.stop(), headers, body, packages=("torch", "transformers", "zstandard"))


if __name__ == "__main__":
    main()
