"""S3 and S3-compatible objects (MinIO, R2, moto) through boto3: ``head_object`` and ranged ``get_object``.

Vocabulary: a location is ``s3://bucket/key``. The client is configured the usual way (botocore reads
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, the credentials chain, ``AWS_REGION`` / the config file), and by
backend settings with s3fs' names, so that fsspec ``storage_options`` work unchanged (as
``StorageOptions.backend``): ``endpoint_url``, ``key``, ``secret``, ``token``, ``anon`` (unsigned requests),
``profile``, ``region_name``, ``client_kwargs`` (to ``boto3.client``), ``config_kwargs`` (to
``botocore.config.Config``). botocore's own retries are off (the fetcher retries), its timeouts are
:attr:`RemoteOptions.request_timeout`, its pool holds :attr:`RemoteOptions.requests_in_flight`.

An object's identity is its ``ETag`` and ``VersionId`` (versioned buckets); every ``get_object`` sends
``IfMatch`` with the ETag and, where there is one, ``VersionId`` (so a versioned object replaced mid-load is still
read as it was), and checks ``ContentRange``, the length and the ETag. S3 serves one range per request
(:attr:`S3Backend.multi_range` is ``False``). What each failure becomes: ``404``/``NoSuchKey``/``NoSuchBucket`` →
``None`` from ``stat``, a ``CheckpointError`` from ``get``; ``403`` → ``CheckpointError`` (access refused);
``412`` or another ETag → ``CheckpointError`` (changed); ``5xx``, throttling, resets, timeouts, short bodies →
:class:`Transient`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import boto3
import botocore.config
import botocore.exceptions

from ...errors import CheckpointError
from ..base import ObjectIdentity
from .backend import RemoteOptions, Transient
from .checks import changed, check_part, check_status, parse_content_range

#: backend options (s3fs' names)
OPTIONS = ("endpoint_url", "key", "secret", "token", "anon", "profile", "region_name", "client_kwargs", "config_kwargs")
_TRANSIENT = (
    botocore.exceptions.ConnectionError,  # resets, EndpointConnectionError, timeouts (ReadTimeoutError ...)
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ResponseStreamingError,
)


def split_s3_url(location: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key``.

    Raises:
        ValueError: not such a URL.
    """
    scheme, _, rest = location.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme.lower() not in ("s3", "s3a") or not bucket or not key:
        raise ValueError(f"{location}: not an s3://bucket/key URL")
    return bucket, key


def make_client(options: RemoteOptions, backend_options: Mapping[str, object]):
    """A boto3 S3 client from backend options (see the module's docstring).

    Raises:
        ValueError: an option this backend does not know.
    """
    unknown = sorted(set(backend_options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown backend settings for s3:// {unknown}; known: {', '.join(OPTIONS)}")
    opts = dict(backend_options)
    session = boto3.session.Session(
        aws_access_key_id=opts.get("key"),
        aws_secret_access_key=opts.get("secret"),
        aws_session_token=opts.get("token"),
        profile_name=opts.get("profile"),
    )
    config = {
        "retries": {"total_max_attempts": 1},
        "connect_timeout": options.request_timeout,
        "read_timeout": options.request_timeout,
        "max_pool_connections": max(10, options.requests_in_flight),
        **dict(opts.get("config_kwargs") or {}),
    }
    if opts.get("anon"):
        config["signature_version"] = botocore.UNSIGNED
    kwargs = {"region_name": opts.get("region_name"), "endpoint_url": opts.get("endpoint_url")}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(opts.get("client_kwargs") or {})
    return session.client("s3", config=botocore.config.Config(**config), **kwargs)


def _raise_client_error(name: str, error: botocore.exceptions.ClientError) -> None:
    """What an S3 error answer means (see the module's docstring)."""
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = error.response.get("Error", {}).get("Code", "")
    if code in ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"):
        raise Transient(f"{code} (HTTP {status})") from error
    if code in ("NoSuchKey", "NoSuchBucket", "NotFound") and status != 404:
        status = 404
    check_status(name, status)
    raise CheckpointError(f"{name}: {code or 'error'} (HTTP {status})", path=name) from error


@contextmanager
def _boto_errors(location: str) -> Iterator[None]:
    """botocore's failures other than an answer (:class:`ClientError`, which passes): a timeout or a dropped
    connection is :class:`Transient` (retried), anything else (no credentials, a bad endpoint) a
    :class:`CheckpointError` naming the object."""
    try:
        yield
    except _TRANSIENT as e:
        raise Transient(f"{type(e).__name__}: {e}") from e
    except botocore.exceptions.BotoCoreError as e:
        raise CheckpointError(f"{location}: {type(e).__name__}: {e}", path=location) from e


class S3Backend:
    """S3 objects by ``s3://bucket/key`` (see the module's docstring); thread-safe (one boto3 client)."""

    multi_range = False

    def __init__(self, options: RemoteOptions, backend_options: Mapping[str, object] | None = None) -> None:
        self.client = make_client(options, backend_options or {})

    def close(self) -> None:
        self.client.close()

    def stat(self, location: str) -> ObjectIdentity | None:
        bucket, key = split_s3_url(location)
        try:
            with _boto_errors(location):
                head = self.client.head_object(Bucket=bucket, Key=key)
        except botocore.exceptions.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            _raise_client_error(location, e)
        return ObjectIdentity(int(head["ContentLength"]), head.get("ETag", ""), head.get("VersionId", "") or "")

    def get(self, location: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity) -> list[bytes]:
        return [self._get_one(location, a, b, identity) for a, b in ranges]

    def first(self, location: str, nbytes: int) -> tuple[ObjectIdentity, bytes] | None:
        """The identity and first ``min(nbytes, size)`` bytes from one ranged ``get_object`` (its ``ContentRange``
        tells the size: no ``head_object``); ``None`` when it does not exist."""
        bucket, key = split_s3_url(location)
        try:
            with _boto_errors(location):
                got = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{max(1, nbytes) - 1}")
                with got["Body"] as stream:
                    body = stream.read()
        except botocore.exceptions.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                return None
            if status == 416:  # an empty object
                identity = self.stat(location)
                return None if identity is None else (identity, b"")
            _raise_client_error(location, e)
        status = got.get("ResponseMetadata", {}).get("HTTPStatusCode")
        total = (parse_content_range(got.get("ContentRange")) or (0, 0, None))[2]
        if status != 206 or total is None:
            why = f"the server ignores Range requests (HTTP {status}, not 206 with the size)"
            raise CheckpointError(f"{location}: {why}", path=location)
        identity = ObjectIdentity(total, got.get("ETag", ""), got.get("VersionId", "") or "")
        end = min(max(1, nbytes), total)
        return identity, check_part(location, got.get("ContentRange"), 0, end, total, body)[:nbytes]

    def _get_one(self, location: str, start: int, end: int, identity: ObjectIdentity) -> bytes:
        bucket, key = split_s3_url(location)
        kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if identity.etag:
            kwargs["IfMatch"] = identity.etag
        if identity.version:
            kwargs["VersionId"] = identity.version
        try:
            with _boto_errors(location):
                got = self.client.get_object(**kwargs)
                with got["Body"] as stream:
                    body = stream.read()
        except botocore.exceptions.ClientError as e:
            _raise_client_error(location, e)
        status = got.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status != 206:
            why = f"the server ignores Range requests (HTTP {status}, not 206)"
            raise CheckpointError(f"{location}: {why}", path=location)
        if identity.etag and got.get("ETag") and got["ETag"] != identity.etag:
            raise changed(location, f"ETag {got['ETag']}, was {identity.etag}")
        return check_part(location, got.get("ContentRange"), start, end, identity.size, body)
