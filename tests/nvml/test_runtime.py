"""Reaching the fake from a child process, and loading it into this one safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from jupyter_gpu_hotplug.nvml.sim import (
    COMPILE_FLAGS,
    LIBRARY_NAME,
    FakeNvmlLoadError,
    fake_nvml_environ,
    find_compiler,
    is_fake_library,
    load_in_process,
)
from tests.fixtures.nvml import FakeNvmlNode

LIST_GPUS = textwrap.dedent(
    """
    import json, sys
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        print(json.dumps({"error": type(error).__name__}))
        sys.exit(0)
    def snapshot():
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return [
            {
                "uuid": pynvml.nvmlDeviceGetUUID(h),
                "name": pynvml.nvmlDeviceGetName(h),
                "minor": pynvml.nvmlDeviceGetMinorNumber(h),
                "util": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
            }
            for h in handles
        ]
    print(json.dumps(snapshot()), flush=True)
    for _ in sys.stdin:  # one more snapshot per line, until stdin closes
        print(json.dumps(snapshot()), flush=True)
    """
)


def expected(node: FakeNvmlNode) -> list[dict[str, object]]:
    return [
        {"uuid": g.uuid, "name": g.name, "minor": g.minor, "util": g.utilization_gpu}
        for g in node.gpus
    ]


def run_child(env: dict[str, str], cwd: Path) -> object:
    result = subprocess.run(
        [sys.executable, "-c", LIST_GPUS],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[0])


class TestChildProcess:
    def test_child_sees_the_gpus(
        self, fake_nvml_node: FakeNvmlNode, fake_nvml_env: dict[str, str], tmp_path: Path
    ) -> None:
        assert run_child(fake_nvml_env, tmp_path) == expected(fake_nvml_node)

    def test_running_child_sees_changes(self, fake_nvml_node: FakeNvmlNode, tmp_path: Path) -> None:
        with subprocess.Popen(
            [sys.executable, "-c", LIST_GPUS],
            env=fake_nvml_node.environ(),
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdin is not None and child.stdout is not None
            assert json.loads(child.stdout.readline()) == expected(fake_nvml_node)
            fake_nvml_node.update_gpu(fake_nvml_node.gpus[1].uuid, utilization_gpu=93)
            child.stdin.write("\n")
            child.stdin.flush()
            after = json.loads(child.stdout.readline())
            child.stdin.close()
            assert child.wait() == 0
        assert after == expected(fake_nvml_node)
        assert after[1]["util"] == 93

    def test_child_init_error(self, fake_nvml_node: FakeNvmlNode, tmp_path: Path) -> None:
        env = fake_nvml_node.environ(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        assert run_child(env, tmp_path) == {"error": "NVMLError_DriverNotLoaded"}


class TestEnviron:
    def test_prepends_library_and_sets_config(self, tmp_path: Path) -> None:
        base = {"LD_LIBRARY_PATH": "/opt/lib::/usr/lib", "HOME": "/home/x"}
        env = fake_nvml_environ(tmp_path / "lib", Path("node.conf"), base=base)
        assert env["LD_LIBRARY_PATH"] == f"{tmp_path}/lib:/opt/lib:/usr/lib"
        assert env["FAKE_NVML_CONFIG"] == os.path.abspath("node.conf")
        assert env["HOME"] == "/home/x"
        assert base["LD_LIBRARY_PATH"] == "/opt/lib::/usr/lib", "the base is not modified"

    def test_library_dir_is_not_repeated(self, tmp_path: Path) -> None:
        base = {"LD_LIBRARY_PATH": f"/a:{tmp_path}"}
        env = fake_nvml_environ(tmp_path, tmp_path / "c", base=base)
        assert env["LD_LIBRARY_PATH"] == f"{tmp_path}:/a"

    def test_filter_and_init_error_are_set_or_cleared(self, tmp_path: Path) -> None:
        inherited = {"FAKE_NVML_DEVICE_FILTER": "/dev", "FAKE_NVML_INIT_ERROR": "9"}
        cleared = fake_nvml_environ(tmp_path, tmp_path / "c", base=inherited)
        assert "FAKE_NVML_DEVICE_FILTER" not in cleared
        assert "FAKE_NVML_INIT_ERROR" not in cleared
        env = fake_nvml_environ(
            tmp_path, tmp_path / "c", device_filter=Path("/dev"), init_error=15, base={}
        )
        assert env["FAKE_NVML_DEVICE_FILTER"] == "/dev"
        assert env["FAKE_NVML_INIT_ERROR"] == "15"


class TestLoadInProcess:
    def test_idempotent(self, fake_nvml_library: Path) -> None:
        first = load_in_process(fake_nvml_library)
        second = load_in_process(fake_nvml_library)
        assert is_fake_library(first) and is_fake_library(second)
        assert first._handle == second._handle

    def test_refuses_when_another_nvml_came_first(
        self, fake_nvml_library: Path, tmp_path: Path
    ) -> None:
        # A stand-in for the real driver's library: right SONAME, no simulator marker. Loaded
        # only in a child, because one process holds one library of that name for good.
        impostor_dir = tmp_path / "impostor"
        impostor_dir.mkdir()
        source = tmp_path / "impostor.c"
        source.write_text("int nvmlInit_v2(void) { return 0; }\n")
        subprocess.run(
            [*find_compiler(), *COMPILE_FLAGS, "-o", str(impostor_dir / LIBRARY_NAME), str(source)],
            check=True,
        )
        script = textwrap.dedent(
            f"""
            from pathlib import Path
            from jupyter_gpu_hotplug.nvml.sim import FakeNvmlLoadError, load_in_process
            for directory in ({str(impostor_dir)!r}, {str(fake_nvml_library)!r}):
                try:
                    load_in_process(Path(directory))
                except FakeNvmlLoadError as error:
                    print(error)
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        )
        not_fake, taken = result.stdout.splitlines()
        assert not_fake.endswith("is not jupyter-gpu-hotplug's fake NVML")
        assert f"another {LIBRARY_NAME} was loaded in this process" in taken

    def test_missing_library(self, tmp_path: Path) -> None:
        with pytest.raises(FakeNvmlLoadError, match="cannot load the fake NVML") as caught:
            load_in_process(tmp_path)
        assert isinstance(caught.value.__cause__, OSError)
