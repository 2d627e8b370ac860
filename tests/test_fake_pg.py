"""torch's fake process group (``init_process_group("fake")``: one process playing one rank of a world, collectives
that do nothing): a load plans and reads as that rank, reading exactly its shards' bytes; a save refuses.

Each rank is played in a subprocess (it inits a process group), which writes the local shards it loaded and its
reports; the test compares them with slices of the full tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loader.options import LoadOptions, Rules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_models as dm

TESTS = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
TIMEOUT = 300
#: checkpoint key -> (shape, sharded dim; None: replicated)
PLAIN = {"rows": ((10, 16), 0), "cols": ((8, 14), 1), "cube": ((4, 6, 8), 2), "bias": ((16,), None)}


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (shape, _) in PLAIN.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)))


def plain_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(shape, generator=g).to(torch.bfloat16) for k, (shape, _) in PLAIN.items()}


# ----------------------------------------------------------------------------------------------- one rank


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: getattr(v.data, "_local_tensor", v.data).detach().clone() for k, v in model.state_dict().items()}


def play_rank(rank: int, root: Path) -> None:
    """Init a fake world of ``WORLD`` as ``rank``; load the plain and the layout checkpoint three ways (into
    fresh sharded models), then try a save. Writes ``rank{rank}_*.safetensors`` and ``rank{rank}.json``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from dist_worker import layout_placements
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint, save_hf_checkpoint
    from loader.placements import shard_module

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    assert dist.get_backend() == "fake"
    mesh = init_device_mesh("cpu", (WORLD,))
    plain = {k: [Replicate()] if d is None else [Shard(d)] for k, (_, d) in PLAIN.items()}
    result: dict = {}
    for way in ("load", "broadcast", "dcp"):
        model = shard_module(Plain(), mesh, plain)
        if way == "dcp":  # dcp's own plan exchange needs real collectives: no_dist (our reader reads as `rank`)
            planner = HFLoadPlanner(model)
            reader = SafetensorsReader(root / "plain")
            dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
            report = planner.finish(reader)
        else:
            report = load_hf_checkpoint(
                model, str(root / "plain"), options=LoadOptions(broadcast_replicated_tensors=way == "broadcast")
            )
        save_file(_locals(model), str(root / f"rank{rank}_{way}.safetensors"))
        result[way] = {"bytes_read": report.bytes_read, "rank": report.rank, "world": report.world_size}
    # conversions (cat, permutes, stacks, a strided shard, a deferred sum) against DTensor's own local chunks
    placements = layout_placements((WORLD,))
    model = shard_module(dm.Layout(), mesh, placements)
    load_hf_checkpoint(model, str(root / "layout.safetensors"), rules=Rules(weights_mapping=dm.RULES))
    expected = dm.expected_state(load_file(str(root / "layout.safetensors")))
    got = _locals(model)
    want = {
        k: distribute_tensor(v, mesh, placements.get(k, [Replicate()]), src_data_rank=None).to_local()
        for k, v in expected.items()
    }
    result["layout_bad"] = sorted(k for k in want if not torch.equal(got[k].float(), want[k]))
    try:  # a save needs every rank's shards: refused, nothing left behind
        save_hf_checkpoint(shard_module(Plain(), mesh, plain, fill=1.0), str(root / "saved"))
    except RuntimeError as e:
        result["save_error"] = str(e)
    (root / f"rank{rank}.json").write_text(json.dumps(result))


def run_rank(rank: int, root: Path) -> dict:
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {TESTS!r})
        from test_fake_pg import play_rank
        play_rank({rank}, Path(sys.argv[1]))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-6000:]}"
    return json.loads((root / f"rank{rank}.json").read_text())


# ----------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module", params=[0, 1, 3], ids=lambda r: f"rank{r}")
def played(request, tmp_path_factory) -> tuple[int, Path, dict]:
    """One rank of a fake world of 4 played in a subprocess: (rank, its folder, its results)."""
    rank, root = request.param, tmp_path_factory.mktemp(f"fake{request.param}")
    (root / "plain").mkdir()
    save_file(plain_tensors(), str(root / "plain" / "model.safetensors"))
    dm.write_checkpoint(str(root / "layout.safetensors"))
    return rank, root, run_rank(rank, root)


def test_a_fake_world_rank_reads_exactly_its_shards(played):
    rank, root, result = played
    full = plain_tensors()
    want = {k: v if d is None else torch.chunk(v, WORLD, d)[rank] for k, v in full.items() for d in [PLAIN[k][1]]}
    shard_bytes = sum(t.numel() * t.itemsize for t in want.values())
    assert shard_bytes < sum(t.numel() * t.itemsize for t in full.values())
    for way in ("load", "broadcast", "dcp"):
        got = load_file(str(root / f"rank{rank}_{way}.safetensors"))
        bad = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
        assert bad == [], (way, bad)
        # this rank's shards and nothing else (nothing broadcast: no peers in a fake world)
        assert result[way] == {"bytes_read": shard_bytes, "rank": rank, "world": WORLD}, (way, result[way])
    assert result["layout_bad"] == [], result["layout_bad"]


def test_a_save_under_a_fake_world_is_refused_and_leaves_nothing(played):
    rank, root, result = played
    assert "fake process group" in result.get("save_error", ""), result
    assert f"rank {rank} of {WORLD}" in result["save_error"]
    left = sorted(p.name for p in root.iterdir())
    assert "saved" not in left and not any(".tmp-" in name for name in left), left  # no checkpoint, no temp folder
