"""The VM tier's wiring: one VM per session, and the guest-side tests kept off the host.

``guest/`` holds tests that only make sense *inside* the systemd node (they restart systemd,
run containers with the systemd driver); on the host they are not collected at all, and
``test_systemd_node.py`` runs them in the VM. In the VM the environment variable below says
where it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..realnode.fixtures import REQUIRE_ENV
from .image import ImageUnavailable, ensure_image, missing_host_tools
from .machine import Machine, boot

IN_VM_ENV = "GPU_HOTPLUG_TEST_IN_VM"

collect_ignore = [] if os.environ.get(IN_VM_ENV) else ["guest"]


@pytest.fixture(scope="session")
def vm() -> Iterator[Machine]:
    """The systemd node, booted once for the session from the cached image."""
    # Where the real node is required (``.ci/test``), so is the VM: a missing part fails there.
    absent = pytest.fail if os.environ.get(REQUIRE_ENV) == "1" else pytest.skip
    if os.geteuid() != 0:
        absent("the VM tier needs root (image build, qemu networking)")
    if missing := missing_host_tools():
        absent(f"the VM tier needs {missing}: run `bash .ci/setup --with-vm`")
    try:
        image = ensure_image()
    except ImageUnavailable as e:
        pytest.fail(str(e))
    # A short directory: ssh's control socket path must fit in sun_path.
    run_dir = Path(tempfile.mkdtemp(prefix="jgh-vm-"))
    try:
        with boot(image, run_dir, tree=Path(__file__).parents[2]) as machine:
            yield machine
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
