"""Distributed flows on process groups (``group=``): two pairs of a real 4-rank gloo world load different checkpoints
at the same time, each on its own group, a failure in one pair fails that pair only, and each pair saves its own
model.

The world runs as one subprocess per rank under a wall-clock limit (tests/gloo_world.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import dist_models as dm
import group_worker
from gloo_world import WORLD, ok, run_world

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    ctx = {"store": str(root / "store"), "out": str(root), "paths": [], "refs": []}
    for seed in (0, 1):  # one checkpoint per pair, different values
        path = str(root / f"pair{seed}.safetensors")
        torch.save(dm.expected_state(dm.write_checkpoint(path, seed=seed)), root / f"pair{seed}_ref.pt")
        ctx["paths"].append(path)
        ctx["refs"].append(str(root / f"pair{seed}_ref.pt"))
    with open(ctx["paths"][0], "rb") as f:
        data = f.read()
    ctx["bad_path"] = str(root / "bad.safetensors")
    with open(ctx["bad_path"], "wb") as f:  # the header whole, the data cut: a read fails
        f.write(data[: len(data) - 64])
    return run_world(group_worker.__file__, root, str(root), ctx, expected_codes=[0] * WORLD)


def test_two_groups_load_different_checkpoints_at_once(results):
    per_rank = ok(results, "two_groups")
    for r, res in enumerate(per_rank):
        assert res["bad"] == [], (r, res)
        assert (res["rank"], res["world"]) == (r % 2, 2), (r, res)


def test_a_failure_fails_its_group_only(results):
    per_rank = ok(results, "one_group_fails")
    for r in (0, 1):
        assert per_rank[r]["raised"] == "CheckpointError", (r, per_rank[r])
        assert per_rank[r]["from_rank"] == 1, (r, per_rank[r])
    assert per_rank[0]["message"] == per_rank[1]["message"]
    for r in (2, 3):
        assert per_rank[r]["raised"] is None and per_rank[r]["bad"] == [], (r, per_rank[r])


def test_two_groups_save_their_own_models_at_once(results):
    per_rank = ok(results, "groups_save")
    for r, res in enumerate(per_rank):
        assert res["same"], (r, res)
        assert (res["rank"], res["world"]) == (r % 2, 2), (r, res)
        assert res["written"] == (["bias", "weight"] if r % 2 == 0 else ["weight"]), (r, res)
