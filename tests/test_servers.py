"""The real servers of tests/servers.py do what the remote-loading tests rely on: ranges, ETags, the Hub layout,
moto's S3, and each fault the fault server can be told to make. Servers are shared per module."""

from __future__ import annotations

import email.parser
import email.policy
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers

requests = pytest.importorskip("requests")

SIZE = 70_000
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TIMEOUT = 10  # seconds for answers that come; ``hang`` uses a short one


@pytest.fixture(scope="module")
def data() -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(SIZE))


@pytest.fixture(scope="module")
def root(tmp_path_factory, data):
    """A plain folder (``model.safetensors``) and the same file in a Hub layout under ``hub/``."""
    root = tmp_path_factory.mktemp("served")
    (root / "model.safetensors").write_bytes(data)
    repo = root / "hub" / "org" / "name"
    (repo / COMMIT).mkdir(parents=True)
    (repo / COMMIT / "model.safetensors").write_bytes(data)
    (repo / "main").symlink_to(COMMIT)
    return root


@pytest.fixture(scope="module")
def web(root):
    yield from servers.serve(servers.nginx(root))


@pytest.fixture(scope="module")
def hub(root):
    yield from servers.serve(servers.nginx(root / "hub", hub=True))


@pytest.fixture(scope="module")
def s3(root):
    yield from servers.serve(servers.s3_server())


@pytest.fixture(scope="module")
def faults_server(root):
    yield from servers.serve(servers.fault_server(root))


@pytest.fixture
def faults(faults_server):
    url, control = faults_server
    control.clear()
    return url + "/model.safetensors", control


def get(url: str, range_: str | None = None, **headers: str):
    if range_:
        headers["Range"] = range_
    return requests.get(url, headers=headers, timeout=TIMEOUT)


def multipart(response) -> list[tuple[str, bytes]]:
    """``(Content-Range, payload)`` of each part of a ``multipart/byteranges`` body, by Python's email parser."""
    head = f"Content-Type: {response.headers['Content-Type']}\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + response.content)
    assert message.is_multipart()
    return [(part["Content-Range"], part.get_payload(decode=True)) for part in message.iter_parts()]


def check_single_range(url: str, data: bytes) -> str:
    response = get(url, "bytes=100-1099")
    assert response.status_code == 206
    assert response.headers["Content-Range"] == f"bytes 100-1099/{SIZE}"
    assert response.content == data[100:1100]
    etag = response.headers["ETag"]
    assert etag.startswith('"') and etag.endswith('"'), etag  # strong
    return etag


# --- nginx -----------------------------------------------------------------------------------------------------


def test_nginx_single_range_and_stable_etag(web, data):
    url = web + "/model.safetensors"
    etag = check_single_range(url, data)
    assert requests.head(url, timeout=TIMEOUT).headers["ETag"] == etag
    assert get(url, "bytes=-10").content == data[-10:]
    assert get(url, "bytes=10-19", **{"If-Match": etag}).status_code == 206
    assert get(url, "bytes=10-19", **{"If-Match": '"other"'}).status_code == 412
    assert get(url, f"bytes={SIZE}-").status_code == 416
    assert ("GET", "/model.safetensors", "bytes=100-1099", 206, 1000) in [
        r[:5] for r in web.requests("/model.safetensors")
    ]


def test_nginx_multi_range_is_multipart_byteranges(web, data):
    ranges = [(0, 8), (1000, 5000), (SIZE - 10, SIZE)]
    response = get(web + "/model.safetensors", "bytes=" + ",".join(f"{a}-{b - 1}" for a, b in ranges))
    assert response.status_code == 206
    assert response.headers["Content-Type"].startswith("multipart/byteranges; boundary=")
    parts = multipart(response)
    assert parts == [(f"bytes {a}-{b - 1}/{SIZE}", data[a:b]) for a, b in ranges]


def test_nginx_takes_1024_ranges_in_one_request(web, data):
    """max_ranges 1024 and 64 KiB header buffers: a 1024-range header (about 13 KiB) is one 206."""
    ranges = [(i * 60, i * 60 + 7) for i in range(1024)]
    response = get(web + "/model.safetensors", "bytes=" + ",".join(f"{a}-{b - 1}" for a, b in ranges))
    assert response.status_code == 206
    assert [payload for _, payload in multipart(response)] == [data[a:b] for a, b in ranges]
    too_many = "bytes=" + ",".join(f"{i * 60}-{i * 60}" for i in range(1025))
    assert get(web + "/model.safetensors", too_many).status_code == 200  # past max_ranges: the whole file


def test_nginx_overlapping_ranges_larger_than_the_file_are_ignored(web, data):
    """nginx's rule: when the ranges add up to more than the file, it answers 200 with the whole file."""
    response = get(web + "/model.safetensors", f"bytes=0-{SIZE - 1},0-{SIZE - 1}")
    assert response.status_code == 200 and response.content == data


def test_nginx_limit_rate_serves_the_same_bytes(root, data):
    for url in servers.serve(servers.nginx(root, limit_rate=10_000_000)):
        check_single_range(url + "/model.safetensors", data)


def test_nginx_hub_resolve_urls(hub, data):
    url = hub + "/org/name/resolve/main/model.safetensors"
    etag = check_single_range(url, data)
    head = requests.head(url, timeout=TIMEOUT).headers
    assert head["X-Repo-Commit"] == COMMIT and head["X-Linked-Size"] == str(SIZE) and head["X-Linked-Etag"] == etag
    assert get(hub + f"/org/name/resolve/{COMMIT}/model.safetensors", "bytes=0-9").content == data[:10]
    for path, code in [("org/name/resolve/main/nope", "EntryNotFound"), ("org/name/resolve/dev/x", "RevisionNotFound")]:
        response = get(f"{hub}/{path}")
        assert (response.status_code, response.headers["X-Error-Code"]) == (404, code)
    assert get(hub + "/org/other/resolve/main/x").headers["X-Error-Code"] == "RepoNotFound"


def test_nginx_hub_through_huggingface_hub(hub, data, monkeypatch):
    """HfFileSystem and hf_hub_download work against it (endpoint= as HF_ENDPOINT would give)."""
    hf = pytest.importorskip("huggingface_hub")
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # tests/hf_models.py sets HF_HUB_OFFLINE=1
    meta = hf.get_hf_file_metadata(hf.hf_hub_url("org/name", "model.safetensors", endpoint=hub))
    assert (meta.commit_hash, meta.size) == (COMMIT, SIZE)
    fs = hf.HfFileSystem(endpoint=hub, skip_instance_cache=True)
    assert fs.ls("org/name", detail=False) == ["org/name/model.safetensors"]
    assert fs.info("org/name/model.safetensors")["size"] == SIZE
    with fs.open("org/name/model.safetensors", cache_type="none") as f:  # the default cache reads 4 MiB blocks
        f.seek(5000)
        assert f.read(100) == data[5000:5100]
    assert hub.requests()[-1].range == "bytes=5000-5099"
    with pytest.raises(FileNotFoundError):
        fs.info("org/name@dev/model.safetensors")


# --- moto's S3 -------------------------------------------------------------------------------------------------


def test_s3_ranged_get_etag_and_if_match(s3, root, data, monkeypatch):
    assert servers.put_folder(s3, "ckpt", "models/tiny", root) == "s3://ckpt/models/tiny"
    for key, value in servers.s3_env(s3).items():
        monkeypatch.setenv(key, value)
    import boto3
    import botocore.exceptions

    client = boto3.client("s3")  # everything from the environment s3_env gives
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="models/tiny/")["Contents"]]
    assert "models/tiny/model.safetensors" in keys and f"models/tiny/hub/org/name/{COMMIT}/model.safetensors" in keys
    got = client.get_object(Bucket="ckpt", Key="models/tiny/model.safetensors", Range="bytes=100-1099")
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206 and got["ContentRange"] == f"bytes 100-1099/{SIZE}"
    assert got["Body"].read() == data[100:1100]
    etag = got["ETag"]
    again = client.get_object(Bucket="ckpt", Key="models/tiny/model.safetensors", Range="bytes=0-9", IfMatch=etag)
    assert again["ETag"] == etag and again["Body"].read() == data[:10]
    with pytest.raises(botocore.exceptions.ClientError) as failed:
        client.get_object(Bucket="ckpt", Key="models/tiny/model.safetensors", Range="bytes=0-9", IfMatch='"x"')
    assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    # like S3, several ranges in one request are not served: 200 with the whole object
    many = client.get_object(Bucket="ckpt", Key="models/tiny/model.safetensors", Range="bytes=0-9,20-29")
    assert many["ResponseMetadata"]["HTTPStatusCode"] == 200 and many["Body"].read() == data


def test_throttle_proxies_s3_ranges_and_etags(s3, root, data):
    """A bandwidth-limited nginx proxy in front of moto keeps 206, Content-Range, ETag and If-Match; its log counts."""
    servers.put_folder(s3, "throttled", "", root)
    for proxy in servers.serve(servers.throttle(s3, limit_rate=50_000_000)):
        client = servers.s3_client(proxy)
        got = client.get_object(Bucket="throttled", Key="model.safetensors", Range="bytes=100-1099")
        assert got["ContentRange"] == f"bytes 100-1099/{SIZE}" and got["Body"].read() == data[100:1100]
        with pytest.raises(Exception, match="PreconditionFailed"):
            client.get_object(Bucket="throttled", Key="model.safetensors", Range="bytes=0-9", IfMatch='"x"')
        first = proxy.requests("/throttled/model.safetensors")[0]
        assert (first.range, first.status, first.bytes) == ("bytes=100-1099", 206, 1000)


# --- the fault server ------------------------------------------------------------------------------------------


def test_fault_server_normal_ranges_and_log(faults, data):
    url, control = faults
    etag = check_single_range(url, data)
    assert get(url, "bytes=10-19", **{"If-Match": etag}).status_code == 206
    assert get(url, "bytes=10-19", **{"If-Match": '"other"'}).status_code == 412
    response = get(url, "bytes=0-9,100-199")
    assert multipart(response) == [(f"bytes 0-9/{SIZE}", data[:10]), (f"bytes 100-199/{SIZE}", data[100:200])]
    assert get(url).content == data
    assert get(url, f"bytes={SIZE}-").status_code == 416
    log = control.log()
    assert log[0][:5] == ("GET", "/model.safetensors", "bytes=100-1099", 206, 1000)
    assert [r.status for r in log] == [206, 206, 412, 206, 200, 416]


def test_fault_ignore_range_and_status(faults, data):
    url, control = faults
    control.set("/model.safetensors", ignore_range=True)
    response = get(url, "bytes=10-19")
    assert response.status_code == 200 and response.content == data
    for status in (404, 403):
        control.set("/model.safetensors", status=status)
        assert get(url, "bytes=10-19").status_code == status


def test_fault_fail_then_ok(faults, data):
    url, control = faults
    control.set("/model.safetensors", fail_then_ok=2)
    assert [get(url, "bytes=0-9").status_code for _ in range(3)] == [500, 500, 206]
    assert get(url, "bytes=0-9").content == data[:10]


def test_fault_truncate(faults):
    url, control = faults
    control.set("/model.safetensors", truncate=True)
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # urllib3's IncompleteRead: fewer bytes than promised
        get(url, "bytes=0-999")
    assert control.log()[-1][:5] == ("GET", "/model.safetensors", "bytes=0-999", 206, 500)


def test_fault_change_etag_after(faults, data):
    url, control = faults
    control.set("/model.safetensors", change_etag_after=1)
    first, second = get(url, "bytes=0-9"), get(url, "bytes=0-9")
    assert first.content == data[:10] and second.content == bytes(b ^ 0xFF for b in data[:10])
    assert first.headers["ETag"] != second.headers["ETag"]
    assert get(url, "bytes=0-9", **{"If-Match": first.headers["ETag"]}).status_code == 412


def test_fault_hang_and_reset(faults):
    url, control = faults
    control.set("/model.safetensors", hang=True)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(url, headers={"Range": "bytes=0-9"}, timeout=1)
    control.set("/model.safetensors", reset=True)
    with pytest.raises(requests.exceptions.ConnectionError):
        get(url, "bytes=0-9")
    assert [r.status for r in control.log()] == [0, 0]
    with pytest.raises(ValueError, match="unknown modes"):
        control.set("/model.safetensors", slow=True)


def test_servers_leave_no_process_behind(root):
    """The context managers stop their whole process group (nginx's workers too), also when the block raises."""
    pids = []
    for manager in (servers.nginx(root), servers.fault_server(root)):
        with pytest.raises(RuntimeError, match="boom"):
            for url in servers.serve(manager):
                pids.append(url.pid if isinstance(url, str) else url[0].pid)
                os.killpg(pids[-1], 0)  # running
                raise RuntimeError("boom")
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
