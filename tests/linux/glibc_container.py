"""A minimal glibc "container" for the driver-edits tests (test helper, not product code).

Why not the busybox fake: the question these tests ask is whether a *new process* in the
container can ``dlopen("libcuda.so.1")`` after an attach — which needs the container's own
dynamic loader, libc and ldcache, as in a Debian notebook image. The child unshares its mount
namespace, mounts a tmpfs as the root (read-only when asked), copies the host's loader, libc and
a probe program into it, builds its ``/etc/ld.so.cache`` with the host's ``ldconfig -r``, and
chroots into it with busybox-static as its shell; :meth:`GlibcContainer.run` runs a command
there as a new process and returns its output.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .fake_container import stop

LOADER = Path("/lib64/ld-linux-x86-64.so.2")
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
BUSYBOX = Path("/bin/busybox")
LIB_DIR = "/usr/lib/x86_64-linux-gnu"

PROBE_SOURCE = r"""
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "libcuda.so.1";
    void *lib = dlopen(name, RTLD_NOW);
    if (!lib) { printf("NOLOAD %s\n", dlerror()); return 1; }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(lib, "cuInit");
    printf("LOADED %s cuInit=%d\n", name, init ? init(0) : -1);
    return 0;
}
"""

END = "__END__"
APPLETS = ("sh", "cat", "ls")


def compile_c(source: str, output: Path, *flags: str) -> Path:
    source_file = output.with_suffix(".c")
    source_file.write_text(source)
    subprocess.run(
        ["cc", "-O1", "-o", str(output), str(source_file), *flags], check=True, timeout=120
    )
    return output


def missing_tools() -> list[str]:
    needed = [LOADER, LIBC, BUSYBOX]
    return [str(p) for p in needed if not p.exists()] + [
        t for t in ("cc", "ldconfig", "unshare") if shutil.which(t) is None
    ]


@dataclass
class GlibcContainer:
    process: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.process.pid

    def run(self, command: str) -> str:
        """Run ``command`` in the container (a new process of its shell); its output."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{command} 2>&1; echo; echo {END}\n")
        self.process.stdin.flush()
        lines = []
        for line in self.process.stdout:
            if line.strip() == END:
                break
            lines.append(line)
        return "".join(lines)[:-1]  # the newline our echo added


@contextlib.contextmanager
def glibc_container(
    workdir: Path, *, read_only: bool = False, setup: Sequence[str] = ()
) -> Iterator[GlibcContainer]:
    """Start one under ``workdir``; ``setup`` are shell commands run in its root (``$R``)
    before the chroot. Killed and reaped afterwards (its mounts go with its namespace)."""
    root = workdir / "root"
    root.mkdir(parents=True)
    probe = compile_c(PROBE_SOURCE, workdir / "probe", "-ldl")
    r = shlex.quote(str(root))
    script = " && ".join(
        [
            f"mount -t tmpfs -o mode=755 rootfs {r}",
            f"mkdir -p {r}/lib64 {r}{LIB_DIR} {r}/etc {r}/bin {r}/lib",
            f"cp {LOADER} {r}/lib64/ && cp {LIBC} {r}{LIB_DIR}/",
            f"cp {BUSYBOX} {r}/bin/busybox",
            *(f"ln -s busybox {r}/bin/{applet}" for applet in APPLETS),
            f"cp {shlex.quote(str(probe))} {r}/bin/probe",
            f"ldconfig -r {r}",
            *(f"R={r}; {c}" for c in setup),
            *([f"mount -o remount,ro {r}"] if read_only else []),
            # "ready" from inside the chroot: the pid's root is the container's from then on
            f"exec chroot {r} /bin/sh -c 'echo ready && exec /bin/sh'",
        ]
    )
    process = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        encoding="latin-1",  # the ldcache is binary; a test greps it for names
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the glibc container failed to start: {ready!r}")
        yield GlibcContainer(process)
    finally:
        stop(process)
