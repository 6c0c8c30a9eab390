"""The simulator's own errors, one hierarchy for the whole ``nvml.sim`` boundary.

Why a separate module: the model, the builder and the loader all raise these, and callers (the
agent's ``--simulate`` start-up, test fixtures) want one ``except FakeNvmlError`` that tells a
broken simulation apart from an NVML error of the simulated GPUs themselves.
"""

from __future__ import annotations

__all__ = ["FakeNvmlBuildError", "FakeNvmlConfigError", "FakeNvmlError", "FakeNvmlLoadError"]


class FakeNvmlError(Exception):
    """Base of every simulator failure; never raised for a simulated NVML error code."""


class FakeNvmlConfigError(FakeNvmlError, ValueError):
    """A simulated GPU or config text that the fake library would reject.

    Also a ``ValueError`` because it is raised for bad values, so callers that validate input
    generically still catch it.
    """


class FakeNvmlBuildError(FakeNvmlError):
    """The fake library could not be compiled (no C compiler, or the compiler failed).

    Retrying does not help: a compiler has to be installed or the source fixed. The message
    says which, and carries the compiler's output.
    """


class FakeNvmlLoadError(FakeNvmlError):
    """The fake library could not be made the NVML of this process.

    Typically a real ``libnvidia-ml.so.1`` was loaded first: one process can hold only one
    library of that name, so the simulator has to run in a fresh process.
    """
