"""A plain module with every layout the distributed loader must handle, its checkpoint and rules."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from loader import Convert, Rename

H, HEADS, E, I, ROWS = 16, 4, 4, 8, 10


def rope_permute(w: torch.Tensor, heads: int = HEADS) -> torch.Tensor:
    d, n = w.shape
    return w.view(heads, d // heads // 2, 2, n).transpose(1, 2).reshape(d, n)


class Layout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.gate_up_strided = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))
        self.uneven = nn.Parameter(torch.empty(ROWS, H))
        self.norm = nn.Parameter(torch.empty(H))
        self.scaled = nn.Parameter(torch.empty(ROWS, H))


def write_checkpoint(path: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        name: torch.randn(shape, generator=g).to(torch.bfloat16)
        for name, shape in [
            ("q", (H, H)),
            ("k", (H, H)),
            ("v", (H, H)),
            ("o_t", (H, H)),
            ("uneven_src", (ROWS, H)),
            ("norm_src", (H,)),
            ("scaled_src", (ROWS, H)),
        ]
    }
    for e in range(E):
        t[f"experts.{e}.w1"] = torch.randn(I, H, generator=g).to(torch.bfloat16)
        t[f"experts.{e}.w3"] = torch.randn(I, H, generator=g).to(torch.bfloat16)
        t[f"experts.{e}.w2"] = torch.randn(H, I, generator=g).to(torch.bfloat16)
    save_file(t, path)
    return t


def gate_up(w1s, w3s):
    return torch.cat([torch.stack(w1s), torch.stack(w3s)], dim=1)


RULES = [
    Convert(["q", "k", "v"], "qkv.weight", lambda q, k, v: torch.cat([rope_permute(q), rope_permute(k), v])),
    Convert("o_t", "o_proj.weight", lambda w: w.t()),
    Convert(
        ["experts.*.w1", "experts.*.w3"], ["gate_up", "gate_up_strided"], lambda a, b: (gate_up(a, b), gate_up(a, b))
    ),
    Convert("experts.*.w2", "down", lambda ws: torch.stack(ws)),
    Rename("uneven_src", "uneven"),
    Rename("norm_src", "norm"),
    Convert("scaled_src", "scaled", lambda w: torch.stack([w, w]).sum(0)),  # `sum`: deferred
]


def expected_state(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w1s = [t[f"experts.{e}.w1"] for e in range(E)]
    w3s = [t[f"experts.{e}.w3"] for e in range(E)]
    gu = gate_up(w1s, w3s).float()
    return {
        "qkv.weight": torch.cat([rope_permute(t["q"]), rope_permute(t["k"]), t["v"]]).float(),
        "o_proj.weight": t["o_t"].t().float(),
        "gate_up": gu,
        "gate_up_strided": gu,
        "down": torch.stack([t[f"experts.{e}.w2"] for e in range(E)]).float(),
        "uneven": t["uneven_src"].float(),
        "norm": t["norm_src"].float(),
        "scaled": (t["scaled_src"] * 2).float(),
    }
