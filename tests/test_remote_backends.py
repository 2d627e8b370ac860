"""The remote backends (loader/storage/remote: HTTP, S3, the Hub, fsspec) against real servers on 127.0.0.1: nginx,
moto's S3 and the fault server of tests/servers.py. Each backend's stat and get, single and multi-range, and each
fault of issue 18 as the backend reports it (the fetcher's retries are tested with the reader)."""

from __future__ import annotations

import logging
import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers
from safetensors.torch import save_file

from loader.errors import CheckpointError
from loader.storage import ObjectIdentity
from loader.storage.remote.backend import RemoteOptions, Transient
from loader.storage.remote.backends import make_backend

pytest.importorskip("requests")
pytest.importorskip("boto3")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
NAME = "model.safetensors"
FAST = RemoteOptions(request_timeout=1.0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A real safetensors file, in a plain folder and in a Hub layout under ``hub/`` (``main`` -> the commit)."""
    root = tmp_path_factory.mktemp("remote")
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(64, 96, generator=generator) for i in range(8)}
    save_file(tensors, str(root / NAME))
    repo = root / "hub" / "org" / "name"
    (repo / COMMIT).mkdir(parents=True)
    (repo / COMMIT / NAME).write_bytes((root / NAME).read_bytes())
    (repo / "main").symlink_to(COMMIT)
    return root


@pytest.fixture(scope="module")
def data(root) -> bytes:
    return (root / NAME).read_bytes()


@pytest.fixture(scope="module")
def web(root):
    yield from servers.serve(servers.nginx(root))


@pytest.fixture(scope="module")
def hub(root):
    yield from servers.serve(servers.nginx(root / "hub", hub=True))


@pytest.fixture(scope="module")
def s3(root):
    for endpoint in servers.serve(servers.s3_server()):
        servers.put_folder(endpoint, "ckpt", "models/tiny", root)
        yield endpoint


@pytest.fixture(scope="module")
def faults_server(root):
    yield from servers.serve(servers.fault_server(root))


@pytest.fixture
def faults(faults_server):
    url, control = faults_server
    control.clear()
    return url + "/" + NAME, control


RANGES = [(0, 8), (1000, 5000), (20_000, 20_001)]


def check_reads(backend, location: str, data: bytes) -> ObjectIdentity:
    """stat gives the size, single and grouped gets give the file's bytes."""
    identity = backend.stat(location)
    assert identity is not None and identity.size == len(data)
    assert backend.get(location, [(100, 1100)], identity) == [data[100:1100]]
    ranges = [*RANGES, (len(data) - 10, len(data))]
    grouped = backend.get(location, ranges, identity) if backend.multi_range else None
    singles = [backend.get(location, [r], identity)[0] for r in ranges]
    assert singles == [data[a:b] for a, b in ranges]
    assert grouped in (None, singles)
    return identity


# --- HTTP (nginx) ----------------------------------------------------------------------------------------------


def test_http_stat_and_ranges(web, data):
    backend = make_backend(web, {})
    identity = check_reads(backend, f"{web}/{NAME}", data)
    assert identity.etag.startswith('"') and backend.multi_range
    assert backend.stat(f"{web}/missing.safetensors") is None
    log = web.requests(f"/{NAME}")
    assert [r.method for r in log][:1] == ["HEAD"]
    assert f"bytes=0-7,1000-4999,20000-20000,{len(data) - 10}-{len(data) - 1}" in [r.range for r in log]
    backend.close()


def test_http_many_ranges_in_one_request(web, data):
    backend = make_backend(web, {}, options=RemoteOptions(requests_in_flight=2))
    identity = backend.stat(f"{web}/{NAME}")
    ranges = [(i * 300, i * 300 + 17) for i in range(200)]
    before = len(web.requests(f"/{NAME}"))
    assert backend.get(f"{web}/{NAME}", ranges, identity) == [data[a:b] for a, b in ranges]
    assert len(web.requests(f"/{NAME}")) == before + 1


def test_http_changed_object_and_missing(web, data):
    backend = make_backend(web, {})
    identity = backend.stat(f"{web}/{NAME}")
    other = ObjectIdentity(identity.size, '"not-the-etag"')
    with pytest.raises(CheckpointError, match="changed"):  # If-Match: nginx answers 412
        backend.get(f"{web}/{NAME}", [(0, 8)], other)
    with pytest.raises(CheckpointError, match="changed"):  # another size in Content-Range
        backend.get(f"{web}/{NAME}", [(0, 8)], ObjectIdentity(identity.size + 1, identity.etag))
    with pytest.raises(CheckpointError, match="not found"):
        backend.get(f"{web}/missing.safetensors", [(0, 8)], identity)


def test_http_options_are_checked(web):
    with pytest.raises(ValueError, match="unknown backend settings.*'tokn'"):
        make_backend(web, {"tokn": "x"})
    with pytest.raises(ValueError, match="auth"):
        make_backend(web, {"auth": "user:password"})
    with pytest.raises(ValueError, match="revision"):
        make_backend(web, {}, revision="main")
    backend = make_backend(web, {"headers": {"X-Test": "1"}, "auth": ("user", "secret")})
    assert backend.stat(f"{web}/{NAME}") is not None  # nginx ignores both


# --- the fault server ------------------------------------------------------------------------------------------


def test_fault_server_serves_like_nginx(faults, data):
    url, _ = faults
    check_reads(make_backend(url, {}, options=FAST), url, data)


def test_fault_ignored_range(faults, data):
    url, control = faults
    backend = make_backend(url, {}, options=FAST)
    identity = backend.stat(url)
    control.set("/" + NAME, ignore_range=True)
    with pytest.raises(CheckpointError, match="ignores Range requests") as raised:
        backend.get(url, [(0, 8)], identity)
    assert raised.value.path == url


def test_fault_multi_range_unsupported_falls_back_to_single_ranges(faults, data, caplog):
    """A server answering a multi-range request with the whole file: the body is not read, the ranges are fetched
    one by one, and the backend asks one range per request from then on."""
    url, control = faults
    backend = make_backend(url, {}, options=FAST)
    identity = backend.stat(url)
    control.set("/" + NAME, ignore_range=True)
    with caplog.at_level(logging.DEBUG, logger="loader.storage.remote.http"):
        with pytest.raises(CheckpointError, match="ignores Range"):  # then refused for the single ranges as well
            backend.get(url, RANGES, identity)
    assert not backend.multi_range and "ranges one by one" in caplog.text
    control.set("/" + NAME)  # ranges again, still one by one
    assert backend.get(url, RANGES, identity) == [data[a:b] for a, b in RANGES]
    assert [r.range for r in control.log()[-3:]] == [f"bytes={a}-{b - 1}" for a, b in RANGES]


@pytest.mark.parametrize(("status", "match"), [(404, "not found"), (403, "access refused"), (401, "access refused")])
def test_fault_status(faults, status, match):
    url, control = faults
    backend = make_backend(url, {"headers": {"Authorization": "Bearer sekrit"}}, options=FAST)
    identity = backend.stat(url)
    control.set("/" + NAME, status=status)
    with pytest.raises(CheckpointError, match=match) as raised:
        backend.get(url, [(0, 8)], identity)
    assert url in str(raised.value) and "sekrit" not in str(raised.value)
    if status == 404:
        assert backend.stat(url) is None
    else:
        with pytest.raises(CheckpointError, match=match):
            backend.stat(url)


def test_fault_500_is_transient_then_ok(faults, data):
    url, control = faults
    backend = make_backend(url, {}, options=FAST)
    identity = backend.stat(url)
    control.set("/" + NAME, fail_then_ok=1)
    with pytest.raises(Transient, match="500"):
        backend.get(url, [(0, 8)], identity)
    assert backend.get(url, [(0, 8)], identity) == [data[:8]]


@pytest.mark.parametrize("ranges", [[(0, 4000)], RANGES])
def test_fault_truncated_body_is_transient(faults, ranges):
    url, control = faults
    backend = make_backend(url, {}, options=FAST)
    identity = backend.stat(url)
    control.set("/" + NAME, truncate=True)
    with pytest.raises(Transient):
        backend.get(url, ranges, identity)


def test_fault_changed_etag(faults):
    url, control = faults
    backend = make_backend(url, {}, options=FAST)
    identity = backend.stat(url)
    control.set("/" + NAME, change_etag_after=0)
    with pytest.raises(CheckpointError, match="changed") as raised:
        backend.get(url, [(0, 8)], identity)
    assert raised.value.path == url
    assert control.log()[-1].status == 412  # If-Match sent


def test_fault_changed_etag_without_if_match(faults):
    """A server that ignores If-Match: the answer's own ETag is checked."""
    url, control = faults
    backend = make_backend(url, {}, options=FAST)
    identity = backend.stat(url)
    backend.if_match = False
    control.set("/" + NAME, change_etag_after=0)
    with pytest.raises(CheckpointError, match="changed.*ETag"):
        backend.get(url, [(0, 8)], identity)


@pytest.mark.parametrize("mode", ["hang", "reset"])
def test_fault_hang_and_reset_are_transient(faults, mode):
    url, control = faults
    backend = make_backend(url, {}, options=RemoteOptions(request_timeout=0.5))
    identity = backend.stat(url)
    control.set("/" + NAME, **{mode: True})
    with pytest.raises(Transient):
        backend.get(url, [(0, 8)], identity)
    with pytest.raises(Transient):
        backend.stat(url)


# --- S3 (moto) -------------------------------------------------------------------------------------------------


def test_s3_through_options(s3, data, monkeypatch):
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    options = {"endpoint_url": s3, "key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}
    backend = make_backend("s3://ckpt/models/tiny", options)
    assert not backend.multi_range
    identity = check_reads(backend, f"s3://ckpt/models/tiny/{NAME}", data)
    assert identity.etag.startswith('"')
    assert backend.stat("s3://ckpt/models/tiny/missing.safetensors") is None
    assert backend.stat("s3://no-such-bucket/x.safetensors") is None
    with pytest.raises(CheckpointError, match="not found"):
        backend.get("s3://ckpt/models/tiny/missing.safetensors", [(0, 8)], identity)


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_s3_endpoint_from_the_environment(s3, data, monkeypatch, variable):
    for key, value in servers.S3_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv(variable, s3)
    backend = make_backend("s3://ckpt/models/tiny", {})
    identity = backend.stat(f"s3://ckpt/models/tiny/{NAME}")
    assert backend.get(f"s3://ckpt/models/tiny/{NAME}", [(8, 100)], identity) == [data[8:100]]


def test_s3_changed_etag_and_refused(s3, data, monkeypatch):
    for key, value in servers.s3_env(s3).items():
        monkeypatch.setenv(key, value)
    backend = make_backend("s3://ckpt", {})
    location = f"s3://ckpt/models/tiny/{NAME}"
    identity = backend.stat(location)
    with pytest.raises(CheckpointError, match="changed"):  # moto answers IfMatch mismatches with 412
        backend.get(location, [(0, 8)], ObjectIdentity(identity.size, '"other"'))
    with pytest.raises(CheckpointError, match="changed"):
        backend.get(location, [(0, 8)], ObjectIdentity(identity.size + 1, identity.etag))
    with pytest.raises(ValueError, match="unknown backend settings for s3://"):
        make_backend("s3://ckpt", {"secret_key": "x"})


def test_s3_unreachable_endpoint_is_transient(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in servers.s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    backend = make_backend("s3://ckpt", {}, options=FAST)
    with pytest.raises(Transient):
        backend.stat(f"s3://ckpt/{NAME}")


# --- the Hub (nginx laid out like it) --------------------------------------------------------------------------


@pytest.fixture
def hub_env(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # tests/hf_models.py sets it for local tests
    return hub


def test_hub_stat_and_ranges(hub_env, data):
    backend = make_backend("hf://org/name", {})
    identity = check_reads(backend, f"hf://org/name/{NAME}", data)
    assert identity.version == COMMIT and identity.etag.startswith('"')
    paths = {r.path for r in hub_env.requests()}
    assert f"/org/name/resolve/main/{NAME}" in paths  # stat by the branch, reads at its commit
    assert f"/org/name/resolve/{COMMIT}/{NAME}" in paths
    assert backend.stat(f"hf://org/name/{NAME}.missing") is None


def test_hub_revisions(hub_env, data):
    assert make_backend("hf://org/name", {}, revision=COMMIT).stat(f"hf://org/name/{NAME}").version == COMMIT
    assert make_backend(f"hf://org/name@{COMMIT}", {}).stat(f"hf://org/name@{COMMIT}/{NAME}").size == len(data)
    with pytest.raises(CheckpointError, match="RevisionNotFound"):
        make_backend("hf://org/name", {}, revision="dev").stat(f"hf://org/name/{NAME}")
    with pytest.raises(CheckpointError, match="RepoNotFound"):
        make_backend("hf://org/other", {}).stat(f"hf://org/other/{NAME}")
    with pytest.raises(CheckpointError, match="names revision 'dev'"):
        make_backend("hf://org/name@dev", {}, revision="main")
    for bad in ("../../x", "a/../b", "/abs"):
        with pytest.raises(CheckpointError, match="not a branch, tag or commit"):
            make_backend("hf://org/name", {}, revision=bad)
    with pytest.raises(CheckpointError, match="not a branch, tag or commit"):
        make_backend("hf://org/name@..", {})
    with pytest.raises(CheckpointError, match="not an hf://org/name"):
        make_backend("hf://gpt2", {})


def test_hub_token_and_offline(hub_env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_sekrit")
    backend = make_backend("hf://org/name", {})
    assert backend.http.headers["authorization"] == "Bearer hf_sekrit"
    assert make_backend("hf://org/name", {"token": "hf_other"}).http.headers["authorization"] == "Bearer hf_other"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        backend.stat(f"hf://org/name/{NAME}")


# --- fsspec (file://, memory://) -------------------------------------------------------------------------------


def test_fsspec_file_and_memory(root, data):
    fsspec = pytest.importorskip("fsspec")
    backend = make_backend(f"file://{root}", {})
    identity = check_reads(backend, f"file://{root}/{NAME}", data)
    assert identity.version
    assert backend.stat(f"file://{root}/missing") is None
    with pytest.raises(CheckpointError, match="not found"):
        backend.get(f"file://{root}/missing", [(0, 8)], identity)
    memory = fsspec.filesystem("memory")
    memory.pipe_file("/ckpt/model.safetensors", data)
    backend = make_backend("memory://ckpt", {})
    identity = check_reads(backend, "memory://ckpt/model.safetensors", data)
    memory.pipe_file("/ckpt/model.safetensors", data[::-1])  # replaced: each get stats it again
    with pytest.raises(CheckpointError, match="changed"):
        backend.get("memory://ckpt/model.safetensors", [(0, 8)], identity)


def test_fsspec_unknown_protocol_and_missing_package():
    with pytest.raises(ValueError, match="no backend for nosuch://"):
        make_backend("nosuch://bucket/x", {})
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="gs://.*not installed"):
        make_backend("gs://bucket/x", {})


def test_s3_versioned_object_replaced_mid_load_is_read_as_it_was(s3, data, monkeypatch):
    """In a versioned bucket the identity holds the VersionId: reads of a replaced object still get the version
    whose header was read (consistent bytes, not an error)."""
    for key, value in servers.s3_env(s3).items():
        monkeypatch.setenv(key, value)
    client = servers.s3_client(s3)
    client.create_bucket(Bucket="versioned")
    client.put_bucket_versioning(Bucket="versioned", VersioningConfiguration={"Status": "Enabled"})
    client.put_object(Bucket="versioned", Key=NAME, Body=data)
    backend = make_backend("s3://versioned", {})
    identity = backend.stat(f"s3://versioned/{NAME}")
    assert identity.version
    client.put_object(Bucket="versioned", Key=NAME, Body=data[::-1])
    assert backend.get(f"s3://versioned/{NAME}", [(0, 64)], identity) == [data[:64]]
    assert backend.stat(f"s3://versioned/{NAME}").version != identity.version
