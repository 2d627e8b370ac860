"""``loader.transfer.simulate_transfer``: the transfer plan for any two meshes on meta models.

Oracles independent of the plan: every source element labelled with the world rank holding it, the labels saved
with ``save_hf_checkpoint`` and loaded into the destination with ``load_hf_checkpoint``; per destination rank,
the count of each label in its shard is what it must receive from that source rank; and real transfers on 4
gloo ranks (colocated and disaggregated), whose reports give each rank's bytes sent, received and kept local.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import transfer_models as tm
from hf_models import build
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loader import load_hf_checkpoint, save_hf_checkpoint
from loader.options import LoadOptions, Rules, SaveOptions, TransferOptions
from loader.plan import box_view
from loader.transfer import TransferMeshes, mesh_parts, simulate_transfer

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

FSDP = lambda name, shape: [Shard(0)]


def _ep_tp(dest: torch.nn.Module) -> dict:
    placements = tm.tp_placements(dest, two_dims=True)
    return {
        n: [Shard(0), _StridedShard(1, split_factor=2)] if n.endswith("gate_up_proj") else p
        for n, p in placements.items()
    }


def _labelled_pairs(tmp_path, src_ranks: int, dst_mesh, dst_placements, offset: int) -> dict[tuple[int, int], int]:
    """Bytes per (source rank, destination world rank), counted through files (no plan involved)."""
    _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
    with torch.no_grad():
        for name, t in source.state_dict().items():
            for r, parts in enumerate(mesh_parts(source, (src_ranks,), FSDP)):
                for g, _ in parts[name][2]:
                    box_view(t, g).fill_(r)
    save_hf_checkpoint(source, str(tmp_path / "labels"), options=SaveOptions(progress=False))
    labels = tm.Engine()
    load_hf_checkpoint(
        labels, str(tmp_path / "labels"), rules=Rules(weights_mapping=tm.rules()), options=LoadOptions(progress=False)
    )
    state = labels.state_dict()
    want: dict[tuple[int, int], int] = {}
    for d, parts in enumerate(mesh_parts(labels, dst_mesh, dst_placements)):
        for name, (_, dtype, boxes) in parts.items():
            for g, _ in boxes:
                counts = torch.bincount(box_view(state[name], g).flatten().long(), minlength=src_ranks)
                for s, n in enumerate(counts.tolist()):
                    if n:
                        want[s, d + offset] = want.get((s, d + offset), 0) + n * dtype.itemsize
    return want


def _meta_pair():
    with torch.device("meta"):
        _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
        dest = tm.Engine()
    return source, dest


@pytest.mark.parametrize("colocated", [False, True])
def test_fsdp_to_tp_bytes_per_rank_pair_are_what_each_destination_needs(tmp_path, colocated):
    """FSDP over 2 ranks → TP over 2 (disaggregated: ranks 2-3; colocated: ranks 0-1), on meta models."""
    source, dest = _meta_pair()
    figures = simulate_transfer(
        source,
        dest,
        dst_mapping=tm.rules(),
        meshes=TransferMeshes(
            src_mesh_shape=(2,),
            src_placements=FSDP,
            dst_mesh_shape=(2,),
            dst_placements=tm.tp_placements(dest),
            colocated=colocated,
        ),
    )
    offset = 0 if colocated else 2
    assert figures.world == 2 + offset and figures.dst_ranks == (offset, offset + 1)
    assert dict(figures.pairs) == _labelled_pairs(tmp_path, 2, (2,), tm.tp_placements(tm.Engine()), offset)
    for r in figures.ranks:
        assert r.received == r.dst_shard_bytes  # each destination element received once
    assert sum(r.sent for r in figures.ranks) == sum(r.dst_shard_bytes for r in figures.ranks)
    if colocated:
        assert all(r.local > 0 for r in figures.ranks)
    else:
        assert figures.bytes_moved == sum(r.dst_shard_bytes for r in figures.ranks)
        assert [r.sent > 0 for r in figures.ranks] == [True, True, False, False]
    assert figures.fallback == 0 and figures.plan_seconds > 0


def test_fsdp_to_ep_tp_with_strided_shard(tmp_path):
    """FSDP over 4 ranks → EP x TP on a 2 x 2 mesh (gate_up ``_StridedShard``), colocated."""
    source, dest = _meta_pair()
    figures = simulate_transfer(
        source,
        dest,
        dst_mapping=tm.rules(),
        meshes=TransferMeshes(
            src_mesh_shape=(4,), src_placements=FSDP, dst_mesh_shape=(2, 2), dst_placements=_ep_tp(dest), colocated=True
        ),
    )
    assert dict(figures.pairs) == _labelled_pairs(tmp_path, 4, (2, 2), _ep_tp(tm.Engine()), 0)
    assert all(r.received_ratio == 1.0 for r in figures.ranks)


def test_the_same_as_a_transfer_in_one_process():
    """One rank each: the simulated bytes are the report's of a real ``transfer_weights``."""
    from loader import transfer_weights

    _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
    dest = tm.Engine()
    report = transfer_weights(source, dest, dst_mapping=tm.rules())
    figures = simulate_transfer(source, dest, dst_mapping=tm.rules(), meshes=TransferMeshes(colocated=True))
    assert figures.ranks[0].received == report.bytes_received and figures.ranks[0].sent == report.bytes_sent
    assert figures.transferred == len(report.transferred)


def test_a_deepseek_v3_pair_plans_on_meta_without_data():
    """A 4-layer DeepSeek-V3 (3 dense + 1 MoE layer of 256 experts) on the meta device: FSDP over 16 ranks →
    EP4 x TP4 (bench/plan_scale.py's placements), disaggregated: every destination rank receives its shard."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import plan_scale

    model = plan_scale.build_model(4)
    assert all(t.is_meta for t in model.state_dict().values())
    placements = plan_scale.placements_for(model)
    figures = simulate_transfer(
        model,
        model,
        meshes=TransferMeshes(
            src_mesh_shape=(16,), src_placements=FSDP, dst_mesh_shape=(4, 4), dst_placements=placements
        ),
    )
    dst = [figures.ranks[r] for r in figures.dst_ranks]
    assert figures.world == 32 and all(r.received == r.dst_shard_bytes > 0 for r in dst)
    assert all(r.sent > 0 for r in figures.ranks[:16]) and not any(r.sent for r in dst)
    assert figures.fallback == 0


# -- against a real transfer on 4 gloo ranks ------------------------------------------------------------------------


def _rank(rank: int, root: str) -> None:
    """One rank: a colocated FSDP (4) -> EP x TP (2 x 2) transfer, then a disaggregated FSDP (2) -> TP (2) one;
    each report saved to ``root/rank{rank}.json``."""
    import json

    import torch.distributed as dist
    import transfer_worker as tw
    from torch.distributed.device_mesh import init_device_mesh

    from loader import transfer_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=4)
    world, two = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    half = init_device_mesh("cpu", (2, 2), mesh_dim_names=("side", "tp"))["tp"]
    out = {}
    report = transfer_weights(
        tw.source_model(world), tw.dest_model(two, ep=True), dst_mapping=tm.rules(), options=TransferOptions(timeout=60)
    )
    out["colocated"] = tw.report_dict(report)
    src = tw.source_model(half) if rank < 2 else None
    dst = tw.dest_model(half) if rank >= 2 else None
    out["disaggregated"] = tw.report_dict(
        transfer_weights(src, dst, dst_mapping=tm.rules(), options=TransferOptions(timeout=60))
    )
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.mark.dist
def test_the_same_bytes_per_rank_as_transfer_weights_on_four_gloo_ranks(tmp_path):
    """Colocated (FSDP over 4 -> EP x TP 2 x 2, ``_StridedShard`` gate_up) and disaggregated (FSDP over ranks 0-1
    -> TP over ranks 2-3): every rank's simulated bytes sent, received and kept local are its report's."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(str(tmp_path),), nprocs=4, join=True, start_method="spawn")
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    source, dest = _meta_pair()
    colocated = simulate_transfer(
        source,
        dest,
        dst_mapping=tm.rules(),
        meshes=TransferMeshes(
            src_mesh_shape=(4,), src_placements=FSDP, dst_mesh_shape=(2, 2), dst_placements=_ep_tp(dest), colocated=True
        ),
    )
    disaggregated = simulate_transfer(
        source,
        dest,
        dst_mapping=tm.rules(),
        meshes=TransferMeshes(
            src_mesh_shape=(2,), src_placements=FSDP, dst_mesh_shape=(2,), dst_placements=tm.tp_placements(dest)
        ),
    )
    for name, figures in (("colocated", colocated), ("disaggregated", disaggregated)):
        for r, sim in enumerate(figures.ranks):
            real = reports[r][name]
            assert (real["bytes_sent"], real["bytes_received"], real["bytes_local"]) == (
                sim.sent, sim.received, sim.local,
            ), (name, r)  # fmt: skip
