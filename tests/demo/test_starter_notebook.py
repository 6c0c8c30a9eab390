"""The starter notebook runs top to bottom, without error, in the simulated demo (issue 6).

How the notebook is run, and why: ``nbclient`` drives a kernel through a jupyter_client
``KernelManager`` and ZMQ; the demo's JupyterLab owns its kernels' managers in another process
and offers them only over HTTP and websockets, which nbclient cannot use (jupyter_server's
``GatewayKernelManager`` would, but its websocket client sends no token, so a token-protected
server refuses it). So the notebook runs in a kernel this test starts with *exactly what the
demo gives its own kernels*: the sandbox provisioner and the kernel environment read back from
the demo's JupyterLab configuration (agent socket, fake NVML filtered by ``/dev``) and the
demo's kernel command (which loads the ``%gpu`` magic). Everything
the notebook touches — its sandbox, the demo's agent (which knows the kernel by its process
credentials on the demo's socket), the simulated GPUs — is the demo's; only the process that
launched the kernel differs, and the end-to-end test covers kernels launched by the demo's
server.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from jupyter_gpu_hotplug.sandboxes.provisioner import (
    sandboxed_kernelspec,
    write_sandboxed_kernelspec,
)

from ..fixtures.requirements import needs_root
from . import leftovers
from .conftest import DemoFactory

pytestmark = [*needs_root, pytest.mark.slow, pytest.mark.timeout(600)]

KERNEL_NAME = "gpu-hotplug-demo-starter"
NOTEBOOK_NAME_PREFIX = "gpu-hotplug-demo-nbclient"


def cell_text(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell showed, as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "\n".join(parts)


def test_starter_notebook_runs_top_to_bottom_in_the_simulated_demo(
    demo_factory: DemoFactory, tmp_path: Path
) -> None:
    demo = demo_factory(simulate=2)
    layout = demo.layout
    lab_config = json.loads(layout.lab_config.read_text())
    kernels_dir = tmp_path / "kernels"
    spec = sandboxed_kernelspec(
        # The demo's own kernel command: it loads the %gpu magic, which the notebook relies on.
        argv=json.loads(layout.kernelspec.read_text())["argv"],
        config={
            "extra_env": lab_config["SandboxedKernelProvisioner"]["extra_env"],
            "name_prefix": NOTEBOOK_NAME_PREFIX,
        },
    )
    write_sandboxed_kernelspec(kernels_dir, KERNEL_NAME, spec=spec)
    notebook = nbformat.read(layout.starter, as_version=4)  # type: ignore[no-untyped-call]
    manager = KernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels_dir)]),
    )
    client = NotebookClient(
        notebook,
        km=manager,
        timeout=180,
        startup_timeout=120,
        resources={"metadata": {"path": str(layout.notebooks)}},
    )
    try:
        # The client is ours to close although the kernel manager is not nbclient's.
        client.execute(cleanup_kc=True)
    finally:
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    by_source = {cell.source.splitlines()[0]: cell_text(cell) for cell in code}
    errors = [o for cell in code for o in cell.outputs if o["output_type"] == "error"]
    assert errors == []
    assert "/dev/nvidia" in by_source["%gpu attach 1"]
    assert "crw" in by_source["!ls -l /dev/nvidia*"], "the GPU's device node is there"
    assert "(simulated)" in by_source["import pynvml"], "NVML lists the attached GPU"
    assert "SIMULATED load: process" in by_source["%gpu load --seconds 300"], "kept busy"
    assert "no GPU device node left" in by_source["import glob"], "detached again"
    # The notebook gave its GPU back; the demo still holds both, free.
    assert [gpu.state for gpu in demo.agent().gpus()] == ["free", "free"]
    assert [p for p in leftovers.demo_sandboxes() if NOTEBOOK_NAME_PREFIX in p.name] == []
    assert demo.interrupt() == 0, demo.logs()
