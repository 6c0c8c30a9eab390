"""NVIDIA's ``nvidia-ctk cdi generate`` describes the simulated driver as it does a real one.

The CDI spec a GPU Operator node has is written by this generator from the driver it finds;
the node's ``cdi`` mode and the engine that applies a spec's ``containerEdits`` on attach both
rest on the simulated driver looking real to it: each simulated GPU by index and UUID with its
``/dev/nvidia<N>``, the driver's libraries (by their versioned names) and ``nvidia-smi`` as
mounts from the driver root, and the ``nvidia-cdi-hook`` hooks. Needs root and the built
toolkit (``tests/realnode/build.sh``), not a running node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.nvml.sim import (
    CUDA_LIBRARY_NAME,
    LIBRARY_NAME,
    FakeNvmlConfig,
    default_gpus,
    ensure_fake_nvml,
    fake_nvml_environ,
    write_config,
)
from jupyter_gpu_hotplug.nvml.sim.driver_root import (
    DRIVER_VERSION,
    LIBRARY_DIR,
    SMI_PATH,
    ensure_driver_root,
    versioned_name,
)

from .cdi import CONTROL_MINOR, SPEC_KIND, GeneratedSpec, generate_spec, make_dev_root
from .components import ContainerToolkit
from .fixtures import required_container_toolkit

# Root (mknod, ldconfig -r) is checked by required_container_toolkit, which fails instead of
# skipping where JGH_REQUIRE_REAL_NODE=1.
pytestmark = [pytest.mark.root, pytest.mark.realnode, pytest.mark.slow]
GPUS = default_gpus(3)


@pytest.fixture(scope="module")
def toolkit() -> ContainerToolkit:
    return required_container_toolkit()


@pytest.fixture(scope="module")
def driver_root() -> Path:
    return ensure_driver_root()


@pytest.fixture(scope="module")
def generated(
    toolkit: ContainerToolkit, driver_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> GeneratedSpec:
    directory = tmp_path_factory.mktemp("cdi")
    config = FakeNvmlConfig(gpus=GPUS)
    write_config(directory / "nvml.conf", config)
    make_dev_root(directory / "devroot", config, caps_major=None)
    return generate_spec(
        toolkit,
        driver_root=driver_root,
        dev_root=directory / "devroot",
        nvml_environ=fake_nvml_environ(ensure_fake_nvml(), directory / "nvml.conf"),
        output_dir=directory / "spec",
    )


def test_every_gpu_by_index_and_uuid_with_its_device_node(generated: GeneratedSpec) -> None:
    assert generated.spec["kind"] == SPEC_KIND
    expected = {str(i) for i in range(len(GPUS))} | {gpu.uuid for gpu in GPUS} | {"all"}
    assert set(generated.device_names) == expected
    dev = generated.path.parent.parent / "devroot" / "dev"
    for index, gpu in enumerate(GPUS):
        for name in (str(index), gpu.uuid):
            (node,) = generated.device(name)["containerEdits"]["deviceNodes"]
            assert node["path"] == f"/dev/nvidia{gpu.minor}"
            assert node["hostPath"] == str(dev / f"nvidia{gpu.minor}")
            assert (node["major"], node.get("minor", 0)) == (NVIDIA_MAJOR, gpu.minor)
    all_nodes = generated.device("all")["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in all_nodes] == [f"/dev/nvidia{gpu.minor}" for gpu in GPUS]
    control = generated.common_edits["deviceNodes"]
    assert [(n["path"], n["minor"]) for n in control] == [("/dev/nvidiactl", CONTROL_MINOR)]


def test_the_driver_is_mounted_from_the_driver_root(
    generated: GeneratedSpec, driver_root: Path
) -> None:
    mounts = {m["containerPath"]: m for m in generated.common_edits["mounts"]}
    for soname in (CUDA_LIBRARY_NAME, LIBRARY_NAME):
        inside = f"/{LIBRARY_DIR}/{versioned_name(soname)}"
        assert inside.endswith(f".so.{DRIVER_VERSION}")
        assert mounts[inside]["hostPath"] == str(driver_root / inside.lstrip("/"))
        assert "ro" in mounts[inside]["options"]
    assert mounts[f"/{SMI_PATH}"]["hostPath"] == str(driver_root / SMI_PATH)


def test_the_hooks_are_nvidias_cdi_hook(
    generated: GeneratedSpec, toolkit: ContainerToolkit
) -> None:
    hooks = generated.common_edits["hooks"]
    assert {h["path"] for h in hooks} == {str(toolkit.nvidia_cdi_hook)}
    by_command = {h["args"][1]: h for h in hooks}
    assert by_command["update-ldcache"]["hookName"] == "createContainer"
    assert by_command["update-ldcache"]["args"][2:] == ["--folder", f"/{LIBRARY_DIR}"]
    links = by_command["create-symlinks"]["args"][2:]
    assert f"{versioned_name(CUDA_LIBRARY_NAME)}::/{LIBRARY_DIR}/{CUDA_LIBRARY_NAME}" in links
    assert "NVIDIA_VISIBLE_DEVICES=void" in generated.common_edits["env"]
