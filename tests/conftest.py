"""Test-suite wiring: each fixture family lives in its own plugin module under ``fixtures/``,
and the fast default run.

``pytest`` with no arguments runs the fast tier (``FAST_RUN``): every test but those that start
real servers, kernels or toolchains (``slow``), the fuzzing tier (``fuzz``), the Kubernetes
tier (``k8s``) and the Linux integration tier (``root``). Naming anything — a path, ``-m``,
``-k`` — runs exactly that, every tier included (``pytest tests/agent/test_service.py`` is that
module, ``pytest tests`` the whole suite), and ``--all-tiers`` runs everything whatever else is
given: ``.ci/test`` passes it. docs/testing.md says which tests a change touches and how long
the fast run takes.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

pytest_plugins = [
    "tests.fixtures.nvml",
    "tests.fixtures.sandbox",
    "tests.fixtures.jupyter",
    "tests.fixtures.browser",
    "tests.fixtures.agent",
    "tests.fixtures.kubeconfig",
    "tests.k8s.fixtures",
    "tests.k8s.agent",
    "tests.realnode.fixtures",
]

FAST_RUN = "not slow and not fuzz and not k8s and not root"
"""The marker expression of a bare ``pytest``."""

# Time is never a verdict on shared 2-core machines: Hypothesis's 200 ms deadline per example
# failed a property test under a CI run's load (DeadlineExceeded). A test's own ``@settings``
# keeps its other choices (example counts) and inherits this.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all-tiers",
        action="store_true",
        help="run every tier even with no path, -m or -k given (a bare pytest is the fast run)",
    )


def _bare(config: pytest.Config) -> bool:
    """Whether pytest was started without naming what to run."""
    return (
        not config.option.all_tiers
        and config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and not config.option.markexpr
        and not config.option.keyword
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if _bare(config):
        config.option.markexpr = FAST_RUN


def pytest_report_header(config: pytest.Config) -> str | None:
    if (
        config.option.markexpr == FAST_RUN
        and config.args_source is pytest.Config.ArgsSource.TESTPATHS
    ):
        return f"fast default run (-m {FAST_RUN!r}); `pytest tests` runs every tier"
    return None
