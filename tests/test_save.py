"""``save_hf_checkpoint`` in one process (issue 10).

Oracle: transformers. For every family of tests/hf_models.py our files are byte-identical to
``save_pretrained``'s (every shard, the index, config.json, generation_config.json), and ``from_pretrained`` of
them gives the model back bit for bit. Plain modules save through reversed renames or ``source_shapes``;
conversions without an inverse are refused before anything is written; a failed save leaves nothing behind.
"""

from __future__ import annotations

import os
import resource
import signal

import numpy as np
import pytest
import torch
from hf_models import FAMILIES, build, read_checkpoint
from huggingface_hub import split_torch_state_dict_into_shards
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file
from torch import nn

import regiontrace as rt
from loader import Convert, Rename, SafetensorsCheckpoint, SaveReport, load_hf_checkpoint, save_hf_checkpoint
from loader.options import LoadOptions, Rules, SaveOptions
from loader.rules import dot_natural_key
from loader.save import TensorSpec, map_for_save, plan_layout, plan_rank_writes
from loader.save.filelayout import header_bytes, parse_size, split_into_files
from loader.save.write import BlockWriter, create_files
from regiontrace.testing import programs, random_tensor

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def folder_bytes(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t


def assert_bit_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, e in expected.items():
        a = actual[name]
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(bits(a), bits(e)), name


# ---------------------------------------------------------------------------------------------------
# transformers families: the same files as save_pretrained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_files_equal_save_pretrained(family, dtype, tmp_path):
    auto, model = build(family, dtype=dtype)
    sharded = {"max_shard_size": "40KB"} if dtype == torch.float32 else {}  # bf16: one file
    report = save_hf_checkpoint(model, tmp_path / "ours", options=SaveOptions(progress=False, **sharded))
    model.save_pretrained(tmp_path / "theirs", **sharded)

    ours, theirs = folder_bytes(tmp_path / "ours"), folder_bytes(tmp_path / "theirs")
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name  # shards, index, config.json, generation_config.json
    assert (len(report.files) > 1) == bool(sharded) and "config.json" in ours
    tensors = read_checkpoint(tmp_path / "ours")
    assert report.keys == tuple(sorted(tensors, key=dot_natural_key))
    assert report.derived_by == "revert_weight_conversion"
    assert report.bytes_written == report.total_size == sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.header_bytes == sum(8 + int.from_bytes(ours[f][:8], "little") for f in report.files)
    assert (report.rank, report.world) == (0, 1) and isinstance(report, SaveReport)

    reference = auto.from_pretrained(tmp_path / "ours", dtype=dtype)
    assert_bit_equal(reference.state_dict(), model.state_dict())


def test_a_loaded_model_saves_the_checkpoint_it_came_from(tmp_path):
    """Loaded by the loader (conversions recorded on the model), saved back: the original files, byte for byte."""
    auto, original = build("qwen3_moe", dtype=torch.bfloat16)
    original.save_pretrained(tmp_path / "ckpt", max_shard_size="30KB")
    _, model = build("qwen3_moe", seed=1, dtype=torch.bfloat16)
    load_hf_checkpoint(model, tmp_path / "ckpt", options=LoadOptions(progress=False))
    assert model._weight_conversions  # recorded like from_pretrained
    save_hf_checkpoint(model, tmp_path / "resaved", options=SaveOptions(max_shard_size="30KB", progress=False))
    assert folder_bytes(tmp_path / "resaved") == folder_bytes(tmp_path / "ckpt")


def test_a_loaded_model_saved_with_another_split_holds_the_same_tensors(tmp_path):
    """Where the original's shard split differs from the save's (another max_shard_size, another writer), the
    files differ but hold the same tensor names, dtypes, shapes and values, bit for bit."""
    _, original = build("qwen3_moe", dtype=torch.bfloat16)
    original.save_pretrained(tmp_path / "ckpt", max_shard_size="30KB")
    _, model = build("qwen3_moe", seed=1, dtype=torch.bfloat16)
    load_hf_checkpoint(model, tmp_path / "ckpt", options=LoadOptions(progress=False))
    save_hf_checkpoint(model, tmp_path / "resaved", options=SaveOptions(progress=False))  # the default: one file
    assert sorted(os.listdir(tmp_path / "resaved")) != sorted(os.listdir(tmp_path / "ckpt"))
    assert_bit_equal(read_checkpoint(tmp_path / "resaved"), read_checkpoint(tmp_path / "ckpt"))


def test_sharded_output_round_trips_through_the_loader(tmp_path):
    _, model = build("mixtral")
    report = save_hf_checkpoint(model, tmp_path / "out", options=SaveOptions(max_shard_size="30KB", progress=False))
    assert len(report.files) > 3 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert SafetensorsCheckpoint.open(str(tmp_path / "out")).total_bytes == report.total_size
    _, fresh = build("mixtral", seed=1)
    load_hf_checkpoint(fresh, tmp_path / "out", options=LoadOptions(progress=False))
    assert_bit_equal(fresh.state_dict(), model.state_dict())


# ---------------------------------------------------------------------------------------------------
# plain modules: renames reversed, Convert with source_shapes


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.qkv = nn.Linear(8, 24, bias=False)
        self.rope = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 4)
        self.experts = nn.Parameter(torch.randn(3, 4, 8))
        self.register_buffer("steps", torch.arange(5))


def rope_permute(w: torch.Tensor, heads: int = 2) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


CONVERT_RULES = [
    Rename(r"^tok\.", "embed."),
    Convert(["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", lambda q, k, v: torch.cat([q, k, v])),
    Convert("attn.wq.weight", "rope.weight", rope_permute),
    Convert("out.weight_t", "out.weight", lambda w: w.t()),
    Convert("moe.*.w", "experts", lambda ws: torch.stack(ws)),
]


def net_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    t = {"tok.weight": torch.randn(10, 8, generator=g), "out.bias": torch.randn(4, generator=g)}
    t.update({f"attn.{p}.weight": torch.randn(8, 8, generator=g) for p in "qkv"})
    t["attn.wq.weight"] = torch.randn(8, 8, generator=g)
    t["out.weight_t"] = torch.randn(8, 4, generator=g)
    t.update({f"moe.{e}.w": torch.randn(4, 8, generator=g) for e in range(3)})
    t["steps"] = torch.arange(5) * 7
    return t


def test_plain_module_with_convert_rules_needs_source_shapes(tmp_path):
    ckpt = net_checkpoint()
    save_file(ckpt, tmp_path / "model.safetensors", metadata={"format": "pt"})
    net = Net()
    load_hf_checkpoint(net, tmp_path, rules=Rules(weights_mapping=CONVERT_RULES), options=LoadOptions(progress=False))
    with pytest.raises(ValueError, match="pass source_shapes"):
        save_hf_checkpoint(net, tmp_path / "no_shapes", rules=Rules(weights_mapping=CONVERT_RULES))
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # refused before anything was created

    extra = {**{k: tuple(v.shape) for k, v in ckpt.items()}, "stray.weight": (2, 2)}
    with pytest.raises(ValueError, match=r"checkpoint keys \['stray.weight'\] \(found by source_shapes\) map to no"):
        save_hf_checkpoint(net, tmp_path / "stray", source_shapes=extra, rules=Rules(weights_mapping=CONVERT_RULES))
    report = save_hf_checkpoint(
        net, tmp_path / "out", source_shapes=str(tmp_path), rules=Rules(weights_mapping=CONVERT_RULES)
    )
    assert report.derived_by == "source_shapes" and not (tmp_path / "out" / "config.json").exists()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()


def test_plain_module_renames_are_reversed(tmp_path):
    rules = [Rename(r"^tok\.", "embed."), Rename(r"^attn\.qkv\.", "qkv."), Rename(r"^proj\.", "out.")]
    net = Net()
    report = save_hf_checkpoint(
        net, tmp_path / "out", rules=Rules(weights_mapping=rules), options=SaveOptions(progress=False)
    )
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert report.derived_by == "renames"
    expected = {"tok.weight", "attn.qkv.weight", "rope.weight", "proj.weight", "proj.bias", "experts", "steps"}
    assert set(saved) == expected
    back = Net()
    load_hf_checkpoint(back, tmp_path / "out", rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False))
    assert_bit_equal(back.state_dict(), net.state_dict())


def test_tied_plain_tensors_are_saved_once(tmp_path):
    net = Net()
    net.head = nn.Linear(8, 10, bias=False)
    net.head.weight = net.embed.weight
    save_hf_checkpoint(net, tmp_path / "out", options=SaveOptions(progress=False))
    assert "head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


@pytest.mark.parametrize(
    ("fn", "source", "says"),
    [
        (lambda w: w * 2, (8, 8), "computed by `mul`, not an index map"),
        (lambda w: w[:, :8], (8, 10), "not a bijection (dropped): source 'src' (8, 10): 16 of 80 elements"),
        (lambda w: w.expand(8, 8), (8, 1), "not a bijection (broadcast)"),
        (lambda w: w.to(torch.bfloat16).float(), (8, 8), "not a bijection (cast)"),
    ],
    ids=["computes", "drops", "broadcast", "narrows"],
)
def test_conversions_without_an_inverse_are_refused(tmp_path, fn, source, says):
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

    shapes = {"src": source}
    with pytest.raises(ValueError, match=r"model tensors \['w'\].*src") as err:
        save_hf_checkpoint(
            One(), tmp_path / "out", source_shapes=shapes, rules=Rules(weights_mapping=[Convert("src", "w", fn)])
        )
    assert says in str(err.value)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------
# the folder: replaced in place, nothing left by a failed save


@pytest.mark.parametrize("url", ["s3://bucket/prefix", "https://example.org/folder", "hf://org/name"])
def test_saving_to_a_url_is_refused_before_anything_is_written(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="object store or the Hub is not supported"):
        save_hf_checkpoint(nn.Linear(2, 2), url)
    assert os.listdir(tmp_path) == []  # not even a temp folder named after the URL


def test_an_existing_folder_gets_its_weights_replaced(tmp_path):
    _, model = build("llama")
    out = tmp_path / "out"
    save_hf_checkpoint(model, out, options=SaveOptions(max_shard_size="20KB", progress=False))
    (out / "README.md").write_text("mine")
    sharded = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(sharded) > 2
    save_hf_checkpoint(model, out, options=SaveOptions(progress=False))  # one file now: the shards and the index go
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    save_hf_checkpoint(model, out, options=SaveOptions(max_shard_size="20KB", progress=False))  # and back
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == sharded
    assert (out / "README.md").read_text() == "mine" and len(os.listdir(tmp_path)) == 1


def test_a_failed_write_leaves_no_checkpoint(tmp_path):
    """A real I/O failure (the file size limit) while the files are created: no folder, no temporary left."""
    _, model = build("llama")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError):
            save_hf_checkpoint(model, tmp_path / "out", options=SaveOptions(progress=False))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------
# the layout: safetensors' headers and huggingface_hub's split, computed from shapes alone


def test_headers_equal_safetensors_serialisation():
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
              torch.uint32, torch.uint64]  # fmt: skip
    names = ["b", "a", "z.0", "z.10", "z.9", "ä.weight", 'q"uote', "back\\slash", "empty"]
    tensors = {}
    for i, name in enumerate(names * 3):
        shape = (0,) if name == "empty" else tuple(torch.randint(1, 4, (i % 3 + 1,), generator=g).tolist())
        tensors[f"{name}.{i}"] = torch.zeros(shape, dtype=dtypes[i % len(dtypes)])
    for metadata in (None, {"format": "pt"}):
        real = save(tensors, metadata=metadata)
        specs = [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
        header, ordered = header_bytes(specs, metadata)
        assert real[: len(header)] == header
        assert len(real) == len(header) + sum(s.nbytes for s in ordered)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=25), st.integers(1, 200))
def test_file_split_equals_huggingface_hub(sizes, limit):
    """Sizes, views sharing a storage (experts of one fused tensor) and empty tensors, split like the hub does."""
    bases = [torch.zeros(64) for _ in range(4)]
    state, specs = {}, []
    for i, (n, base) in enumerate(sizes):
        key = f"layers.{i}.w"
        t = bases[base][:n] if base else torch.zeros(n)  # base 0: a storage of its own
        state[key] = t
        storage = t.untyped_storage()
        sid = ("empty",) if storage.nbytes() == 0 else storage.data_ptr()
        specs.append(TensorSpec(key, tuple(t.shape), t.dtype, sid, storage.nbytes()))
    split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    ours, total = split_into_files(specs, limit)
    assert total == split.metadata["total_size"]
    assert [(name, sorted(keys)) for name, keys in ours] == [
        (name, sorted(keys)) for name, keys in split.filename_to_tensors.items()
    ]


# ---------------------------------------------------------------------------------------------------
# property: random bijective op chains, saved through the writer with a tiny staging buffer


class Holder(nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("out", value)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(programs(), st.integers(0, 2**32 - 1), st.sampled_from([8, 64, 1 << 20]))
def test_random_bijections_write_their_sources_back(tmp_path_factory, program, seed, staging):
    """A random bijective op chain as a ``Convert``: saving the model tensor it made writes back every source, byte
    for byte, through direct and staged (chunked) writes."""
    leaves = {n: rt.RegionTensor.leaf(n, s, d) for n, s, d in program.leaves}
    try:
        rt.invert(rt.trace(program, **leaves), leaves)  # every leaf read once (a leaf left out is a drop)
    except rt.NotInvertible:
        assume(False)
    gen = torch.Generator().manual_seed(seed)
    sources = {n: random_tensor(s, d, gen) for n, s, d in program.leaves}
    model = Holder(program(**{n: t.clone() for n, t in sources.items()}))
    names = list(sources)
    rules = [Convert(names, "out", lambda *xs: program(**dict(zip(names, xs))))]
    shapes = {n: (t.shape, t.dtype) for n, t in sources.items()}
    mapping = map_for_save(model, Rules(weights_mapping=rules), source_shapes=shapes)
    layout = plan_layout(mapping.specs, metadata={"format": "pt"})
    folder = tmp_path_factory.mktemp("prop")
    create_files(folder, layout)
    with BlockWriter(folder, layout, staging_bytes=staging) as writer:
        for block, values in plan_rank_writes(mapping, 0, 1).items:
            writer.write_block(block, values)
    assert writer.bytes_written == layout.data_bytes
    written = load_file(folder / layout.files[0].name)
    for name, t in sources.items():
        assert torch.equal(bits(written[name]), bits(t)), (program, name)


# ---------------------------------------------------------------------------------------------------
# inputs save_pretrained would write wrong or not at all: a clear ValueError, and nothing on disk


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))


ONE_BYTE = "a file holds at least one byte"


@pytest.mark.parametrize(
    ("size", "why"),
    [
        ("infGB", "not a finite number of bytes"), ("1e400GB", "not a finite number of bytes"),
        ("1e300GB", "not a finite number of bytes"), ("nanGB", "not a finite number of bytes"),
        (None, "a NoneType, not an int or a str"), (1e9, "a float, not an int or a str"),
        (True, "a bool, not an int or a str"), (-5, ONE_BYTE), (0, ONE_BYTE), ("-1GB", ONE_BYTE),
        ("0.0001KB", ONE_BYTE), ("garbage", "no known unit ('ge')"),
        ("5XB", "no known unit ('XB')"), ("5", "no known unit ('5')"), ("GB", "'' is not a number"),
        ("five GB", "'five' is not a number"),
    ],
)  # fmt: skip
def test_a_bad_max_shard_size_is_a_value_error_before_anything_is_written(tmp_path, size, why):
    with pytest.raises(ValueError) as err:
        save_hf_checkpoint(Tiny(), tmp_path / "out", options=SaveOptions(max_shard_size=size, progress=False))
    assert str(err.value).startswith(f"max_shard_size={size!r} is not a file size ({why})"), str(err.value)
    assert os.listdir(tmp_path) == []  # no folder, no temporary folder


def test_max_shard_size_reads_like_save_pretrained_and_binary_units(tmp_path):
    """Decimal units as huggingface_hub reads them for save_pretrained (its float arithmetic: the same split),
    binary units as transformers' convert_file_size_to_int; files equal save_pretrained's with the byte count."""
    from huggingface_hub.serialization._base import parse_size_to_int
    from transformers.utils.hub import convert_file_size_to_int

    for text in ["5GB", "500MB", "1.5KB", "1.001MB", " 5 gb ", "20kb", "1e3KB", "2TB"]:
        assert parse_size(text) == parse_size_to_int(text), text
    for text in ["10GiB", "3MiB", "20KiB", "2kib"]:
        assert parse_size(text) == convert_file_size_to_int(text), text
    assert parse_size("1TiB") == 2**40 and parse_size(np.int64(4096)) == 4096 and parse_size(1) == 1

    _, model = build("llama")
    report = save_hf_checkpoint(model, tmp_path / "ours", options=SaveOptions(max_shard_size="20KiB", progress=False))
    model.save_pretrained(tmp_path / "theirs", max_shard_size=20 * 1024)
    assert len(report.files) > 2 and folder_bytes(tmp_path / "ours") == folder_bytes(tmp_path / "theirs")


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_a_tensor_named_metadata_is_refused_before_anything_is_written(tmp_path, kind):
    """safetensors keeps its header metadata under ``__metadata__``: a tensor of that name makes a file it cannot
    read (as save_file itself writes it)."""
    model = Tiny()
    value = torch.ones(2)
    if kind == "parameter":
        model.register_parameter("__metadata__", nn.Parameter(value))
    else:
        model.register_buffer("__metadata__", value)
    with pytest.raises(ValueError, match=r"checkpoint key '__metadata__' is the header entry safetensors reserves"):
        save_hf_checkpoint(model, tmp_path / "out", options=SaveOptions(progress=False))
    assert os.listdir(tmp_path) == []
    save_file({"__metadata__": value}, tmp_path / "raw.safetensors")  # why: the file safetensors writes
    with pytest.raises(Exception, match="header"):
        load_file(tmp_path / "raw.safetensors")


@pytest.mark.parametrize(
    ("make", "bit", "fix"),
    [
        (lambda: torch.randn(5, dtype=torch.complex64).conj(), "conjugate", "resolve_conj"),
        (lambda: torch._neg_view(torch.randn(5)), "negative", "resolve_neg"),
    ],
)
def test_a_contiguous_conj_or_neg_view_is_refused(tmp_path, make, bit, fix):
    """Its memory holds the unconjugated (unnegated) values, and save_pretrained writes that memory: refused."""
    _, model = build("llama")
    model.register_buffer("lazy", make())
    model.save_pretrained(tmp_path / "theirs")
    assert not torch.equal(load_file(tmp_path / "theirs" / "model.safetensors")["lazy"], model.lazy)  # why
    with pytest.raises(ValueError) as err:
        save_hf_checkpoint(model, tmp_path / "ours", options=SaveOptions(progress=False))
    assert f"model tensor 'lazy' has its {bit} bit set" in str(err.value) and f".{fix}()" in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["theirs"]


def test_a_strided_conj_or_neg_view_saves_its_values_as_save_pretrained_does(tmp_path):
    """A non-contiguous conj / neg view: save_pretrained's .contiguous() resolves it; the same bytes here."""
    _, model = build("llama")
    model.register_buffer("conj_t", torch.randn(3, 5, dtype=torch.complex64).conj().t())
    model.register_buffer("neg_imag", torch.randn(6, dtype=torch.complex64).conj().imag)
    assert model.conj_t.is_conj() and model.neg_imag.is_neg() and not model.conj_t.is_contiguous()
    save_hf_checkpoint(model, tmp_path / "ours", options=SaveOptions(progress=False))
    model.save_pretrained(tmp_path / "theirs")
    assert folder_bytes(tmp_path / "ours") == folder_bytes(tmp_path / "theirs")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved["conj_t"], model.conj_t.resolve_conj()) and torch.equal(saved["neg_imag"], model.neg_imag)


def test_rank_agreement_ignores_tensor_order_and_names_the_first_difference():
    """What the ranks of a distributed save compare (tests/test_save_distributed.py runs it on gloo ranks), on a
    real in-process store: the same tensors in another order agree; a rank that disagrees raises, one that
    agrees with rank 0 writes nothing."""
    from torch.distributed import HashStore

    from loader.save.agreement import RankAgreement

    layout = plan_layout([TensorSpec("w", (4, 3), torch.float32), TensorSpec("b", (3,), torch.float32)])
    w, b = torch.zeros(4, 3), torch.zeros(3)
    same = [RankAgreement({"w": w, "b": b}, layout), RankAgreement({"b": b, "w": w}, layout)]
    store = HashStore()
    for rank, agreement in enumerate(same):
        agreement.publish(store, rank)
    assert [a.check(store, rank, 2) for rank, a in enumerate(same)] == [True, True]

    store = HashStore()
    ranks = [RankAgreement({"w": w, "b": b}, layout), RankAgreement({"w": w, "b": b.double()}, layout)]
    ranks.append(RankAgreement({"w": w, "b": b}, layout))
    for rank, agreement in enumerate(ranks):
        agreement.publish(store, rank)
    assert ranks[0].check(store, 0, 3) is False and ranks[2].check(store, 2, 3) is False
    with pytest.raises(ValueError) as err:
        ranks[1].check(store, 1, 3)
    assert str(err.value).startswith(
        "the ranks hold model tensor 'b' differently: rank 0 holds a plain tensor of shape (3,) float32, rank 1 "
        "holds a plain tensor of shape (3,) float64;"
    )
