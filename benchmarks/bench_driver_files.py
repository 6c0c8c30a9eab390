"""What giving a running container the driver's files costs an attach and a detach (issue 33).

Run as root:

    .venv/bin/python benchmarks/bench_driver_files.py [--runs 50]

A minimal glibc container (``tests/linux/glibc_container.py``: a tmpfs root in a private mount
namespace, its own loader, libc and ``ld.so.cache``) and a driver root laid out as NVIDIA's
(``nvidia-smi``-less: two libraries and their SONAME links, as the simulated one). Each round
times ``driver_edits.apply`` (the spec's two library mounts through the mount helper, two links,
``ldconfig``) and ``driver_edits.remove``, and the floor beside them: the mount helper alone
(``bindmounts.bind``/``unbind``, one process start and the syscalls) and one ``ldconfig -X -r``.
Median and p99 in milliseconds, printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_gpu_hotplug.linux import bindmounts, driver_edits
from jupyter_gpu_hotplug.linux.cdi_spec import ContainerEdits, Hook, Mount
from tests.linux.glibc_container import LIB_DIR, compile_c, glibc_container

VERSION = "550.54.15"
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1000


def driver_root(directory: Path) -> tuple[Path, ContainerEdits]:
    lib_dir = directory / LIB_DIR.lstrip("/")
    lib_dir.mkdir(parents=True)
    mounts = []
    for soname in LIBRARIES:
        versioned = soname.removesuffix(".1") + f".{VERSION}"
        compile_c("int cuInit(unsigned f) { return 0; }\n", lib_dir / versioned, "-shared",
                  "-fPIC", f"-Wl,-soname,{soname}")  # fmt: skip
        (lib_dir / soname).symlink_to(versioned)
        target = PurePosixPath(f"{LIB_DIR}/{versioned}")
        mounts.append(Mount(PurePosixPath(str(lib_dir / versioned)), target, ("ro", "nodev")))
    hook = Hook("createContainer", PurePosixPath("/usr/bin/nvidia-cdi-hook"),
                ("nvidia-cdi-hook", "update-ldcache", "--folder", LIB_DIR))  # fmt: skip
    return directory, ContainerEdits(mounts=tuple(mounts), hooks=(hook,))


def line(what: str, samples: list[float]) -> str:
    return (f"{what:<44} median {statistics.median(samples):7.2f} ms   "
            f"p99 {percentile(samples, 0.99):7.2f} ms   (n={len(samples)})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-driver-files-"))
    _, edits = driver_root(work / "driver")
    record = work / "record.json"
    timings: dict[str, list[float]] = {
        k: [] for k in ("apply", "remove", "bind", "unbind", "ldconfig")
    }
    with glibc_container(work / "c") as container:
        pid = container.pid
        binds = [bindmounts.BindMount(m.host_path, m.container_path) for m in edits.mounts]
        for _ in range(args.runs):  # alternating, in one session: the floor next to the whole
            timings["apply"].append(timed(lambda: driver_edits.apply(pid, edits, record=record)))
            timings["remove"].append(timed(lambda: driver_edits.remove(record)))
            start = time.perf_counter()
            made = bindmounts.bind(pid, binds)
            timings["bind"].append((time.perf_counter() - start) * 1000)
            timings["unbind"].append(timed(lambda: bindmounts.unbind(pid, binds)))
            bindmounts.remove_created(pid, [e for m in made for e in m.created])
            timings["ldconfig"].append(timed(lambda: subprocess.run(
                ["ldconfig", "-X", "-r", f"/proc/{pid}/root"], check=True)))  # fmt: skip
        assert container.run("probe").startswith("NOLOAD")  # everything was taken back
    print(f"driver files for a running glibc container: {len(edits.mounts)} library mounts, "
          f"{len(LIBRARIES)} links, ldcache")  # fmt: skip
    print(line("apply (whole: record, mounts, links, ldcache)", timings["apply"]))
    print(line("remove (whole)", timings["remove"]))
    print(line("floor: the mount helper binding both", timings["bind"]))
    print(line("floor: the mount helper unmounting both", timings["unbind"]))
    print(line("floor: one ldconfig -X -r", timings["ldconfig"]))


if __name__ == "__main__":
    main()
