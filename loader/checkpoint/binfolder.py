"""A ``torch.save`` checkpoint: one ``pytorch_model.bin`` or a sharded folder with its
``pytorch_model.bin.index.json``, known from each file's zip records and pickle only (:mod:`.torchzip`); and
:func:`open_checkpoint`, which opens a path as the format its files are in.

The folder rules are the safetensors folder's (:mod:`.folder`): the index's names must be plain relative names
inside the folder; files may be symlinks; a URL's folder is never listed (its index, else its
``pytorch_model.bin``). Shards without their index are refused (the index says which file holds which tensor).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointNotFoundError, redact_url
from ..options import StorageOptions
from ..storage import LocalStore, Store, is_url, open_store
from ..storage.untrusted import err
from .chunks import TensorInfo
from .dcp import DcpCheckpoint, is_dcp_checkpoint
from .folder import SafetensorsCheckpoint, index_files
from .header import HeaderFile
from .hub import resolve_checkpoint
from .protocol import TableCheckpoint
from .torchzip import read_torch_file

BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"
#: ``save_pretrained``'s shard names of a ``.bin`` save: ``i`` of ``n``
_BIN_SHARD = re.compile(r"pytorch_model-(\d{5})-of-(\d{5})\.bin")
#: files of a remote checkpoint read at once
REMOTE_FILE_THREADS = 16


def is_bin_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a ``torch.save`` file or a ``.bin`` index (by its last component)."""
    last = os.fspath(path).partition("?")[0].rstrip("/").rpartition("/")[2]
    return last.endswith(".bin") or last == BIN_INDEX_NAME


def _locate(path: str | os.PathLike[str], storage: StorageOptions) -> tuple[Store, str, str]:
    """The store of the checkpoint ``path`` names, the file name in it (``""``: the folder) and its location."""
    text = os.fspath(path)
    if is_url(text):
        base, mark, query = text.partition("?")
        if not is_bin_path(base):
            return open_store(base.rstrip("/") + mark + query, storage), "", ""
        head, _, last = base.rstrip("/").rpartition("/")
        store = open_store(head, storage)
        return store, last, store.sign(last, query) if query else store.locate(last)  # type: ignore[attr-defined]
    if storage.for_urls_only:
        raise ValueError(f"storage options (backend, remote) apply to URLs only, not to the local path {text!r}")
    local = resolve_checkpoint(text, revision=storage.revision)
    if os.path.isdir(local):
        return LocalStore(local), "", ""
    store = LocalStore(os.path.dirname(local))
    return store, os.path.basename(local), store.locate(os.path.basename(local))


def _files(store: Store, name: str, location: str) -> tuple[list[str], dict[str, list[str]] | None, str]:
    """The files, the keys the index places in each (None without one) and the index's location (``""``: none)."""
    if name and name != BIN_INDEX_NAME:
        return [location], None, ""
    index_path = location or store.locate(BIN_INDEX_NAME)
    if name == BIN_INDEX_NAME or store.exists(index_path):
        wanted = index_files(store, index_path)
        return list(wanted), wanted, index_path
    single = store.locate(BIN_SINGLE_NAME)
    if store.exists(single):
        return [single], None, ""
    names = store.list_names() or []
    shards = sorted(n for n in names if _BIN_SHARD.fullmatch(n))
    if shards:
        raise err(store.root, f"holds {len(shards)} .bin shard file(s) ({shards[0]}, …) and no {BIN_INDEX_NAME}")
    what = f"neither {BIN_INDEX_NAME} nor {BIN_SINGLE_NAME}"
    raise CheckpointNotFoundError(f"{store.root}: {what} found", path=store.root)


def _read_files(store: Store, files: Sequence[str]) -> list[HeaderFile]:
    if not store.remote or len(files) < 2:
        return [read_torch_file(f, store) for f in files]
    with ThreadPoolExecutor(min(REMOTE_FILE_THREADS, len(files))) as pool:
        return list(pool.map(lambda f: read_torch_file(f, store), files))


class BinCheckpoint(TableCheckpoint):
    """A ``torch.save`` checkpoint (one ``.bin`` file or a sharded folder with its index): the
    :class:`~.protocol.Checkpoint` of ``pytorch_model*.bin`` files, each tensor one chunk inside its storage's
    zip record (plain encoding). Attributes as :class:`~.folder.SafetensorsCheckpoint`'s (``metadata`` ``{}``
    per file; ``identities`` each file's as its records were read)."""

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        storage: StorageOptions | None = None,
        identities: Mapping[str, object] | None = None,
    ) -> BinCheckpoint:
        """Open a ``.bin`` checkpoint, reading and validating only each file's zip records and pickle.

        ``path`` may be a ``.bin`` file, a ``pytorch_model.bin.index.json``, a folder holding either, a cached Hub
        repo id, or the URL of any of these. In a folder the index is used if present (exactly the files and keys
        it names), else ``pytorch_model.bin``.

        Args:
            path: File, folder, repo id or URL.
            storage: Where and how its bytes are reached (:class:`~loader.options.StorageOptions`).
            identities: For a URL: ``{location: ObjectIdentity}`` to read bound to (another rank's).

        Raises:
            CheckpointNotFoundError: no ``.bin`` checkpoint there.
            CheckpointError: a file or the index is malformed or refused (:mod:`.torchzip`, :mod:`.ziparchive`),
                names missing files or keys, or two files hold the same key.
        """
        store, name, location = _locate(path, storage or StorageOptions())
        if identities and store.remote:
            store.pin(identities)  # type: ignore[attr-defined]
        files, wanted, index_path = _files(store, name, location)
        tensors: dict[str, TensorInfo] = {}
        found: dict[str, object] = {}
        for file, header in zip(files, _read_files(store, files)):
            found[file] = header.identity
            keys = wanted[file] if wanted is not None else list(header.tensors)
            for key in keys:
                if key not in header.tensors:
                    raise err(index_path, f"index places it in {file}, whose state dict lacks it", key)
                if key in tensors:
                    other = os.path.basename(tensors[key].file)  # type: ignore[arg-type]
                    raise err(file, f"key {key!r} in both {other} and {os.path.basename(file)}", key)
                tensors[key] = header.tensors[key]
        return cls(tensors, tuple(files), None, found, store)

    def __repr__(self) -> str:
        return f"BinCheckpoint({redact_url(self.root)!r}, files={len(self.files)}, tensors={len(self.tensors)})"


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    storage: StorageOptions | None = None,
    identities: Mapping[str, object] | None = None,
) -> TableCheckpoint:
    """Open the checkpoint at ``path`` in the format its files are in: a ``.bin`` file or index as a
    :class:`BinCheckpoint`; a folder holding a DCP ``.metadata`` (or that file) as a
    :class:`~.dcp.DcpCheckpoint`; anything else as a :class:`~.folder.SafetensorsCheckpoint`, and, where no safetensors
    checkpoint is found there, as a :class:`BinCheckpoint` (a folder of ``pytorch_model*.bin`` files), and at a URL
    where neither is, as the DCP folder whose ``.metadata`` is there.

    Raises:
        CheckpointNotFoundError: neither format is there (the safetensors error, naming what was tried).
        CheckpointError: as the format's ``open``.
    """
    if is_bin_path(path):
        return BinCheckpoint.open(path, storage=storage, identities=identities)
    if is_dcp_checkpoint(path):  # a torch.distributed.checkpoint folder (or its .metadata)
        return DcpCheckpoint.open(path, storage=storage, identities=identities)
    try:
        return SafetensorsCheckpoint.open(path, storage=storage, identities=identities)
    except CheckpointNotFoundError as missing:
        try:
            return BinCheckpoint.open(path, storage=storage, identities=identities)
        except CheckpointNotFoundError:
            if not is_url(os.fspath(path)):
                raise missing from None
        try:  # a DCP folder at a URL (no listing to find its .metadata by): that file, asked for
            return DcpCheckpoint.open(_metadata_url(os.fspath(path)), storage=storage, identities=identities)
        except CheckpointNotFoundError:
            raise missing from None


def _metadata_url(url: str) -> str:
    """The DCP ``.metadata`` of the folder at ``url`` (its query kept)."""
    base, mark, query = url.partition("?")
    return f"{base.rstrip('/')}/.metadata{mark}{query}"
