"""The local driver's commit: a finished staging folder takes the place of the folder ``path`` in one step.

Vocabulary: the *staging* folder holds the new checkpoint, beside ``path``; the *swap* is one
``renameat2(RENAME_EXCHANGE)`` of two folders (Linux); *aside* is the ``<path>.old-commit-XXXXXXXX`` name the old
folder ends under; *carried* files are the user's, kept across the commit (:mod:`.local_carry`).

Under a lock (:mod:`.local_lock`: ``fcntl.flock`` on ``<parent>/.<name>.lock``, opened without following a symlink,
so concurrent saves into one path commit one after the other), the files of the old folder that are not part of a
checkpoint (a README, tokenizer files, …) are carried into the staging folder (hard links, else copies:
:mod:`.local_carry`; a folder with a mount point inside is refused), the staging folder is renamed to
``<path>.old-commit-XXXXXXXX`` and the two folders are swapped; what appeared in the old folder meanwhile is moved
into the new one, then the old folder, now under the ``.old-commit-`` name, is removed. Where the swap is
unavailable (not Linux, or a filesystem answering ``EINVAL``/``ENOSYS``) the old folder is renamed aside to
``<path>.old-commit-XXXXXXXX`` and the new one renamed in: a kill between the two renames leaves no ``path`` and the
old checkpoint at the ``.old-commit-`` name, which :func:`recover` (run by the next commit into ``path``, under the
lock) puts back.

:data:`STEP_HOOK`, when set, is called with each step's name just before the step (tests kill the process or raise
there).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import re
import shutil
import stat
import tempfile
from collections.abc import Callable

from .local_carry import Carried, carry_over, check_no_mounts, mounts_at_or_below, take_late
from .local_lock import locked

log = logging.getLogger("loader")

#: called with each commit step's name just before the step is taken (None: nothing)
STEP_HOOK: Callable[[str], None] | None = None
#: False: always the two-rename fallback, as where the swap is unavailable
USE_SWAP = True
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276, "ppc64le": 357, "s390x": 347, "riscv64": 276}
_swap_fn: Callable[[str, str], None] | None | bool = False  # False: not looked up yet


def destination(path: str | os.PathLike[str]) -> str:
    """The absolute folder a save into ``path`` commits to (a symlink to a folder: the folder it names)."""
    path = os.path.abspath(os.fspath(path))
    return os.path.realpath(path) if os.path.islink(path) else path


def commit_folder(staging: str, path: str, timeout: float | None = None) -> None:
    """Make the finished checkpoint in ``staging`` (a folder beside ``path``) appear at ``path`` in one step;
    an existing folder's files that are not checkpoint weights or index are kept.

    Raises:
        TimeoutError: another save into ``path`` held the lock for more than ``timeout`` seconds.
        ValueError: ``path`` is a mount point or holds one (nothing moved).
        OSError: the commit failed: ``path`` holds the old checkpoint, whole (or the new one, where the
            failure came after the swap and only the removal of the old folder was left); the lock path is a
            symlink or not a regular file.
    """
    path = destination(path)
    with locked(path, timeout, _step):
        _step("recover")
        recover(path)
        check_no_mounts(path)
        if not os.path.lexists(path):
            _step("rename")
            try:
                os.rename(staging, path)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(path):
                    raise
            else:
                return _finish(path, None, {})
        if not os.path.isdir(path) or os.path.islink(path):
            raise NotADirectoryError(errno.ENOTDIR, "cannot save there: it is not a folder", path)
        carried = carry_over(path, staging, _step)
        with contextlib.suppress(OSError):
            os.chmod(staging, stat.S_IMODE(os.stat(path).st_mode))
        aside = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-commit-", dir=os.path.dirname(path))
        try:
            _step("rescan")
            carry_over(path, staging, _step, carried)  # what the user wrote meanwhile: there at the swap
            if not _stage_and_swap(staging, path, aside):
                _fallback(staging, path, aside)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(aside)  # the empty placeholder: ``path`` still holds the old checkpoint
            raise
        _finish(path, aside, carried)


def recover(path: str) -> list[str]:
    """Finish what an interrupted commit into ``path`` left (call under the lock): with no ``path``, the newest
    ``<path>.old-commit-XXXXXXXX`` folder is put back; every other such folder is removed. Returns what was done."""
    parent, name = os.path.split(destination(path))
    pattern = re.compile(re.escape(name) + r"\.old-commit-[a-z0-9_]{8}")  # mkdtemp's names
    try:
        found = [os.path.join(parent, n) for n in os.listdir(parent) if pattern.fullmatch(n)]
    except FileNotFoundError:
        return []
    found = [f for f in found if os.path.isdir(f) and not os.path.islink(f)]
    done = []
    if found and not os.path.lexists(os.path.join(parent, name)):
        newest = max(found, key=lambda f: os.stat(f).st_mtime_ns)
        if os.listdir(newest):  # an empty one is a placeholder, never a checkpoint
            os.rename(newest, os.path.join(parent, name))
            found.remove(newest)
            done.append(f"restored {newest}")
            log.warning("an interrupted save left the previous checkpoint at %s: restored to %s", newest, path)
    for f in found:
        if _remove_old(f):
            done.append(f"removed {f}")
    return done


# ---------------------------------------------------------------------------------------------------


def _step(name: str) -> None:
    if STEP_HOOK is not None:
        STEP_HOOK(name)


def _remove_old(folder: str, strict: bool = False) -> bool:
    """Remove an old folder, unless a filesystem is mounted inside it (left, with a warning: never emptied).
    ``strict``: a failure to remove raises, else it is ignored. Returns whether it was removed."""
    mounts = mounts_at_or_below(folder)
    if mounts:
        log.warning("%s is left in place: %s is mounted inside it (a commit never removes a mount)", folder, mounts[0])
        return False
    shutil.rmtree(folder, ignore_errors=not strict)
    return True


def _stage_and_swap(staging: str, path: str, aside: str) -> bool:
    """The new folder to ``aside`` (onto its empty placeholder), then one swap of ``aside`` and ``path``.
    False (and ``staging`` as it was) where the swap is unavailable; on an error ``staging`` is put back."""
    swap = swapper()
    if swap is None:
        return False
    _step("stage")
    os.rename(staging, aside)
    try:
        _step("swap")
        swap(aside, path)
        return True
    except OSError as e:
        os.rename(aside, staging)
        if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            log.info("renameat2(RENAME_EXCHANGE) is unavailable for %s (%s): two renames instead", path, e)
            return False
        raise
    except BaseException:
        os.rename(aside, staging)
        raise


def _fallback(staging: str, path: str, aside: str) -> None:
    """Two renames: ``path`` aside (to ``aside``), then ``staging`` to ``path``; a failure of the second puts the
    old folder back. A kill between them leaves no ``path``: :func:`recover` puts the old folder back."""
    _step("move-aside")
    os.rename(path, aside)
    try:
        _step("move-in")
        os.rename(staging, path)
    except BaseException:
        os.rename(aside, path)
        raise


def _finish(path: str, aside: str | None, carried: Carried) -> None:
    """After the commit: what appeared in the old folder (now ``aside``) since the carry-over moves into ``path``,
    then the old folder goes, best effort (a leftover goes at the next commit). Where the move fails, the old folder
    stays whole, renamed to ``<path>.kept-XXXXXXXX`` (which no commit removes)."""
    try:
        if aside is not None:
            _step("take-late")
            moved = take_late(aside, path, carried, _step)
            if moved:
                log.info("moved %d file(s) written into %s during the commit into the new checkpoint", len(moved), path)
    except OSError as e:
        kept = aside.replace(".old-commit-", ".kept-", 1) if aside else aside
        with contextlib.suppress(OSError):  # a name recover() never removes: the user's files in it stay
            os.rename(aside, kept)
        log.warning(
            "the checkpoint is saved at %s, but moving what was written into the old folder during the commit "
            "failed (%s): the old folder, with those files, is kept at %s",
            path,
            e,
            kept if os.path.isdir(kept) else aside,
        )
        return
    try:
        if aside is not None:
            _step("remove-old")
            _remove_old(aside, strict=True)
        _step("done")
    except OSError as e:
        log.warning("the checkpoint is saved at %s, but removing the old folder %s failed: %s", path, aside, e)


def swapper() -> Callable[[str, str], None] | None:
    """``swap(a, b)``: swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); None where the C
    library and the kernel offer no way to ask (or :data:`USE_SWAP` is off)."""
    global _swap_fn
    if not USE_SWAP:
        return None
    if _swap_fn is False:
        _swap_fn = _find_swap()
    return _swap_fn  # type: ignore[return-value]


def _find_swap() -> Callable[[str, str], None] | None:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    renameat2 = getattr(libc, "renameat2", None)
    number = _SYS_RENAMEAT2.get(platform.machine())
    if renameat2 is None and number is None:
        return None

    def swap(a: str, b: str) -> None:
        args = (ctypes.c_int(_AT_FDCWD), os.fsencode(a), ctypes.c_int(_AT_FDCWD), os.fsencode(b))
        flags = ctypes.c_uint(_RENAME_EXCHANGE)
        if renameat2 is not None:
            rc = renameat2(*args, flags)
        else:
            rc = libc.syscall(ctypes.c_long(number), *args, flags)
        if rc != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), a, None, b)

    return swap
