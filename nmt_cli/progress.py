"""Progress of long work (downloading, cleaning, bpe, binarizing, translating): a rich bar when the
bar can be seen, plain log lines on stderr otherwise (a log file, a CI job, a pipe).

Each caller chooses the bar's columns and what its log lines say; the switch between the two, the
counting and the timing are here once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn


def log(message: str) -> None:
    """One plain line on stderr, as it is (no rich markup or highlighting)."""
    print(message, file=sys.stderr, flush=True)


class ProgressReport:
    """`done` units (bytes, lines) out of `total` (None: unknown), plus the caller's `fields`.

    On a terminal: a rich bar of `columns` (empty: rich's default columns) for a task named
    `description`. Otherwise: `first_line` when the work starts, `line(self)` every `every_seconds`
    (None: never) and, with `at_end`, once more when the work ends without an exception.
    `bar` overrides the terminal test (None: whenever stderr is a terminal).
    """

    def __init__(self, description: str, total: int | None, line: Callable[[ProgressReport], str], *,
                 columns: Sequence[str | ProgressColumn] = (), first_line: str | None = None,
                 every_seconds: float | None = None, at_end: bool = True, transient: bool = False,
                 bar: bool | None = None, **fields: Any) -> None:
        self.description, self.total, self.line, self.fields = description, total, line, fields
        self.first_line, self.every_seconds, self.at_end = first_line, every_seconds, at_end
        self.done, self.start = 0, time.monotonic()
        self._last_log = self.start
        console = Console(stderr=True)
        self._bar: Progress | None = None
        if console.is_terminal if bar is None else bar:
            self._bar = Progress(*columns, console=console, transient=transient)
            self._task = self._bar.add_task(description, total=total, **fields)

    def __enter__(self) -> ProgressReport:
        self.start = self._last_log = time.monotonic()
        if self._bar is not None:
            self._bar.start()
        elif self.first_line is not None:
            log(self.first_line)
        return self

    def advance(self, n: int, total: int | None = None, **fields: Any) -> None:
        """`n` more units done; a `total` learnt on the way and new `fields` replace the old ones."""
        self.done += n
        self.total = self.total if total is None else total
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.update(self._task, advance=n, total=total, **fields)
        elif self.every_seconds is not None and time.monotonic() - self._last_log >= self.every_seconds:
            self._last_log = time.monotonic()
            log(self.line(self))

    @property
    def seconds(self) -> float:
        """Since the work started (never 0, so a rate can be divided by it)."""
        return max(time.monotonic() - self.start, 1e-9)

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif exc_type is None and self.at_end:
            log(self.line(self))
