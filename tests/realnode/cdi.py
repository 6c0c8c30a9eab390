"""A node's CDI spec from NVIDIA's own generator, for the simulated driver.

On a node the GPU Operator (>= 25.10) set up, NVIDIA's Container Toolkit has written
``/var/run/cdi/nvidia.yaml`` with ``nvidia-ctk cdi generate``: per GPU (by index and by UUID)
its ``/dev/nvidia<N>``, and for every GPU the driver's libraries and programs as mounts plus
``nvidia-cdi-hook`` hooks (``create-symlinks``, ``update-ldcache`` ...). This module runs the
same generator, built from its Go module (``build.sh``), against the simulated driver root
(``jupyter_gpu_hotplug.nvml.sim.driver_root``) and the fake NVML, and against a device root of
real character nodes, so that what a CDI-mode node applies to containers is what NVIDIA's code
wrote, not a hand-made imitation.

Used by the real node's ``cdi`` mode (``node.py``) and by ``test_cdi_spec.py``. Needs root
(``mknod``; building the driver root runs ``ldconfig -r``).
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.nvml.sim import FakeNvmlConfig
from jupyter_gpu_hotplug.nvml.sim.driver_root import LIBRARY_DIR

from .components import ContainerToolkit

SPEC_NAME: Final = "nvidia.yaml"
"""The file name NVIDIA's toolkit container gives the node's spec in ``/var/run/cdi``."""
SPEC_KIND: Final = "nvidia.com/gpu"
CONTROL_MINOR: Final = 255
"""``/dev/nvidiactl`` is ``c 195:255``."""
GENERATE_TIMEOUT_S: Final = 120


class CdiSpecError(RuntimeError):
    """``nvidia-ctk cdi generate`` failed; the message carries its output."""


@dataclass(frozen=True)
class GeneratedSpec:
    """A spec ``nvidia-ctk`` wrote, and what it said while writing it."""

    path: Path
    spec: dict[str, Any]
    log: str

    def device(self, name: str) -> dict[str, Any]:
        """The device called ``name`` (an index, a UUID or ``all``)."""
        found: dict[str, Any] = next(d for d in self.spec["devices"] if d["name"] == name)
        return found

    @property
    def device_names(self) -> list[str]:
        return [str(d["name"]) for d in self.spec["devices"]]

    @property
    def common_edits(self) -> dict[str, Any]:
        edits: dict[str, Any] = self.spec.get("containerEdits", {})
        return edits


def make_dev_root(dev_root: Path, config: FakeNvmlConfig, *, caps_major: int | None) -> None:
    """``dev_root/dev`` as the driver leaves ``/dev``: ``nvidia<minor>`` per GPU, ``nvidiactl``,
    and with MIG devices ``nvidia-caps/nvidia-cap<N>`` of their access minors (``caps_major``,
    the simulated node's ``nvidia-caps`` major). Real character nodes: the toolkit reads their
    numbers, and a CDI-mode runtime gives them to containers, where they open with ENXIO (no
    driver) as far as the device cgroup allows."""
    dev = dev_root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    nodes = [(dev / f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor) for gpu in config.gpus]
    nodes.append((dev / "nvidiactl", NVIDIA_MAJOR, CONTROL_MINOR))
    migs = [mig for gpu in config.gpus for mig in gpu.mig_devices]
    if migs:
        assert caps_major is not None, "MIG devices need the node's nvidia-caps major"
        (dev / "nvidia-caps").mkdir(exist_ok=True)
        for mig in migs:
            for minor in (mig.gi_access_minor, mig.ci_access_minor):
                nodes.append((dev / "nvidia-caps" / f"nvidia-cap{minor}", caps_major, minor))
    for path, major, minor in nodes:
        if not path.exists():
            os.mknod(path, stat.S_IFCHR, os.makedev(major, minor))
            path.chmod(0o666)  # as the driver's nodes are, whatever the umask


def generate_spec(
    toolkit: ContainerToolkit,
    *,
    driver_root: Path,
    dev_root: Path,
    nvml_environ: Mapping[str, str],
    output_dir: Path,
    wrap: Callable[[list[str]], list[str]] = list,
    extra_args: Sequence[str] = (),
) -> GeneratedSpec:
    """Run ``nvidia-ctk cdi generate --mode nvml`` for the simulated driver at
    ``driver_root`` (``ensure_driver_root()``) and the nodes at ``dev_root/dev``
    (``make_dev_root``), with the fake NVML of ``nvml_environ``; the spec goes to
    ``output_dir/nvidia.yaml``. ``wrap`` runs the command in another context (the node's
    ``in_driver_namespace`` for its MIG tables). Its hooks name the built ``nvidia-cdi-hook``.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    output = output_dir / SPEC_NAME
    argv = wrap(
        [
            str(toolkit.nvidia_ctk),
            "cdi",
            "generate",
            "--mode=nvml",
            f"--driver-root={driver_root}",
            f"--dev-root={dev_root}",
            f"--nvidia-cdi-hook-path={toolkit.nvidia_cdi_hook}",
            f"--output={output}",
            *extra_args,
        ]
    )
    # The library directory first, as the toolkit's container has the driver's libraries on
    # its search path; the fake NVML's own directory would do too.
    env = dict(nvml_environ)
    env["LD_LIBRARY_PATH"] = f"{driver_root / LIBRARY_DIR}:{env.get('LD_LIBRARY_PATH', '')}"
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S, check=False
    )
    if done.returncode != 0 or not output.is_file():
        raise CdiSpecError(
            f"nvidia-ctk cdi generate failed ({done.returncode}): {' '.join(argv)}\n"
            f"{done.stderr[-4000:]}"
        )
    output.chmod(0o644)
    spec: dict[str, Any] = yaml.safe_load(output.read_text())
    return GeneratedSpec(path=output, spec=spec, log=done.stderr)
