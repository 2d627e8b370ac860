"""A DCP chunk's blob is read when the chunk is first needed, not when the folder opens: a key of two chunks (each
a 32 KiB blob of one ``.distcp`` file, from ``dcp.save``) loaded as the rows of one of them reads no page of the
other's blob, and loads bit for bit as ``dcp.load``; a hostile blob is refused, naming the file and the key, only by
a load that needs it, and before a byte is written into the model."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from loader import Convert, load_hf_checkpoint
from loader.checkpoint.dcp import DcpCheckpoint
from loader.errors import CheckpointError
from loader.options import LoadOptions, Rules
from loader.storage import PAGE

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
QUIET = LoadOptions(progress=False)
ROWS, COLS = 4, 4096
SOURCE = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


@pytest.fixture
def two_chunks(tmp_path):
    """A folder whose key ``w`` (4 x 4096) is stored as two chunks of 2 rows, each its own blob of one file."""
    halves = {"top": SOURCE[:2].clone(), "bottom": SOURCE[2:].clone()}
    dcp.save(halves, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own trusted file, edited into a key of two chunks
    top = metadata.state_dict_metadata.pop("top")
    metadata.state_dict_metadata.pop("bottom")
    chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([2, COLS])) for r in (0, 2)]
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(top.properties, torch.Size([ROWS, COLS]), chunks)
    storage = {i.fqn: info for i, info in metadata.storage_data.items()}
    metadata.storage_data = {
        MetadataIndex("w", torch.Size([0, 0]), 0): storage["top"],
        MetadataIndex("w", torch.Size([2, 0]), 1): storage["bottom"],
    }
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return tmp_path


def _pages(chunk) -> set[int]:
    blob = chunk.spec.blob
    return set(range(blob.offset // PAGE, -(-(blob.offset + blob.length) // PAGE)))


def _load_rows(folder, rows: slice) -> tuple[DcpCheckpoint, torch.nn.Linear]:
    checkpoint = DcpCheckpoint.open(folder)
    model = torch.nn.Linear(COLS, len(range(ROWS)[rows]), bias=False)
    rules = Rules(weights_mapping=[Convert("w", "weight", lambda w: w[rows])])
    load_hf_checkpoint(model, checkpoint, rules=rules, options=QUIET)
    return checkpoint, model


def test_a_load_reads_the_blobs_of_the_chunks_it_needs_alone(two_chunks):
    checkpoint = DcpCheckpoint.open(two_chunks)
    assert checkpoint.opened_pages == {}  # opening reads the metadata alone
    first, second = checkpoint.tensors["w"].split
    assert _pages(second) - _pages(first), "the second blob holds pages of its own"
    checkpoint, model = _load_rows(two_chunks, slice(0, 2))
    assert torch.equal(model.weight.detach(), SOURCE[:2])
    first, second = checkpoint.tensors["w"].split
    (read,) = checkpoint.opened_pages.values()
    assert first.found and not second.found
    assert read and read <= _pages(first), (sorted(read), sorted(_pages(first)))


def test_a_key_of_two_chunks_loads_as_dcp_load(two_chunks):
    ours, theirs = torch.nn.Linear(COLS, ROWS, bias=False), {"w": torch.zeros(ROWS, COLS)}
    rules = Rules(weights_mapping=[Convert("w", "weight", lambda w: w * 1)])
    report = load_hf_checkpoint(ours, str(two_chunks), rules=rules, options=QUIET)
    dcp.load(theirs, checkpoint_id=str(two_chunks), no_dist=True)
    assert torch.equal(ours.weight.detach().view(torch.int32), theirs["w"].view(torch.int32))
    assert torch.equal(theirs["w"], SOURCE) and report.bytes_read == SOURCE.nbytes


def _spoil_second_blob(folder) -> None:
    """Overwrite the end-of-central-directory record of the second chunk's blob (its last 22 bytes)."""
    checkpoint = DcpCheckpoint.open(folder)
    blob = checkpoint.tensors["w"].split[1].spec.blob
    with open(checkpoint.tensors["w"].split[1].location, "r+b") as f:
        f.seek(blob.offset + blob.length - 22)
        f.write(b"\0" * 22)


def test_a_hostile_blob_is_refused_by_the_load_that_needs_it_before_a_byte_is_written(two_chunks):
    _spoil_second_blob(two_chunks)
    _, model = _load_rows(two_chunks, slice(0, 2))  # the spoilt blob is not needed: it is not read
    assert torch.equal(model.weight.detach(), SOURCE[:2])
    for rows in (slice(2, 4), slice(1, 3), slice(0, 4)):
        model = torch.nn.Linear(COLS, len(range(ROWS)[rows]), bias=False)
        before = model.weight.detach().clone()
        rules = Rules(weights_mapping=[Convert("w", "weight", lambda w, rows=rows: w[rows])])
        with pytest.raises(CheckpointError, match="end-of-central-directory") as e:
            load_hf_checkpoint(model, str(two_chunks), rules=rules, options=QUIET)
        assert e.value.key == "w" and os.path.basename(e.value.path).endswith(".distcp"), rows
        assert torch.equal(model.weight.detach(), before), rows
    checkpoint = DcpCheckpoint.open(two_chunks)
    with pytest.raises(CheckpointError, match="end-of-central-directory"):
        checkpoint.resolve(["w"])


def test_a_hostile_blob_is_refused_in_planning_without_the_plan_cache(two_chunks):
    """Without a kept plan the plan's sources are looked up in planning too: the load refuses before reading."""
    from loader import HFLoadPlanner

    _spoil_second_blob(two_chunks)
    model = torch.nn.Linear(COLS, ROWS, bias=False)
    before = model.weight.detach().clone()
    planner = HFLoadPlanner(model, rules=Rules(weights_mapping=[Convert("w", "weight", lambda w: w * 1)]))
    planner.plan_cache = None
    with pytest.raises(CheckpointError, match="end-of-central-directory") as e:
        planner.build_plan(DcpCheckpoint.open(two_chunks))
    assert e.value.key == "w"
    with pytest.raises(CheckpointError, match="end-of-central-directory"):
        load_hf_checkpoint(model, str(two_chunks), planner=planner, options=QUIET)
    assert torch.equal(model.weight.detach(), before)
