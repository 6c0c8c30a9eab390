"""A fake container for device-node tests (test helper, not product code).

The child unshares its mount namespace, makes every mount private, mounts a
tmpfs as its root filesystem with another tmpfs on ``/dev`` — as runtimes do —
lets the "workload" plant files, links and nodes, chroots into it and then
answers ``stat``/``ls``/``chmod``/``chown`` requests over a pipe, so a test sees ``/dev``
exactly as the container does. Its root is invisible from the host: on the host
side ``rootfs`` stays an empty directory.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

Plant = tuple[str, str, object]
"""``(kind, path inside the container, argument)``: ``("symlink", "dev/nvidia3", "/etc")``,
``("file", "dev/nvidia3", None)``, ``("node", "dev/nvidia3", [1, 5])``."""

_CHILD = r"""
import ctypes, errno, json, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)

def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))

CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x20000, 0x4000, 0x40000
config = json.loads(sys.argv[1])
root = config["root"]
check(libc.unshare(CLONE_NEWNS), "unshare")
check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", 0, b"mode=755"), "mount rootfs")
if config["dev_link"] is None:
    os.mkdir(root + "/dev")
    check(libc.mount(b"tmpfs", (root + "/dev").encode(), b"tmpfs", 0, b"mode=755"), "mount dev")
else:
    os.symlink(config["dev_link"], root + "/dev")
for kind, path, arg in config["plant"]:
    target = os.path.join(root, path)
    if kind == "symlink":
        os.symlink(arg, target)
    elif kind == "file":
        open(target, "w").close()
    elif kind == "dir":
        os.mkdir(target)
    elif kind == "node":
        os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(*arg))
os.chroot(root)
os.chdir("/")
print("READY", flush=True)
for line in sys.stdin:
    command, path, *args = line.split()
    try:
        if command == "stat":
            info = os.lstat(path)
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISCHR(info.st_mode):
                reply = "chr %d:%d %o %d:%d" % (
                    os.major(info.st_rdev), os.minor(info.st_rdev), mode, info.st_uid, info.st_gid)
            elif stat.S_ISLNK(info.st_mode):
                reply = "lnk " + os.readlink(path)
            elif stat.S_ISDIR(info.st_mode):
                reply = "dir %o" % mode
            else:
                reply = "other"
        elif command == "ls":
            reply = " ".join(sorted(os.listdir(path)))
        elif command == "chmod":
            os.chmod(path, int(args[0], 8))
            reply = "done"
        elif command == "chown":
            os.chown(path, *map(int, args[0].split(":")))
            reply = "done"
        else:
            raise OSError(errno.EINVAL, "unknown command")
        reply = "OK " + reply
    except OSError as e:
        reply = "ERR " + errno.errorcode[e.errno]
    print(reply, flush=True)
"""


@dataclass
class FakeContainer:
    """A running fake container: its pid and a way to look at its ``/dev`` from inside."""

    process: subprocess.Popen[str]
    rootfs: Path
    """The host directory its private root is mounted on (empty as seen from the host)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def stat(self, path: str) -> str:
        """What the container sees at ``path``: ``chr 195:3 666 0:0``, ``lnk /x``,
        ``dir 755``, ``other``, or the errno name."""
        return self.ask(f"stat {path}").removeprefix("OK ").removeprefix("ERR ")


@contextlib.contextmanager
def fake_container(
    workdir: Path, *, dev_link: str | None = None, plant: Sequence[Plant] = ()
) -> Iterator[FakeContainer]:
    """Start a fake container under ``workdir``; ``dev_link`` makes its ``/dev`` a symlink
    to that target instead of a tmpfs. The process is killed and reaped afterwards (its
    mounts go with its mount namespace)."""
    rootfs = workdir / "rootfs"
    rootfs.mkdir()
    config = {"root": str(rootfs), "dev_link": dev_link, "plant": [list(p) for p in plant]}
    process = subprocess.Popen(
        [sys.executable, "-u", "-c", _CHILD, json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline().strip()
        if ready != "READY":
            raise RuntimeError(f"fake container failed to start: {ready!r}")
        yield FakeContainer(process, rootfs)
    finally:
        stop(process)


def stop(process: subprocess.Popen[str]) -> None:
    """Kill and reap a fake container (its mounts go with its mount namespace)."""
    process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()
