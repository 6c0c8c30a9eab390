"""The one error the in-kernel commands show as a message for people, not as a bug.

Boundary: IPython's traceback hook only; shared by the ``%gpu`` magic and its progress display
(an interrupted wait), so neither imports the other.
"""

from __future__ import annotations

__all__ = ["GpuCommandError"]


class GpuCommandError(Exception):
    """A ``%gpu`` command failed for a reason the user should read (the agent said no, or
    cannot be reached). Shown as ``message`` alone: no traceback, because it is no bug."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def _render_traceback_(self) -> list[str]:
        """IPython calls this instead of formatting a traceback (terminal and ipykernel)."""
        return self.message.splitlines()
