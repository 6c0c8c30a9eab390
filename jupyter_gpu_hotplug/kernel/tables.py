"""The ``%gpu status`` / ``list`` / ``queue`` tables: HTML in a notebook, text that fits 80
columns elsewhere.

Boundary: pure functions from values to strings (no IPython); the magic decides where a table
goes. A table is written once as ``Table`` and rendered twice, so the notebook and the
terminal show the same rows.

Why short ids: a GPU UUID is 40 characters, half a terminal line; it dominated the old
output and wrapped mid-string at notebook width. Tables show ``GPU-1a2b3c4d`` (enough to tell
GPUs apart and to type: ``%gpu detach`` takes a UUID beginning or the node index), and the
HTML form keeps the full UUID one click away, selectable as a whole for copying.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = ["TEXT_WIDTH", "Table", "Uuid", "short_uuid"]

TEXT_WIDTH: Final = 80
"""Columns a plain-text table may use (a terminal, a log, a notebook without HTML)."""

_GAP: Final = 2
_ELLIPSIS: Final = "…"


def short_uuid(uuid: str) -> str:
    """``GPU-1a2b3c4d-…`` → ``GPU-1a2b3c4d``: the kind and the first eight hex digits."""
    kind, dash, rest = uuid.partition("-")
    return f"{kind}{dash}{rest[:8]}" if len(rest) > 8 else uuid


@dataclass(frozen=True)
class Uuid:
    """A cell holding a GPU's UUID: short in text, short plus the full one (copyable) in HTML."""

    value: str

    def text(self) -> str:
        return short_uuid(self.value)

    def html(self) -> str:
        full = html.escape(self.value)
        return (
            f'<details class="gpuhp-uuid"><summary title="{full}">'
            f"{html.escape(short_uuid(self.value))}</summary>"
            f'<code style="user-select: all">{full}</code></details>'
        )


Cell = str | Uuid


def _text(cell: Cell) -> str:
    return cell.text() if isinstance(cell, Uuid) else cell


def _html(cell: Cell) -> str:
    return cell.html() if isinstance(cell, Uuid) else html.escape(cell)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + _ELLIPSIS


@dataclass(frozen=True)
class Table:
    """A titled table with notes under it.

    ``flexible``: the columns that give up width (clipped with ``…``), widest first, when the
    text form would exceed ``TEXT_WIDTH``; the others (indexes, ids, states) never do.
    """

    title: str
    columns: tuple[str, ...]
    rows: Sequence[tuple[Cell, ...]]
    notes: tuple[str, ...] = ()
    flexible: frozenset[str] = field(default_factory=frozenset)
    empty: str = "(none)"

    def text(self, width: int = TEXT_WIDTH) -> str:
        """The table in plain text, every line at most ``width`` columns (notes wrap)."""
        lines = [_clip(self.title, width)]
        if self.rows:
            cells = [[_text(cell) for cell in row] for row in self.rows]
            widths = [
                max(len(self.columns[i]), *(len(row[i]) for row in cells))
                for i in range(len(self.columns))
            ]
            self._fit(widths, width)
            for row in [list(self.columns), *cells]:
                padded = (_clip(cell, w).ljust(w) for cell, w in zip(row, widths, strict=True))
                lines.append((" " * _GAP).join(padded).rstrip())
        else:
            lines.extend(_wrap(f"  {self.empty}", width))
        for note in self.notes:
            lines.extend(_wrap(note, width))
        return "\n".join(lines)

    def _fit(self, widths: list[int], width: int) -> None:
        flexible = [i for i, name in enumerate(self.columns) if name in self.flexible]
        while sum(widths) + _GAP * (len(widths) - 1) > width and flexible:
            widest = max(flexible, key=lambda i: widths[i])
            floor = max(len(self.columns[widest]), 8)
            if widths[widest] <= floor:
                flexible.remove(widest)
                continue
            widths[widest] -= 1

    def html(self) -> str:
        """The table as HTML (theme-aware classes of ``render.CSS``)."""
        head = "".join(f"<th>{html.escape(column)}</th>" for column in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{_html(cell)}</td>" for cell in row) + "</tr>"
            for row in self.rows
        )
        table = (
            f'<table class="gpuhp-table"><tr>{head}</tr>{body}</table>'
            if self.rows
            else f'<div class="gpuhp-muted">{html.escape(self.empty)}</div>'
        )
        notes = "".join(f'<div class="gpuhp-muted">{html.escape(n)}</div>' for n in self.notes)
        return f'<div class="gpuhp-root"><b>{html.escape(self.title)}</b>{table}{notes}</div>'


def _wrap(text: str, width: int) -> list[str]:
    """``text`` broken at spaces into lines of at most ``width`` columns."""
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if len(candidate) > width and line:
                lines.append(line)
                line = word
            else:
                line = candidate
        lines.append(line)
    return lines
