"""A checkpoint: one safetensors file or a sharded folder with its index, known from its headers only."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, KeysView, Mapping, Sequence

from .header import TensorInfo, err, no_duplicate_keys, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_Meta = dict[str, dict[str, str]]


def _index_files(root: str, index_path: str, allow_external_symlinks: bool) -> dict[str, list[str]]:
    """Parse an index file; return ``{absolute shard path: [keys]}`` in sorted shard order."""
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise err(index_path, f"index is not valid UTF-8 JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise err(index_path, "index must be a JSON object with a 'weight_map' object")
    real_root = os.path.realpath(root)
    by_file: dict[str, list[str]] = {}
    checked: dict[str, str] = {}  # file name -> path: each distinct name is validated once
    for key, name in weight_map.items():
        path = checked.get(name) if isinstance(name, str) else None
        if path is None:
            if not isinstance(name, str) or not name:
                raise err(index_path, f"weight_map value must be a file name, got {name!r}", key)
            norm = os.path.normpath(name)
            if os.path.isabs(name) or norm == ".." or norm.startswith(".." + os.sep):
                raise err(index_path, f"file {name!r} escapes the checkpoint folder {root}", key)
            path = os.path.join(root, norm)
            if not allow_external_symlinks:
                real = os.path.realpath(path)
                if os.path.commonpath([real, real_root]) != real_root:
                    raise err(index_path, f"file {name!r} resolves to {real}, outside {real_root}", key)
            checked[name] = path
        by_file.setdefault(path, []).append(key)
    for path in by_file:
        if not os.path.isfile(path):
            raise err(index_path, f"names missing file {path}", by_file[path][0])
    return {path: by_file[path] for path in sorted(by_file)}


class SafetensorsCheckpoint(Mapping[str, TensorInfo]):
    """A safetensors checkpoint (one file or a sharded folder), known from its headers only.

    A read-only mapping from tensor key to :class:`TensorInfo`.

    Attributes:
        root: Absolute folder of the checkpoint.
        files: Absolute paths of the files in use, in order.
        tensors: ``{key: TensorInfo}``.
        metadata: ``{file: __metadata__ dict}`` for every file in ``files``.
    """

    def __init__(
        self, root: str, files: Sequence[str], tensors: dict[str, TensorInfo], metadata: _Meta | None = None
    ) -> None:
        self.root = os.path.abspath(root)
        self.files = tuple(files)
        self.tensors = tensors
        self.metadata = metadata if metadata is not None else {f: {} for f in self.files}

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, revision: str | None = None, allow_external_symlinks: bool = False
    ) -> SafetensorsCheckpoint:
        """Open a checkpoint, reading and validating only its headers.

        ``path`` may be a ``.safetensors`` file, a ``model.safetensors.index.json`` file, or a folder. In
        a folder the index is used if present (exactly the files and keys it names; keys a shard has
        beyond the index are ignored), else ``model.safetensors``, else every ``*.safetensors`` (sorted).

        Args:
            path: File or folder.
            allow_external_symlinks: Accept index entries that are symlinks resolving outside the folder
                (needed for Hugging Face hub cache snapshots, whose files link into ``../../blobs``).

        Returns:
            The opened checkpoint.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointError: A file or the index is malformed, names missing files/keys, escapes the
                folder, or two files hold the same key.
        """
        path = os.path.abspath(os.fspath(path))
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path}")
        if os.path.isfile(path) and os.path.basename(path) != INDEX_NAME:
            tensors, meta = read_header(path)
            return cls(os.path.dirname(path), (path,), tensors, {path: meta})
        root = os.path.dirname(path) if os.path.isfile(path) else path
        index_path = os.path.join(root, INDEX_NAME)
        if os.path.isfile(index_path):
            wanted: dict[str, list[str]] | None = _index_files(root, index_path, allow_external_symlinks)
            files = list(wanted)
        elif os.path.isfile(os.path.join(root, SINGLE_NAME)):
            wanted, files = None, [os.path.join(root, SINGLE_NAME)]
        else:
            wanted = None
            files = sorted(
                os.path.join(root, n)
                for n in os.listdir(root)
                if n.endswith(".safetensors") and os.path.isfile(os.path.join(root, n))
            )
            if not files:
                raise err(root, "folder holds no .safetensors files")
        tensors: dict[str, TensorInfo] = {}
        metadata: _Meta = {}
        for file in files:
            header, metadata[file] = read_header(file)
            if wanted is not None:
                for key in wanted[file]:
                    if key not in header:
                        raise err(index_path, f"index places it in {file}, whose header lacks it", key)
                    tensors[key] = header[key]
                continue
            for key, info in header.items():
                if key in tensors:
                    other = os.path.basename(tensors[key].file)
                    raise err(file, f"key {key!r} in both {other} and {os.path.basename(file)}", key)
                tensors[key] = info
        return cls(root, files, tensors, metadata)

    @classmethod
    def from_infos(cls, infos: Mapping[str, TensorInfo], root: str = ".") -> SafetensorsCheckpoint:
        """Build a checkpoint from tensor metadata alone (no files touched), e.g. for planning simulations.

        Args:
            infos: ``{key: TensorInfo}``; each info's ``key`` must match its mapping key.
            root: Folder to report as :attr:`root`.

        Returns:
            The checkpoint; ``files`` lists the infos' files in first-seen order, ``metadata`` is empty.

        Raises:
            ValueError: A mapping key differs from its info's ``key``.
        """
        for key, info in infos.items():
            if info.key != key:
                raise ValueError(f"mapping key {key!r} holds TensorInfo for {info.key!r}")
        files = tuple(dict.fromkeys(info.file for info in infos.values()))
        return cls(root, files, dict(infos))

    def __getitem__(self, key: str) -> TensorInfo:
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self) -> KeysView[str]:
        """Tensor keys, in checkpoint order."""
        return self.tensors.keys()

    @property
    def total_bytes(self) -> int:
        """Sum of all tensors' data bytes."""
        return sum(info.nbytes for info in self.tensors.values())

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({self.root!r}, files={len(self.files)}, tensors={len(self.tensors)})"
