"""The new source formats over the wire: a sharded ``.bin`` folder, a DCP folder and a compressed-tensors int4
folder, each from nginx (``http://``), moto's S3 (``s3://``) and nginx laid out like the Hub (``hf://``), load
bit-identical to the local load (itself checked against ``from_pretrained`` / ``dcp.load``), with the planned bytes
of the local load; in one process and on 4 gloo ranks (tests/formats_remote_worker.py). A zip's central directory,
its pickle and a DCP chunk's records are fetched by range: nginx's own log holds the bytes sent to the planned
bytes and the metadata, and a partial load fetches well under the files' sizes."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers
from bin_files import save_bin
from hf_models import build, read_checkpoint, save
from packed_int4 import scheme_of, write_pack_quantized

from loader import load_hf_checkpoint
from loader.options import LoadOptions, RemoteOptions, RequestCosts, StorageOptions

pytest.importorskip("requests")
pytest.importorskip("boto3")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

QUIET = LoadOptions(progress=False)
BF16 = torch.bfloat16
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BUCKET = "formats"
FORMATS = ["bin", "dcp", "int4"]
SCHEMES = ["http", "s3", "hf"]
#: where a format's checkpoint is opened from, under its folder's URL (a remote DCP folder is named by its metadata)
ENTRY = {"bin": "", "dcp": "/.metadata", "int4": "", "nothing": ""}
#: a llama of about 2.7 MB in bf16: big enough that a file's opening requests (64 KiB each) are a small part of it
SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def assert_bit_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, e in expected.items():
        a = actual[name]
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(bits(a), bits(e)), name


def write_formats(root, model: torch.nn.Module) -> dict[str, object]:
    """``{format: folder}`` under ``root``: ``model``'s bf16 weights as a sharded ``.bin`` folder, a DCP folder and
    an int4 ``pack-quantized`` folder (asymmetric groups of 16), each with the config."""
    import torch.distributed.checkpoint as dcp

    folders = {f: root / f for f in FORMATS}
    save_bin(model, folders["bin"], BF16, max_shard_bytes=1_000_000)
    state = {k: v.detach().to(BF16).clone() for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(folders["dcp"]), no_dist=True)
    model.config.save_pretrained(folders["dcp"])
    save(model, root / "plain", dtype=BF16)
    folders["int4"].mkdir()
    (folders["int4"] / "config.json").write_text((root / "plain" / "config.json").read_text())
    write_pack_quantized(folders["int4"], read_checkpoint(root / "plain"), scheme_of(4, 16, False))
    return folders


def asked(r) -> int:
    """A logged GET's bytes as tests/test_remote_load.py counts them: a single range's body; of several, the ranges
    but a first ``0-`` one (the file's header asked again, storage/remote/recheck.py: not the load's reads)."""
    if "," not in (r.range or ""):
        return r.bytes
    spans = [tuple(map(int, part.split("-"))) for part in r.range.removeprefix("bytes=").split(",")]
    return sum(b - a + 1 for a, b in spans if a != 0)


def file_bytes(folder, fmt: str) -> int:
    """The bytes of the files holding ``fmt``'s tensors."""
    suffix = {"bin": ".bin", "dcp": ".distcp", "int4": ".safetensors"}[fmt]
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.endswith(suffix))


def meta_bytes(folder, fmt: str) -> int:
    """What a load may fetch besides the tensors: the index / config / DCP metadata whole, and per data file its
    opening requests (the tail with the central directory, local headers, the pickle; a safetensors header)."""
    small = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".json", "") or f.name == ".metadata")
    return small + 3 * 65536 * sum(1 for f in folder.iterdir() if f.suffix in (".bin", ".distcp", ".safetensors"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The three formats of one llama under ``plain/``, the same files as Hub repos ``org/{format}`` under
    ``hub/``."""
    root = tmp_path_factory.mktemp("formats_remote")
    _, model = build("llama", seed=2, **SIZE)
    out = write_formats(root / "plain", model)
    for fmt, folder in out.items():
        repo = root / "hub" / "org" / fmt
        (repo / COMMIT).mkdir(parents=True)
        for f in folder.iterdir():
            (repo / COMMIT / f.name).write_bytes(f.read_bytes())
        (repo / "main").symlink_to(COMMIT)
    return out


@pytest.fixture(scope="module")
def web(folders):
    yield from servers.serve(servers.nginx(folders["bin"].parent))


@pytest.fixture(scope="module")
def hub(folders):
    yield from servers.serve(servers.nginx(folders["bin"].parent.parent / "hub", hub=True))


@pytest.fixture(scope="module")
def s3(folders):
    for endpoint in servers.serve(servers.s3_server()):
        servers.put_folder(endpoint, BUCKET, "models", folders["bin"].parent)
        yield endpoint


def s3_backend(endpoint: str) -> dict:
    keys = servers.S3_CREDENTIALS
    return {
        "endpoint_url": endpoint,
        "key": keys["AWS_ACCESS_KEY_ID"],
        "secret": keys["AWS_SECRET_ACCESS_KEY"],
        "region_name": keys["AWS_DEFAULT_REGION"],
    }


@pytest.fixture
def remote(web, hub, s3, monkeypatch):
    """``remote(scheme, fmt)`` -> ``(url, StorageOptions)``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def make(scheme: str, fmt: str, **options) -> tuple[str, StorageOptions]:
        if scheme == "http":
            return f"{web}/{fmt}{ENTRY[fmt]}", StorageOptions(**options)
        if scheme == "s3":
            return f"s3://{BUCKET}/models/{fmt}{ENTRY[fmt]}", StorageOptions(backend=s3_backend(s3), **options)
        assert scheme == "hf", scheme
        monkeypatch.setenv("HF_ENDPOINT", hub)
        return f"hf://org/{fmt}{ENTRY[fmt]}", StorageOptions(**options)

    return make


def target(fmt: str, **overrides) -> torch.nn.Module:
    _, model = build("llama", seed=9, dtype=BF16, **{**SIZE, **overrides})
    return model


def reference(fmt: str, folder) -> dict[str, torch.Tensor]:
    """What the format's own reader makes of ``folder``: ``from_pretrained`` (int4 dequantized) or ``dcp.load``."""
    import transformers

    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        state = copy.deepcopy(target(fmt)).state_dict()
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        return state
    extra = {}
    if fmt == "int4":
        extra["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=BF16, **extra).state_dict()


@pytest.mark.parametrize("fmt", FORMATS)
def test_local_load_equals_the_formats_own_reader(fmt, folders):
    model = target(fmt)
    report = load_hf_checkpoint(model, str(folders[fmt]), options=QUIET)
    assert_bit_equal(model.state_dict(), reference(fmt, folders[fmt]))
    assert report.bytes_read == report.planned_bytes <= file_bytes(folders[fmt], fmt)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_remote_load_is_bit_identical_to_the_local_one(fmt, scheme, folders, remote, web):
    local = target(fmt)
    local_report = load_hf_checkpoint(local, str(folders[fmt]), options=QUIET)
    url, storage = remote(scheme, fmt)
    model = target(fmt)
    logged = len(web.requests())
    report = load_hf_checkpoint(model, url, options=QUIET, storage=storage)
    assert_bit_equal(model.state_dict(), local.state_dict())
    what = (fmt, scheme, report)
    assert report.loaded_keys == local_report.loaded_keys and report.deferred == local_report.deferred, what
    assert report.planned_bytes == local_report.planned_bytes, what
    assert report.planned_bytes <= report.bytes_read <= file_bytes(folders[fmt], fmt), what
    if scheme == "http":  # nginx's own count: every data-file request a range, within 1.05x planned + metadata
        sent = [r for r in web.requests()[logged:] if r.method == "GET" and r.path.startswith(f"/{fmt}/")]
        data = [r for r in sent if r.path.endswith((".bin", ".distcp", ".safetensors"))]
        assert data and all(r.range for r in data), sent
        wire = sum(asked(r) for r in sent)
        assert report.planned_bytes <= wire <= 1.05 * report.planned_bytes + meta_bytes(folders[fmt], fmt), sent


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_partial_load_fetches_well_under_the_files(fmt, scheme, folders, remote, web, hub):
    """A model of one layer of the checkpoint's two: only that layer's ranges (and the metadata) are fetched;
    nothing is downloaded whole. nginx's log counts what it sent for ``http`` and ``hf``."""
    url, storage = remote(scheme, fmt, remote=RemoteOptions(costs=RequestCosts(latency=1e-9)))
    local, model = target(fmt, num_hidden_layers=1), target(fmt, num_hidden_layers=1)
    load_hf_checkpoint(local, str(folders[fmt]), options=QUIET)
    server = {"http": web, "hf": hub}.get(scheme)
    logged = len(server.requests()) if server else 0
    report = load_hf_checkpoint(model, url, options=QUIET, storage=storage)
    assert_bit_equal(model.state_dict(), local.state_dict())
    total = file_bytes(folders[fmt], fmt)
    assert report.bytes_read == report.planned_bytes < 0.8 * total, (report, total)
    if server is not None:
        sent = [r for r in server.requests()[logged:] if r.method == "GET"]
        data = [r for r in sent if r.path.endswith((".bin", ".distcp", ".safetensors"))]
        assert data and all(r.range for r in data), sent
        assert sum(r.bytes for r in data) < 0.8 * total, sent


# --- 4 gloo ranks ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(folders, web, s3, hub, tmp_path_factory):
    """tests/formats_remote_worker.py: each format TP on 4 ranks from local, nginx, S3 and the Hub, compared on
    each rank with the local load."""
    import formats_remote_worker
    from gloo_world import WORLD, run_world

    root = tmp_path_factory.mktemp("formats_world")
    refs = {}
    for fmt in FORMATS:  # the one-process local load (checked against the format's own reader above)
        model = target(fmt)
        load_hf_checkpoint(model, str(folders[fmt]), options=QUIET)
        refs[fmt] = str(root / f"ref_{fmt}.pt")
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, refs[fmt])
    ctx = {
        "ref": refs,
        "total": {f: file_bytes(p, f) for f, p in folders.items()},
        "store": str(root / "store"),
        "out": str(root),
        "local": {f: str(p) for f, p in folders.items()},
        "http": {f: f"{web}/{f}{ENTRY[f]}" for f in FORMATS},
        "s3": {f: f"s3://{BUCKET}/models/{f}{ENTRY[f]}" for f in FORMATS},
        "hf": {f: f"hf://org/{f}{ENTRY[f]}" for f in FORMATS},
        "s3_backend": s3_backend(s3),
        "hf_endpoint": str(hub),
    }
    logged = len(web.requests())
    results = run_world(formats_remote_worker.__file__, root, str(root), ctx, expected_codes=[0] * WORLD)
    return results, web.requests()[logged:]


@pytest.mark.dist
@pytest.mark.parametrize("scheme", ["local", *SCHEMES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_four_ranks_load_each_format_like_the_local_load(world, fmt, scheme, folders):
    """Per rank: its shards equal its local load, its planned bytes the local load's (well under the files), what
    it fetched within 1.05x of them; over nginx, the bytes nginx sent it (by its User-Agent) too."""
    from gloo_world import ok

    results, logged = world
    for rank, res in enumerate(ok(results, f"{fmt}_{scheme}")):
        assert res["unequal"] == [] and res["bad"] == [], (rank, res)
        assert res["planned_bytes"] == res["local_planned"], (rank, res)
        assert res["planned_bytes"] < 0.6 * res["total_bytes"], (rank, res)  # its shards, not the whole
        if scheme == "local":
            assert res["bytes_read"] == res["planned_bytes"], (rank, res)
        else:  # exchanged reads: what a rank did not fetch, a peer fetched and sent it
            assert res["planned_bytes"] <= res["bytes_read"] + res["bytes_exchanged"], (rank, res)
            assert res["bytes_read"] <= 1.05 * res["planned_bytes"] + 4096, (rank, res)
            # packed int4 column shards are exchanged too: a few requests per file, not one per row (~2200)
            assert fmt != "int4" or res["requests"] < 100, (rank, res)
        if scheme == "http":
            sent = [r for r in logged if r.agent == res["agent"] and r.method == "GET"]
            wire = sum(asked(r) for r in sent)
            assert sent and res["bytes_read"] <= wire, (rank, res, sent)
            assert wire <= 1.05 * res["planned_bytes"] + meta_bytes(folders[fmt], fmt), (rank, wire, res, sent)


@pytest.mark.dist
def test_four_ranks_over_nginx_send_no_whole_file(world):
    """Every request of a data file is a range answered 206 (the probes of files a format does not have: 404)."""
    _, logged = world
    data = [r for r in logged if r.method == "GET" and r.path.endswith((".bin", ".distcp", ".safetensors"))]
    found = [r for r in data if r.status != 404]
    assert found and all(r.range and r.status == 206 for r in found), found
    assert {r.path for r in data if r.status == 404} <= {"/bin/model.safetensors"}, data


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_dcp_folder_url_opens_as_its_metadata(scheme, folders, remote):
    """A remote DCP folder named by its folder URL (not its ``.metadata``): found after the safetensors and
    ``.bin`` probes, loaded as from ``.../.metadata``."""
    url, storage = remote(scheme, "dcp")
    local, model = target("dcp"), target("dcp")
    load_hf_checkpoint(local, str(folders["dcp"]), options=QUIET)
    report = load_hf_checkpoint(model, url.removesuffix("/.metadata") + "/", options=QUIET, storage=storage)
    assert_bit_equal(model.state_dict(), local.state_dict())
    assert report.planned_bytes <= report.bytes_read <= file_bytes(folders["dcp"], "dcp")


def test_a_url_with_no_checkpoint_names_the_safetensors_probe(remote):
    from loader.errors import CheckpointNotFoundError

    url, storage = remote("http", "nothing")
    with pytest.raises(CheckpointNotFoundError, match="safetensors"):
        load_hf_checkpoint(target("bin"), url, options=QUIET, storage=storage)
