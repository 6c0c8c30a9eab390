"""Fixtures shared by the kernel-side tests (the ``%gpu`` magic and the monitor widget)."""

from __future__ import annotations

import pytest

from jupyter_gpu_hotplug.kernel.cuda import CudaState

from .samples import IDLE


@pytest.fixture
def cuda() -> list[CudaState]:
    """What the code under test's CUDA check answers (the last item; a test appends)."""
    return [IDLE]
