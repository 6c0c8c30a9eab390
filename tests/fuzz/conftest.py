"""The fuzzing tier's shared settings: bounded, derandomized, no example database.

Bounded so that the tier runs on CI's 2 cores in a few minutes (``FUZZ_EXAMPLES`` per
property, each request answered in milliseconds); derandomized so that a CI failure
reproduces exactly from the same commit.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

FUZZ_EXAMPLES = 250

settings.register_profile(
    "fuzz",
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
