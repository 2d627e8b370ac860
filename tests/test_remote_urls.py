"""Remote URLs as a user writes them, and what an error may say about them: credentials and signatures never in an
error, a log or a traceback; a caller's headers not sent to another host on a redirect; index entries that are not
plain names refused; a presigned file URL read as that file; a request's whole duration bounded; multi-range
answers in any shape RFC 9110 allows. Against real servers on 127.0.0.1 (nginx, tests/fault_server.py)."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import traceback

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import requests
import servers
from processes import HOST
from safetensors.torch import save_file

from loader import CheckpointError, SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import quantization_config
from loader.options import RemoteOptions, RequestCosts, Rules, StorageOptions
from loader.storage.remote.backend import Transient
from loader.storage.remote.backends import make_backend
from loader.storage.remote.fetch import with_retries

NAME = "model.safetensors"
INDEX = "model.safetensors.index.json"
SECRETS = ("s3cr3t-password", "s3cr3t-signature", "s3cr3t-credential", "s3cr3t-token", "s3cr3t-sig")
PRESIGNED = (
    "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=s3cr3t-credential&X-Amz-Date=20250101T000000Z"
    "&X-Amz-Expires=3600&X-Amz-Security-Token=s3cr3t-token&X-Amz-Signature=s3cr3t-signature&sig=s3cr3t-sig"
)
FAST = StorageOptions(remote=RemoteOptions(retries=1, backoff=0.0, request_timeout=10.0))


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(64, 96, generator=generator) for i in range(4)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """``ckpt/`` (one file), ``bad/`` (an index that is not JSON), ``small/`` (an 8.5 KB file), ``outside/`` beside
    them: what an index's entries must not reach."""
    root = tmp_path_factory.mktemp("urls")
    for folder in ("ckpt", "bad", "outside", "small", "redirect", "signed", "signed2", "query"):
        (root / folder).mkdir()
    for folder in ("ckpt", "redirect", "signed", "signed2", "query"):  # one per test of the fault servers' logs
        save_file(tensors(), str(root / folder / NAME))
    save_file({"w": torch.arange(2048, dtype=torch.float32)}, str(root / "small" / NAME))
    save_file({"stolen": torch.ones(3)}, str(root / "outside" / NAME))
    (root / "bad" / INDEX).write_text("{not json")
    return root


@pytest.fixture(scope="module")
def web(root):
    yield from servers.serve(servers.nginx(root))


@pytest.fixture(scope="module")
def two_fault_servers(root):
    for first in servers.serve(servers.fault_server(root)):
        for second in servers.serve(servers.fault_server(root)):
            yield first, second


@pytest.fixture
def faults(two_fault_servers):
    for _, control in two_fault_servers:
        control.clear()
    return two_fault_servers[0]


def with_userinfo(url: str) -> str:
    return url.replace("http://", "http://alice:s3cr3t-password@", 1)


def refused_port() -> int:
    """A port nothing listens on (bound, then closed: connecting to it is refused)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def assert_no_secret(error: BaseException, caplog) -> None:
    """No secret in the message, the path, the repr, the traceback (causes included) or the loader's log."""
    shown = [str(error), repr(error), getattr(error, "path", "") or "", caplog.text]
    shown.append("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    for text in shown:
        assert not [s for s in SECRETS if s in text], text


@pytest.mark.parametrize("kind", ["userinfo", "presigned"])
@pytest.mark.parametrize("fault", ["404", "500", "refused", "bad_index"])
def test_credentials_and_signatures_never_reach_an_error_or_a_log(web, faults, kind, fault, caplog):
    caplog.set_level(logging.DEBUG, logger="loader")
    fault_url, control = faults
    base = {"404": f"{web}/nowhere", "500": fault_url, "refused": f"http://{HOST}:{refused_port()}/ckpt"}
    base["bad_index"] = f"{web}/bad"
    if fault == "500":
        control.set(f"/{NAME}", status=500)
    url = with_userinfo(base[fault]) if kind == "userinfo" else base[fault]
    target = f"/{INDEX}" if fault == "bad_index" else f"/{NAME}"
    url = url + target + (PRESIGNED if kind == "presigned" else "")
    with pytest.raises(CheckpointError) as info:
        SafetensorsCheckpoint.open(url, storage=FAST)
    assert_no_secret(info.value, caplog)
    assert target.lstrip("/") in str(info.value) and target.lstrip("/") in info.value.path  # still names the file
    if kind == "presigned":
        assert "X-Amz-Signature=REDACTED" in str(info.value) and "X-Amz-Date=20250101T000000Z" in str(info.value)


def test_a_load_from_a_url_with_credentials_reports_none_of_them(web, caplog):
    caplog.set_level(logging.DEBUG, logger="loader")
    model = torch.nn.Module()
    model.register_parameter("layer0", torch.nn.Parameter(torch.zeros(64, 96)))  # no checkpoint key: unexpected
    load_hf_checkpoint(model, with_userinfo(f"{web}/ckpt") + "?token=s3cr3t-token", rules=Rules(strict=False))
    checkpoint = SafetensorsCheckpoint.open(with_userinfo(f"{web}/ckpt/{NAME}") + PRESIGNED)
    assert not [s for s in SECRETS if s in caplog.text + repr(checkpoint) + repr(checkpoint.store)]
    assert "unexpected" in caplog.text  # the log that names the checkpoint was written


def test_a_redirect_to_another_host_drops_the_callers_headers(two_fault_servers):
    (first, first_control), (second, second_control) = two_fault_servers
    for control in (first_control, second_control):
        control.clear()
    first_control.set(f"/redirect/{NAME}", redirect=second)  # another port: another host to requests
    second_control.set(f"/redirect/{NAME}", refuse_header="X-Secret")  # a 403 if the header reached it
    headers = {"headers": {"X-Secret": "s3cr3t-token"}}
    checkpoint = SafetensorsCheckpoint.open(f"{first}/redirect/{NAME}", storage=StorageOptions(backend=headers))
    assert sorted(checkpoint) == sorted(tensors())
    statuses = [{r.status for r in c.log() if r.path == f"/redirect/{NAME}"} for c in (first_control, second_control)]
    assert statuses == [{302}, {206}]
    with pytest.raises(CheckpointError, match="access refused"):  # allowed: the header goes along, and is refused
        SafetensorsCheckpoint.open(
            f"{first}/redirect/{NAME}", storage=StorageOptions(backend={**headers, "forward_headers": True})
        )
    with pytest.raises(ValueError, match="forward_headers"):
        SafetensorsCheckpoint.open(
            f"{first}/redirect/{NAME}", storage=StorageOptions(backend={"forward_headers": "yes"})
        )


BAD_NAMES = [
    "%2e%2e/outside/model.safetensors",
    "%2E%2E/outside/model.safetensors",
    "%252e%252e/outside/model.safetensors",
    "..%2foutside/model.safetensors",
    "../outside/model.safetensors",
    "sub/../../outside/model.safetensors",
    "/etc/model.safetensors",
    "http://elsewhere/model.safetensors",
    "C:model.safetensors",
    "..\\outside\\model.safetensors",
    "sub//model.safetensors",
    "model.safetensors\0",
    "%00model.safetensors",
]


@pytest.fixture(scope="module")
def evil(root):
    """``evil-<i>/`` folders, each an index naming ``BAD_NAMES[i]`` (beside ``outside/``)."""
    for i, name in enumerate(BAD_NAMES):
        folder = root / f"evil-{i}"
        folder.mkdir()
        (folder / INDEX).write_text(json.dumps({"weight_map": {"stolen": name}}))
    return root


def test_nginx_serves_a_percent_encoded_dotdot_outside_the_folder(web, evil):
    """The attack is real: nginx decodes ``%2e%2e`` and serves the folder beside."""
    answer = requests.get(f"{web}/evil-0/%2e%2e/outside/{NAME}", timeout=10)
    assert answer.status_code == 200 and answer.content == (evil / "outside" / NAME).read_bytes()


@pytest.mark.parametrize("i", range(len(BAD_NAMES)))
@pytest.mark.parametrize("where", ["local", "nginx"])
def test_an_index_entry_that_is_not_a_plain_relative_name_is_refused(web, evil, where, i):
    folder = str(evil / f"evil-{i}") if where == "local" else f"{web}/evil-{i}"
    with pytest.raises(CheckpointError) as info:
        SafetensorsCheckpoint.open(folder)
    assert info.value.path.endswith(INDEX) and info.value.key == "stolen"
    assert INDEX in str(info.value) and repr(BAD_NAMES[i])[1:-1][:12] in str(info.value)
    assert "is not a plain relative name in the folder" in str(info.value)


def test_an_index_entry_with_a_query_or_fragment_is_refused_for_a_url(web, evil):
    for i, name in enumerate(["model.safetensors?x=1", "model.safetensors#part"]):
        folder = evil / f"evil-query-{i}"
        folder.mkdir()
        (folder / INDEX).write_text(json.dumps({"weight_map": {"stolen": name}}))
        with pytest.raises(CheckpointError, match="which a URL reads as its query or fragment") as info:
            SafetensorsCheckpoint.open(f"{web}/evil-query-{i}")
        assert info.value.path.endswith(INDEX) and info.value.key == "stolen"


def test_plain_relative_names_in_subfolders_still_load(root, web):
    folder = root / "nested"
    (folder / "sub").mkdir(parents=True)
    save_file(tensors(), str(folder / "sub" / NAME))
    (folder / INDEX).write_text(json.dumps({"weight_map": {k: f"sub/{NAME}" for k in tensors()}}))
    for where in (str(folder), f"{web}/nested"):
        assert sorted(SafetensorsCheckpoint.open(where)) == sorted(tensors())


def test_a_presigned_file_url_is_that_file_with_its_query(root, web, faults):
    local = SafetensorsCheckpoint.open(str(root / "ckpt" / NAME))
    checkpoint = SafetensorsCheckpoint.open(f"{web}/ckpt/{NAME}{PRESIGNED}")  # nginx ignores the query
    assert checkpoint.files == (f"{web}/ckpt/{NAME}{PRESIGNED}",) and checkpoint.root == f"{web}/ckpt"
    assert {k: (v.shape, v.data_start) for k, v in checkpoint.items()} == {
        k: (v.shape, v.data_start) for k, v in local.items()
    }
    # as S3 checks a signature: the file's requests must carry it; config.json, beside it, is refused (403)
    url, control = faults
    control.set(f"/signed/{NAME}", require_query="X-Amz-Signature=s3cr3t-signature")
    control.set("/signed/config.json", require_query="X-Amz-Signature=another")
    with pytest.raises(CheckpointError, match="access refused"):
        SafetensorsCheckpoint.open(f"{url}/signed/{NAME}")
    checkpoint = SafetensorsCheckpoint.open(f"{url}/signed/{NAME}{PRESIGNED}")
    with checkpoint.reader() as reader:
        got = {key: torch.empty_like(value) for key, value in tensors().items()}
        for key, out in got.items():
            reader.pread_into(checkpoint[key].file, checkpoint[key].data_start, memoryview(out.numpy()).cast("B"))
    assert all(torch.equal(got[k], v) for k, v in tensors().items())
    assert {r.status for r in control.log() if r.path == f"/signed/{NAME}"} == {403, 206}


def test_a_presigned_file_url_loads_and_the_config_beside_it_is_skipped_with_a_warning(faults, caplog):
    url, control = faults
    control.set(f"/signed2/{NAME}", require_query="X-Amz-Signature=s3cr3t-signature")
    control.set("/signed2/config.json", require_query="X-Amz-Signature=another")

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for i in range(4):
                self.register_module(f"layer{i}", torch.nn.Linear(96, 64, bias=False))

    named = Named()
    load_hf_checkpoint(named, f"{url}/signed2/{NAME}{PRESIGNED}")
    assert all(torch.equal(getattr(named, f"layer{i}").weight, tensors()[f"layer{i}.weight"]) for i in range(4))
    checkpoint = SafetensorsCheckpoint.open(f"{url}/signed2/{NAME}{PRESIGNED}")
    with caplog.at_level(logging.WARNING, logger="loader"):
        assert quantization_config(checkpoint.store) is None  # what an FP8 load asks: refused, so absent
    assert "config.json: access refused beside the presigned" in caplog.text
    assert not [s for s in SECRETS if s in caplog.text]
    assert [r.status for r in control.log() if r.path == "/signed2/config.json"] == [403]
    with pytest.raises(CheckpointError, match="access refused"):  # a folder's own objects: refused is an error
        SafetensorsCheckpoint.open(f"{url}/signed2?X-Amz-Signature=another")


def test_a_folder_url_with_a_query_sends_it_with_every_request(faults):
    url, control = faults
    for path in (f"/query/{NAME}", f"/query/{INDEX}", "/query/config.json"):
        control.set(path, require_query="token=s3cr3t-token")
    checkpoint = SafetensorsCheckpoint.open(f"{url}/query?token=s3cr3t-token")
    assert sorted(checkpoint) == sorted(tensors()) and checkpoint.root == f"{url}/query"
    statuses = {r.status for r in control.log() if r.path.startswith("/query/")}
    assert statuses == {206, 404}  # the index's and the config's 404, never a 403


def test_a_trickling_server_fails_the_request_naming_the_bound(faults):
    """8.5 KB at 20 B/s would take 7 minutes; ``timeout=5`` bounds the gaps only (the server sends every 50 ms),
    ``min_rate=2000`` the whole request (5 s + 8.5 KB / 2000 B/s): the load fails naming ``min_rate``."""
    url, control = faults
    control.set(f"/small/{NAME}", trickle=20)
    options = StorageOptions(remote=RemoteOptions(request_timeout=5.0, min_rate=2000.0, retries=0))
    with pytest.raises(CheckpointError, match="too slow.*min_rate 2000 B/s") as info:
        SafetensorsCheckpoint.open(f"{url}/small/{NAME}", storage=options)
    assert f"small/{NAME}" in str(info.value) and "failed after 1 attempt" in str(info.value)
    assert isinstance(info.value.__cause__, Transient)  # retried where retries are left


@pytest.mark.parametrize(
    "value_type, option",
    [
        (RemoteOptions, "request_timeout"),
        (RemoteOptions, "backoff"),
        (RequestCosts, "latency"),
        (RemoteOptions, "min_rate"),
        (RequestCosts, "bandwidth"),
        (RequestCosts, "max_overread"),
    ],
)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300])
def test_options_out_of_range_are_a_value_error_naming_them(value_type, option, value):
    if value == 1e300 and option not in ("request_timeout", "backoff", "latency"):
        value = float("-inf")
    with pytest.raises(ValueError, match=f"{value_type.__name__}.{option}"):
        value_type(**{option: value})


def test_many_retries_with_a_long_backoff_do_not_overflow():
    """``backoff * 2**i`` past i = 1024 is no float (an ``OverflowError`` before): the delay is capped."""
    failures = []

    def call():
        failures.append(1)
        if len(failures) <= 1100:
            raise Transient("again")
        return "ok"

    assert with_retries("http://h/x", "GET", call, RemoteOptions(retries=2000, backoff=0.0)) == "ok"
    assert len(failures) == 1101
    stop = threading.Event()

    def slow():  # the first failure's backoff would be 1e6 s: stopping ends the wait and the retries
        stop.set()
        raise Transient("slow")

    with pytest.raises(CheckpointError, match="cancelled"):
        with_retries("http://h/x", "GET", slow, RemoteOptions(retries=5000, backoff=1e6), stop)


COALESCED_RANGES = [(100, 200), (300, 400), (4000, 4100), (20000, 20001)]


@pytest.mark.parametrize("how", ["one", "plain", "reverse"])
def test_a_multi_range_answer_coalesced_or_reordered_is_accepted(root, faults, how):
    url, control = faults
    data = (root / "ckpt" / NAME).read_bytes()
    control.set(f"/ckpt/{NAME}", coalesce=how)
    backend = make_backend(url, {}, options=RemoteOptions(request_timeout=10.0))
    location = f"{url}/ckpt/{NAME}"
    got = backend.get(location, COALESCED_RANGES, backend.stat(location))
    assert got == [data[a:b] for a, b in COALESCED_RANGES] and backend.multi_range
    gets = [r for r in control.log() if r.method == "GET" and r.path == f"/ckpt/{NAME}"]
    assert len(gets) == 1, control.log()  # one request: not fetched again range by range
    request = gets[0]
    assert request.status == 206 and request.range.count(",") == len(COALESCED_RANGES) - 1


@pytest.mark.parametrize(("how", "match"), [("unasked", "not asked"), ("missing", "no part of the answer covers")])
def test_a_multi_range_answer_missing_a_range_or_sending_another_is_refused(faults, how, match):
    url, control = faults
    control.set(f"/ckpt/{NAME}", coalesce=how)
    backend = make_backend(url, {}, options=RemoteOptions(request_timeout=10.0))
    location = f"{url}/ckpt/{NAME}"
    with pytest.raises(CheckpointError, match=match) as info:
        backend.get(location, COALESCED_RANGES, backend.stat(location))
    assert NAME in str(info.value)


def test_a_column_shard_loads_from_a_server_that_coalesces_every_multi_range_answer(faults):
    url, control = faults
    control.set(f"/ckpt/{NAME}", coalesce="one")
    model = torch.nn.Module()
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(64, 24)))
    checkpoint = SafetensorsCheckpoint.open(f"{url}/ckpt/{NAME}")
    info = checkpoint["layer1.weight"]
    rows = [(info.data_start + r * 96 * 4 + 24 * 4, info.data_start + r * 96 * 4 + 48 * 4) for r in range(64)]
    with checkpoint.reader() as reader:
        reader.will_read(info.file, lambda: rows, sparse=True)
        out = bytearray(64 * 24 * 4)
        for r, (a, _) in enumerate(rows):
            reader.pread_into(info.file, a, memoryview(out)[r * 96 : (r + 1) * 96])
    got = torch.frombuffer(out, dtype=torch.float32).reshape(64, 24)
    assert torch.equal(got, tensors()["layer1.weight"][:, 24:48])
    multi = [r for r in control.log() if r.path == f"/ckpt/{NAME}" and r.range and "," in r.range]
    assert multi and all(r.status == 206 for r in multi)
