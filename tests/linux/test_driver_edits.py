"""driver_edits + bindmounts: the driver's libraries given to a running glibc container, and
taken back — with the container's own loader proving it, and the attacks it must survive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from jupyter_gpu_hotplug.linux import bindmounts, driver_edits
from jupyter_gpu_hotplug.linux.cdi_spec import ContainerEdits, Hook, Mount
from jupyter_gpu_hotplug.linux.driver_edits import DriverEditsError

from ..fixtures.requirements import needs_root
from .glibc_container import LIB_DIR, GlibcContainer, compile_c, glibc_container, missing_tools

pytestmark = [
    *needs_root,
    pytest.mark.skipif(bool(missing_tools()), reason=f"missing {missing_tools()}"),
]

VERSION = "550.54.15"
LIBCUDA = f"libcuda.so.{VERSION}"
FAKE_CUDA = "int cuInit(unsigned flags) { (void)flags; return 0; }\n"


@pytest.fixture
def driver_root(tmp_path: Path) -> Path:
    """A driver root as the toolkit finds one: the library and its SONAME link."""
    lib_dir = tmp_path / "driver" / LIB_DIR.lstrip("/")
    lib_dir.mkdir(parents=True)
    compile_c(FAKE_CUDA, lib_dir / LIBCUDA, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1")
    (lib_dir / "libcuda.so.1").symlink_to(LIBCUDA)
    return tmp_path / "driver"


def edits_for(driver_root: Path) -> ContainerEdits:
    """The edits ``nvidia-ctk cdi generate`` writes for this root (its shape, trimmed)."""
    return ContainerEdits(
        env=("NVIDIA_VISIBLE_DEVICES=void",),
        mounts=(
            Mount(
                PurePosixPath(f"{driver_root}{LIB_DIR}/{LIBCUDA}"),
                PurePosixPath(f"{LIB_DIR}/{LIBCUDA}"),
                ("ro", "nosuid", "nodev", "rbind", "rprivate"),
            ),
        ),
        hooks=(
            Hook(
                "createContainer",
                PurePosixPath("/usr/bin/nvidia-cdi-hook"),
                (
                    "nvidia-cdi-hook",
                    "create-symlinks",
                    "--link",
                    f"libcuda.so.1::{LIB_DIR}/libcuda.so",
                ),
            ),
            Hook(
                "createContainer",
                PurePosixPath("/usr/bin/nvidia-cdi-hook"),
                ("nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={VERSION}"),
            ),
            Hook(
                "createContainer",
                PurePosixPath("/usr/bin/nvidia-cdi-hook"),
                ("nvidia-cdi-hook", "update-ldcache", "--folder", LIB_DIR),
            ),
        ),
    )


@pytest.fixture
def container(tmp_path: Path) -> Iterator[GlibcContainer]:
    with glibc_container(tmp_path / "c") as c:
        yield c


def host_mounts_mention(name: str) -> bool:
    return name in Path("/proc/self/mountinfo").read_text()


def test_apply_lets_a_new_process_load_libcuda_and_remove_takes_all_of_it_back(
    container: GlibcContainer, driver_root: Path, tmp_path: Path
) -> None:
    record = tmp_path / "state" / "edits.json"
    before = container.run("probe")
    assert before.startswith("NOLOAD"), before
    pid = container.pid

    applied = driver_edits.apply(pid, edits_for(driver_root), record=record, source_root=Path("/"))

    assert applied.mounts == (PurePosixPath(f"{LIB_DIR}/{LIBCUDA}"),)
    assert set(applied.links) == {
        PurePosixPath(f"{LIB_DIR}/libcuda.so.1"),
        PurePosixPath(f"{LIB_DIR}/libcuda.so"),
    }
    assert applied.ldcache
    assert applied.env_not_applied == ("NVIDIA_VISIBLE_DEVICES=void",)
    assert any("enable-cuda-compat" in s for s in applied.hooks_skipped)
    assert container.run("probe").strip() == "LOADED libcuda.so.1 cuInit=0"
    assert "libcuda.so.1" in container.run("cat /etc/ld.so.cache")
    assert record.is_file()
    assert not host_mounts_mention(LIBCUDA)  # the host's namespace never sees the mount

    assert driver_edits.remove(record) == []

    assert container.run("probe").startswith("NOLOAD")
    listing = container.run(f"ls {LIB_DIR}").split()
    assert listing == ["libc.so.6"]
    assert "libcuda" not in container.run("cat /etc/ld.so.cache")
    assert LIBCUDA not in Path(f"/proc/{pid}/mountinfo").read_text()
    assert not record.exists()


def test_apply_twice_adds_nothing_and_one_remove_undoes_it(
    container: GlibcContainer, driver_root: Path, tmp_path: Path
) -> None:
    record = tmp_path / "edits.json"
    edits = edits_for(driver_root)
    driver_edits.apply(container.pid, edits, record=record, source_root=Path("/"))
    again = driver_edits.apply(container.pid, edits, record=record, source_root=Path("/"))
    assert again.mounts == () and again.links == ()
    mounts = Path(f"/proc/{container.pid}/mountinfo").read_text().splitlines()
    assert len([line for line in mounts if LIBCUDA in line]) == 1
    assert driver_edits.remove(record) == []
    assert container.run("probe").startswith("NOLOAD")


def test_a_crash_between_two_steps_is_undone_from_the_record(
    container: GlibcContainer, driver_root: Path, tmp_path: Path
) -> None:
    """kill -9 of the agent after the record and the mount, before the links and the cache:
    a fresh process (the restarted agent) undoes it from the record alone."""
    record = tmp_path / "edits.json"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from jupyter_gpu_hotplug.linux import driver_edits
        from tests.linux.test_driver_edits import edits_for
        def crash(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        driver_edits._make_link = crash
        driver_edits.apply({container.pid}, edits_for(Path({str(driver_root)!r})),
                           record=Path({str(record)!r}))
        """
    )
    agent = subprocess.run(
        [sys.executable, "-c", script], cwd=Path(__file__).parents[2], check=False, timeout=120
    )
    assert agent.returncode == -signal.SIGKILL
    assert LIBCUDA in Path(f"/proc/{container.pid}/mountinfo").read_text()  # half-done

    assert driver_edits.remove(record) == []

    assert LIBCUDA not in Path(f"/proc/{container.pid}/mountinfo").read_text()
    assert container.run(f"ls {LIB_DIR}").split() == ["libc.so.6"]
    assert not record.exists()


def test_a_library_the_runtime_mounted_is_left_in_place(driver_root: Path, tmp_path: Path) -> None:
    """NVIDIA's legacy mode mounts the libraries at creation; detach must not take them."""
    source = f"{driver_root}{LIB_DIR}/{LIBCUDA}"
    setup = [
        f'touch "$R{LIB_DIR}/{LIBCUDA}" && mount --bind -o ro {source} "$R{LIB_DIR}/{LIBCUDA}"',
        f'ln -s {LIBCUDA} "$R{LIB_DIR}/libcuda.so.1" && ldconfig -r "$R"',
    ]
    with glibc_container(tmp_path / "c", setup=setup) as container:
        record = tmp_path / "edits.json"
        applied = driver_edits.apply(
            container.pid, edits_for(driver_root), record=record, source_root=Path("/")
        )
        assert applied.mounts == ()
        driver_edits.remove(record)
        assert container.run("probe").strip() == "LOADED libcuda.so.1 cuInit=0"


def test_a_symlinked_directory_is_followed_inside_the_container_only(
    driver_root: Path, tmp_path: Path
) -> None:
    """As a runtime follows an image's ``/var/run -> /run``: a link on the way is resolved in
    the container's root, so even one aimed at the host's ``/etc`` lands in the container's."""
    plant = 'rm -rf "$R/usr/lib/x86_64-linux-gnu" && ln -s /etc "$R/usr/lib/x86_64-linux-gnu"'
    host_etc = set(os.listdir("/etc"))
    with glibc_container(tmp_path / "c", setup=[plant]) as container:
        record = tmp_path / "edits.json"
        driver_edits.apply(container.pid, edits_for(driver_root), record=record)
        assert LIBCUDA in container.run("ls /etc").split()
        assert set(os.listdir("/etc")) == host_etc and not host_mounts_mention(LIBCUDA)
        assert driver_edits.remove(record) == []
        assert LIBCUDA not in container.run("ls /etc").split()


@pytest.mark.parametrize(
    ("plant", "message"),
    [
        # the mount point itself is a link to a file the container wants overmounted
        (f'ln -s /etc/passwd "$R{LIB_DIR}/{LIBCUDA}"', "symlink"),
        # the library directory leads into the kernel's files
        (
            'mkdir "$R/proc" && mount -t proc proc "$R/proc"'
            ' && rm -rf "$R/usr/lib/x86_64-linux-gnu"'
            ' && ln -s /proc/self "$R/usr/lib/x86_64-linux-gnu"',
            "procfs",
        ),
    ],
    ids=["file_symlink", "into_procfs"],
)
def test_a_planted_link_is_refused_and_nothing_is_mounted(
    plant: str, message: str, driver_root: Path, tmp_path: Path
) -> None:
    with glibc_container(tmp_path / "c", setup=[plant]) as container:
        record = tmp_path / "edits.json"
        mounts_before = Path(f"/proc/{container.pid}/mountinfo").read_text()
        with pytest.raises(DriverEditsError, match=message):
            driver_edits.apply(container.pid, edits_for(driver_root), record=record)
        assert Path(f"/proc/{container.pid}/mountinfo").read_text() == mounts_before
        assert not record.exists()


def test_a_read_only_root_without_the_mount_point_is_refused_clearly(
    driver_root: Path, tmp_path: Path
) -> None:
    with glibc_container(tmp_path / "c", read_only=True) as container:
        record = tmp_path / "edits.json"
        with pytest.raises(DriverEditsError, match="read-only"):
            driver_edits.apply(
                container.pid, edits_for(driver_root), record=record, source_root=Path("/")
            )
        assert LIBCUDA not in Path(f"/proc/{container.pid}/mountinfo").read_text()
        assert not record.exists()


def test_the_preflight_knows_which_container_can_load_libcuda(
    container: GlibcContainer, driver_root: Path, tmp_path: Path
) -> None:
    assert not driver_edits.container_has_library(container.pid)
    assert driver_edits.provides_library(edits_for(driver_root))
    assert not driver_edits.provides_library(ContainerEdits())
    driver_edits.apply(
        container.pid, edits_for(driver_root), record=tmp_path / "e.json", source_root=Path("/")
    )
    assert driver_edits.container_has_library(container.pid)


def test_unbind_leaves_a_mount_that_is_not_the_source(
    container: GlibcContainer, driver_root: Path, tmp_path: Path
) -> None:
    """A mount at the same path whose inode is not the host's file is not ours to remove."""
    other = tmp_path / "other.so"
    other.write_text("x")
    mount = bindmounts.BindMount(PurePosixPath(str(other)), PurePosixPath(f"{LIB_DIR}/{LIBCUDA}"))
    bindmounts.bind(container.pid, [mount], source_root=Path("/"))
    ours = bindmounts.BindMount(PurePosixPath(f"{driver_root}{LIB_DIR}/{LIBCUDA}"), mount.target)
    assert bindmounts.unbind(container.pid, [ours], source_root=Path("/")) == []
    assert bindmounts.is_bound(container.pid, mount, source_root=Path("/"))


def test_a_gone_container_leaves_nothing_to_undo(driver_root: Path, tmp_path: Path) -> None:
    record = tmp_path / "edits.json"
    with glibc_container(tmp_path / "c") as container:
        pid = container.pid
        driver_edits.apply(pid, edits_for(driver_root), record=record, source_root=Path("/"))
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # poll for the reaped process to vanish from procfs
    assert driver_edits.remove(record) == []
    assert not record.exists()


def test_a_process_sharing_the_hosts_root_is_given_nothing(
    driver_root: Path, tmp_path: Path
) -> None:
    """Local mode's kernel on the host (or a container on the host's root filesystem) sees
    the host's driver: nothing is mounted, created or re-cached on the host's own files."""
    record = tmp_path / "edits.json"
    sleeper = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while (
            Path(f"/proc/{sleeper.pid}/ns/mnt").stat().st_ino
            == Path("/proc/self/ns/mnt").stat().st_ino
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)  # poll until unshare has made its namespace
        for pid in (os.getpid(), sleeper.pid):
            applied = driver_edits.apply(
                pid, edits_for(driver_root), record=record, source_root=Path("/")
            )
            assert applied == driver_edits.Applied((), (), False, (), ())
        assert not record.exists()
        assert not Path(f"{LIB_DIR}/{LIBCUDA}").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_reused_pid_is_not_touched(
    container: GlibcContainer, driver_root: Path, tmp_path: Path
) -> None:
    """The record names pid and start time: another process under the pid is not ours."""
    record = tmp_path / "edits.json"
    driver_edits.apply(container.pid, edits_for(driver_root), record=record, source_root=Path("/"))
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "start_time": data["start_time"] + 1}))
    assert driver_edits.remove(record) == []
    assert not record.exists()
    assert container.run("probe").strip() == "LOADED libcuda.so.1 cuInit=0"  # left alone
