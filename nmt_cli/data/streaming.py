"""Streaming large text files through worker processes, in input order, with a progress display.

`nmt bpe` and `nmt binarize` handle corpora of millions of lines. They read a file as blocks of
about `BLOCK_BYTES` that end at a line break (`line_blocks`), hand the blocks to a pool of worker
processes (`WorkerPool.map`) and get the results back in input order. At most two blocks per
worker are in flight, so memory stays flat however large the corpus is. `line_progress` shows a
rich progress bar on a terminal and a `key=value` log line now and then otherwise.
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nmt_cli.artifacts import MAX_LINE_BYTES, line_too_long, open_input
from nmt_cli.errors import NmtError
from nmt_cli.progress import ProgressReport

BLOCK_BYTES = 1 << 20  # ~8k sentences of WMT text: large enough that inter-process overhead vanishes
T = TypeVar("T")
R = TypeVar("R")


class Block(NamedTuple):
    """Whole lines of one file: every line ends with LF except perhaps the file's last one."""

    path: str
    first_line: int  # 1-based number of the block's first line in its file
    data: bytes

    @property
    def line_count(self) -> int:
        return self.data.count(b"\n") + (not self.data.endswith(b"\n"))

    def text(self) -> str:
        """The block decoded as strict UTF-8; an error names the file and line."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = self.first_line + self.data.count(b"\n", 0, e.start)
            raise NmtError(f"{self.path}, line {line}: invalid UTF-8; every input must be UTF-8 text "
                           "(run the stage that wrote it again)") from None

    def lines(self) -> list[str]:
        """The lines without their LF (and without a CR before it), as `artifacts.read_lines` reads them."""
        text = self.text()
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        if "\r" in text:
            lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        return lines


def line_blocks(path: Path, block_bytes: int | None = None) -> Iterator[Block]:
    """Yield `path` as blocks of whole lines of about `block_bytes` (a longer line is one block; a
    line over `MAX_LINE_BYTES` is an error)."""
    block_bytes = block_bytes or BLOCK_BYTES
    with open_input(path) as f:
        pending, first_line = bytearray(), 1
        while data := f.read(block_bytes):
            pending += data
            cut = pending.rfind(b"\n") + 1
            if not cut and len(pending) > MAX_LINE_BYTES:
                raise line_too_long(path, first_line)
            if cut:
                block = Block(str(path), first_line, bytes(pending[:cut]))
                del pending[:cut]
                first_line += block.line_count
                yield block
        if pending:
            yield Block(str(path), first_line, bytes(pending))


def cpu_cores() -> int:
    """The CPU cores this process may use (a job scheduler may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_count(workers: int) -> int:
    """`workers`, or the CPU cores this process may use when it is 0."""
    if workers < 0:
        raise NmtError(f"workers must be 0 (one per CPU core) or a positive number, not {workers}")
    return workers or cpu_cores()


class WorkerPool:
    """Runs a function over a stream of items in `workers` processes, yielding results in input order.

    With one worker everything runs in this process (no start-up cost, easy to debug). Workers are
    started with "spawn": forking a process that runs a progress-bar thread can deadlock.
    """

    def __init__(self, workers: int) -> None:
        self.workers = worker_count(workers)
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> WorkerPool:
        if self.workers > 1:
            self._executor = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_interrupts)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """`fn(item)` for every item, in order; `fn` must be a module-level function."""
        if self._executor is None:
            yield from map(fn, items)
            return
        in_flight: collections.deque[concurrent.futures.Future] = collections.deque()
        try:
            for item in items:
                in_flight.append(self._executor.submit(fn, item))
                if len(in_flight) >= 2 * self.workers:
                    yield in_flight.popleft().result()
            while in_flight:
                yield in_flight.popleft().result()
        except concurrent.futures.process.BrokenProcessPool:
            raise NmtError(f"a worker process died (out of memory?); run again with fewer workers than "
                           f"{self.workers} (--workers)") from None
        finally:
            for future in in_flight:
                future.cancel()


def _ignore_interrupts() -> None:
    """Ctrl-C reaches every process of the terminal; only the main one reacts (and stops the pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def line_progress(stage: str, step: str, total_lines: int, log_seconds: float = 30.0) -> ProgressReport:
    """Lines done out of a known total: a rich bar on a terminal, else a log line every `log_seconds`
    and one at the end."""
    columns = (TextColumn(f"{stage} {step}"), BarColumn(), MofNCompleteColumn(), TextColumn("lines"),
               TimeElapsedColumn(), TimeRemainingColumn())

    def line(p: ProgressReport) -> str:
        return (f"stage={stage} step={step} lines={p.done} total={p.total} "
                f"lines_per_second={p.done / p.seconds:.0f} seconds={p.seconds:.1f}")
    return ProgressReport(step, total_lines, line, columns=columns, every_seconds=log_seconds)
