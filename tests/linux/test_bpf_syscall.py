"""The raw bpf(2) layer: struct layouts, loads with verifier logs, retries, queries."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.linux.bpf import syscall
from jupyter_gpu_hotplug.linux.bpf.asm import (
    AluOp,
    alu64_imm,
    build_device_program,
    encode_program,
    exit_,
)
from jupyter_gpu_hotplug.linux.bpf.syscall import (
    AttachFlags,
    BpfError,
    Command,
    Fd,
    ProgId,
    ProgramLoadError,
)
from jupyter_gpu_hotplug.linux.devrules import ALL_ACCESS, char_device
from tests.fixtures.requirements import needs_cgroup2, needs_root
from tests.linux.cgroup2_support import cgroup2_mount, temporary_cgroup

ONLY_NULL = build_device_program([char_device(1, 3, ALL_ACCESS)])
RETURNS_TWO = encode_program([alu64_imm(AluOp.MOV, 0, 2), exit_()])
RETURN_RANGE_REFUSED = re.compile(r"should have been in (\[0, 1\]|\(0x0; 0x1\))")
"""The verifier's refusal of a return value outside 0..1, as kernels 6.1 (the VM tier's
Debian 12) and 6.18 word it."""


# ---- pure: layouts and names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("struct", "field", "offset"),
    [
        # Offsets of union bpf_attr / struct bpf_prog_info in include/uapi/linux/bpf.h.
        (syscall._ProgLoadAttr, "insns", 8),
        (syscall._ProgLoadAttr, "log_buf", 32),
        (syscall._ProgLoadAttr, "prog_name", 48),
        (syscall._ProgLoadAttr, "expected_attach_type", 68),
        (syscall._ProgAttachAttr, "replace_bpf_fd", 16),
        (syscall._ProgQueryAttr, "prog_ids", 16),
        (syscall._ProgQueryAttr, "prog_cnt", 24),
        (syscall._InfoAttr, "info", 8),
        (syscall._ProgInfoStruct, "xlated_prog_len", 20),
        (syscall._ProgInfoStruct, "xlated_prog_insns", 32),
        (syscall._ProgInfoStruct, "name", 64),
    ],
)
def test_struct_layouts_match_the_kernel_headers(
    struct: type[ctypes.Structure], field: str, offset: int
) -> None:
    assert getattr(struct, field).offset == offset


@pytest.mark.parametrize(
    ("name", "sanitized"),
    [
        ("sd_devices", "sd_devices"),
        ("gpu-hotplug", "gpu_hotplug"),
        ("a.b_c9", "a.b_c9"),
        ("much-too-long-program-name", "much_too_long_p"),
        ("ünïcode", "_n_code"),
    ],
)
def test_prog_names_are_sanitized(name: str, sanitized: str) -> None:
    assert syscall.sanitize_prog_name(name) == sanitized


def test_fd_closes_once(tmp_path: Path) -> None:
    fd = Fd(os.open(tmp_path, os.O_RDONLY))
    number = fd.fileno()
    with fd:
        os.fstat(number)
    fd.close()
    with pytest.raises(ValueError, match="closed"):
        fd.fileno()
    with pytest.raises(OSError) as excinfo:
        os.fstat(number)
    assert excinfo.value.errno == errno.EBADF


def test_unknown_architecture_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "sparc64")
    with pytest.raises(syscall.BpfUnavailableError, match="sparc64") as excinfo:
        syscall.prog_get_fd_by_id(ProgId(1))
    assert excinfo.value.errno == errno.ENOSYS


def test_load_rejects_ragged_code() -> None:
    with pytest.raises(ValueError, match="not a program"):
        syscall.prog_load(b"\x95\x00", name="x")


def test_eagain_is_retried_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def always_eagain(command: Command, attr: ctypes.Structure) -> int:
        calls.append(getattr(attr, "log_level", -1))
        raise BpfError(command, errno.EAGAIN)

    monkeypatch.setattr(syscall, "_bpf", always_eagain)
    with pytest.raises(ProgramLoadError) as excinfo:
        syscall.prog_load(ONLY_NULL, name="eagain")
    assert excinfo.value.errno == errno.EAGAIN
    # Five attempts without a log, then five with one (to explain the failure).
    assert calls == [0] * syscall._LOAD_ATTEMPTS + [1] * syscall._LOAD_ATTEMPTS


# ---- against the kernel ------------------------------------------------------------------------


@needs_root
def test_load_and_read_back() -> None:
    with syscall.prog_load(ONLY_NULL, name="gpu-hotplug test") as program:
        info = syscall.prog_info(program)
        assert info.name == "gpu_hotplug_tes"
        assert info.type == syscall.PROG_TYPE_CGROUP_DEVICE
        assert info.xlated == ONLY_NULL
        with syscall.prog_get_fd_by_id(info.id) as again:
            assert syscall.prog_info(again).id == info.id


@needs_root
def test_transient_eagain_then_success(monkeypatch: pytest.MonkeyPatch) -> None:
    real = syscall._bpf
    failures = [errno.EAGAIN, errno.EAGAIN]

    def flaky(command: Command, attr: ctypes.Structure) -> int:
        if failures:
            raise BpfError(command, failures.pop())
        return real(command, attr)

    monkeypatch.setattr(syscall, "_bpf", flaky)
    with syscall.prog_load(ONLY_NULL, name="flaky") as program:
        assert syscall.prog_info(program).xlated == ONLY_NULL


@needs_root
def test_refused_program_carries_the_verifier_log() -> None:
    with pytest.raises(ProgramLoadError) as excinfo:
        syscall.prog_load(RETURNS_TWO, name="bad")
    assert excinfo.value.errno == errno.EINVAL
    assert RETURN_RANGE_REFUSED.search(excinfo.value.log)
    assert excinfo.value.log in str(excinfo.value)


@needs_root
def test_verifier_log_buffer_grows_until_the_log_fits() -> None:
    # Each instruction on the failing path adds a log line: about 1 MiB of log,
    # far beyond the first 64 KiB buffer.
    code = encode_program([alu64_imm(AluOp.MOV, 0, 2)] * 30_000 + [exit_()])
    with pytest.raises(ProgramLoadError) as excinfo:
        syscall.prog_load(code, name="long_log")
    assert excinfo.value.errno == errno.EINVAL
    assert len(excinfo.value.log) > syscall._LOG_SIZE_START
    assert RETURN_RANGE_REFUSED.search(excinfo.value.log)


@needs_root
def test_missing_program_id() -> None:
    with pytest.raises(BpfError) as excinfo:
        syscall.prog_get_fd_by_id(ProgId(2**31 - 1))
    assert excinfo.value.errno == errno.ENOENT
    assert excinfo.value.command is Command.PROG_GET_FD_BY_ID


@needs_root
def test_replace_is_supported_on_this_kernel() -> None:
    syscall.supports_replace.cache_clear()
    assert syscall.supports_replace()


@pytest.fixture
def cgroup_fd() -> Iterator[Fd]:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy is mounted")
    with temporary_cgroup(mount) as path, Fd(os.open(path, os.O_RDONLY)) as fd:
        yield fd


@needs_cgroup2
def test_attach_replace_query_detach(cgroup_fd: Fd, monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        syscall.prog_load(ONLY_NULL, name="one") as one,
        syscall.prog_load(ONLY_NULL, name="two") as two,
        syscall.prog_load(ONLY_NULL, name="three") as three,
        syscall.prog_load(ONLY_NULL, name="four") as four,
    ):
        ids = [syscall.prog_info(p).id for p in (one, two, three)]
        syscall.prog_attach(cgroup_fd, one, flags=AttachFlags.ALLOW_MULTI)
        syscall.prog_attach(cgroup_fd, two, flags=AttachFlags.ALLOW_MULTI)
        syscall.prog_attach(cgroup_fd, three, flags=AttachFlags.ALLOW_MULTI, replace=one)
        # The id array starts too small: the query must grow it on ENOSPC.
        monkeypatch.setattr(syscall, "_QUERY_CAPACITY", 1)
        result = syscall.prog_query(cgroup_fd)
        assert result.attach_flags == AttachFlags.ALLOW_MULTI
        assert result.prog_ids == (ids[2], ids[1])
        with pytest.raises(BpfError) as excinfo:
            syscall.prog_attach(cgroup_fd, four, flags=AttachFlags.ALLOW_MULTI, replace=one)
        assert excinfo.value.errno == errno.ENOENT  # `one` is no longer attached
        syscall.prog_detach(cgroup_fd, two)
        assert syscall.prog_query(cgroup_fd).prog_ids == (ids[2],)
