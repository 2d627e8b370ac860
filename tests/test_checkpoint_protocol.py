"""The Checkpoint protocol: formats that implement it, a key stored as several chunks in several real files (loaded
bit for bit through index maps, value reads and deferred reads), chunk grids compiled against random boxes, and
element encodings the loader does not read refused by name before any byte is read."""

from __future__ import annotations

import math
import os
import sys

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
from loader.execute import execute_plan
from loader.options import LoadOptions, Rules
from loader.plan import StandInCheckpoint, TargetSlot, TraceCache, Untraced, plan_rank
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
            infos = [(headers[name].tensors[key], tuple(map(tuple, box))) for name, box in boxes]  # boxes from JSON
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


@pytest.mark.parametrize(
    "cuts",
    [
        [((0, 3), (0, 8)), ((3, 5), (0, 8)), ((5, 6), (0, 8))],  # row slots, the first across the chunk rows
        [((0, 6), (0, 4)), ((0, 6), (4, 8))],  # column slots, across the column chunks
        [((1, 4), (2, 7))],  # one slot holding a window of all three chunks
    ],
)
def test_slots_across_chunk_bounds_read_their_boxes(split, cuts):
    """Each rank's slot (a box of ``w``, as a sharded model holds it) is read from the chunks it crosses, bit for
    bit, reading only the bytes of its box."""
    ckpt, full = split
    keyplan = plan_keys(Net(), {k: ckpt[k].shape for k in ckpt})
    for box in cuts:
        local = torch.full([b - a for a, b in box], float("nan"))
        slots = {"w": TargetSlot("w", (6, 8), torch.float32, local, ((box, tuple((0, b - a) for a, b in box)),))}
        slots |= {k: TargetSlot(k, tuple(full[k].shape), torch.float32, None, ()) for k in ("b", "p")}
        plan = plan_rank(keyplan, ckpt, slots, check_devices=False)
        assert {chunk_source("w", j) for j in range(3)} >= {r.block.source for r in plan.reads}
        with ckpt.reader() as reader:
            execute_plan(plan, reader, LoadOptions(progress=False))
            assert local.numel() * 4 <= reader.bytes_read <= ckpt["w"].nbytes  # its box's chunks only
        assert torch.equal(local, _narrowed(full["w"], box))


@pytest.mark.dist
def test_a_sharded_model_loads_split_keys_on_every_rank(tmp_path):
    """A 4-rank gloo world: row-sharded ``w`` and column-sharded ``v`` (their slots cross the chunks' bounds) and a
    replicated pinwheel ``p`` load from the split checkpoint equal to the whole tensors."""
    sys.path.insert(0, os.path.dirname(__file__))
    import chunks_worker
    from gloo_world import WORLD, ok, run_world

    g = torch.Generator().manual_seed(1)
    full = {k: torch.randn(6, 8, generator=g) for k in ("w", "v")} | {"p": torch.randn(3, 3, generator=g)}
    parts = {"w": W_PARTS, "v": W_PARTS, "p": [(f"p{j}.safetensors", box) for j, box in enumerate(PINWHEEL)]}
    folder = tmp_path / "split"
    folder.mkdir()
    write_split(str(folder), full, parts)
    torch.save(full, tmp_path / "ref.pt")
    shapes = {k: list(t.shape) for k, t in full.items()}
    ctx = {"store": str(tmp_path / "store"), "out": str(tmp_path), "folder": str(folder), "parts": parts}
    ctx |= {"shapes": shapes, "ref": str(tmp_path / "ref.pt")}
    results = run_world(chunks_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    for r, res in enumerate(ok(results, "split_keys")):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert res["deferred"] == ("p",)
        assert 0 < res["bytes_read"] <= sum(t.numel() * 4 for t in full.values())


def test_unknown_encoding_is_refused_by_name_before_any_read(split):
    ckpt, _ = split
    info = ckpt["b"]
    packed = TensorInfo.of_chunks(info.key, info.dtype, info.shape, info.chunks, encoding="int4-packed")
    assert packed.encoding == "int4-packed" and packed.file == info.file
    odd = TableCheckpoint({**ckpt.tensors, "b": packed}, identities=ckpt.identities, store=ckpt.store)
    net = Net()
    with pytest.raises(CheckpointError) as e:
        load(net, odd)
    assert "'int4-packed'" in str(e.value) and "'b'" in str(e.value) and "a.safetensors" in str(e.value)
    assert all(not p.detach().any() for p in net.parameters())  # nothing written
    with pytest.raises(CheckpointError, match="int4-packed"):
        read_tensor(packed)


# ------------------------------------------------------------------------------------- chunk grids x boxes


class Target(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.out = nn.Parameter(torch.zeros(shape))


#: index maps a conversion may apply to the chunked key (each crosses chunk bounds its own way)
OPS = {
    "identity": lambda k: k,
    "transpose": lambda k: k.t(),
    "flatten": lambda k: k.reshape(-1),
    "flip": lambda k: k.flip(1),
    "every other row": lambda k: k[::2],
    "halves swapped": lambda k: torch.cat([k[k.shape[0] // 2 :], k[: k.shape[0] // 2]]),
}


def _grid(cuts: list[list[int]], shape: tuple[int, ...]) -> list[Box]:
    """The boxes of the grid cutting each dim at ``cuts[d]``."""
    edges = [sorted({0, n, *(c for c in cs if 0 < c < n)}) for cs, n in zip(cuts, shape)]
    boxes: list[Box] = [()]
    for e in edges:
        boxes = [(*b, (lo, hi)) for b in boxes for lo, hi in zip(e, e[1:])]
    return boxes


@st.composite
def guillotine(draw, box: Box, depth: int = 3) -> list[Box]:
    """A random tiling of ``box`` by cuts along one dim at a time (each part cut again, its own way)."""
    splittable = [d for d, (a, b) in enumerate(box) if b - a > 1]
    if depth == 0 or not splittable or not draw(st.booleans()):
        return [box]
    d = draw(st.sampled_from(splittable))
    a, b = box[d]
    cut = draw(st.integers(a + 1, b - 1))
    halves = [tuple((lo, hi) if e == d else span for e, span in enumerate(box)) for lo, hi in ((a, cut), (cut, b))]
    return [part for half in halves for part in draw(guillotine(half, depth - 1))]


@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    tiling=st.data(),
    op=st.sampled_from(sorted(OPS)),
    corner=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
    reverse=st.booleans(),
)
def test_chunk_tilings_compile_to_reads_that_reproduce_the_tensor(shape, tiling, op, corner, reverse):
    """Any guillotine tiling (a grid, or parts cut again) x an index map x a random box of its output: the blocks
    read only chunk sources, each within its chunk, and reproduce the box of the conversion of the whole tensor."""
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    whole = tuple((0, n) for n in shape)
    if tiling.draw(st.booleans()):
        cuts = tiling.draw(st.lists(st.lists(st.integers(1, 6), max_size=3), min_size=2, max_size=2))
        boxes = _grid(cuts, shape)
    else:
        boxes = tiling.draw(guillotine(whole))
    if reverse:  # chunk indices need not follow the index space
        boxes = boxes[::-1]
    chunks = [Chunk(b, f"/nowhere/{j}.safetensors", 0) for j, b in enumerate(boxes)]
    info = TensorInfo.of_chunks("k", torch.float32, shape, chunks)
    ckpt = TableCheckpoint({"k": info})
    expected = OPS[op](full)
    keyplan = plan_keys(Target(tuple(expected.shape)), {"k": shape}, weights_mapping=[Convert("k", "out", OPS[op])])
    (conv,) = keyplan.conversions
    traced = TraceCache().trace(conv, ckpt)
    assert not isinstance(traced, Untraced), traced
    lo = [min(int(c * n), n - 1) for c, n in zip(corner[:2], expected.shape)]
    out_box = tuple((a, a + max(1, int(c * (n - a)))) for a, c, n in zip(lo, corner[2:], expected.shape))
    sources = {chunk_source("k", j): _narrowed(full, b).contiguous() for j, b in enumerate(boxes)}
    if not info.split:
        sources = {"k": full}
    blocks = traced.blocks(0, out_box, conv.sources)
    assert {b.source for b in blocks} <= set(sources)
    for b in blocks:  # each block reads inside its source (its chunk)
        lo_, hi_ = b.source_span()
        assert 0 <= lo_ <= hi_ <= sources[b.source].numel()
    out = torch.full([hi - lo for lo, hi in out_box], float("nan"))
    execute_blocks(blocks, sources, out)
    assert torch.equal(out, _narrowed(expected, out_box))
