"""The test suite's side of `nmt_cli.hooks` (conftest.py points NMT_TEST_HOOKS here for every
process the tests start). Each hook does nothing unless a test asks for it by an environment variable:

- ``NMT_TEST_FAULTS``: space-separated faults ``KIND@A[-B][.M][/R]``: on update attempts A..B,
  micro-batch M (from 1; any when left out), rank R (every rank when left out). KIND is ``loss``
  (the loss becomes NaN, its gradient stays finite), ``grad`` (after the gradient all-reduce, one
  value of the gradient of the model's last parameter becomes +inf on that rank only), ``oom`` (a
  torch.OutOfMemoryError after the micro-batch's forward) or ``oom-backward`` (after its backward).
- ``NMT_TEST_PID_DIR``: each training process writes its process id to ``rank{R}.restart{N}.pid`` there.
- ``NMT_TEST_SAVE_PAUSE_SECONDS``: sleep where a crash is most interesting: after a checkpoint's
  temporary file is written but before it is renamed into place, and after a numbered checkpoint
  is in place but before checkpoint_last.pt is. The tests kill the process there.
- ``NMT_TEST_EXAMPLE_LOG``: a folder; each rank appends "EPOCH UPDATE IDS..." for every micro-batch
  it trained to ``examples.rank{R}.txt`` there.

This file is loaded by path in processes that never import the tests' conftest: it imports only
torch and the standard library.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

import torch

_FAULT = re.compile(r"(loss|grad|oom|oom-backward)@(\d+)(?:-(\d+))?(?:\.(\d+))?(?:/(\d+))?")


@dataclasses.dataclass
class Faults:
    """The faults NMT_TEST_FAULTS asks of one rank."""

    entries: list[tuple[str, range, int | None]]  # (kind, attempts, micro-batch or None for any)

    @classmethod
    def from_env(cls, rank: int) -> Faults:
        entries = []
        for item in os.environ.get("NMT_TEST_FAULTS", "").split():
            match = _FAULT.fullmatch(item)
            assert match, f"NMT_TEST_FAULTS: {item!r} is not KIND@A[-B][.M][/R]"
            kind, first, last, micro, on_rank = match.groups()
            if on_rank is None or int(on_rank) == rank:
                entries.append((kind, range(int(first), int(last or first) + 1),
                                int(micro) if micro else None))
        return cls(entries)

    def wanted(self, kind: str, attempt: int, micro: int | None = None) -> bool:
        return any(k == kind and attempt in a and m in (None, micro) for k, a, m in self.entries)


def forward_done(attempt: int, micro: int, rank: int, loss: torch.Tensor) -> torch.Tensor | None:
    faults = Faults.from_env(rank)
    if faults.wanted("oom", attempt, micro):
        raise torch.OutOfMemoryError(f"NMT_TEST_FAULTS: out of memory after the forward of micro-batch "
                                     f"{micro} of update attempt {attempt}")
    return loss + float("nan") if faults.wanted("loss", attempt) else None


def backward_done(attempt: int, micro: int, rank: int) -> None:
    if Faults.from_env(rank).wanted("oom-backward", attempt, micro):
        raise torch.OutOfMemoryError(f"NMT_TEST_FAULTS: out of memory after the backward of micro-batch "
                                     f"{micro} of update attempt {attempt}")


def gradients_reduced(attempt: int, rank: int, model: torch.nn.Module) -> None:
    if Faults.from_env(rank).wanted("grad", attempt):
        with torch.no_grad():
            [p for p in model.parameters() if p.grad is not None][-1].grad.view(-1)[0] = float("inf")


def worker_started(rank: int) -> None:
    if folder := os.environ.get("NMT_TEST_PID_DIR"):
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        (Path(folder) / f"rank{rank}.restart{restart}.pid").write_text(str(os.getpid()))


def examples_trained(rank: int, epoch: int, update: int, ids: list[int]) -> None:
    if folder := os.environ.get("NMT_TEST_EXAMPLE_LOG"):
        with open(Path(folder) / f"examples.rank{rank}.txt", "a") as f:
            f.write(f"{epoch} {update} {' '.join(map(str, ids))}\n")


def _pause() -> None:
    seconds = float(os.environ.get("NMT_TEST_SAVE_PAUSE_SECONDS", "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


def file_written(path: Path) -> None:
    _pause()


def checkpoint_saved(path: Path) -> None:
    _pause()
