"""Folders of ``model-0000i-of-0000n.safetensors`` shards without their index: a complete set loads (logged, naming the
files), as torch's ``HuggingFaceStorageReader`` reads it; a provably incomplete one is refused, naming the folder and
what is missing: a member absent, sets of different sizes, or a save's staging folder (interrupted before its commit).

The folders are written by torch's own ``HuggingFaceStorageWriter`` (``dcp.save``), then lose their index (a copy of
the weight files alone).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from loader import CheckpointError, HFLoadPlanner, SafetensorsCheckpoint, SafetensorsReader, load_hf_checkpoint
from loader.options import LoadOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # no_dist=True: "torch.distributed is disabled"

INDEX = "model.safetensors.index.json"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2, bias=False)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=g) for k, v in Net().state_dict().items()}


def torch_save(folder, files: int) -> dict[str, torch.Tensor]:
    """The tensors saved by torch's HuggingFaceStorageWriter into ``files`` files, the index then removed."""
    state = tensors()
    mapping = {k: 1 + i % files for i, k in enumerate(state)}
    dcp.save(dict(state), storage_writer=HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=mapping),
             no_dist=True)  # fmt: skip
    names = sorted(os.listdir(folder))
    assert names == [f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)] + [INDEX]
    os.remove(folder / INDEX)
    return state


@pytest.mark.parametrize("files", [1, 3])
def test_a_complete_shard_set_without_its_index_loads_and_says_so(tmp_path, caplog, files):
    state = torch_save(tmp_path, files)
    with caplog.at_level(logging.INFO, logger="loader"):
        report = load_hf_checkpoint(net := Net(), tmp_path, options=LoadOptions(progress=False))
    for name, value in state.items():
        assert torch.equal(net.state_dict()[name], value), name
    assert report.missing_keys == report.unexpected_keys == ()
    lines = [r.getMessage() for r in caplog.records if "shard file" in r.getMessage()]
    assert lines and str(tmp_path) in lines[0] and f"complete set of {files} shard file(s)" in lines[0]
    assert all(f"model-{i:05d}-of-{files:05d}.safetensors" in lines[0] for i in range(1, files + 1))
    # inside dcp.load: our reader, a drop-in for torch's, reads the same folder as torch's reader does
    for reader in (SafetensorsReader(str(tmp_path)), HuggingFaceStorageReader(str(tmp_path))):
        planner = HFLoadPlanner(inside := Net())
        dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
        for name, value in state.items():
            assert torch.equal(inside.state_dict()[name], value), (type(reader).__name__, name)


def test_a_shard_set_with_a_member_missing_is_refused(tmp_path):
    torch_save(tmp_path, 3)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    for opener in (
        SafetensorsCheckpoint.open,
        lambda p: load_hf_checkpoint(Net(), p, options=LoadOptions(progress=False)),
    ):
        with pytest.raises(CheckpointError, match="holds 2 of the 3 shard files") as info:
            opener(tmp_path)
        assert "missing model-00002-of-00003.safetensors" in str(info.value) and INDEX in str(info.value)
        assert info.value.path == str(tmp_path)


def test_shard_files_of_two_sets_or_numbered_past_their_set_are_refused(tmp_path):
    torch_save(first := tmp_path / "first", 2)
    torch_save(second := tmp_path / "second", 3)
    shutil.copy(second / "model-00003-of-00003.safetensors", first)
    with pytest.raises(CheckpointError, match="2 sets of different sizes") as info:
        SafetensorsCheckpoint.open(first)
    assert "model-00001-of-00002.safetensors, model-00002-of-00002.safetensors" in str(info.value)
    os.remove(first / "model-00003-of-00003.safetensors")
    shutil.copy(first / "model-00002-of-00002.safetensors", first / "model-00003-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"numbered outside 1\.\.2 \(model-00003-of-00002.safetensors\)"):
        SafetensorsCheckpoint.open(first)


def test_a_saves_staging_folder_is_refused(tmp_path):
    """A save killed before its commit leaves ``<path>.tmp-XXXXXXXX`` holding every shard, no index."""
    staging = tmp_path / "ckpt.tmp-a1b2_c3d"
    torch_save(staging, 2)
    with pytest.raises(CheckpointError, match="staging folder of a save interrupted before its commit") as info:
        load_hf_checkpoint(Net(), staging, options=LoadOptions(progress=False))
    assert info.value.path == str(staging)
    torch_save(tmp_path / "ckpt.tmp-not-ours", 2)  # another name: an ordinary folder
    SafetensorsCheckpoint.open(tmp_path / "ckpt.tmp-not-ours")
