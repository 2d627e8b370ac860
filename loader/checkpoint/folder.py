"""A checkpoint: one safetensors file or a sharded folder with its index, known from its headers only.

One rule for single files and shards: a file may be a symlink to a regular file anywhere (the Hugging Face
cache links ``snapshots/<rev>/*`` into ``../../blobs``; a user's symlink farm does the same), but the
*names* an index gives must be plain relative names inside the checkpoint folder, as given and percent-decoded
(no ``..`` or empty component, no absolute path, scheme, backslash or NUL byte), for a local folder as for a URL.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointNotFoundError, redact_url
from ..options import StorageOptions
from ..storage import LocalStore, Store, is_url, open_store
from ..storage.untrusted import err, loads_json
from .header import HeaderFile, TensorInfo, read_header_file
from .hub import resolve_checkpoint
from .protocol import TableCheckpoint, chunk_files

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: an index larger than this is refused before it is read (real ones are well under 10 MiB)
MAX_INDEX_BYTES = 64 << 20
#: the file names of a sharded save (``save_pretrained``'s, torch's ``HuggingFaceStorageWriter``'s): ``i`` of ``n``
_SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
#: the staging folder of one of our saves (``<path>.tmp-XXXXXXXX``, :func:`tempfile.mkdtemp`'s names): a save
#: interrupted before its commit
_STAGING_FOLDER = re.compile(r".+\.tmp-[a-z0-9_]{8}")
log = logging.getLogger("loader")
_Meta = dict[str, dict[str, str]]


#: percent-decodings an index's file names are checked through (``%2e``, ``%252e``, ...)
_DECODINGS = 4
#: ``scheme:`` or a drive letter at a name's start
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
#: headers of a remote checkpoint's files read at once (one request or two each)
REMOTE_HEADER_THREADS = 16


def read_index(index_path: str, store: Store | None = None) -> object:
    """Read and parse an index file (any JSON value; :func:`_index_files` checks its shape).

    Raises:
        CheckpointError: not a regular file, over :data:`MAX_INDEX_BYTES`, or not valid UTF-8 JSON.
    """
    store = store if store is not None else LocalStore(os.path.dirname(index_path))
    return loads_json(index_path, store.read_small(index_path, MAX_INDEX_BYTES, "index"), "index")


def _name_problem(name: str, remote: bool) -> str:
    """Why a file name an index gives is not a plain relative name inside the folder; ``""`` when it is.

    The name is checked as given and as every percent-decoding of it reads (a server decodes ``%2e%2e`` to
    ``..``, a proxy in front of it may decode once more), for every store alike.
    """
    seen = name
    for _ in range(_DECODINGS):
        if "\0" in seen:
            return "a NUL byte"
        if "\\" in seen:
            return "a backslash"
        if seen.startswith("/") or os.path.isabs(seen):
            return "an absolute path, which escapes the checkpoint folder"
        if _SCHEME.match(seen):
            return "a scheme or drive (a URL, C:...)"
        parts = seen.split("/")
        if ".." in parts:
            return "a '..' component, which escapes the checkpoint folder"
        if "" in parts:
            return "an empty path component"
        decoded = urllib.parse.unquote(seen)
        if decoded == seen:
            break
        seen = decoded
    if remote and ("?" in name or "#" in name):
        return "'?' or '#', which a URL reads as its query or fragment"
    return ""


def _shard_path(store: Store, index_path: str, key: str, name: object) -> str:
    """The location of a file the index names, refusing names that are not plain relative names inside the folder
    (:func:`_name_problem`)."""
    if not isinstance(name, str) or not name:
        raise err(index_path, f"weight_map value must be a file name, got {name!r}", key)
    problem = _name_problem(name, store.remote)
    if problem:
        where = f"a plain relative name in the folder {store.root}"
        raise err(index_path, f"file name {name!r} is not {where} (as given or percent-decoded): {problem}", key)
    return store.locate(posixpath.normpath(name) if store.remote else os.path.normpath(name))


def _index_files(store: Store, index_path: str) -> dict[str, list[str]]:
    """Parse an index file; return ``{shard location: [keys]}`` in sorted shard order."""
    index = read_index(index_path, store)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise err(index_path, "index must be a JSON object with a 'weight_map' object")
    by_file: dict[str, list[str]] = {}
    checked: dict[str, str] = {}  # file name -> path: each distinct name is validated once
    for key, name in weight_map.items():
        path = checked.get(name) if isinstance(name, str) else None
        if path is None:
            path = checked[name] = _shard_path(store, index_path, key, name)
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        # a link that exists but leads nowhere is reported when opened; a missing remote object when its header is
        if not store.remote and not store.exists(path):
            raise err(index_path, f"names missing file {path}", keys[0])
    return {path: by_file[path] for path in sorted(by_file)}


def index_files(store: Store, index_path: str) -> dict[str, list[str]]:
    """An index's ``{shard location: [keys]}`` in sorted shard order, its file names checked as a safetensors
    index's are (any format's index of the same shape: ``pytorch_model.bin.index.json``).

    Raises:
        CheckpointError: as :func:`read_index`; a name that is not a plain relative name in the folder; a
            missing file.
    """
    return _index_files(store, index_path)


def _folder_files(store: Store) -> list[str]:
    """Every ``*.safetensors`` entry of a folder without index or ``model.safetensors``, sorted.

    Entries that are not regular files (a directory, a symlink loop) are kept, so that opening them
    reports what is wrong instead of the folder looking empty.
    """
    root, names = store.root, store.list_names()
    if names is None:
        raise CheckpointNotFoundError(
            f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found (a folder at this URL cannot be listed)", path=root
        )
    files = sorted(store.locate(n) for n in names if n.endswith(".safetensors"))
    shards = _complete_shard_set(root, names)
    if shards:
        log.info(
            "%s: no %s; loading the complete set of %d shard file(s) %s%s", root, INDEX_NAME, len(shards),
            ", ".join(shards[:8]), f", … and the other {len(files) - len(shards)} .safetensors file(s)"
            if len(files) > len(shards) else "",
        )  # fmt: skip
    if not files:  # FileNotFoundError as well, as from_pretrained and load_file raise
        raise CheckpointNotFoundError(f"{root}: folder holds no .safetensors files", path=root)
    return files


def _complete_shard_set(root: str, names: Sequence[str]) -> list[str]:
    """The ``model-0000i-of-0000n.safetensors`` files of a folder without index, sorted, once shown complete.

    Raises:
        CheckpointError: the set is provably incomplete: a member is missing, files of sets of different sizes
            (two saves), or the folder is one of our saves' staging folders (a save interrupted before its commit).
    """
    found = sorted((int(m[2]), int(m[1]), m[0]) for m in map(_SHARD_NAME.fullmatch, names) if m is not None)
    if not found:
        return []
    totals = sorted({n for n, _, _ in found})
    if len(totals) > 1:
        listed = sorted(name for _, _, name in found)
        raise err(
            root,
            f"holds shard files of {len(totals)} sets of different sizes ({', '.join(listed[:3])}, …: {len(listed)} in "
            f"all) and no {INDEX_NAME}: parts of two saves, an interrupted one? (the index says which file holds "
            "which tensor)",
        )
    total, numbers = totals[0], {i for _, i, _ in found}
    stray = sorted(name for _, i, name in found if not 1 <= i <= total)
    if stray:
        raise err(root, f"holds shard files numbered outside 1..{total} ({', '.join(stray[:4])}) and no {INDEX_NAME}")
    missing = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1) if i not in numbers]
    if missing:
        raise err(
            root,
            f"holds {len(found)} of the {total} shard files of a sharded save and no {INDEX_NAME}: missing "
            f"{', '.join(missing[:4])}{', …' if len(missing) > 4 else ''} (an incomplete copy or save?)",
        )
    if _STAGING_FOLDER.fullmatch(os.path.basename(root.rstrip("/"))):
        raise err(root, "is the staging folder of a save interrupted before its commit (no index written): refused")
    return [name for _, _, name in found]


def _locate(path: str | os.PathLike[str], storage: StorageOptions) -> tuple[Store, str, str]:
    """The store of the checkpoint ``path`` names, the file name in it (``""`` for the folder itself) and that
    file's location. A URL is a file's or a folder's by its path: a presigned file URL's query string
    (``.../model.safetensors?X-Amz-Signature=...``) goes with that file's requests only, a folder URL's with every
    object's (:class:`~loader.storage.remote.RemoteStore`)."""
    text = os.fspath(path)
    if is_url(text):
        base, mark, query = text.partition("?")
        head, _, last = base.rstrip("/").rpartition("/")
        if not (last.endswith(".safetensors") or last == INDEX_NAME):
            store = open_store(base.rstrip("/") + mark + query, storage)
            return store, "", ""
        store = open_store(head, storage)
        return store, last, store.sign(last, query) if query else store.locate(last)  # type: ignore[attr-defined]
    if storage.for_urls_only:
        raise ValueError(f"storage options (backend, remote) apply to URLs only, not to the local path {text!r}")
    local = resolve_checkpoint(text, revision=storage.revision)
    if os.path.isdir(local):
        return LocalStore(local), "", ""
    store = LocalStore(os.path.dirname(local))
    return store, os.path.basename(local), store.locate(os.path.basename(local))


def _pin(store: Store, identities: Mapping[str, object] | None) -> None:
    """A URL's store reads the objects ``identities`` name bound to them
    (:meth:`~loader.storage.remote.RemoteStore.pin`); a local store ignores them."""
    if identities and store.remote:
        store.pin(identities)  # type: ignore[attr-defined]


def _read_headers(store: Store, files: list[str]) -> list[HeaderFile]:
    """Every file's header, in order; a remote store's several at once (each costs a round trip)."""
    if not store.remote or len(files) < 2:
        return [read_header_file(f, store) for f in files]
    with ThreadPoolExecutor(min(REMOTE_HEADER_THREADS, len(files))) as pool:
        return list(pool.map(lambda f: read_header_file(f, store), files))


class SafetensorsCheckpoint(TableCheckpoint):
    """A safetensors checkpoint (one file or a sharded folder), known from its headers only: the safetensors
    implementation of :class:`~.protocol.Checkpoint` (each tensor one chunk, plain encoding).

    Attributes:
        root: The checkpoint's folder: an absolute path, or a URL.
        files: Locations of the files in use, in order (absolute paths, symlinks not resolved; or URLs).
        tensors: ``{key: TensorInfo}``.
        metadata: ``{file: __metadata__ dict}`` for every file in ``files``.
        identities: ``{file: identity}`` of every file in ``files`` as its header was read (a
            :class:`~loader.storage.FileIdentity` from the ``fstat`` of the descriptor the header was read through,
            or a remote object's :class:`~loader.storage.ObjectIdentity`); empty for :meth:`from_infos`.
        store: Where the bytes are (:class:`~loader.storage.Store`): readers come from :meth:`reader`.
    """

    def __init__(
        self,
        root: str,
        files: Sequence[str],
        tensors: dict[str, TensorInfo],
        metadata: _Meta | None = None,
        identities: Mapping[str, object] | None = None,
        store: Store | None = None,
    ) -> None:
        store = store if store is not None else LocalStore(root)
        super().__init__(tensors, tuple(files), metadata, identities, store)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        storage: StorageOptions | None = None,
        identities: Mapping[str, object] | None = None,
    ) -> SafetensorsCheckpoint:
        """Open a checkpoint, reading and validating only its headers.

        ``path`` may be a ``.safetensors`` file, a ``model.safetensors.index.json`` file, a folder, a
        Hugging Face Hub repo id (``"org/name"``, see :func:`~loader.checkpoint.hub.resolve_checkpoint`), or the
        URL of any of these (``s3://``, ``https://``, ``hf://org/name``; see docs/remote.md): a URL's folder is
        never listed (its index, else its ``model.safetensors``).
        In a folder the index is used if present (exactly the files and keys it names; keys a shard has
        beyond the index are ignored), else ``model.safetensors``, else every ``*.safetensors`` (sorted);
        ``model-0000i-of-0000n.safetensors`` shards without their index load only as a complete set (all ``n``,
        one ``n``, not in a save's staging folder), else are refused.
        Files may be symlinks to regular files anywhere; the names an index gives must stay in the folder.

        Args:
            path: File, folder, repo id or URL.
            storage: Where and how its bytes are reached (:class:`~loader.options.StorageOptions`: the revision of
                a repo id or ``hf://`` URL, a URL's backend settings and requests); None: the defaults.
            identities: For a URL: ``{location: ObjectIdentity}`` to read bound to (another rank's: ``pin``).

        Returns:
            The opened checkpoint.

        Raises:
            CheckpointNotFoundError: ``path`` is not a file, a folder or a repo id that could be resolved, or
                is a folder without ``.safetensors`` files (also a :class:`FileNotFoundError`).
            CheckpointError: A file or the index is malformed, not a regular file, names missing files or
                keys, escapes the folder, or two files hold the same key; a folder holds shards but no index.
        """
        store, name, location = _locate(path, storage or StorageOptions())  # a URL's store is given the revision
        _pin(store, identities)
        files, wanted, index_path = _checkpoint_files(store, name, location)
        tensors, metadata, found = _tables(store, files, wanted, index_path)
        return cls(store.root, files, tensors, metadata, found, store)

    @classmethod
    def from_infos(
        cls, infos: Mapping[str, TensorInfo], root: str = ".", store: Store | None = None
    ) -> SafetensorsCheckpoint:
        """Build a checkpoint from tensor metadata alone (no files touched), e.g. for planning simulations.

        Args:
            infos: ``{key: TensorInfo}``; each info's ``key`` must match its mapping key.
            root: Folder to report as :attr:`root`.
            store: The store the files are in; default: the local folder ``root``.

        Returns:
            The checkpoint; ``files`` lists the infos' chunk locations in first-seen order, ``metadata`` is
            ``{}`` for each, ``identities`` is empty.

        Raises:
            ValueError: A mapping key differs from its info's ``key``.
        """
        for key, info in infos.items():
            if info.key != key:
                raise ValueError(f"mapping key {key!r} holds TensorInfo for {info.key!r}")
        return cls(root, chunk_files(infos), dict(infos), store=store)

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({redact_url(self.root)!r}, files={len(self.files)}, tensors={len(self.tensors)})"


def _checkpoint_files(store: Store, name: str, location: str) -> tuple[list[str], dict[str, list[str]] | None, str]:
    """The files a checkpoint is read from, the keys its index places in each (None without an index), and the
    index's location (``""`` for a single file)."""
    if name and name != INDEX_NAME:
        return [location], None, ""
    index_path = location or store.locate(INDEX_NAME)
    if name == INDEX_NAME or store.exists(index_path):
        wanted = _index_files(store, index_path)
        return list(wanted), wanted, index_path
    if store.exists(store.locate(SINGLE_NAME)):
        return [store.locate(SINGLE_NAME)], None, index_path
    return _folder_files(store), None, index_path


def _tables(
    store: Store, files: list[str], wanted: dict[str, list[str]] | None, index_path: str
) -> tuple[dict[str, TensorInfo], _Meta, dict[str, object]]:
    """Every file's header read into the checkpoint's tensors, metadata and identities.

    Raises:
        CheckpointError: the index places a key in a file whose header lacks it, or two files hold one key.
    """
    tensors: dict[str, TensorInfo] = {}
    metadata: _Meta = {}
    identities: dict[str, object] = {}
    for file, header in zip(files, _read_headers(store, files)):
        metadata[file], identities[file] = header.metadata, header.identity
        if wanted is not None:
            for key in wanted[file]:
                if key not in header.tensors:
                    raise err(index_path, f"index places it in {file}, whose header lacks it", key)
                tensors[key] = header.tensors[key]
            continue
        for key, info in header.tensors.items():
            if key in tensors:
                other = os.path.basename(tensors[key].file)
                raise err(file, f"key {key!r} in both {other} and {os.path.basename(file)}", key)
            tensors[key] = info
    return tensors, metadata, identities
