"""Checkpoint paths that are Hugging Face Hub repo ids (``"org/name"``), resolved to a local snapshot folder.

The local cache is tried first, so a cached repo resolves offline (``HF_HUB_OFFLINE=1``); only a repo
that is not cached is downloaded, and then only its ``*.safetensors`` files, index and ``config.json``
(its ``quantization_config`` tells how FP8 weights dequantize). ``huggingface_hub``
(which comes with transformers) is imported only when a repo id is resolved. The cache folder and the
offline switch are read from the environment at each call (``HF_HUB_CACHE``, ``HF_HOME``,
``HF_HUB_OFFLINE``), not only when ``huggingface_hub`` was first imported.
"""

from __future__ import annotations

import logging
import os
import re

from loader.errors import CheckpointError, CheckpointNotFoundError

from ..storage.untrusted import open_regular_file, pread_exact, short

log = logging.getLogger(__name__)

#: the files a checkpoint needs from a repo: weights and their index, nothing else
HUB_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
_TRUE = {"1", "ON", "YES", "TRUE"}
#: a commit hash, as ``huggingface_hub`` names snapshot folders (a ref file holds one)
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: a ref file larger than this is refused before it is read (real ones hold 40 bytes)
_MAX_REF_BYTES = 4096


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hub repo id: ``name`` or ``org/name`` (as ``huggingface_hub`` checks).

    Args:
        text: A checkpoint path as the user gave it.

    Returns:
        True for ``"org/name"`` or ``"name"`` made of letters, digits, ``_``, ``-`` and ``.`` (no ``--`` or
        ``..``, at most 96 characters); False for anything that can only be a path.
    """
    return len(text) <= 96 and "--" not in text and ".." not in text and _REPO_ID.fullmatch(text) is not None


def hub_cache_dir() -> str:
    """The Hugging Face Hub cache folder, from the environment as it is now.

    Returns:
        ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
        ``huggingface_hub``'s default.
    """
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """Whether Hub downloads are off: ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set now or at import."""
    from huggingface_hub import constants

    now = any(os.environ.get(n, "").upper() in _TRUE for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return now or bool(constants.HF_HUB_OFFLINE)


def _holds_checkpoint(folder: str) -> bool:
    try:
        return any(n.endswith((".safetensors", ".safetensors.index.json")) for n in os.listdir(folder))
    except OSError:
        return False


def check_revision(revision: object) -> None:
    """Refuse a revision that could lead ``huggingface_hub`` out of the repo's ``refs/`` folder.

    A revision is a branch, tag (``refs/pr/1`` included) or commit hash; ``huggingface_hub`` reads
    ``refs/<revision>`` as a file path, so ``..`` components, absolute paths, backslashes and NUL bytes are refused.

    Raises:
        CheckpointError: ``revision`` is not None and not such a name (the message names it).
    """
    if revision is None:
        return
    if not isinstance(revision, str):
        raise CheckpointError(f"revision must be a branch, tag or commit hash (a str), got {short.repr(revision)}")
    refused = (
        ("\0" in revision, "holds a NUL byte"),
        ("\\" in revision, "holds a backslash"),
        (revision.startswith("/") or os.path.isabs(revision), "is an absolute path"),
        (".." in revision.split("/"), "has a '..' component"),
    )
    why = next((why for bad, why in refused if bad), None)
    if why is not None:
        raise CheckpointError(f"revision={short.repr(revision)} {why}: a revision is a branch, tag or commit hash")


def _ref_commit(repo_dir: str, revision: str) -> str | None:
    """The commit hash the cache's ``refs/<revision>`` file holds (whitespace stripped); None: no such file.

    Raises:
        CheckpointError: the file is not a regular file, or holds anything but a 40-hex commit hash.
    """
    ref = os.path.join(repo_dir, "refs", revision)
    if not os.path.lexists(ref):
        return None
    fd, st = open_regular_file(ref)
    try:
        raw = pread_exact(fd, ref, min(st.st_size, _MAX_REF_BYTES + 1), 0)
    finally:
        os.close(fd)
    text = raw.decode("utf-8", "replace").strip()
    if len(raw) > _MAX_REF_BYTES or not _COMMIT.fullmatch(text):
        raise CheckpointError(
            f"{ref}: the ref of revision {revision!r} holds {short.repr(text)}, not a 40-hex commit hash", path=ref
        )
    return text


def _inside_snapshots(folder: str, repo_dir: str, repo_id: str, revision: str | None) -> str:
    """``folder`` if it is a snapshot folder of the repo (``<repo_dir>/snapshots/<commit>``, links resolved)."""
    snapshots = os.path.realpath(os.path.join(repo_dir, "snapshots"))
    real = os.path.realpath(folder)
    if os.path.dirname(real) != snapshots:
        raise CheckpointError(
            f"{folder}: the snapshot of Hub repo {repo_id!r} at revision {revision or 'main'!r} resolves to {real}, "
            f"outside the repo's snapshots folder {snapshots}",
            path=folder,
        )
    return folder


def _repo_dir(repo_id: str, cache_dir: str) -> str:
    from huggingface_hub.file_download import repo_folder_name

    return os.path.join(cache_dir, repo_folder_name(repo_id=repo_id, repo_type="model"))


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str) -> tuple[str | None, str]:
    """``(snapshot folder, "")`` if the cache holds the repo's checkpoint files, else ``(None, why not)``.

    A branch or tag is looked up in the cache's ``refs/`` here, its content accepted only as a commit hash, and the
    snapshot must lie in the repo's ``snapshots/`` folder (``huggingface_hub`` would follow a path in a ref).
    """
    from huggingface_hub import snapshot_download

    repo_dir = _repo_dir(repo_id, cache_dir)
    name = revision or "main"
    commit = name if _COMMIT.fullmatch(name) else _ref_commit(repo_dir, name)
    try:
        folder = snapshot_download(
            repo_id,
            revision=commit or name,
            cache_dir=cache_dir,
            allow_patterns=list(HUB_PATTERNS),
            local_files_only=True,
        )
    except (OSError, ValueError) as e:  # LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError
        return None, f"not in the cache {cache_dir} ({type(e).__name__})"
    folder = _inside_snapshots(folder, repo_dir, repo_id, revision)
    if not _holds_checkpoint(folder):
        return None, f"its cached snapshot {folder} holds no .safetensors files"
    return folder, ""


def _download(repo_id: str, revision: str | None, cache_dir: str) -> tuple[str | None, str]:
    """``(snapshot folder, "")`` after downloading the repo's checkpoint files, else ``(None, why not)``."""
    from huggingface_hub import snapshot_download

    log.info("downloading %s (%s) from the Hugging Face Hub into %s", repo_id, ", ".join(HUB_PATTERNS), cache_dir)
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(HUB_PATTERNS))
    except (OSError, ValueError) as e:  # HfHubHTTPError (not found, gated, network), LocalEntryNotFoundError
        return None, f"the download failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    folder = _inside_snapshots(folder, _repo_dir(repo_id, cache_dir), repo_id, revision)
    if not _holds_checkpoint(folder):
        return None, "the repo holds no .safetensors files"
    return folder, ""


def resolve_checkpoint(path: str | os.PathLike[str], revision: str | None = None, *, download: bool = True) -> str:
    """The local path of a checkpoint given as a path or as a Hugging Face Hub repo id.

    An existing file or folder (or a symlink, even a broken one) is the checkpoint. Otherwise, when
    ``path`` looks like a repo id, the Hub cache is tried first (works offline), then, unless offline or
    ``download`` is False, the repo's ``*.safetensors`` files and index are downloaded into the cache.

    Args:
        path: A file, a folder, or a repo id ``"org/name"``.
        revision: Branch, tag or commit hash of a repo id; ``None``: the default branch (``main``).
        download: Whether a repo that is not cached may be downloaded.

    Returns:
        The absolute path of the file or folder (for a repo id: its snapshot folder in the cache).

    Raises:
        CheckpointNotFoundError: ``path`` is neither a file, a folder, nor a repo id found in the cache
            or on the Hub; the message names everything that was tried.
        CheckpointError: ``revision`` was given for a local path, or could lead out of the repo's cache folder
            (see :func:`check_revision`); a cached ref that is not a commit hash, or a snapshot outside the repo's
            ``snapshots/`` folder.
    """
    check_revision(revision)
    text = os.fspath(path)
    usable = bool(text) and "\0" not in text  # else no file can have this name
    local = os.path.abspath(text) if usable else text
    if usable and os.path.lexists(text):
        if revision is not None:
            raise CheckpointError(f"{local}: revision={revision!r} is for Hub repo ids, not a local path", path=local)
        return local
    tried = f"no checkpoint {text!r}: no such file or folder {local!r}"
    if not looks_like_repo_id(text):
        raise CheckpointNotFoundError(tried, path=text)
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        msg = f"{tried}; to look it up as a Hugging Face Hub repo id, pip install huggingface_hub"
        raise CheckpointNotFoundError(msg, path=text) from None
    cache_dir = hub_cache_dir()
    folder, why = _cached_snapshot(text, revision, cache_dir)
    if folder is None:
        if hub_offline() or not download:
            why += "; offline (HF_HUB_OFFLINE), so not downloaded" if download else "; not downloaded"
        else:
            folder, why = _download(text, revision, cache_dir)
    if folder is None:
        repo = f"Hub repo {text!r} at revision {revision or 'main'!r}"
        raise CheckpointNotFoundError(f"{tried}, and as a {repo}: {why}", path=text)
    return os.path.abspath(folder)
