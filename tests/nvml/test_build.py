"""Building the fake library: cache hits, rebuilds, races and clear errors.

Compiler runs are counted with a wrapper script that logs each call and then runs the real
compiler, so "did not recompile" is observed, not inferred from timestamps.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.nvml.sim import (
    COMPILE_FLAGS,
    LIBRARY_NAME,
    FakeNvmlBuildError,
    build,
    build_key,
    default_cache_dir,
    ensure_fake_nvml,
    fake_nvml_source,
    find_compiler,
)

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow


def real_compiler() -> str:
    found = shutil.which("cc") or shutil.which("gcc")
    assert found is not None, "the test suite needs a C compiler: apt-get install gcc"
    return found


@pytest.fixture
def counting_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A compiler wrapper and the log it appends one line to per run."""
    log = tmp_path / "compiler.log"
    wrapper = tmp_path / "bin" / "counting-cc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho run >> "{log}"\nexec "{real_compiler()}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_second_call_uses_the_cache(tmp_path: Path, counting_compiler: tuple[Path, Path]) -> None:
    wrapper, log = counting_compiler
    cache = tmp_path / "cache"
    first = ensure_fake_nvml(cache, compiler=str(wrapper))
    second = ensure_fake_nvml(cache, compiler=str(wrapper))
    assert first == second
    assert runs(log) == 1
    assert first.parent == cache
    assert sorted(p.name for p in first.iterdir()) == ["fakenvml.c", LIBRARY_NAME]
    assert (first / "fakenvml.c").read_bytes() == fake_nvml_source()
    assert stat.S_IMODE((first / LIBRARY_NAME).stat().st_mode) == 0o755
    assert stat.S_IMODE(first.stat().st_mode) == 0o755, "other users' kernels must reach it"


def test_changed_source_rebuilds(
    tmp_path: Path, counting_compiler: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper, log = counting_compiler
    cache = tmp_path / "cache"
    original = ensure_fake_nvml(cache, compiler=str(wrapper))
    changed_source = fake_nvml_source() + b"\n/* changed */\n"
    monkeypatch.setattr(build, "fake_nvml_source", lambda: changed_source)
    rebuilt = ensure_fake_nvml(cache, compiler=str(wrapper))
    assert rebuilt != original
    assert runs(log) == 2
    assert (rebuilt / "fakenvml.c").read_bytes() == changed_source
    assert (original / LIBRARY_NAME).is_file(), "old builds stay for processes still using them"


def test_key_depends_on_source_flags_and_compiler(tmp_path: Path) -> None:
    compiler = [real_compiler()]
    key = build_key(b"int x;", compiler)
    assert build_key(b"int x;", compiler) == key
    assert build_key(b"int y;", compiler) != key
    assert build_key(b"int x;", [*compiler, "-m64"]) != key
    copy = tmp_path / "cc-copy"
    shutil.copy2(compiler[0], copy)
    os.utime(copy, ns=(0, 0))
    assert build_key(b"int x;", [str(copy)]) != key, "another compiler binary, another build"


def test_concurrent_first_uses_agree(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    barrier = threading.Barrier(3)
    results: list[Path] = []
    failures: list[BaseException] = []

    def build_once() -> None:
        barrier.wait()
        try:
            results.append(ensure_fake_nvml(cache))
        except BaseException as error:  # reported to the main thread below
            failures.append(error)

    threads = [threading.Thread(target=build_once) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert len(set(results)) == 1
    assert [p.name for p in cache.iterdir()] == [results[0].name], "no staging dirs left"
    assert (results[0] / LIBRARY_NAME).is_file()


class TestCompilerErrors:
    def test_no_compiler_on_path(self, tmp_path: Path) -> None:
        with pytest.raises(FakeNvmlBuildError, match=r"install gcc \(apt-get install gcc\)"):
            ensure_fake_nvml(tmp_path / "cache", environ={"PATH": str(tmp_path)})
        assert not (tmp_path / "cache").exists()

    def test_named_compiler_missing(self, tmp_path: Path) -> None:
        with pytest.raises(FakeNvmlBuildError, match=r"'/nonexistent/cc' not found.*install gcc"):
            ensure_fake_nvml(tmp_path / "cache", compiler="/nonexistent/cc")

    def test_cc_variable_missing(self, tmp_path: Path) -> None:
        with pytest.raises(FakeNvmlBuildError, match=r"'no-such-cc' not found"):
            find_compiler(environ={"CC": "no-such-cc", "PATH": os.environ["PATH"]})

    def test_cc_variable_with_arguments(self) -> None:
        environ = {"CC": f"{real_compiler()} -m64", "PATH": ""}
        assert find_compiler(environ=environ) == [real_compiler(), "-m64"]

    def test_compile_failure_carries_compiler_output(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(build, "fake_nvml_source", lambda: b"this is not C;\n")
        cache = tmp_path / "cache"
        with pytest.raises(FakeNvmlBuildError, match=r"(?s)failed \(exit 1\).*error"):
            ensure_fake_nvml(cache)
        assert list(cache.iterdir()) == [], "a failed build leaves nothing behind"


class TestCacheDir:
    def test_explicit_override_wins(self) -> None:
        environ = {"GPU_HOTPLUG_CACHE_DIR": "/srv/cache", "XDG_CACHE_HOME": "/xdg", "HOME": "/h"}
        assert default_cache_dir(environ) == Path("/srv/cache")

    def test_xdg(self) -> None:
        environ = {"XDG_CACHE_HOME": "/xdg", "HOME": "/h"}
        assert default_cache_dir(environ) == Path("/xdg/jupyter-gpu-hotplug")

    def test_relative_xdg_is_ignored(self) -> None:
        environ = {"XDG_CACHE_HOME": "relative", "HOME": "/h"}
        assert default_cache_dir(environ) == Path("/h/.cache/jupyter-gpu-hotplug")

    def test_used_when_no_dir_is_given(self, tmp_path: Path) -> None:
        environ = {"GPU_HOTPLUG_CACHE_DIR": str(tmp_path / "env-cache"), "PATH": os.environ["PATH"]}
        built = ensure_fake_nvml(environ=environ)
        assert built.parent == tmp_path / "env-cache"


def test_source_is_warning_free_under_strict_flags(tmp_path: Path) -> None:
    source = tmp_path / "fakenvml.c"
    source.write_bytes(fake_nvml_source())
    strict = ["-Werror", "-Wpedantic", "-Wshadow", "-Wconversion", "-Wformat=2"]
    result = subprocess.run(
        [real_compiler(), *COMPILE_FLAGS, *strict, "-o", str(tmp_path / LIBRARY_NAME), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
