"""Conversions that compute values (a pointwise product, a norm's ``+ 1``) inside ``dcp.load`` with
``SafetensorsReader``: traced into value reads as by ``load_hf_checkpoint``, reading the same bytes (only the regions
the model needs) and giving the same report, bit-identical values; torch's ``HuggingFaceStorageReader``, which reads
boxes only, still runs them for real (deferred).

The distributed case runs one rank of a fake world of 2 (``init_process_group("fake")``) in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from loader import Convert, HFLoadPlanner, LoadReport, SafetensorsReader, load_hf_checkpoint
from loader.options import LoadOptions, Rules

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # no_dist=True: "torch.distributed is disabled"

TESTS = os.path.dirname(os.path.abspath(__file__))
ROWS, COLS = 8, 6


class Gated(nn.Module):
    """``w = a[:2] * b[:2]`` (rows 0-1 of two sources), ``norm = n[:4] + 1``: each reads part of its sources."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, COLS))
        self.norm = nn.Parameter(torch.zeros(4))
        self.full = nn.Parameter(torch.zeros(ROWS, COLS))  # c * d whole: sharded in the distributed case


RULES = [
    Convert(["a", "b"], "w", lambda a, b: a[:2] * b[:2]),
    Convert("n", "norm", lambda n: n[:4] + 1),
    Convert(["c", "d"], "full", lambda c, d: c * d),
]


def write(folder: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(ROWS, COLS, generator=g) for k in "abcd"}
    tensors["n"] = torch.randn(10, generator=g)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return tensors


def dcp_load(model: nn.Module, folder: str, reader) -> LoadReport:
    planner = HFLoadPlanner(model, rules=Rules(weights_mapping=RULES))
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
    return planner.finish(reader)


def test_value_conversions_inside_dcp_load_read_what_load_hf_checkpoint_reads(tmp_path):
    tensors = write(str(tmp_path))
    direct = load_hf_checkpoint(
        direct_model := Gated(), str(tmp_path), rules=Rules(weights_mapping=RULES), options=LoadOptions(progress=False)
    )
    inside = dcp_load(dcp_model := Gated(), str(tmp_path), SafetensorsReader(str(tmp_path)))
    assert inside == direct  # every field but the timing: keys, traced, deferred, bytes, blocks, reasons
    assert inside.requests == direct.requests
    assert inside.deferred == () and set(inside.traced) == {"w", "norm", "full"}
    # rows 0-1 of a and b, n's first 4 elements, c and d whole: nothing read that the model does not need
    assert inside.bytes_read == inside.planned_bytes == (2 * 2 * COLS + 4 + 2 * ROWS * COLS) * 4
    want = {
        "w": tensors["a"][:2] * tensors["b"][:2],
        "norm": tensors["n"][:4] + 1,
        "full": tensors["c"] * tensors["d"],
    }
    for name, value in want.items():
        assert torch.equal(getattr(dcp_model, name), value), name
        assert torch.equal(getattr(dcp_model, name), getattr(direct_model, name)), name


def test_torchs_box_reader_still_runs_value_conversions_for_real(tmp_path):
    tensors = write(str(tmp_path))
    report = dcp_load(model := Gated(), str(tmp_path), HuggingFaceStorageReader(str(tmp_path)))
    assert set(report.deferred) == {"w", "norm", "full"}
    assert all("values=False" in why for why in report.deferred_reasons.values())
    assert torch.equal(model.w, tensors["a"][:2] * tensors["b"][:2])
    assert torch.equal(model.norm, tensors["n"][:4] + 1)


def play_rank(rank: int, folder: str) -> None:
    """As ``rank`` of a fake world of 2: load :class:`Gated` with ``full`` sharded by rows, both ways; write the
    reports and each way's local shard of ``full``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loader.placements import shard_module

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    placements = {"full": [Shard(0)], "w": [Replicate()], "norm": [Replicate()]}
    out = {}
    for way in ("direct", "dcp"):
        model = shard_module(Gated(), mesh, placements)
        if way == "direct":
            report = load_hf_checkpoint(
                model, folder, rules=Rules(weights_mapping=RULES), options=LoadOptions(progress=False)
            )
        else:
            report = dcp_load(model, folder, SafetensorsReader(folder))
        local = model.full.data.to_local()
        out[way] = {
            "report": repr(report.__dict__ | {"seconds": 0.0}),
            "bytes_read": report.bytes_read,
            "deferred": list(report.deferred),
            "full": local.flatten().tolist(),
        }
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_value_conversions_inside_dcp_load_read_only_the_ranks_shard(tmp_path):
    tensors = write(str(tmp_path))
    rank = 1
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from test_loader_dcp_values import play_rank
        play_rank({rank}, sys.argv[1])
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads((tmp_path / f"rank{rank}.json").read_text())
    direct, inside = out["direct"], out["dcp"]
    assert inside["report"] == direct["report"] and inside["deferred"] == [] == direct["deferred"]
    # full: this rank's rows 4-7 of c and d; w: rows 0-1 of a and b; norm: 4 elements of n
    assert inside["bytes_read"] == (2 * (ROWS // 2) * COLS + 2 * 2 * COLS + 4) * 4
    want = (tensors["c"] * tensors["d"])[ROWS // 2 :].flatten().tolist()
    assert inside["full"] == want == direct["full"]
