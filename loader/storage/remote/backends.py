"""Which :class:`~.backend.Backend` serves a URL, made from its options; each imported only when used.

========================  ===================================  =========================================
URL                       backend (library)                    backend options
========================  ===================================  =========================================
``http://``, ``https://`` :class:`~.http.HttpBackend` (requests) ``headers``, ``verify``, ``auth``,
                                                               ``forward_headers``
``s3://``, ``s3a://``     :class:`~.s3.S3Backend` (boto3)       s3fs' names: ``endpoint_url``, ``key``,
                                                               ``secret``, ``token``, ``anon``, ``profile``,
                                                               ``region_name``, ``client_kwargs``,
                                                               ``config_kwargs``
``hf://``                 :class:`~.hub.HubBackend`             ``token``, ``endpoint``, ``headers``,
                          (huggingface_hub, requests)          ``verify``, ``forward_headers``
anything else fsspec      :class:`~.fsspec_backend              the filesystem's own
knows (``gs://`` ...)     .FsspecBackend` (fsspec)
========================  ===================================  =========================================
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from ...errors import redact_url
from .backend import Backend, RemoteOptions

#: how to install what the backends import
EXTRA = "pip install 'regiontrace[remote]'"
#: the libraries the ``remote`` extra installs
_LIBRARIES = {"requests", "requests_toolbelt", "urllib3", "boto3", "botocore", "huggingface_hub", "fsspec"}
#: the HTTP backend's options
HTTP_OPTIONS = ("headers", "verify", "auth", "forward_headers")


def _module(name: str, url: str):
    """Import ``.name``; a missing library of the ``remote`` extra is an ``ImportError`` that says how to install it."""
    try:
        return importlib.import_module(f".{name}", __package__)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _LIBRARIES:
            raise
        raise ImportError(f"{redact_url(url)}: reading this URL needs {e.name}, which is not installed: {EXTRA}") from e


def http_options(url: str, backend_options: Mapping[str, object]) -> dict[str, object]:
    """The HTTP backend's keyword arguments from backend options.

    Raises:
        ValueError: an unknown option, or one of the wrong type.
    """
    unknown = sorted(set(backend_options) - set(HTTP_OPTIONS))
    if unknown:
        known = ", ".join(HTTP_OPTIONS)
        raise ValueError(f"unknown backend settings for {redact_url(url)}: {unknown}; known: {known}")
    opts = dict(backend_options)
    if not isinstance(opts.get("headers", {}), Mapping):
        raise ValueError("StorageOptions.backend['headers'] must be a dict of header names to values")
    if not isinstance(opts.get("verify", True), (bool, str)):
        raise ValueError("StorageOptions.backend['verify'] must be a bool or a CA bundle's path")
    auth = opts.get("auth")
    if auth is not None and not (isinstance(auth, (tuple, list)) and len(auth) == 2):
        raise ValueError("StorageOptions.backend['auth'] must be a (user, password) pair")
    if auth is not None:
        opts["auth"] = tuple(auth)
    if not isinstance(opts.get("forward_headers", False), bool):
        raise ValueError("StorageOptions.backend['forward_headers'] must be a bool")
    return opts


def make_backend(
    url: str, backend_options: Mapping[str, object], revision: str | None = None, options: RemoteOptions | None = None
) -> Backend:
    """The backend for ``url``'s scheme (see the module's table).

    Args:
        url: A location (or a folder's) of the backend's scheme.
        backend_options: :attr:`~loader.options.StorageOptions.backend`.
        revision: An ``hf://`` repo's branch, tag or commit (refused for other URLs).
        options: Timeouts and pool sizes (defaults when ``None``).

    Raises:
        ImportError: the backend's library is not installed (the message says how to install it).
        ValueError: an option the backend does not know, a revision for a URL that is not ``hf://``.
        CheckpointError: an ``hf://`` URL whose revision is malformed or differs from ``revision``.
    """
    options = options or RemoteOptions()
    scheme = url.partition("://")[0].lower()
    if revision is not None and scheme != "hf":
        raise ValueError(f"revision={revision!r} applies to hf:// URLs only, not to {redact_url(url)}")
    if scheme in ("http", "https"):
        return _module("http", url).HttpBackend(options, **http_options(url, backend_options))
    if scheme in ("s3", "s3a"):
        return _module("s3", url).S3Backend(options, backend_options)
    if scheme == "hf":
        hub = _module("hub", url)
        backend = hub.HubBackend(options, backend_options, revision)
        backend.resolve_url(url)  # checks the URL's revision against ``revision`` now
        return backend
    fsspec_backend = _module("fsspec_backend", url)
    try:
        return fsspec_backend.FsspecBackend(scheme, backend_options)
    except ImportError as e:
        why = f"fsspec's {scheme}:// filesystem needs a package not installed here: {e}"
        raise ImportError(f"{redact_url(url)}: {why}") from e
    except ValueError as e:
        raise ValueError(f"{redact_url(url)}: no backend for {scheme}:// URLs ({e})") from e
