"""Loading from URLs end to end (issue 18): every family of tests/hf_models.py over nginx (``http://``), moto's S3
(``s3://``, through ``StorageOptions.backend`` and through the environment) and nginx laid out like the Hub (``hf://``
with ``HF_ENDPOINT``) loads bit-identical to the local load; each fault of the fault server gives a
``CheckpointError`` naming the URL with the model untouched (``rollback=True``), a 500 then success loads; the dcp
path (``HFLoadPlanner`` + ``SafetensorsReader(url)``) and ``regiontrace plan <url>`` work. Servers are per module."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers
from hf_models import FAMILIES, build, clone_state, save

from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint
from loader.checkpoint.header import REMOTE_HEAD_BYTES
from loader.errors import CheckpointError
from loader.options import LoadOptions, RemoteOptions, RequestCosts, StorageOptions

pytest.importorskip("requests")
pytest.importorskip("boto3")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
BUCKET = "ckpts"
SHARDED = "llama_sharded"  # llama saved in 20 KB shards: an index and several files
#: quick failures for the fault tests: one retry, short backoff and timeout
FAST = StorageOptions(remote=RemoteOptions(retries=1, backoff=0.01, request_timeout=1.0))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{name: local folder}`` for each family and :data:`SHARDED`, under ``plain/``; the same files as Hub repos
    ``org/{name}`` under ``hub/`` (``main`` -> :data:`COMMIT`)."""
    root = tmp_path_factory.mktemp("remote_load")
    out = {}
    for family in FAMILIES:
        out[family] = root / "plain" / family
        save(build(family)[1], out[family])
    out[SHARDED] = root / "plain" / SHARDED
    save(build("llama")[1], out[SHARDED], max_shard_size="20KB")
    for name, folder in out.items():
        repo = root / "hub" / "org" / name
        (repo / COMMIT).mkdir(parents=True)
        for f in folder.iterdir():
            (repo / COMMIT / f.name).write_bytes(f.read_bytes())
        (repo / "main").symlink_to(COMMIT)
    return out


@pytest.fixture(scope="module")
def web(folders):
    yield from servers.serve(servers.nginx(folders[SHARDED].parent))


@pytest.fixture(scope="module")
def hub(folders):
    yield from servers.serve(servers.nginx(folders[SHARDED].parent.parent / "hub", hub=True))


@pytest.fixture(scope="module")
def s3(folders):
    for endpoint in servers.serve(servers.s3_server()):
        servers.put_folder(endpoint, BUCKET, "models", folders[SHARDED].parent)
        yield endpoint


@pytest.fixture(scope="module")
def faults_server(folders):
    yield from servers.serve(servers.fault_server(folders[SHARDED].parent))


@pytest.fixture
def remote(web, hub, s3, monkeypatch):
    """``remote(scheme, name)`` -> ``(url, backend settings)``, the environment set for the scheme (within the
    test): ``http``, ``s3_options`` (endpoint and keys as options, none in the environment), ``s3_env``
    (``AWS_ENDPOINT_URL_S3`` and the keys from the environment), ``hf`` (``HF_ENDPOINT``)."""
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # tests/hf_models.py turns it on for local tests

    def make(scheme: str, name: str) -> tuple[str, dict]:
        if scheme == "http":
            return f"{web}/{name}", {}
        if scheme == "s3_options":
            keys = servers.S3_CREDENTIALS
            options = {"endpoint_url": s3, "key": keys["AWS_ACCESS_KEY_ID"], "secret": keys["AWS_SECRET_ACCESS_KEY"]}
            return f"s3://{BUCKET}/models/{name}", {**options, "region_name": keys["AWS_DEFAULT_REGION"]}
        if scheme == "s3_env":
            for key, value in servers.S3_CREDENTIALS.items():
                monkeypatch.setenv(key, value)
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3)
            return f"s3://{BUCKET}/models/{name}", {}
        assert scheme == "hf", scheme
        monkeypatch.setenv("HF_ENDPOINT", hub)
        return f"hf://org/{name}", {}

    return make


SCHEMES = ["http", "s3_options", "s3_env", "hf"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t


def assert_bit_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, e in expected.items():
        a = actual[name]
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(bits(a), bits(e)), name


def object_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.endswith(".safetensors"))


@pytest.mark.parametrize("family", [*FAMILIES, SHARDED])
def test_family_loads_bit_identical_to_the_local_load(family, folders, remote, web):
    _, template = build("llama" if family == SHARDED else family, seed=1)
    local = copy.deepcopy(template)
    local_report = load_hf_checkpoint(local, folders[family], options=LoadOptions(progress=False))
    for scheme in SCHEMES:
        url, options = remote(scheme, family)
        fresh = copy.deepcopy(template)
        logged = len(web.requests())
        report = load_hf_checkpoint(
            fresh, url, options=LoadOptions(progress=False), storage=StorageOptions(backend=options or {})
        )
        assert_bit_equal(fresh.state_dict(), local.state_dict())
        what = (scheme, report)
        assert (report.loaded_keys, report.traced, report.deferred) == (
            local_report.loaded_keys,
            local_report.traced,
            local_report.deferred,
        ), what
        assert report.planned_bytes == local_report.planned_bytes, what
        assert report.planned_bytes <= report.bytes_read <= object_bytes(folders[family]), what
        assert 1 <= report.requests, what
        if scheme == "http":  # the report claims no more than the server sent
            gets = [r for r in web.requests()[logged:] if r.method == "GET"]
            assert report.requests <= len(gets) and report.bytes_read <= sum(r.bytes for r in gets), what


def test_partial_load_fetches_only_its_ranges(folders, remote, web):
    """A model with one layer of the checkpoint's two: with no gap worth reading through, only the planned bytes
    are fetched (the other layer's are not)."""
    url, _ = remote("http", "llama")
    _, model = build("llama", seed=1, num_hidden_layers=1)
    _, local = build("llama", seed=1, num_hidden_layers=1)
    load_hf_checkpoint(local, folders["llama"], options=LoadOptions(progress=False))
    logged = len(web.requests())
    storage = StorageOptions(remote=RemoteOptions(costs=RequestCosts(latency=1e-9)))
    report = load_hf_checkpoint(model, url, options=LoadOptions(progress=False), storage=storage)
    assert_bit_equal(model.state_dict(), local.state_dict())
    assert report.bytes_read == report.planned_bytes < object_bytes(folders["llama"])
    gets = [r for r in web.requests()[logged:] if r.method == "GET"]
    # a file's last request asks its header again first (storage/remote/recheck.py): its data ranges count here
    data = [r for r in gets if not r.range.startswith("bytes=0-") or "," in r.range]
    # bytes_read also counts the data bytes the header's first request returned (used, not fetched again)
    reused = report.bytes_read - sum(data_bytes(r) for r in data)
    assert 0 <= reused < REMOTE_HEAD_BYTES and len(data) == report.requests


def data_bytes(r) -> int:
    """A logged GET's data bytes: the body of a single range; a multi-range request's ranges but a first
    ``0-`` one (the header asked again), as asked (its body also holds the parts' headers)."""
    if "," not in r.range:
        return r.bytes
    spans = [tuple(map(int, part.split("-"))) for part in r.range.removeprefix("bytes=").split(",")]
    return sum(b - a + 1 for a, b in spans if a != 0)


# --- faults ----------------------------------------------------------------------------------------------------


@pytest.fixture
def faulty(faults_server, folders):
    """``(folder URL, control, last shard's URL path, model, its state before)`` for :data:`SHARDED` served by the
    fault server."""
    url, control = faults_server
    control.clear()
    index = json.loads((folders[SHARDED] / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    _, model = build("llama", seed=1)
    return f"{url}/{SHARDED}", control, f"/{SHARDED}/{last}", model, clone_state(model)


def first_data_request(control, path: str) -> int:
    """How many requests for ``path`` come before its first data read (the GET after the header's: one request of
    its first bytes, as these shards' headers are shorter than it)."""
    log = [r for r in control.log() if r.path == path]
    return [i for i, r in enumerate(log) if r.method == "GET"][1]


FAULTS = [
    ({"ignore_range": True}, "ignores Range"),
    ({"status": 404}, "not found"),
    ({"status": 403}, "access refused"),
    ({"fail_then_ok": 100}, "500"),
    ({"truncate": True}, ""),
    ({"hang": True}, ""),
    ({"reset": True}, ""),
]


@pytest.mark.parametrize(
    ("mode", "match"), FAULTS, ids=[next(iter(m)) + str(next(iter(m.values()))) for m, _ in FAULTS]
)
def test_fault_is_a_checkpoint_error_naming_the_url_and_the_model_is_untouched(faulty, mode, match):
    url, control, path, model, before = faulty
    control.set(path, **mode)
    with pytest.raises(CheckpointError, match=match) as raised:
        load_hf_checkpoint(model, url, options=LoadOptions(rollback=True, progress=False), storage=FAST)
    assert path in str(raised.value), raised.value
    assert_bit_equal(model.state_dict(), before)


def test_object_replaced_mid_load_rolls_back(faulty, folders):
    """The last shard's ETag changes after its header was read: its first data read is refused (412 on If-Match),
    and the tensors already written from the other shards are restored."""
    url, control, path, model, before = faulty
    _, probe = build("llama", seed=1)
    load_hf_checkpoint(
        probe, url, options=LoadOptions(progress=False)
    )  # a clean load: how many requests come before the data reads
    skip = first_data_request(control, path)
    control.clear()
    control.set(path, change_etag_after=skip)
    with pytest.raises(CheckpointError, match="changed") as raised:
        load_hf_checkpoint(model, url, options=LoadOptions(rollback=True, progress=False), storage=FAST)
    assert path in str(raised.value)
    assert_bit_equal(model.state_dict(), before)


def test_500_then_success_loads(faulty, folders):
    url, control, path, model, _ = faulty
    _, local = build("llama", seed=1)
    load_hf_checkpoint(local, folders[SHARDED], options=LoadOptions(progress=False))
    control.set(path, fail_then_ok=2)
    storage = replace(FAST, remote=replace(FAST.remote, retries=3))
    load_hf_checkpoint(model, url, options=LoadOptions(progress=False), storage=storage)
    assert_bit_equal(model.state_dict(), local.state_dict())
    assert [r.status for r in control.log() if r.path == path][:2] == [500, 500]


# --- dcp and the command line ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "s3_options", "hf"])
def test_dcp_load_through_safetensors_reader(scheme, folders, remote):
    import torch.distributed.checkpoint as dcp

    url, options = remote(scheme, "qwen3_moe")
    _, local = build("qwen3_moe", seed=1)
    model = copy.deepcopy(local)
    load_hf_checkpoint(local, folders["qwen3_moe"], options=LoadOptions(progress=False))
    planner = HFLoadPlanner(model)
    reader = SafetensorsReader(url, storage=StorageOptions(backend=options or {}))
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
    report = planner.finish(reader)
    assert_bit_equal(model.state_dict(), local.state_dict())
    assert report.bytes_read >= report.planned_bytes > 0 and report.requests >= 1


@pytest.mark.parametrize("scheme", ["http", "s3_env", "hf"])
def test_cli_plan_of_a_url(scheme, folders, remote):
    import loader.cli

    def plan(checkpoint: str, *extra: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert loader.cli.main(["plan", checkpoint, "--mesh", "2x2", "--json", *extra]) in (0, None)
        return json.loads(out.getvalue())

    url, options = remote(scheme, "qwen3_moe")
    extra = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    remote_plan, local_plan = plan(url, *extra), plan(str(folders["qwen3_moe"]))
    assert remote_plan.pop("checkpoint") == url.rstrip("/")
    local_plan.pop("checkpoint")
    assert remote_plan == local_plan


# --- bytes on the wire ----------------------------------------------------------------------------------------


WIRE = "wire_moe"  # a Qwen3-MoE of hidden 64, head_dim 128 and 8 experts of 2048 in 4 MB shards (6 files), on nginx


@pytest.fixture(scope="module")
def wire_folder(folders):
    """:data:`WIRE` saved beside the other folders nginx serves; its model's config is the folder's."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=2048, num_hidden_layers=2),
        **dict(num_attention_heads=4, num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2),
        **dict(vocab_size=128, tie_word_embeddings=False),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    folder = folders[SHARDED].parent / WIRE
    model.save_pretrained(folder, max_shard_size="4MB")
    return folder


def header_bytes(folder) -> int:
    """What a rank's header requests may fetch: the index, and per file its first request (the 8-byte length and
    the header, or :data:`REMOTE_HEAD_BYTES` where that is more)."""
    total = (folder / "model.safetensors.index.json").stat().st_size
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += max(8 + int.from_bytes(fh.read(8), "little"), REMOTE_HEAD_BYTES)
    return total


def data_fetched_twice(folder, requests) -> dict[str, int]:
    """Per file, the data bytes (past its header) that ``requests`` fetched more than once."""
    out = {}
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            data_start = 8 + int.from_bytes(fh.read(8), "little")
        seen = np.zeros(f.stat().st_size, dtype=np.int64)
        for r in requests:
            if r.path.endswith("/" + f.name) and r.range:
                for part in r.range.removeprefix("bytes=").split(","):
                    a, b = part.split("-")
                    seen[int(a) : int(b) + 1] += 1
        out[f.name] = int((seen[data_start:] > 1).sum())
    return out


def test_one_rank_fetches_each_byte_once_and_no_head_request(wire_folder, web):
    """One process loading all of :data:`WIRE` from nginx: no HEAD request, each data byte fetched once (the header's
    first request's data bytes used, not fetched again), bytes on the wire within 1.05x the tensors' bytes and the
    header requests' bytes."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(wire_folder))
    storage = StorageOptions(backend={"headers": {"User-Agent": "regiontrace-wire-one"}})
    report = load_hf_checkpoint(model, f"{web}/{WIRE}", options=LoadOptions(progress=False), storage=storage)
    sent = [r for r in web.requests() if r.agent == "regiontrace-wire-one"]
    assert sent and not [r for r in sent if r.method != "GET"], sent
    assert not any(data_fetched_twice(wire_folder, sent).values())
    shard = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert report.planned_bytes == shard
    assert sum(r.bytes for r in sent) <= 1.05 * shard + header_bytes(wire_folder), sent


def test_hub_files_are_probed_without_head_requests(remote, hub):
    """``hf://``: each file's existence, size, identity and commit come with its first bytes from one ranged GET at
    its resolve URL (the index's included), as over plain HTTP: no HEAD request."""
    url, options = remote("hf", SHARDED)
    logged = len(hub.requests())
    _, model = build("llama", seed=1)
    load_hf_checkpoint(model, url, options=LoadOptions(progress=False), storage=StorageOptions(backend=options or {}))
    sent = hub.requests()[logged:]
    assert len(sent) > 6 and all(r.method == "GET" for r in sent), sent  # the index and 6 shards at least


@pytest.mark.dist
@pytest.mark.parametrize("name", ["wire_tp4", "wire_tp4_bounded"])
def test_bytes_on_the_wire_per_rank_are_its_shard_and_the_headers(world, wire_folder, name):
    """:data:`WIRE` TP on 4 ranks from nginx with exchanged reads (q/k/v/embed/lm_head ``Shard(0)``, o_proj
    ``Shard(1)``, experts' gate_up ``Shard(1)`` and down ``Shard(2)``): per rank, as nginx's log counts it, no HEAD
    request, no data byte fetched twice, and the bytes on the wire within ``1 + max_overread`` times its shard (the
    default 0.05; ``wire_tp4_bounded``: 0.01) and the header requests' bytes."""
    from gloo_world import ok
    from remote_worker import WIRE_BOUND

    results, logged = world
    bound = WIRE_BOUND if "bounded" in name else RequestCosts().max_overread
    for rank, res in enumerate(ok(results, name)):
        assert res["unequal_shards"] == [], (rank, res)
        sent = [r for r in logged if r.agent == res["agent"]]
        assert sent and not [r for r in sent if r.method != "GET"], (rank, sent)
        assert not any(data_fetched_twice(wire_folder, sent).values()), (rank, sent)
        wire = sum(r.bytes for r in sent)
        assert wire <= (1 + bound) * res["shard_bytes"] + header_bytes(wire_folder), (rank, wire, res)


# --- 4 gloo ranks ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(folders, web, s3, wire_folder, tmp_path_factory):
    """tests/remote_worker.py's scenarios on 4 gloo ranks: a bf16 qwen3_moe checkpoint (as tests/test_distributed.py
    loads locally) in S3 and on nginx; yields ``(results per rank, nginx requests during the run)``."""
    import remote_worker
    import transformers
    from gloo_world import WORLD, run_world

    root = tmp_path_factory.mktemp("remote_world")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2),
        **dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2),
        **dict(vocab_size=70, tie_word_embeddings=False),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    folder = folders[SHARDED].parent / "dist_moe"  # served by nginx too
    model.save_pretrained(folder)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "ref.pt")
    keys = servers.S3_CREDENTIALS
    ctx = {
        "store": str(root / "store"),
        "out": str(root),
        "local": str(folder),
        "ref": str(root / "ref.pt"),
        "s3": s3,
        "s3_url": servers.put_folder(s3, BUCKET, "dist/moe", folder),
        "s3_keys": {
            "key": keys["AWS_ACCESS_KEY_ID"],
            "secret": keys["AWS_SECRET_ACCESS_KEY"],
            "region_name": "us-east-1",
        },
        "s3_env": {**servers.s3_env(s3), "AWS_ENDPOINT_URL": ""},
        "http_url": f"{web}/dist_moe",
        "wire_local": str(wire_folder),
        "wire_url": f"{web}/{WIRE}",
    }
    ctx["s3_env"].pop("AWS_ENDPOINT_URL")
    logged = len(web.requests())
    results = run_world(remote_worker.__file__, root, str(root), ctx, expected_codes=[0] * WORLD)
    return results, web.requests()[logged:]


@pytest.mark.dist
@pytest.mark.parametrize(
    "name",
    [
        "s3_tp4",
        "s3_ep_tp_2x2",
        "http_tp4",
        "http_tp4_each_its_own",
        "local_tp4_exchanged",
        "s3_dcp_2x2",
        "s3_broadcast_2x2",
    ],
)
def test_remote_shards_equal_the_local_ones_on_4_ranks(world, name):
    from gloo_world import ok

    results, _ = world
    per_rank = ok(results, name)
    for rank, res in enumerate(per_rank):
        assert res["unequal_shards"] == [] and res["bad"] == [], (rank, res)
        assert res["requests"] >= 1, (rank, res)
        if "broadcast" not in name:  # broadcasting ranks fetch some of each other's replicated regions
            # exchanged reads: what a rank did not fetch itself, a peer fetched and sent it
            assert res["planned_bytes"] <= res["bytes_read"] + res["bytes_exchanged"], (rank, res)
            assert res["planned_bytes"] <= 1.02 * res["shard_bytes"], (rank, res)
            assert res["bytes_read"] <= 1.05 * res["shard_bytes"], (rank, res)
        if "each_its_own" in name:
            assert res["bytes_exchanged"] == 0, (rank, res)
        elif "tp4" in name:  # column shards: fetched in contiguous chunks, exchanged
            assert res["bytes_exchanged"] > 0, (rank, res)
    if "broadcast" in name:  # one fetch per replicated region: fewer bytes in all than each rank fetching its own
        alone = ok(results, "s3_ep_tp_2x2")  # planned: what each rank would read of its own
        assert sum(r["bytes_read"] for r in per_rank) < sum(r["planned_bytes"] for r in alone)


@pytest.mark.dist
def test_exchanged_reads_take_fewer_requests_than_each_rank_its_own(world):
    """TP column shards over HTTP: each rank fetching its own runs needs many ranges (multipart requests); fetched
    as contiguous chunks and exchanged, a few plain ranged requests per file."""
    from gloo_world import ok

    results, _ = world
    exchanged, alone = ok(results, "http_tp4"), ok(results, "http_tp4_each_its_own")
    assert sum(r["requests"] for r in exchanged) < sum(r["requests"] for r in alone), (exchanged, alone)


@pytest.mark.dist
def test_tp_column_shards_use_multi_range_requests_over_http(world):
    """TP column shards are strided rows of a tensor: nginx is asked several ranges per request."""
    _, logged = world
    ranges = [r.range for r in logged if r.method == "GET" and r.range]  # http_tp4_each_its_own's, at least
    assert ranges and any("," in r for r in ranges), ranges
    probes = [r for r in logged if r.path == "/dist_moe/model.safetensors.index.json"]  # it has none: a 404
    assert probes and all(r.status == 404 for r in probes), probes
    assert all(r.status == 206 for r in logged if r.method == "GET" and r not in probes), logged


def test_hub_revisions_and_missing_repos(folders, remote):
    _, local = build("llama", seed=1)
    load_hf_checkpoint(local, folders["llama"], options=LoadOptions(progress=False))
    url, _ = remote("hf", "llama")
    for path, revision in [(url, COMMIT), (f"{url}@main", None), (f"{url}@{COMMIT}", COMMIT)]:
        _, model = build("llama", seed=1)
        load_hf_checkpoint(model, path, options=LoadOptions(progress=False), storage=StorageOptions(revision=revision))
        assert_bit_equal(model.state_dict(), local.state_dict())
    _, model = build("llama", seed=1)
    before = clone_state(model)
    for path, revision, match in [
        (url, "dev", "RevisionNotFound"),
        ("hf://org/nothing", None, "RepoNotFound"),
        (f"{url}@main", "dev", "names revision 'main'"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            load_hf_checkpoint(
                model, path, options=LoadOptions(progress=False), storage=StorageOptions(revision=revision)
            )
    assert_bit_equal(model.state_dict(), before)
