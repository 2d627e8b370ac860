"""The Checkpoint protocol: formats that implement it, a key stored as several chunks in several real files (loaded
bit for bit through index maps, value reads and deferred reads), chunk grids compiled against random boxes, and
element encodings the loader does not read refused by name before any byte is read."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from loader import load_hf_checkpoint
from loader.checkpoint import (
    Checkpoint,
    Chunk,
    SafetensorsCheckpoint,
    TableCheckpoint,
    TensorInfo,
    chunk_source,
    read_header_file,
    read_tensor,
)
from loader.errors import CheckpointError
from loader.options import LoadOptions, Rules
from loader.plan import StandInCheckpoint, TraceCache, Untraced
from loader.rules import Convert, plan_keys
from loader.storage import LocalStore
from regiontrace.executor import execute_blocks

Box = tuple[tuple[int, int], ...]


class SplitFiles(TableCheckpoint):
    """A checkpoint over several safetensors files in which a key may be split into sub-boxes: ``parts`` maps each
    key to ``[(file name, box)]``; each file holds its sub-box of the key under the key's own name."""

    def __init__(self, folder: str, parts: dict[str, list[tuple[str, Box]]], shapes: dict[str, tuple[int, ...]]):
        store = LocalStore(folder)
        names = sorted({name for boxes in parts.values() for name, _ in boxes})
        headers = {name: read_header_file(store.locate(name), store) for name in names}
        tensors = {}
        for key, boxes in parts.items():
            infos = [(headers[name].tensors[key], box) for name, box in boxes]
            chunks = [Chunk(box, info.file, info.data_start) for info, box in infos]
            tensors[key] = TensorInfo.of_chunks(key, infos[0][0].dtype, shapes[key], chunks)
        identities = {store.locate(name): h.identity for name, h in headers.items()}
        super().__init__(tensors, identities=identities, store=store)


def load(model: nn.Module, checkpoint: Checkpoint, rules: list | None = None):
    """``load_hf_checkpoint`` of ``checkpoint`` (an object, not a path) with ``rules`` replacing the default ones."""
    options = LoadOptions(progress=False)
    return load_hf_checkpoint(model, checkpoint, rules=Rules(weights_mapping=rules), options=options)


def _narrowed(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (a, b) in enumerate(box):
        t = t.narrow(d, a, b - a)
    return t


def write_split(folder: str, full: dict[str, torch.Tensor], parts: dict[str, list[tuple[str, Box]]]) -> SplitFiles:
    """Write each key's sub-boxes into the files ``parts`` names; the checkpoint over them."""
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for key, boxes in parts.items():
        for name, box in boxes:
            by_file.setdefault(name, {})[key] = _narrowed(full[key], box).contiguous()
    for name, tensors in by_file.items():
        save_file(tensors, os.path.join(folder, name))
    return SplitFiles(folder, parts, {k: tuple(t.shape) for k, t in full.items()})


#: ``w`` (6, 8): rows 0:2 in a.safetensors, rows 2:6 split by columns into b (cols 0:3) and c (cols 3:8)
W_PARTS = [
    ("a.safetensors", ((0, 2), (0, 8))),
    ("b.safetensors", ((2, 6), (0, 3))),
    ("c.safetensors", ((2, 6), (3, 8))),
]
#: a pinwheel tiling of (3, 3): no cut along one dim separates its chunks
PINWHEEL = [((0, 1), (0, 2)), ((0, 2), (2, 3)), ((2, 3), (1, 3)), ((1, 3), (0, 1)), ((1, 2), (1, 2))]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(6, 8))
        self.b = nn.Parameter(torch.zeros(6))
        self.p = nn.Parameter(torch.zeros(3, 3))


@pytest.fixture
def split(tmp_path) -> tuple[SplitFiles, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(6, 8, generator=g), "b": torch.randn(6, generator=g), "p": torch.randn(3, 3, generator=g)}
    parts = {
        "w": W_PARTS,
        "b": [("a.safetensors", ((0, 6),))],
        "p": [(f"p{j}.safetensors", box) for j, box in enumerate(PINWHEEL)],
    }
    return write_split(str(tmp_path), full, parts), full


def test_every_format_is_a_checkpoint(split, tmp_path):
    ckpt, _ = split
    save_file({"x": torch.ones(2)}, os.path.join(tmp_path, "model.safetensors"))
    stand_in = StandInCheckpoint({"x": ((2, 3), torch.float16)})
    for c in (SafetensorsCheckpoint.open(tmp_path / "model.safetensors"), stand_in, ckpt):
        assert isinstance(c, Checkpoint)
    assert not isinstance({"x": None}, Checkpoint)
    assert stand_in["x"].shape == (2, 3) and stand_in.identities == {} and stand_in.files == ()
    with pytest.raises(ValueError, match="no bytes"):
        stand_in.reader()


def test_chunks_tile_and_resolve_as_sources(split):
    ckpt, full = split
    info = ckpt["w"]
    assert len(info.chunks) == 3 and info.file is None and info.nbytes == full["w"].numel() * 4
    assert ckpt["b"].split == () and ckpt["b"].chunks[0].box == ((0, 6),)  # one chunk: a plain info
    second = ckpt[chunk_source("w", 1)]
    assert second.shape == (4, 3) and second.file.endswith("b.safetensors") and second.split == ()
    assert chunk_source("w", 1) not in ckpt and set(ckpt) == {"w", "b", "p"}
    with pytest.raises(KeyError):
        ckpt[chunk_source("w", 3)]
    assert set(ckpt.files) == {
        os.path.join(ckpt.root, n) for n in ("a.safetensors", "b.safetensors", "c.safetensors")
    } | {os.path.join(ckpt.root, f"p{j}.safetensors") for j in range(5)}
    with pytest.raises(CheckpointError, match="overlap"):
        TensorInfo.of_chunks("v", torch.float32, (4,), [Chunk(((0, 3),), "f", 0), Chunk(((2, 4),), "f", 12)])
    with pytest.raises(CheckpointError, match="cover 3 of the 4"):
        TensorInfo.of_chunks("v", torch.float32, (4,), [Chunk(((0, 3),), "f", 0)])
    for key, tensor in full.items():  # a whole read assembles the chunks
        assert torch.equal(read_tensor(ckpt[key]), tensor)


def test_a_key_split_across_files_loads_bit_for_bit(split):
    """Index maps read each chunk within its bounds; the pinwheel tiling is read whole, assembled."""
    ckpt, full = split
    net = Net()
    report = load(net, ckpt)
    for key, tensor in full.items():
        assert torch.equal(getattr(net, key).detach(), tensor), key
    assumed = torch.cat([full["w"][:2], torch.cat([full["w"][2:, :3], full["w"][2:, 3:]], dim=1)])
    assert torch.equal(net.w.detach(), assumed)
    assert set(report.loaded_keys) == {"w", "b", "p"}
    assert set(report.traced) == {"w", "b"} and report.deferred == ("p",)
    assert "no cuts along one dim" in report.deferred_reasons["p"]
    assert report.bytes_read == sum(t.numel() * 4 for t in full.values())  # every chunk read once


class Converted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.zeros(8, 6))  # w transposed
        self.s = nn.Parameter(torch.zeros(3, 4))  # a window across the three chunks
        self.v = nn.Parameter(torch.zeros(6, 8))  # computed by a pointwise op: a value read


def test_conversions_over_a_split_key(split):
    ckpt, full = split
    rules = [Convert("w", ["t", "s", "v"], lambda w: (w.t(), w[1:4, 2:6], w * 2 + 1))]
    net = Converted()
    report = load(net, ckpt, rules)
    w = full["w"]
    assert torch.equal(net.t.detach(), w.t())
    assert torch.equal(net.s.detach(), w[1:4, 2:6])
    assert torch.equal(net.v.detach(), w * 2 + 1)
    assert set(report.traced) == {"t", "s", "v"} and report.deferred == ()


def test_unknown_encoding_is_refused_by_name_before_any_read(split):
    ckpt, _ = split
    info = ckpt["b"]
    packed = TensorInfo(info.key, info.file, info.dtype, info.shape, info.data_start, info.data_end, "int4-packed")
    odd = TableCheckpoint({**ckpt.tensors, "b": packed}, identities=ckpt.identities, store=ckpt.store)
    net = Net()
    with pytest.raises(CheckpointError) as e:
        load(net, odd)
    assert "'int4-packed'" in str(e.value) and "'b'" in str(e.value) and "a.safetensors" in str(e.value)
    assert all(not p.detach().any() for p in net.parameters())  # nothing written
    with pytest.raises(CheckpointError, match="int4-packed"):
        read_tensor(packed)


# ------------------------------------------------------------------------------------- chunk grids x boxes


class Square(nn.Module):
    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.out = nn.Parameter(torch.zeros(shape[1], shape[0]))


def _grid(cuts: list[list[int]], shape: tuple[int, ...]) -> list[Box]:
    """The boxes of the grid cutting each dim at ``cuts[d]``."""
    edges = [sorted({0, n, *(c for c in cs if 0 < c < n)}) for cs, n in zip(cuts, shape)]
    boxes: list[Box] = [()]
    for e in edges:
        boxes = [(*b, (lo, hi)) for b in boxes for lo, hi in zip(e, e[1:])]
    return boxes


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 7),
    cols=st.integers(1, 7),
    cuts=st.lists(st.lists(st.integers(1, 6), max_size=3), min_size=2, max_size=2),
    box=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(1, 7), st.integers(1, 7)),
    flip=st.booleans(),
)
def test_chunk_grids_compile_to_reads_that_reproduce_the_tensor(rows, cols, cuts, box, flip):
    shape = (rows, cols)
    full = torch.arange(rows * cols, dtype=torch.float32).view(shape)
    boxes = _grid(cuts, shape)
    if flip:  # the grid's boxes in another order: chunk indices need not follow the index space
        boxes = boxes[::-1]
    chunks = [Chunk(b, f"/nowhere/{j}.safetensors", 0) for j, b in enumerate(boxes)]
    info = TensorInfo.of_chunks("k", torch.float32, shape, chunks)
    ckpt = TableCheckpoint({"k": info})
    keyplan = plan_keys(Square(shape), {"k": shape}, weights_mapping=[Convert("k", "out", lambda k: k.t())])
    (conv,) = keyplan.conversions
    traced = TraceCache().trace(conv, ckpt)
    assert not isinstance(traced, Untraced)
    r0, c0 = min(box[0], cols - 1), min(box[1], rows - 1)
    out_box = ((r0, min(cols, r0 + box[2])), (c0, min(rows, c0 + box[3])))
    sources = {chunk_source("k", j): _narrowed(full, b).contiguous() for j, b in enumerate(boxes)} if info.split else {}
    sources.setdefault("k", full)
    blocks = traced.blocks(0, out_box, conv.sources)
    assert all(b.source in sources for b in blocks)
    if info.split:
        assert all(b.source != "k" for b in blocks)  # every read is within one chunk
    out = torch.full([hi - lo for lo, hi in out_box], float("nan"))
    execute_blocks(blocks, sources, out)
    assert torch.equal(out, _narrowed(full.t(), out_box))
    assert math.prod(out.shape) == sum(b.numel for b in blocks)
