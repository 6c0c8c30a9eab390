"""Fixtures shared by the tier-2 tests of this folder."""

from __future__ import annotations

import pytest

from jupyter_gpu_hotplug.linux.sandbox.runtime import Backend, host_backends

BACKEND_SETS = {
    "v1": frozenset({Backend.V1}),
    "v2": frozenset({Backend.V2}),
    "hybrid": frozenset({Backend.V1, Backend.V2}),
}
"""The device-cgroup mechanisms a sandbox can be confined by, alone and together."""


@pytest.fixture(params=sorted(BACKEND_SETS))
def backends(request: pytest.FixtureRequest) -> frozenset[Backend]:
    """Each backend set this host has (the others are skipped, saying why)."""
    wanted = BACKEND_SETS[request.param]
    if not wanted <= host_backends():
        pytest.skip(f"this host lacks the {request.param} device cgroup backend")
    return wanted
