"""The methods of bench/remote_bench.py besides ours, and how the bench tells one measurement from the next in a
server's request log.

Each method loads this rank's shards of a checkpoint folder at a URL (``http://HOST/rK`` or ``s3://BUCKET/rK``)
into a built (DTensor-sharded) model and returns ``{"bytes_read": ..., "requests": ...}`` as the method itself
counts them (``None`` where it does not); the bytes on the wire come from the server's log.

* ``download``: what every node does today — fetch every file of the folder to a local temporary folder, then
  ``load_hf_checkpoint`` it from there. Over HTTP: the index, then each file in 8 MiB ranged GETs on 8 threads (as
  ``hf_transfer`` / boto3's transfer manager split a file); over S3: boto3's ``download_file`` (its transfer
  manager: 8 MiB parts, 10 threads).
* ``runai``: runai-model-streamer's ``SafetensorsStreamer`` over every ``s3://`` file (its C++ reader threads,
  ``RUNAI_STREAMER_CONCURRENCY`` unset: 8 for object stores, 8 MiB chunks; ``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS``
  30000 unless set, ours' ``timeout``), each whole tensor then cut to this
  rank's shard and copied (bench/peers.py's ``Placer``): what vLLM's runai loader does on each rank. It reads
  ``s3://`` (and ``gs://``, ``az://``), not HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from loader.options import LoadOptions

CHUNK = 8 << 20  # bytes per ranged GET of a download
THREADS = 8  # GETs in flight per file of a download
MARK = "/__mark__/"  # the URL path prefix of the bench's marker requests


def mark(base_url: str, tag: str) -> None:
    """Leave ``GET /__mark__/<tag>`` in the server's log (answered 404 or so): what follows belongs to ``tag``."""
    try:
        urllib.request.urlopen(base_url + MARK + tag, timeout=30).close()
    except urllib.error.HTTPError:
        pass


def split_log(requests: list, rank_of) -> dict[str, dict[int, dict[str, int]]]:
    """``{tag: {rank: {"bytes", "requests"}}}`` from a server's log (:class:`servers.LoggedRequest` rows) split at
    the marker requests; ``rank_of(request)`` is the rank that made it (its folder, or its user agent), or ``None``."""
    out: dict[str, dict[int, dict[str, int]]] = {}
    tag = None
    for r in requests:
        if r.path.startswith(MARK):
            tag = r.path[len(MARK) :]
            continue
        rank = rank_of(r)
        if tag is None or rank is None:
            continue
        cell = out.setdefault(tag, {}).setdefault(rank, {"bytes": 0, "requests": 0})
        cell["bytes"] += r.bytes
        cell["requests"] += 1
    return out


def _local_load(model, folder: str) -> int:
    from loader import load_hf_checkpoint

    return load_hf_checkpoint(model, folder, options=LoadOptions(progress=False)).bytes_read


def _http_get(url: str, headers: dict | None = None) -> bytes:
    import requests

    response = requests.get(url, headers=headers or {}, timeout=120)
    response.raise_for_status()
    return response.content


def _http_download(url: str, target: str) -> int:
    """One file in :data:`CHUNK`-byte ranged GETs on :data:`THREADS` threads, written in place."""
    import requests

    size = int(requests.head(url, timeout=60).headers["Content-Length"])
    with open(target, "wb") as f:
        f.truncate(size)
    fd = os.open(target, os.O_WRONLY)
    try:

        def part(start: int) -> None:
            end = min(start + CHUNK, size)
            data = _http_get(url, {"Range": f"bytes={start}-{end - 1}"})
            if len(data) != end - start:
                raise OSError(f"{url}: bytes [{start}, {end}): got {len(data)}")
            os.pwrite(fd, data, start)

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(part, range(0, size, CHUNK)))
    finally:
        os.close(fd)
    return size


def download_http(model, url: str) -> dict:
    """Every file of the folder ``url`` (``config.json``, the index and the shards it names) to a temporary folder,
    then a local load."""
    tmp = tempfile.mkdtemp(prefix="remote_bench_dl_")
    try:
        index = _http_get(f"{url}/model.safetensors.index.json")
        with open(os.path.join(tmp, "model.safetensors.index.json"), "wb") as f:
            f.write(index)
        names = ["config.json", *sorted(set(json.loads(index)["weight_map"].values()))]
        fetched = len(index) + sum(_http_download(f"{url}/{n}", os.path.join(tmp, n)) for n in names)
        _local_load(model, tmp)
        return {"bytes_read": fetched, "requests": None}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _s3_names(client, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def download_s3(model, url: str) -> dict:
    """Every object under the prefix ``url`` through boto3's ``download_file``, then a local load."""
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")  # endpoint and keys from the environment (servers.s3_env)
    tmp = tempfile.mkdtemp(prefix="remote_bench_dl_")
    try:
        fetched = 0
        for key in _s3_names(client, bucket, prefix):
            target = os.path.join(tmp, key[len(prefix) + 1 :])
            client.download_file(bucket, key, target)
            fetched += os.path.getsize(target)
        _local_load(model, tmp)
        return {"bytes_read": fetched, "requests": None}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def runai_s3(model, url: str) -> dict:
    """runai-model-streamer over every ``.safetensors`` object of the prefix ``url``; whole tensors, each cut to
    this rank's shard (the files are listed as vLLM's runai loader lists them: by prefix)."""
    import boto3
    from peers import Placer
    from runai_model_streamer import SafetensorsStreamer

    os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")  # path-style: an S3-compatible server
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    # its default (1 s below its low-speed limit, then abort) fails on this shared 2-CPU machine: ours' 30 s
    os.environ.setdefault("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "30000")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    keys = [k for k in _s3_names(boto3.client("s3"), bucket, prefix) if k.endswith(".safetensors")]
    placer = Placer(model)
    logical = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"s3://{bucket}/{k}" for k in keys], device="cpu")
        for key, full in streamer.get_tensors():
            logical += full.numel() * full.element_size()
            placer.place(key, full)
            del full
    return {"bytes_read": logical, "requests": None}


#: ``{method: {server kind: loader}}``; a server kind a method lacks is a row saying why
PEERS = {
    "download": {"http": download_http, "s3": download_s3},
    "runai": {"s3": runai_s3},
}
WHY_NOT = {("runai", "http"): "runai-model-streamer reads files and s3:// / gs:// / az:// objects, not HTTP"}
