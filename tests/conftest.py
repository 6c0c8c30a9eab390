"""Test-suite wiring: each fixture family lives in its own plugin module under ``fixtures/``."""

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
