"""The demo's errors: each one is a sentence for the person at the terminal, never a traceback.

Why a hierarchy of its own: the command line turns any ``DemoError`` into its message and exit
code ``1``; everything else is a bug and keeps its traceback. Library errors are chained
(``raise DemoStartError(...) from e``) so ``--debug`` style investigation still has them.
"""

from __future__ import annotations


class DemoError(Exception):
    """Base of the demo's errors; ``str(error)`` is what the user reads."""


class DemoUnavailable(DemoError):
    """The demo cannot run here at all (not Linux, not root, port busy...); nothing was started.

    ``hint`` says what would work instead.
    """

    def __init__(self, reason: str, *, hint: str) -> None:
        super().__init__(f"{reason}\n{hint}")
        self.reason = reason
        self.hint = hint


class DemoStartError(DemoError):
    """A part of the demo did not come up; what was started has been stopped again."""


class ChildDied(DemoError):
    """A child process (the agent or JupyterLab) ended while the demo was running."""
