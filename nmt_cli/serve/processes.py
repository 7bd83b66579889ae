"""A search thread's running search in a process of its own, stepped from the thread one step at a time.

Why: the search's Python (the search's bookkeeping and torch's dispatch of each small operation of a
step) holds the interpreter lock for most of a step, and the server's HTTP side needs it too. With its
search threads in the server's process, the whole server got no more than about one core's worth of
work done at 64 clients (one search thread: 6.5 s of CPU in 6.5 s of wall time on a 2-core machine),
where `nmt translate`'s large batches keep both cores busy (benchmarks/README.md, "Serving"). A
process of its own per search thread gives each its own interpreter lock.

Each `SearchProcess` loads the served model as `nmt translate` does (the same file, the dtype the
server's own translator runs in, one torch thread), translates a first sentence, and then answers
the search thread's messages: start a search with these settings; these sentences join, take a step,
and send back the n-best (as texts) of the sentences it settles. The search thread keeps deciding who
joins (serve/batcher.py); the process only searches. The process ends when its pipe closes (the server
stopped); it ignores SIGINT and SIGTERM, which are the server's to handle
(draining waits for the searches in flight). A process that dies (killed, out of memory) fails the
requests it was searching (the search thread's `_fail`), and the next search starts another.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from nmt_cli.config.inference import TranslateConfig
from nmt_cli.errors import NmtError

Settled = list[tuple[int, list[tuple[float, str]]]]  # (key, n-best (score, text)) of each settled sentence


class SearchFailed(RuntimeError):
    """The search process failed a step (its traceback is the message) or stopped."""


class SearchProcess:
    """One worker process searching for one search thread (see the module docstring). `cfg`: the
    served model's translation settings; `dtype`: the precision the server's translator decided on."""

    def __init__(self, cfg: TranslateConfig, dtype: str, name: str) -> None:
        self.cfg, self.name = dataclasses.replace(cfg, threads=1, dtype=dtype), name
        self._context = multiprocessing.get_context("spawn")  # not fork: torch has started threads
        self.process: multiprocessing.process.BaseProcess | None = None
        self._spawn()

    def _spawn(self) -> None:
        parent, child = self._context.Pipe()
        self.process = self._context.Process(target=_main, args=(self.cfg, child), name=self.name,
                                             daemon=True)
        self.process.start()
        child.close()
        self.conn = parent

    def ready(self) -> None:
        """Wait until the process has loaded the model and translated a first sentence (several start
        at once: spawn them all, then wait for each); NmtError if it could not."""
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            kind, detail = "failed", f"it stopped (exit code {self.process.exitcode})"
        if kind != "ready":
            self.close()
            raise NmtError(f"nmt serve: the search process {self.name} could not start: {detail}")

    def running(self, beam: int, nbest: int) -> RemoteSearch:
        """A new running search with these settings (a new process first if the last one died)."""
        if self.process is None or not self.process.is_alive():
            print(f"serve: search process {self.name} stopped (exit code "
                  f"{None if self.process is None else self.process.exitcode}); starting another",
                  file=sys.stderr, flush=True)
            self.close()
            self._spawn()
            self.ready()
        return RemoteSearch(self, beam, nbest)

    def call(self, message: tuple[Any, ...]) -> Any:
        """Send `message`, return the answer; SearchFailed if the process failed it or is gone."""
        try:
            self.conn.send(message)
            kind, answer = self.conn.recv()
        except (EOFError, OSError) as e:  # BrokenPipeError is an OSError
            raise SearchFailed(f"the search process {self.name} stopped ({type(e).__name__})") from None
        if kind == "error":
            raise SearchFailed(f"the search process {self.name} failed:\n{answer}")
        return answer

    def close(self) -> None:
        if self.process is not None:
            self.conn.close()  # the process sees its pipe close and ends
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.process = None


class RemoteSearch:
    """`translate.RunningSearch`'s interface over a `SearchProcess`: `join` is sent with the next
    `step`, one message and one answer a step."""

    def __init__(self, process: SearchProcess, beam: int, nbest: int) -> None:
        self.process, self.joining, self.count = process, [], 0
        process.call(("search", beam, nbest))

    def __len__(self) -> int:
        return self.count

    def join(self, keys: Sequence[int], sources: Sequence[Sequence[int]]) -> None:
        self.joining += zip(keys, sources, strict=True)
        self.count += len(keys)

    def step(self) -> Settled:
        joining, self.joining = self.joining, []
        settled = self.process.call(("step", joining))
        self.count -= len(settled)
        return settled


def _main(cfg: TranslateConfig, conn: multiprocessing.connection.Connection) -> None:
    """The worker: load, translate a first sentence, then answer until the pipe closes."""
    from nmt_cli.inference.translate import load_translator

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        translator = load_translator(cfg, lambda message: None)  # the server's own load has warned
        translator.translate(["Hello."])
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    search = None
    with translator.keeping_packed_weights(), torch.inference_mode():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if message[0] == "search":
                    search = translator.searching(message[1], message[2]).running()
                    answer = None
                else:
                    joining = message[1]
                    if joining:
                        search.join([key for key, _ in joining], [ids for _, ids in joining])
                    answer = search.step() if len(search) else []
            except Exception:
                search = None
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", answer))
