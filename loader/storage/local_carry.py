"""The user's files in a local checkpoint folder, which a commit keeps and never moves off their filesystem.

A commit replaces the folder whole (:mod:`.local_commit`), so what is not the checkpoint's travels with it:

* :func:`check_no_mounts`: a folder that is a mount point, or has one inside, is refused before anything is
  written (the old folder, moved aside and removed, would take the mounted filesystem with it);
* :func:`carry_over`: the old folder's entries that are no checkpoint weight file or index, and that the new
  checkpoint does not hold, are hard-linked (else copied) into the new folder; what was carried is recorded;
* :func:`take_late`: after the swap, what appeared in the old folder after the carry-over (or was replaced there)
  is moved into the new one, before the old folder is removed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Callable
from typing import Any

#: weight files of a checkpoint besides the index: what a new checkpoint replaces, never carried over
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
INDEX_NAME = "model.safetensors.index.json"
#: where the mount points are listed (Linux); elsewhere, or unreadable: device numbers and ``os.path.ismount``
MOUNTINFO = "/proc/self/mountinfo"

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_size
#: what :func:`carry_over` carried, by name: a file's (old identity, new identity), a folder's own ``Carried``
Carried = dict[str, Any]
Step = Callable[[str], None]


def check_no_mounts(path: str) -> None:
    """Refuse ``path`` when it is a mount point or holds one (at any depth).

    Raises:
        ValueError: naming the mount point(s).
    """
    found = mounts_at_or_below(path)
    if not found:
        return
    if found[0] == os.path.realpath(path):
        raise ValueError(
            f"cannot save to {path!r}: it is a mount point, and a save replaces the folder whole (one rename, which "
            "a mount point refuses): save into a folder inside it"
        )
    more = f" (and {len(found) - 1} more: {', '.join(found[1:4])})" if len(found) > 1 else ""
    raise ValueError(
        f"cannot save to {path!r}: {found[0]!r} is a mount point inside it{more}; a save replaces the folder whole "
        "and would take the mounted filesystem away with the old folder: unmount it, or save elsewhere"
    )


def mounts_at_or_below(path: str) -> list[str]:
    """The mount points at ``path`` or inside it, sorted (``path`` resolved; none when it is not a folder)."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return []
    points = _mount_points()
    if points is None:
        return _mounts_by_device(real)
    inside = real.rstrip(os.sep) + os.sep
    return sorted({p for p in points if p == real or p.startswith(inside)})


def carry_over(old: str, new: str, step: Step, carried: Carried | None = None) -> Carried:
    """Link (else copy) into ``new`` every entry of ``old`` that ``new`` lacks and that is no checkpoint weight
    file or index (those the new checkpoint replaces). Returns ``carried`` with what was carried added (a second
    call carries only what appeared since)."""
    carried = {} if carried is None else carried
    have = set(os.listdir(new))
    for name in sorted(os.listdir(old)):
        src = os.path.join(old, name)
        if name in have or _is_checkpoint_file(name, src):
            continue
        step(f"carry {name}")
        carried[name] = _link_tree(src, os.path.join(new, name))
    return carried


def take_late(old: str, new: str, carried: Carried, step: Step) -> list[str]:
    """After the swap: move into ``new`` what appeared in ``old`` after the carry-over (a name ``new`` lacks) and
    what was replaced there (a carried file whose old entry changed while its copy in ``new`` did not).
    Returns the paths moved (in ``new``).

    Raises:
        OSError: a carried entry turned from a file into a folder or back (the caller keeps the old folder).
    """
    moved: list[str] = []
    for name in sorted(os.listdir(old)):
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if name not in carried and _is_checkpoint_file(name, src):
            continue
        was = carried.get(name)
        if was is None:
            if not os.path.lexists(dst):  # else the new checkpoint's own file (config.json), or the user's newer one
                step(f"late {name}")
                os.rename(src, dst)
                moved.append(dst)
        elif isinstance(was, dict) != _is_dir(src) and _identity(dst) is not None:
            raise OSError(errno.EEXIST, "turned from a file into a folder or back during the commit", src)
        elif isinstance(was, dict):
            if _is_dir(dst):
                moved += take_late(src, dst, was, step)
        elif _identity(src) != was[0] and _identity(dst) == was[1]:
            step(f"late {name}")
            os.replace(src, dst)
            moved.append(dst)
    return moved


# ---------------------------------------------------------------------------------------------------


def _is_checkpoint_file(name: str, full: str) -> bool:
    return bool(WEIGHT_FILE.fullmatch(name) or name == INDEX_NAME) and not os.path.isdir(full)


def _identity(path: str) -> Identity | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _link_tree(src: str, dst: str) -> tuple[Identity, Identity] | Carried:
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst)
        inner = {name: _link_tree(os.path.join(src, name), os.path.join(dst, name)) for name in sorted(os.listdir(src))}
        shutil.copystat(src, dst)
        return inner
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # no hard links here (or not allowed): a copy
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size), _identity(dst)


def _mount_points() -> list[str] | None:
    """Every mount point of this process's mount namespace (None: no mount table to read)."""
    try:
        with open(MOUNTINFO, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    escaped = re.compile(rb"\\([0-7]{3})")  # a space is \040, a newline \012, a backslash \134
    fields = (line.split(b" ") for line in lines)
    return [os.fsdecode(escaped.sub(lambda m: bytes([int(m[1], 8)]), f[4])) for f in fields if len(f) > 4]


def _mounts_by_device(root: str) -> list[str]:
    """Mount points where no mount table can be read: a folder on another device than its parent, or one
    ``os.path.ismount`` says is one (symlinks not followed)."""
    found = [root] if os.path.ismount(root) else []
    device = os.lstat(root).st_dev
    for folder, subfolders, _ in os.walk(root):
        for name in list(subfolders):
            full = os.path.join(folder, name)
            if os.lstat(full).st_dev != device or os.path.ismount(full):
                found.append(full)
                subfolders.remove(name)
    return sorted(found)
