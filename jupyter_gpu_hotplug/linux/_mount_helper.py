"""The short-lived, single-threaded process that moves bind mounts into a container.

Why a process of its own: a mount can only be attached to a mount namespace the caller is in
(``move_mount(2)`` checks the target), and ``setns(CLONE_NEWNS)`` refuses a multi-threaded caller
— the agent has threads. So :mod:`.bindmounts` starts this file (``python -I -S``, standard
library only: it is run by path, not imported, and imports nothing of the package) and hands it
open file descriptors, never paths: the source files (``O_PATH``, opened by the parent in the
host's root as the agent sees it, in the agent's own mount namespace — the one this process
starts in), the mount points in the container (``O_PATH``, opened by the parent inside the
container's root with symlinks refused), and the container's mount namespace. Nothing here
resolves a path that a container could have planted.

Input (argv[1], JSON): ``{"target_ns": fd, "ops": [...]}``,
each op ``{"op": "bind", "source": fd, "target": fd, "attrs": int}`` or
``{"op": "unmount", "target": fd}``. Output (stdout, JSON): ``{"done": n}`` or
``{"done": n, "error": "...", "errno": e}`` — ops before ``n`` took effect, none after.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8


class StepError(Exception):
    """A syscall failed; ``errno`` is the kernel's answer."""

    def __init__(self, what: str, err: int) -> None:
        super().__init__(f"{what}: {os.strerror(err)}")
        self.errno = err


def _check(result: int, what: str) -> int:
    if result < 0:
        raise StepError(what, ctypes.get_errno())
    return int(result)


def _setns(fd: int, what: str) -> None:
    _check(_libc.setns(fd, CLONE_NEWNS), f"entering the {what} mount namespace")


def _clone(source_fd: int, attrs: int) -> int:
    tree = _check(
        _libc.syscall(
            SYS_OPEN_TREE, source_fd, b"", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH
        ),
        "cloning the source (open_tree)",
    )
    if attrs:
        # struct mount_attr {u64 attr_set, attr_clr, propagation, userns_fd}
        attr = (ctypes.c_uint64 * 4)(attrs, 0, 0, 0)
        _check(
            _libc.syscall(
                SYS_MOUNT_SETATTR,
                tree,
                b"",
                AT_EMPTY_PATH | AT_RECURSIVE,
                attr,
                ctypes.sizeof(attr),
            ),
            "setting the mount's attributes (mount_setattr)",
        )
    return tree


def main(request: dict[str, Any]) -> dict[str, Any]:
    ops = request["ops"]
    done = 0
    fd_dir = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # Every source is cloned while still in the agent's namespace, the sources' (open_tree
        # refuses a mount of another namespace); the clones are detached trees, attachable
        # anywhere after.
        trees = [_clone(op["source"], op["attrs"]) if op["op"] == "bind" else -1 for op in ops]
        _setns(request["target_ns"], "container's")
        # setns moved our cwd to the namespace's root; the fd directory opened before it is the
        # one place to name a target fd from, whatever the container mounted on its /proc.
        os.fchdir(fd_dir)
        for op, tree in zip(ops, trees, strict=True):
            if op["op"] == "bind":
                _check(
                    _libc.syscall(
                        SYS_MOVE_MOUNT,
                        tree,
                        b"",
                        op["target"],
                        b"",
                        MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
                    ),
                    "attaching the mount (move_mount)",
                )
            else:
                _check(
                    _libc.umount2(str(op["target"]).encode(), MNT_DETACH),
                    "unmounting (umount2)",
                )
            done += 1
    except StepError as error:
        return {"done": done, "error": str(error), "errno": error.errno}
    return {"done": done}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
