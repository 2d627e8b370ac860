"""One version per load: a Hub revision resolved once to a commit and every file read at it; an object replaced
mid-load under an absent, weak or unchanging validator (the fault server, nginx's own ETag) caught by its sizes
and by its header fetched again with its last request, with one warning naming the URL; and, on 4 gloo ranks
(tests/versions_worker.py), the ranks of one load reading one version of every file — the fault server answering
ranks differently, an S3 object of a versioned bucket overwritten and a Hub branch moved between two ranks'
header reads — or failing together naming the file."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers

from loader import CheckpointError, HFLoadPlanner, SafetensorsCheckpoint, load_hf_checkpoint
from loader.execute import execute_plan
from loader.options import LoadOptions, RemoteOptions, StorageOptions

pytest.importorskip("requests")
pytest.importorskip("boto3")

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
FAST = StorageOptions(remote=RemoteOptions(retries=1, backoff=0.01, request_timeout=5.0))
N = 64  # 64 x 64 float32 tensors: 16 KiB each, beyond what a header's first request holds


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(N, N))
        self.b = nn.Parameter(torch.zeros(N, N))


def version(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(N, N, generator=g), "b": torch.randn(N, N, generator=g)}


def write(path, seed: int) -> dict[str, torch.Tensor]:
    """A file of :class:`Pair` whose header names its version: every version the same size, other headers."""
    tensors = version(seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, str(path), metadata={"version": str(seed)})
    return tensors


def write_sharded(folder, seed: int) -> dict[str, torch.Tensor]:
    """:class:`Pair` in two shards with an index."""
    tensors = version(seed)
    os.makedirs(folder, exist_ok=True)
    for i, key in enumerate(("a", "b")):
        save_file({key: tensors[key]}, os.path.join(folder, f"model-0000{i + 1}-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


def equal(model: nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(getattr(model, k).detach(), v) for k, v in tensors.items())


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The fault server's root: ``plain/v1``, ``plain/v2`` (same size, other header and values), ``plain/v3``
    (larger), and the Hub repo ``org/pair`` (commits A and B, sharded; ``main`` -> A)."""
    root = tmp_path_factory.mktemp("versions")
    values = {
        "v1": write(root / "plain" / "v1" / "model.safetensors", 1),
        "v2": write(root / "plain" / "v2" / "model.safetensors", 2),
    }
    save_file({**version(3), "c": torch.zeros(8)}, str(root / "plain" / "v3.safetensors"))
    v1 = os.stat(root / "plain/v1/model.safetensors")
    os.utime(root / "plain/v2/model.safetensors", (v1.st_atime + 100, v1.st_mtime + 100))  # another Last-Modified
    assert os.path.getsize(root / "plain/v1/model.safetensors") == os.path.getsize(root / "plain/v2/model.safetensors")
    values["A"] = write_sharded(root / "hub" / "org" / "pair" / COMMIT_A, 1)
    values["B"] = write_sharded(root / "hub" / "org" / "pair" / COMMIT_B, 2)
    return root, values


@pytest.fixture(scope="module")
def faults(tree):
    yield from servers.serve(servers.fault_server(tree[0]))


@pytest.fixture
def fault(faults, tree, monkeypatch):
    """``(base URL, control, values)``, the server's modes cleared and ``main`` -> A."""
    url, control = faults
    control.clear()
    main = tree[0] / "hub" / "org" / "pair" / "main"
    main.unlink(missing_ok=True)
    main.symlink_to(COMMIT_A)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"{url}/hub")
    return url, control, tree[1]


def data_requests_from(control, path: str) -> int:
    """How many responses for ``path`` come before its first data read (a GET past the first request)."""
    log = [r for r in control.log() if r.path == path]
    gets = [i for i, r in enumerate(log) if r.method == "GET"]
    return gets[1] if len(gets) > 1 else len(log)


def replaced_from_first_data_read(url: str, control, path: str, validator: str, alternate: str) -> int:
    """Serve ``path`` under ``validator``, then ``alternate`` in its place from its first data read on (counted in
    a clean load first); returns how many responses come before that read."""
    control.set(path, validator=validator)
    load_hf_checkpoint(
        Pair(), f"{url}{path}", storage=FAST, options=LoadOptions(progress=False)
    )  # a clean load: the requests
    skip = data_requests_from(control, path)
    control.clear()
    control.set(path, validator=validator, alternate=alternate, alternate_after=skip)
    return skip


# --- the Hub: one commit per load ------------------------------------------------------------------------------


def test_a_hub_branch_moving_during_the_open_reads_every_file_at_the_first_commit(fault, tree):
    """``main`` moves to commit B right after the first answer (the index's): the index, both shards and the
    config are still read at commit A — nothing is read at ``main`` after the first answer."""
    url, control, values = fault
    index = "/hub/org/pair/resolve/main/model.safetensors.index.json"
    control.set(index, relink_after=[1, "hub/org/pair/main", COMMIT_B])
    model = Pair()
    load_hf_checkpoint(model, "hf://org/pair", storage=FAST, options=LoadOptions(progress=False))
    assert equal(model, values["A"])
    paths = [r.path for r in control.log()]
    assert [p for p in paths if "/resolve/main/" in p] == [index], paths
    assert any(f"/resolve/{COMMIT_A}/model-00002-of-00002.safetensors" in p for p in paths), paths
    assert os.readlink(tree[0] / "hub/org/pair/main") == COMMIT_B  # the branch did move


def test_identities_posted_by_rank_zero_read_back_and_compare_every_field():
    """What rank 0 posts reads back equal, header CRC included; a location only one side holds, or any field that
    differs (size, ETag, version, header bytes or CRC), is a difference."""
    from loader.distributed.versions import decode, differences, encode
    from loader.storage import ObjectIdentity

    ids = {"s3://b/a": ObjectIdentity(10, '"e"', "v1", 8, 123), "s3://b/i": ObjectIdentity(3, "", "Mon, 01 GMT")}
    back = decode(encode(ids))
    assert back == ids and differences(back, ids) == []
    assert [i.head_crc for i in back.values()] == [123, 0]
    for changed in ({"size": 11}, {"etag": '"f"'}, {"version": "v2"}, {"head_bytes": 9}, {"head_crc": 124}):
        other = {**ids, "s3://b/a": ObjectIdentity(**{**vars(ids["s3://b/a"]), **changed})}
        assert differences(other, ids) == ["s3://b/a"], changed
    assert differences({**ids, "s3://b/new": ObjectIdentity(1)}, ids) == ["s3://b/new"]


# --- weak validators ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("validator", ["none", "constant", "weak"])
def test_an_object_replaced_mid_load_under_a_weak_validator_is_caught_by_its_header(fault, validator, caplog):
    """The file's next version (same size, other header and values) is served from its first data read on, under
    no validator, one constant ETag, or one weak ETag and Last-Modified: its header fetched again with the last
    request differs, so the load fails naming the file and restores the model; one warning named the URL (not for
    the constant ETag: it looks strong)."""
    url, control, values = fault
    path = "/plain/v1/model.safetensors"
    replaced_from_first_data_read(url, control, path, validator, "plain/v2/model.safetensors")
    model = Pair()
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="loader")
    secret = url.replace("http://", "http://user:hunter2@")
    with pytest.raises(CheckpointError, match="header") as raised:
        load_hf_checkpoint(model, f"{secret}{path}", storage=FAST, options=LoadOptions(progress=False, rollback=True))
    assert path in str(raised.value)
    assert equal(model, {k: torch.zeros(N, N) for k in ("a", "b")})
    warned = [r.getMessage() for r in caplog.records if "no strong validator" in r.getMessage()]
    if validator == "constant":  # a strong ETag, as far as anyone can tell: only the header tells the change
        assert not warned, warned
    else:
        assert len(warned) == 1 and path in warned[0] and "hunter2" not in warned[0], warned


def test_a_last_modified_alone_is_sent_as_if_range(fault):
    """No ETag, a Last-Modified per version: every data request carries ``If-Range`` with the Last-Modified the
    header was read with, so a server honouring it answers the next version with the whole object (200) — refused
    at once as a changed object naming the file, not read."""
    url, control, _ = fault
    path = "/plain/v1/model.safetensors"
    skip = replaced_from_first_data_read(url, control, path, "dated", "plain/v2/model.safetensors")
    with pytest.raises(CheckpointError, match="If-Range") as raised:
        load_hf_checkpoint(Pair(), f"{url}{path}", storage=FAST, options=LoadOptions(progress=False))
    assert path in str(raised.value) and "changed" in str(raised.value)
    assert all(r.status == 200 for r in control.log()[skip:] if r.method == "GET"), control.log()


def test_an_object_that_grows_mid_load_is_caught_by_its_size(fault):
    """No validator, and the file replaced by a larger one: the first data answer's Content-Range total differs
    from the size its header was read with."""
    url, control, _ = fault
    path = "/plain/v1/model.safetensors"
    replaced_from_first_data_read(url, control, path, "none", "plain/v3.safetensors")
    with pytest.raises(CheckpointError, match="bytes now") as raised:
        load_hf_checkpoint(Pair(), f"{url}{path}", storage=FAST, options=LoadOptions(progress=False))
    assert path in str(raised.value)


def test_the_header_comes_again_with_the_last_request_and_no_request_more(fault, tree):
    """Over a multi-range server the header's bytes ride on the file's last request, whether it carries several
    ranges (here ``a`` and ``b`` around a tensor the model does not load) or one (a whole file): as many requests
    as without the check, the last asking the header's range before the data; its bytes do not count in the
    report (headers never do)."""
    url, control, values = fault
    path = "/plain/gapped.safetensors"
    tensors = {"a": values["v1"]["a"], "a_skipped": torch.zeros(N, N), "b": values["v1"]["b"]}  # stored in name order
    save_file(tensors, str(tree[0] / path.lstrip("/")))
    model = Pair()
    report = load_hf_checkpoint(model, f"{url}{path}", options=LoadOptions(progress=False))
    assert equal(model, values["v1"])
    gets = [r for r in control.log() if r.path == path and r.method == "GET"]
    assert len(gets) == 1 + report.requests, gets  # the header's first request, then the reads
    assert gets[-1].range.startswith("bytes=0-") and gets[-1].range.count(",") == 2, gets
    assert report.bytes_read == report.planned_bytes
    control.clear()
    path = "/plain/v1/model.safetensors"
    report = load_hf_checkpoint(Pair(), f"{url}{path}", options=LoadOptions(progress=False))
    gets = [r for r in control.log() if r.path == path and r.method == "GET"]
    assert len(gets) == 1 + report.requests and gets[-1].range.startswith("bytes=0-"), gets
    assert gets[-1].range.count(",") == 1 and report.bytes_read == report.planned_bytes, gets


def test_nginx_etag_of_a_same_second_same_size_rewrite_is_caught(tmp_path):
    """nginx's ETag is the modification time in seconds and the size: a rewrite of the same size within the same
    second keeps it. The file rewritten after the header was read (same size, same mtime, another header): the
    reads fail naming the file instead of loading the new values."""
    import requests

    folder = tmp_path / "ckpt"
    write(folder / "model.safetensors", 1)
    with servers.nginx(tmp_path) as web:
        url = f"{web}/ckpt/model.safetensors"
        checkpoint = SafetensorsCheckpoint.open(url)
        before = requests.head(url, timeout=10).headers["ETag"]
        stat = os.stat(folder / "model.safetensors")
        write(folder / "model.safetensors", 2)
        os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert requests.head(url, timeout=10).headers["ETag"] == before  # nginx cannot tell the two apart
        model = Pair()
        plan = HFLoadPlanner(model).build_plan(checkpoint)
        with checkpoint.reader() as reader, pytest.raises(CheckpointError, match="header") as raised:
            execute_plan(plan, reader, LoadOptions(progress=False))
    assert "/ckpt/model.safetensors" in str(raised.value)


# --- 4 gloo ranks ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tree, faults, tmp_path_factory):
    """tests/versions_worker.py's scenarios on 4 gloo ranks: the fault server answering rank 1 with v2 (a strong
    ETag honouring ``If-Match``; one constant ETag ignoring it), ``s3://`` buckets with and without versioning
    overwritten between rank 0's header read and the others', the Hub's ``main`` moved meanwhile."""
    import versions_worker
    from gloo_world import WORLD, run_world

    root, values = tree
    url, control = faults
    control.clear()
    main = root / "hub" / "org" / "pair" / "main"
    main.unlink(missing_ok=True)
    main.symlink_to(COMMIT_A)
    v2 = "plain/v2/model.safetensors"
    for name, mode in {"strong": {}, "constant": {"validator": "constant", "ignore_if_match": True}}.items():
        path = root / "plain" / name / "model.safetensors"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes((root / "plain/v1/model.safetensors").read_bytes())
        control.set(f"/plain/{name}/model.safetensors", alternate=v2, alternate_for=["X-Rank", "1"], **mode)
    out = tmp_path_factory.mktemp("versions_world")
    for endpoint in servers.serve(servers.s3_server()):
        client = servers.s3_client(endpoint)
        for bucket in ("versioned", "unversioned"):
            client.create_bucket(Bucket=bucket)
            body = (root / "plain/v1/model.safetensors").read_bytes()
            if bucket == "versioned":
                client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
            for prefix in ("pair", "dcp"):
                client.put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors", Body=body)
        keys = servers.S3_CREDENTIALS
        ctx = {
            "store": str(out / "store"),
            "out": str(out),
            "faults": str(url),
            "s3": endpoint,
            "s3_keys": {"key": keys["AWS_ACCESS_KEY_ID"], "secret": keys["AWS_SECRET_ACCESS_KEY"]}
            | {"region_name": keys["AWS_DEFAULT_REGION"]},
            "versioned": "versioned",
            "unversioned": "unversioned",
            "v2": str(root / v2),
            "hub": f"{url}/hub",
            "hub_repo": str(root / "hub" / "org" / "pair"),
            "commit_b": COMMIT_B,
        }
        results = run_world(versions_worker.__file__, out, str(out), ctx, expected_codes=[0] * WORLD)
        yield [r for r in results], values, control.log()


def outcomes(world, name: str) -> list[dict]:
    from gloo_world import ok

    return ok(world[0], name)


@pytest.mark.dist
def test_a_rank_served_another_version_fails_every_rank_naming_the_file(world):
    """Rank 1 is served v2 (another ETag): it opens again bound to rank 0's ETag, the server answers 412, and every
    rank raises that error naming the file — none loads a version alone."""
    errors = [r["error"] for r in outcomes(world, "http_if_match")]
    assert all("/plain/strong/model.safetensors" in e and "changed" in e for e in errors), errors
    assert all("rank 1" in e for e in errors), errors  # the failure is rank 1's, raised everywhere


@pytest.mark.dist
def test_a_rank_served_other_bytes_under_one_etag_fails_every_rank_naming_the_file(world):
    """One constant ETag for both versions, ``If-Match`` ignored: rank 1's header differs from rank 0's, bound to
    the same identity: every rank raises naming the file."""
    errors = [r["error"] for r in outcomes(world, "http_constant_etag")]
    assert all("/plain/constant/model.safetensors" in e and "same identity" in e for e in errors), errors


@pytest.mark.dist
def test_a_versioned_s3_object_overwritten_between_two_ranks_reads_loads_rank_zeros_version_everywhere(world):
    """Ranks 1-3 read v2's header, then read rank 0's ``VersionId``: every rank loads v1 (``load_hf_checkpoint``, and
    ``dcp.load`` with ``SafetensorsReader``, whose ``read_metadata`` agrees the same way)."""
    values = world[1]["v1"]
    for r in outcomes(world, "s3_versioned") + outcomes(world, "s3_versioned_dcp"):  # dcp.load's too
        assert r["error"] == "", r["error"]
        assert all(torch.equal(r["values"][k], v) for k, v in values.items())


@pytest.mark.dist
def test_an_unversioned_s3_object_overwritten_between_two_ranks_reads_fails_every_rank(world):
    """Without versions rank 0's object is gone: ``IfMatch`` with its ETag fails, on every rank, naming it."""
    errors = [r["error"] for r in outcomes(world, "s3_unversioned")]
    assert all("s3://unversioned/pair/model.safetensors" in e and "changed" in e for e in errors), errors


@pytest.mark.dist
def test_a_hub_branch_moved_between_two_ranks_reads_loads_rank_zeros_commit_everywhere(world):
    """``main`` moves from A to B after rank 0 read its headers: ranks 1-3 read at A, as rank 0 did."""
    values = world[1]["A"]
    for r in outcomes(world, "hub_branch_moved"):
        assert r["error"] == "", r["error"]
        assert all(torch.equal(r["values"][k], v) for k, v in values.items())
