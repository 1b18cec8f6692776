"""SpecError: every problem with a spec, reported at its place in the user's text."""
from __future__ import annotations

import difflib
import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """The text of a spec and the name it is reported under (a path or '<library>/gla.mix')."""

    text: str
    filename: str = "<spec>"

    def line(self, number: int) -> str:
        # Split on '\n' only: the parser counts lines that way, and str.splitlines() would
        # also break at form feeds and U+2028, putting the caret under the wrong line.
        lines = self.text.split("\n")
        return lines[number - 1].rstrip("\r") if 1 <= number <= len(lines) else ""

    def end(self) -> "Span":
        """Just after the last character that is not whitespace (where 'end of file' points)."""
        text = self.text.rstrip(" \t\f\r\n")
        start = text.rfind("\n") + 1
        return Span.point(text.count("\n") + 1, len(text) - start + 1)


@dataclass(frozen=True)
class Span:
    """1-based line and column of the first character; end is exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def point(line: int, column: int) -> "Span":
        return Span(line, column, line, column + 1)


class SpecError(Exception):
    """A spec is wrong. str() is the full report: message, file:line:column, the line, a caret."""

    def __init__(self, message: str, source: Source | None = None, span: Span | None = None,
                 notes: tuple[str, ...] = ()):
        self.message = message
        self.source = source
        self.span = span
        self.notes = tuple(notes)
        super().__init__(self.render())

    @property
    def filename(self) -> str | None:
        return self.source.filename if self.source else None

    @property
    def line(self) -> int | None:
        return self.span.line if self.span else None

    @property
    def column(self) -> int | None:
        return self.span.column if self.span else None

    def render(self) -> str:
        if self.source is None or self.span is None:
            head = f"error: {self.message}"
            where = f"  --> {self.source.filename}" if self.source else ""
            return "\n".join(x for x in (head, where, *self._note_lines()) if x)
        span = self.span
        text = self.source.line(span.line)
        width = 1
        if span.end_line == span.line and span.end_column > span.column:
            width = span.end_column - span.column
        width = max(1, min(width, max(1, len(text) - span.column + 1)))
        text, column, width = _window(text, span.column, width)
        shown, cells = _displayed(text)
        gutter = str(span.line)
        pad = " " * len(gutter)
        out = [
            f"{self.source.filename}:{span.line}:{span.column}: error: {self.message}",
            f"{pad} |",
            f"{gutter} | {shown}",
            f"{pad} | {' ' * sum(cells[:column - 1])}^{'~' * (sum(cells[column - 1:][:width]) - 1)}",
        ]
        return "\n".join(out + self._note_lines())

    def _note_lines(self) -> list[str]:
        return [f"note: {n}" for n in self.notes]


# A line longer than this is shown as the part around the error, so that a 10,000-character
# name gives a readable report rather than a 10,000-cell line and underline.
SHOWN_LINE_MAX = 120
ELLIPSIS = "..."


def _window(text: str, column: int, width: int) -> tuple[str, int, int]:
    """(the part of the line to show, the error's column in it, the underline's width)."""
    if len(text) <= SHOWN_LINE_MAX:
        return text, column, width
    keep = SHOWN_LINE_MAX - 2 * len(ELLIPSIS)
    width = min(width, keep // 2)
    start = max(0, min(column - 1 - keep // 4, len(text) - keep))
    part = text[start:start + keep]
    head = ELLIPSIS if start > 0 else ""
    tail = ELLIPSIS if start + keep < len(text) else ""
    return head + part + tail, column - start + len(head), width


def _displayed(text: str) -> tuple[str, list[int]]:
    """The line as shown under the message, and the terminal cells of each character, so
    that the caret lands under the right character: a tab or an invisible or control
    character is shown as one cell (' ' or '?'), a wide (CJK) character takes two."""
    shown, cells = [], []
    for ch in text:
        if ch == "\t":
            ch = " "
        elif not ch.isprintable():
            ch = "?"
        shown.append(ch)
        cells.append(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1)
    return "".join(shown), cells


def did_you_mean(name: str, candidates) -> str:
    """' (did you mean 'k'?)' when a candidate is close, else ''."""
    pool = sorted(set(candidates))
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.5)
    if not close:
        lowered = {c.lower(): c for c in pool}
        if name.lower() in lowered:
            close = [lowered[name.lower()]]
    return f" (did you mean '{close[0]}'?)" if close else ""
