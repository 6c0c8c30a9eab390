"""Adopting the state directory safely: never trust a directory or file someone else prepared.

Why it exists: the state directory holds the agent token (root-level power over every
container's devices) and the ledger (which GPU belongs to whom). An agent started with
``--state-dir=/tmp/x`` where another user had already made ``/tmp/x`` (or planted
``/tmp/x/token``, or a symlink) would hand that user its token or let them rewrite its ledger.
So an existing state directory, each of its ancestors and the token file are checked before
use, the way OpenSSH's ``StrictModes`` checks ``~/.ssh``: owned by the agent's user (or root),
not writable by group or others (an ancestor may be a sticky directory such as ``/tmp``), and
never a symlink. A refusal names the path, its owner and its mode, and says what to do.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Final

__all__ = ["UnsafeStateError", "prepare_state_dir", "unsafe_reason"]

_DIR_MODE: Final = 0o700
_WRITABLE_BY_OTHERS: Final = stat.S_IWGRP | stat.S_IWOTH


class UnsafeStateError(Exception):
    """The state directory or a file in it is not safe to adopt; the message says why."""


def _owner_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def unsafe_reason(
    info: os.stat_result, *, forbidden_bits: int, ancestor: bool = False
) -> str | None:
    """Why a file or directory with ``info`` (from ``lstat``) must not be trusted, or None.

    Trusted: owned by this process's effective user or root, none of ``forbidden_bits`` set,
    and not a symlink. An ``ancestor`` directory may be sticky and writable by all (``/tmp``),
    and may be a symlink its trusted owner made (``/var/run``).
    """
    mode = stat.S_IMODE(info.st_mode)
    described = f"owner {_owner_name(info.st_uid)}, mode {mode:04o}"
    if info.st_uid not in (os.geteuid(), 0):
        return f"it belongs to someone else ({described}; the agent runs as uid {os.geteuid()})"
    if stat.S_ISLNK(info.st_mode):
        return None if ancestor else f"it is a symlink ({described}); none is followed there"
    if mode & forbidden_bits and not (ancestor and mode & stat.S_ISVTX):
        return f"group or others may change it ({described})"
    return None


def _check(path: Path, *, what: str, forbidden_bits: int, ancestor: bool = False) -> bool:
    """Refuse ``path`` if it is unsafe; False when it does not exist."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise UnsafeStateError(f"cannot inspect {what} {path}: {e.strerror}") from e
    reason = unsafe_reason(info, forbidden_bits=forbidden_bits, ancestor=ancestor)
    if reason is None and not stat.S_ISDIR(info.st_mode) and not ancestor:
        reason = "it is not a directory"
    if reason is not None:
        raise UnsafeStateError(
            f"refusing {what} {path}: {reason}. Give a --state-dir that only root can write "
            "(the default is /var/lib/gpu-hotplug), or remove it and let the agent create it"
        )
    return True


def prepare_state_dir(path: Path) -> None:
    """Check an existing state directory (and its ancestors), or create it with mode 0700.

    Raises ``UnsafeStateError`` naming the first path that is a symlink, someone else's, or
    writable by group or others (an ancestor may be sticky, as ``/tmp`` is).
    """
    for parent in reversed(path.parents):
        _check(parent, what="the directory", forbidden_bits=_WRITABLE_BY_OTHERS, ancestor=True)
    if _check(path, what="the state directory", forbidden_bits=_WRITABLE_BY_OTHERS):
        return
    try:
        path.mkdir(mode=_DIR_MODE, parents=True)
    except FileExistsError:
        pass  # made meanwhile: checked below like any existing one
    except OSError as e:
        raise UnsafeStateError(f"cannot create the state directory {path}: {e.strerror}") from e
    _check(path, what="the state directory", forbidden_bits=_WRITABLE_BY_OTHERS)
