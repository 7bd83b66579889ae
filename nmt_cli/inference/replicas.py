"""Copies of a compiled model in worker processes, each searching its own batches on one CPU thread.

A decoder compiled with torch.compile runs best as one search per core, each on one thread, like
the eager decoder's one batch per thread (`translate_ids`). But dynamo, which runs a compiled
function, is not thread-safe, so such searches cannot share a process: each of `count` processes
(started with "spawn", not "fork", which is unsafe after torch has started threads) loads the model
file itself, compiles its decoder on one thread and then searches whatever batch it is sent (faster
than one compiled search on all threads: `benchmarks/translate_speed.py --compile`, figures in
benchmarks/README.md). Each process holds its own copy of the weights.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import multiprocessing.util
import os
import signal
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt_cli.config.inference import TranslateConfig
from nmt_cli.inference.search import Hypothesis, Penalty, beam_search, compile_decoder
from nmt_cli.model import file as model_file
from nmt_cli.model.cpu import keep_freed_memory

# seconds the processes wait for each other to start and compile: a cold compile takes ~1 min
_STARTED = 30 * 60

# The one replica of the process this module runs in (a worker): set by `_start`.
_replica: dict[str, Any] = {}


class CompileFailed(RuntimeError):
    """A worker process could not compile its decoder; the message says why."""


def describe(e: BaseException) -> str:
    """Why compiling failed, in one line: the exception's type and the first line of its message."""
    if isinstance(e, CompileFailed):
        return str(e)
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


class Replicas:
    """`count` worker processes, each with the model of `cfg.model` in `dtype`, its decoder compiled
    for `cfg.beam`. Returns once every process has compiled; a process that could not compile makes
    this raise CompileFailed with its reason. Close it (or use it as a context manager) when done."""

    def __init__(self, cfg: TranslateConfig, dtype: torch.dtype, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        started = context.Barrier(count, timeout=_STARTED)
        self.count = count
        self._pool = ProcessPoolExecutor(count, context, initializer=_start, initargs=(cfg, dtype, started))
        try:
            # One call per process: each waits at the barrier until all `count` have compiled, so no
            # process can take two of them, and every process is started now rather than on demand.
            failures = [f.result() for f in [self._pool.submit(_compiled) for _ in range(count)]]
        except BaseException:  # Ctrl-C included: stop the processes now, not after they have compiled
            processes = self.processes()
            for process in processes:
                process.terminate()
            for process in processes:
                process.join()
            self.close()
            raise
        if any(failures):
            self.close()
            raise CompileFailed(next(f for f in failures if f))

    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The worker processes (the pool has no public way to reach them before Python 3.14)."""
        return list(getattr(self._pool, "_processes", {}).values())

    def submit(self, src: Tensor) -> Future[list[list[Hypothesis]]]:
        """Beam search (as `beam_search`, with the settings of cfg) of one batch, src (B, S), in a worker."""
        return self._pool.submit(_search, src)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start(cfg: TranslateConfig, dtype: torch.dtype, started: Any) -> None:
    """In a new worker process: load and compile the model, keeping any failure for `_compiled` to report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    signal.signal(signal.SIGTERM, _exit)  # how `Replicas` stops a worker before it has compiled
    # When the pool lets this process go, its results are sent: end it after multiprocessing's own
    # finalizers, skipping the interpreter's teardown of torch and the compiler (2 s, which `nmt
    # translate` waited for before exiting). Priority -100: after every other finalizer.
    multiprocessing.util.Finalize(None, _done, exitpriority=-100)
    torch.set_num_threads(1)
    keep_freed_memory()
    _replica.update(cfg=cfg, started=started, failure="")
    try:
        model, _, _ = model_file.load_model(Path(cfg.model[0]), torch.device("cpu"))
        model = model.to(dtype)
        compile_decoder(model, cfg.beam)
        _replica["model"] = model
    except Exception as e:  # torch.compile fails in many ways (no compiler, an unsupported platform)
        _replica["failure"] = describe(e)


def _exit(signum: int, frame: object) -> None:
    """Exit at once, but first free what this process made that outlives it (tqdm, imported by
    torch, makes a named semaphore; left behind, Python warns of it as leaked)."""
    multiprocessing.util._run_finalizers(0)
    os._exit(128 + signum)


def _done() -> None:
    """End this worker now, its work done (see `_start`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _compiled() -> str:
    """The reason this worker could not compile ('' if it could), once every worker has got this far."""
    _replica["started"].wait()
    return _replica["failure"]


def _search(src: Tensor) -> list[list[Hypothesis]]:
    cfg: TranslateConfig = _replica["cfg"]
    return beam_search(_replica["model"], src, beam=cfg.beam, nbest=cfg.nbest,
                       lenpen=Penalty(cfg.lenpen, cfg.length_penalty), max_len_a=cfg.max_len_a,
                       max_len_b=cfg.max_len_b, style=cfg.beam_style, stop=cfg.stop)
