"""cdi_spec: the node's CDI specs read and validated; which edits belong to a GPU's node."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest

from jupyter_gpu_hotplug.linux.cdi_spec import CdiRegistry, CdiSpecError, load_spec, parse_spec

LIB = "/usr/lib/x86_64-linux-gnu"


def nvidia_spec(driver_root: str = "/run/nvidia/driver") -> dict[str, object]:
    """The shape ``nvidia-ctk cdi generate`` writes (two GPUs, trimmed)."""

    def gpu(name: str, minor: int) -> dict[str, object]:
        return {"name": name, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{minor}"}]}}

    return {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            gpu("0", 0),
            gpu("GPU-11111111-2222-3333-4444-555555555555", 0),
            gpu("1", 1),
            {
                "name": "all",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}]
                },
            },
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
            "mounts": [
                {
                    "hostPath": f"{driver_root}{LIB}/libcuda.so.550.54.15",
                    "containerPath": f"{LIB}/libcuda.so.550.54.15",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
                }
            ],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB],
                }
            ],
        },
    }


def write(directory: Path, name: str, spec: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(spec))
    return path


def test_a_gpus_edits_are_the_common_ones_and_its_own(tmp_path: Path) -> None:
    write(tmp_path / "cdi", "nvidia.json", nvidia_spec())
    registry = CdiRegistry([tmp_path / "cdi"])
    assert len(registry.refresh()) == 1
    edits = registry.edits(PurePosixPath("/dev/nvidia1"))
    assert edits is not None
    assert edits.device_nodes == (PurePosixPath("/dev/nvidiactl"), PurePosixPath("/dev/nvidia1"))
    assert [str(m.container_path) for m in edits.mounts] == [f"{LIB}/libcuda.so.550.54.15"]
    assert edits.hooks[0].args[1] == "update-ldcache"
    assert registry.edits(PurePosixPath("/dev/nvidia7")) is None


def test_yaml_specs_are_read_and_other_kinds_ignored(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec()))
    other = nvidia_spec()
    other["kind"] = "example.com/fpga"
    write(tmp_path / "cdi", "fpga.json", other)
    specs = CdiRegistry([tmp_path / "cdi"]).refresh()
    assert [s.kind for s in specs] == ["nvidia.com/gpu"]


def test_the_later_directory_wins(tmp_path: Path) -> None:
    write(tmp_path / "etc", "nvidia.json", nvidia_spec("/old"))
    write(tmp_path / "run", "nvidia.json", nvidia_spec("/new"))
    registry = CdiRegistry([tmp_path / "etc", tmp_path / "run"])
    registry.refresh()
    edits = registry.edits(PurePosixPath("/dev/nvidia0"))
    assert edits is not None and str(edits.mounts[0].host_path).startswith("/new/")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(cdiVersion="9.9.9"), "cdiVersion"),
        (lambda s: s.update(kind="nvidia"), "vendor/class"),
        (lambda s: s.update(devices=[]), "no device"),
        (lambda s: s["devices"].append({"name": "0"}), "defined twice"),
        (lambda s: s["devices"].append({"name": "-bad"}), "not a device name"),
        (
            lambda s: s["containerEdits"]["mounts"][0].update(containerPath="usr/lib/x.so"),
            "absolute",
        ),
        (
            lambda s: s["containerEdits"]["mounts"][0].update(containerPath="/usr/../etc/passwd"),
            "normalised",
        ),
        (lambda s: s["containerEdits"]["mounts"][0].update(hostPath="/"), "normalised"),
        (lambda s: s["containerEdits"].update(env=["not an assignment"]), "KEY=value"),
        (lambda s: s["containerEdits"].update(hooks=[{"path": "/x"}]), "hookName"),
    ],
    ids=["version", "kind", "no_devices", "duplicate", "device_name", "relative", "dotdot",
         "root", "env", "hook"],
)  # fmt: skip
def test_a_malformed_spec_is_refused_naming_the_file(
    tmp_path: Path, change: object, message: str
) -> None:
    spec = nvidia_spec()
    change(spec)  # type: ignore[operator]
    path = write(tmp_path, "bad.json", spec)
    with pytest.raises(CdiSpecError, match=message) as error:
        load_spec(path)
    assert str(path) in str(error.value)


def test_not_json_is_an_error_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(CdiSpecError, match="not JSON"):
        parse_spec("{", path=tmp_path / "x.json")


def test_an_unchanged_spec_is_not_parsed_again_and_a_changed_one_is(tmp_path: Path) -> None:
    path = write(tmp_path / "cdi", "nvidia.json", nvidia_spec("/old"))
    registry = CdiRegistry([tmp_path / "cdi"])
    (first,) = registry.refresh()
    (again,) = registry.refresh()
    assert again is first
    path.write_text(json.dumps(nvidia_spec("/newer-root")))
    (changed,) = registry.refresh()
    assert str(changed.common.mounts[0].host_path).startswith("/newer-root/")
    path.unlink()
    assert registry.refresh() == ()
