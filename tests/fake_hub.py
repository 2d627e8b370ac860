"""A fake Hugging Face Hub cache on disk: the layout ``snapshot_download`` leaves, no network."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    """Write ``files`` as blobs linked from ``snapshots/<commit>/`` and point ``refs`` at the commit."""
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)  # ../../blobs/<sha>, as the Hub cache does
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
