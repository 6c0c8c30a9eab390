"""The VM tier: the production-default node (systemd pid 1, pure cgroup v2, the systemd cgroup
driver), booted once per session, and what must hold there.

The checks run *inside* the VM, under pytest, over the installed source tree (see
``machine.py``); one guest run covers every suite (a pytest start-up costs much under
emulation), and each suite below is judged from its JUnit report:

- ``daemon_reload``: issue 20's acceptance (``guest/test_daemon_reload.py``), with containerd
  (CRI, runc) and podman with crun — which refuses the hybrid hosts of CI;
- ``engine_v2``: the engine's cgroup v2 tests of ``tests/linux`` on a pure v2 hierarchy — on
  the hybrid hosts of CI they run beside v1; only the v1 and hybrid variants may skip here.

The guest pytest loads only the fixture plugins these need (``GUEST_PLUGINS``), not the
suite's whole ``conftest.py``: importing the Jupyter, browser and schema libraries costs
minutes under emulation.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Final

import pytest

from tests.fixtures.requirements import needs_root

from .machine import BOOT_TIMEOUT, Machine

GUEST_TIMEOUT: Final = 1500.0
"""The whole guest run: 3-6 minutes measured, 3x that on a loaded host."""
TIER_TIMEOUT: Final = int(BOOT_TIMEOUT + GUEST_TIMEOUT + 300)
"""pytest-timeout's bound for the first test, which boots the VM and runs the guest."""

pytestmark = [pytest.mark.vm, pytest.mark.timeout(TIER_TIMEOUT), *needs_root]
SUITES: Final = {
    "daemon_reload": ["tests/vm/guest/test_daemon_reload.py"],
    "engine_v2": [
        "tests/linux/test_bpf_syscall.py",
        "tests/linux/test_cgroup_v2.py",
        "tests/linux/test_engine.py",
    ],
}
GUEST_PLUGINS: Final = (
    "pytest_timeout",
    "pytest_asyncio.plugin",
    "tests.fixtures.sandbox",
    "tests.linux.conftest",
)
GUEST_TEST_TIMEOUT: Final = 1200
ALLOWED_SKIPS: Final = (
    "lacks the v1 device cgroup backend",
    "lacks the hybrid device cgroup backend",
    "needs a hybrid host",
    "needs the v1 devices controller",
    "needs the cgroup v1 'devices' controller",
)
"""Skip reasons that are this VM's nature (no v1 hierarchy); any other skip fails a suite."""


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class GuestRun:
    returncode: int
    output: str
    seconds: float
    outcomes: dict[str, Outcome]


def _suite_of(classname: str) -> str | None:
    path = classname.replace(".", "/")
    return next((s for s, files in SUITES.items() if any(path in f for f in files)), None)


def _parse(report: str) -> dict[str, Outcome]:
    outcomes = {suite: Outcome() for suite in SUITES}
    for case in ET.fromstring(report).iter("testcase"):
        suite = _suite_of(case.get("classname", ""))
        if suite is None:
            continue
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            outcomes[suite].failed[name] = (
                (problem.get("message") or "") + "\n" + (problem.text or "")
            )
        elif skipped is not None:
            outcomes[suite].skipped[name] = skipped.get("message") or ""
        else:
            outcomes[suite].passed.append(name)
    return outcomes


@pytest.fixture(scope="session")
def guest_run(vm: Machine) -> GuestRun:
    """Every suite in one pytest run inside the VM, with a JUnit report read back."""
    started = time.monotonic()
    targets = [t for files in SUITES.values() for t in files]
    extra = ["--noconftest", "-o", f"timeout={GUEST_TEST_TIMEOUT}"]
    for plugin in GUEST_PLUGINS:
        extra += ["-p", plugin]
    result = vm.pytest(targets, junit="/tmp/guest-junit.xml", extra=extra, timeout=GUEST_TIMEOUT)
    report = vm.run("cat /tmp/guest-junit.xml", check=False).stdout
    output = result.stdout + result.stderr
    if not report:
        pytest.fail(
            f"the guest pytest wrote no report (exit {result.returncode}):\n{output[-6000:]}"
        )
    return GuestRun(result.returncode, output, time.monotonic() - started, _parse(report))


@pytest.mark.parametrize("suite", list(SUITES))
def test_suite_passes_in_the_vm(guest_run: GuestRun, suite: str) -> None:
    outcome = guest_run.outcomes[suite]
    details = "\n\n".join(f"{name}:\n{text[-3000:]}" for name, text in outcome.failed.items())
    assert not outcome.failed, (
        f"failed in the VM:\n{details}\n\nguest output:\n{guest_run.output[-4000:]}"
    )
    unexpected = {
        name: why
        for name, why in outcome.skipped.items()
        if not any(allowed in why for allowed in ALLOWED_SKIPS)
    }
    assert not unexpected, f"skipped in the VM: {unexpected}"
    assert outcome.passed, f"nothing of {suite} ran in the VM:\n{guest_run.output[-4000:]}"
