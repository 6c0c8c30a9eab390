"""The CUDA checkpoint binding against the fake driver's ``cuCheckpointProcess*`` calls.

A target subprocess loads the fake ``libcuda.so.1``, holds a GPU's node as a CUDA context does
and serves the checkpoint calls; this process drives it through ``nvml.checkpoint`` exactly as
the agent will, and reads ``/proc/<pid>/fd`` to see which GPU node the target holds. The fast
run's nodes are ``nvidia<N>`` links to distinct character devices (``/dev/null``, ``/dev/zero``,
``/dev/full``: any node that opens stands for a GPU, and an fd is told by its ``st_rdev`` as the
busy scan tells it); as root the same cycle runs on ``c 195:N`` nodes made with ``mknod``, which
the fake holds with ``O_PATH`` (no driver answers them).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Final

import pytest

from jupyter_gpu_hotplug.nvml.checkpoint import CheckpointError, CudaCheckpoint, ProcessState
from jupyter_gpu_hotplug.nvml.sim import (
    CONFIG_ENV,
    CUDA_DEV_DIR_ENV,
    CUDA_LIBRARY_NAME,
    FakeNvmlConfig,
    SimulatedGpu,
    default_gpus,
    ensure_fake_cuda,
    write_config,
)
from tests.fixtures.nvml import add_gpu_node
from tests.fixtures.requirements import needs_root

CHECKPOINT_DIR_ENV: Final = "FAKE_CUDA_CHECKPOINT_DIR"
FAIL_ENV: Final = "FAKE_CUDA_CHECKPOINT_FAIL"
STAND_INS: Final = ("/dev/null", "/dev/zero", "/dev/full")
"""Character devices anyone may open: the fast run's GPU nodes 0, 1 and 2."""
MEMORY_BYTES: Final = 3 * 2**20
OTHER_CHIP: Final = "NVIDIA A100-SXM4-80GB (simulated)"

TARGET: Final = """
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
assert cuda.cuInit(0) == 0
result = cuda.fakeCudaHoldContext(int(sys.argv[3]), ctypes.c_ulonglong(int(sys.argv[2])))
print(result, flush=True)
sys.stdin.read()
"""
"""Holds GPU ``argv[3]`` with ``argv[2]`` bytes, says so, then waits for its stdin to close."""


@dataclasses.dataclass(frozen=True)
class Host:
    """The fake driver and a node with three GPUs: 0 and 1 of one chip, 2 of another."""

    library: Path
    dev: Path
    config: Path
    sockets: Path
    gpus: tuple[SimulatedGpu, ...]


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_fake_cuda(tmp_path_factory.mktemp("cache")) / CUDA_LIBRARY_NAME


@pytest.fixture(params=["linked", pytest.param("mknod", marks=needs_root)])
def host(
    request: pytest.FixtureRequest,
    library: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Host]:
    gpus = default_gpus(3)
    gpus = (*gpus[:2], dataclasses.replace(gpus[2], name=OTHER_CHIP))
    dev = tmp_path / "dev"
    dev.mkdir()
    for gpu, stand_in in zip(gpus, STAND_INS, strict=True):
        if request.param == "mknod":
            add_gpu_node(dev, gpu.minor)
        else:
            (dev / f"nvidia{gpu.minor}").symlink_to(stand_in)
    config = tmp_path / "nvml.conf"
    write_config(config, FakeNvmlConfig(gpus=gpus))
    # A short directory: a unix socket's path has room for 107 bytes.
    sockets = Path(tempfile.mkdtemp(prefix="ckpt-"))
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(sockets))
    monkeypatch.setenv(CONFIG_ENV, str(config))
    monkeypatch.delenv(FAIL_ENV, raising=False)
    try:
        yield Host(library, dev, config, sockets, gpus)
    finally:
        shutil.rmtree(sockets)


@pytest.fixture
def driver(library: Path) -> CudaCheckpoint:
    return CudaCheckpoint(str(library))


@pytest.fixture
def target(host: Host) -> Iterator[subprocess.Popen[str]]:
    """A CUDA process holding GPU 0 (ordinal 0: the lowest minor it may open)."""
    environ = {
        "PATH": os.environ.get("PATH", ""),
        CUDA_DEV_DIR_ENV: str(host.dev),
        CONFIG_ENV: str(host.config),
        CHECKPOINT_DIR_ENV: str(host.sockets),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(host.library), str(MEMORY_BYTES), "0"],
        env=environ,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "0", "fakeCudaHoldContext succeeded"
        yield process
    finally:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def held_gpus(pid: int, host: Host) -> set[int]:
    """The minors of the GPU nodes ``pid`` has an fd on, told by ``st_rdev`` as the busy scan
    tells them."""
    by_rdev = {os.stat(host.dev / f"nvidia{gpu.minor}").st_rdev: gpu.minor for gpu in host.gpus}
    fd_dir = Path(f"/proc/{pid}/fd")
    held = set()
    for fd in os.listdir(fd_dir):
        try:
            info = os.stat(fd_dir / fd)
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(info.st_mode) and info.st_rdev in by_rdev:
            held.add(by_rdev[info.st_rdev])
    return held


def refused(call: Callable[[], object], name: str) -> CheckpointError:
    """The error ``call`` raises, checked to carry the driver's error ``name``."""
    with pytest.raises(CheckpointError) as raised:
        call()
    assert raised.value.name == name
    return raised.value


def suspend(driver: CudaCheckpoint, pid: int) -> None:
    driver.lock(pid, timeout_ms=5000)
    driver.checkpoint(pid)


def test_suspend_and_resume_on_the_same_gpu(
    driver: CudaCheckpoint, host: Host, target: subprocess.Popen[str]
) -> None:
    pid = target.pid
    assert driver.supported()
    assert driver.state(pid) is ProcessState.RUNNING
    assert held_gpus(pid, host) == {0}
    assert driver.restore_thread_id(pid) in {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}

    driver.lock(pid, timeout_ms=5000)
    assert driver.state(pid) is ProcessState.LOCKED
    assert held_gpus(pid, host) == {0}, "a lock keeps the GPU"
    driver.checkpoint(pid)
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    assert held_gpus(pid, host) == set(), "a checkpointed process holds no GPU node"

    driver.restore(pid)
    assert driver.state(pid) is ProcessState.LOCKED, "restore leaves it locked"
    assert held_gpus(pid, host) == {0}
    driver.unlock(pid)
    assert driver.state(pid) is ProcessState.RUNNING
    assert target.poll() is None


def test_the_device_memory_a_checkpoint_keeps_in_host_memory(
    library: Path, target: subprocess.Popen[str]
) -> None:
    cuda = ctypes.CDLL(str(library))
    used = ctypes.c_ulonglong()
    assert cuda.fakeCudaProcessMemory(target.pid, ctypes.byref(used)) == 0
    assert used.value == MEMORY_BYTES


def test_resume_onto_another_gpu_of_the_same_chip(
    driver: CudaCheckpoint, host: Host, target: subprocess.Popen[str]
) -> None:
    pid = target.pid
    suspend(driver, pid)
    driver.restore(pid, {host.gpus[0].uuid: host.gpus[1].uuid})
    assert held_gpus(pid, host) == {1}
    driver.unlock(pid)
    assert driver.state(pid) is ProcessState.RUNNING


@pytest.mark.parametrize(
    "pairs",
    [
        pytest.param(lambda gpus: {gpus[0].uuid: gpus[2].uuid}, id="other-chip"),
        pytest.param(lambda gpus: {gpus[1].uuid: gpus[0].uuid}, id="checkpointed-gpu-not-named"),
        pytest.param(
            lambda gpus: {gpus[0].uuid: "GPU-00000000-0000-0000-0000-000000000000"},
            id="unknown-gpu",
        ),
    ],
)
def test_a_restore_it_cannot_do_leaves_it_checkpointed(
    driver: CudaCheckpoint,
    host: Host,
    target: subprocess.Popen[str],
    pairs: Callable[[tuple[SimulatedGpu, ...]], Mapping[str, str]],
) -> None:
    pid = target.pid
    suspend(driver, pid)
    refused(lambda: driver.restore(pid, pairs(host.gpus)), "CUDA_ERROR_INVALID_VALUE")
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    assert held_gpus(pid, host) == set()
    driver.restore(pid)
    assert held_gpus(pid, host) == {0}, "the same GPU still takes it back"


def test_calls_in_the_wrong_state_are_refused(
    driver: CudaCheckpoint, host: Host, target: subprocess.Popen[str]
) -> None:
    pid = target.pid
    for call in (driver.checkpoint, driver.restore, driver.unlock):
        assert refused(functools.partial(call, pid), "CUDA_ERROR_ILLEGAL_STATE").code == 401
    assert driver.state(pid) is ProcessState.RUNNING
    driver.lock(pid, timeout_ms=5000)
    refused(functools.partial(driver.lock, pid, timeout_ms=5000), "CUDA_ERROR_ILLEGAL_STATE")
    refused(functools.partial(driver.restore, pid), "CUDA_ERROR_ILLEGAL_STATE")
    driver.checkpoint(pid)
    refused(functools.partial(driver.lock, pid, timeout_ms=5000), "CUDA_ERROR_ILLEGAL_STATE")
    for call in (driver.checkpoint, driver.unlock):
        refused(functools.partial(call, pid), "CUDA_ERROR_ILLEGAL_STATE")
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    assert held_gpus(pid, host) == set()


@pytest.mark.parametrize(
    ("failure", "step", "error", "state", "holds"),
    [
        ("lock_timeout", "lock", "CUDA_ERROR_TIMEOUT", ProcessState.RUNNING, {0}),
        ("unsupported", "lock", "CUDA_ERROR_NOT_SUPPORTED", ProcessState.RUNNING, {0}),
        ("checkpoint", "checkpoint", "CUDA_ERROR_OUT_OF_MEMORY", ProcessState.LOCKED, {0}),
        (
            "restore_other_chip",
            "restore",
            "CUDA_ERROR_INVALID_VALUE",
            ProcessState.CHECKPOINTED,
            set(),
        ),
    ],
)
def test_an_injected_failure_leaves_the_documented_state(
    driver: CudaCheckpoint,
    host: Host,
    target: subprocess.Popen[str],
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    step: str,
    error: str,
    state: ProcessState,
    holds: set[int],
) -> None:
    pid = target.pid
    steps = {
        "lock": lambda: driver.lock(pid, timeout_ms=100),
        "checkpoint": lambda: driver.checkpoint(pid),
        "restore": lambda: driver.restore(pid, {host.gpus[0].uuid: host.gpus[1].uuid}),
    }
    if step != "lock":
        driver.lock(pid, timeout_ms=5000)
    if step == "restore":
        driver.checkpoint(pid)
    monkeypatch.setenv(FAIL_ENV, failure)
    refused(steps[step], error)
    assert driver.state(pid) is state
    assert held_gpus(pid, host) == holds
    assert target.poll() is None, "the process lives"
    monkeypatch.delenv(FAIL_ENV)
    steps[step]()  # the same step goes through once the cause is gone


def test_a_process_without_a_cuda_context_is_not_supported(
    driver: CudaCheckpoint, host: Host
) -> None:
    error = refused(lambda: driver.state(os.getpid()), "CUDA_ERROR_NOT_SUPPORTED")
    assert error.code == 801
    assert str(os.getpid()) in str(error)


def test_a_driver_without_the_api_says_so() -> None:
    """An older driver loads but lacks the calls: libc stands in for it (it has none)."""
    old = CudaCheckpoint("libc.so.6")
    assert not old.supported()
    error = refused(lambda: old.lock(1, timeout_ms=1000), "UNSUPPORTED_DRIVER")
    assert "the driver lacks the CUDA checkpoint API (R550+)" in str(error)
    assert error.code is None


def test_no_driver_library_is_one_error() -> None:
    refused(lambda: CudaCheckpoint("libcuda-not-installed.so.1"), "NO_DRIVER")
