"""A training run's folder: checkpoint_{update}.pt, checkpoint_last.pt, checkpoint_best.pt, written
so that a crash at any point leaves a checkpoint to resume from (the file format: `model.file`), in
the background while training goes on (`Saver`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from nmt_cli import hooks
from nmt_cli.artifacts import fsync_dir
from nmt_cli.errors import NmtError
from nmt_cli.model.file import load, save

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
NUMBERED = re.compile(r"checkpoint_(\d+)\.pt")
# What an interrupted atomic write leaves in a save folder (artifacts.atomic_writer, _replace_with).
_TEMPORARIES = (".checkpoint_*.tmp", ".train.jsonl.*.tmp", ".config.yaml.*.tmp")


def numbered_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(update, path) of every checkpoint_{update}.pt in `save_dir`, oldest first."""
    found = []
    for path in Path(save_dir).glob("checkpoint_*.pt"):
        if match := NUMBERED.fullmatch(path.name):
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_training(save_dir: Path, update: int, state: dict[str, Any], best: bool, keep_last: int,
                  numbered: bool = True) -> Path:
    """Write checkpoint_{update}.pt, make checkpoint_last.pt and, when `best`, checkpoint_best.pt hard
    links to it, and delete all but the newest `keep_last` numbered checkpoints. With `numbered`
    False (a save for crash safety only, off the averaging cadence), write checkpoint_last.pt alone:
    `nmt average --last N` reads only numbered checkpoints, so such a save never enters an average.

    checkpoint_last.pt names the same file as the newest numbered checkpoint, so a save writes its
    bytes once. Damage to that file (a flipped bit, a truncation) shows under both names; `load_latest`
    then falls back to the newest intact numbered checkpoint before it, which keep_last >= 2 keeps: a
    resume loses one checkpoint interval. Deleting an old numbered name never deletes the file that
    checkpoint_last.pt or checkpoint_best.pt still name. Each name is swapped in by an atomic rename
    (a copy where the filesystem has no hard links), so a crash at any point leaves every name
    readable; `load_latest` then takes whichever intact file is newest.
    """
    save_dir = Path(save_dir)
    if not numbered:
        save(save_dir / LAST, state)
        if best:  # a hard link keeps this file's content when checkpoint_last.pt is next replaced
            _replace_with(save_dir / LAST, save_dir / BEST)
        return save_dir / LAST
    path = save_dir / f"checkpoint_{update}.pt"
    save(path, state)
    hooks.at("checkpoint_saved", path=path)  # tests: a crash before checkpoint_last.pt is
    link_last(path)
    if best:
        _replace_with(path, save_dir / BEST)
    for _, old in numbered_checkpoints(save_dir)[: -keep_last if keep_last > 0 else None]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def link_last(path: Path) -> None:
    """Make checkpoint_last.pt beside `path` name the same file (atomically): what a resume from a
    newer file than checkpoint_last.pt does, once at start-up (a crash between the two names left it
    behind)."""
    _replace_with(path, Path(path).with_name(LAST))


class Saver:
    """Writes training checkpoints in a background thread: the training thread only copies the state
    to CPU memory, then trains on (and the other ranks, which wait on rank 0, with it) while the copy
    is hashed and written by `save_training`. One write at a time: `submit` first waits for the one
    before. Used as a context manager around a run, it waits for the write in flight on every way out,
    so the run's end never leaves a checkpoint lost or half-written.
    """

    def __init__(self, info: Callable[[str], None], warn: Callable[[str], None]) -> None:
        self.info, self.warn = info, warn
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, save_dir: Path, update: int, state: dict[str, Any], best: bool, keep_last: int,
               numbered: bool = True) -> None:
        """Write `state` as `save_training` does, from a copy taken now: training may change its
        tensors as soon as this returns. Raises the error of the write before, if it failed."""
        self.wait()
        copy = _snapshot(state)
        self._thread = threading.Thread(target=self._write, name=f"checkpoint {update}",
                                        args=(save_dir, update, copy, best, keep_last, numbered))
        self._thread.start()

    def _write(self, save_dir: Path, update: int, state: dict[str, Any], best: bool, keep_last: int,
               numbered: bool) -> None:
        try:
            path = save_training(save_dir, update, state, best, keep_last, numbered)
        except BaseException as e:  # noqa: BLE001 (raised again by `wait`, in the training thread)
            self._error = e
            return
        self.info(f"saved {path}" + (" (best so far)" if best else ""))

    def wait(self) -> None:
        """Join the write in flight, if any, and raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if error is None:
            self.wait()
            return
        try:  # the error already on its way is the one to report; the write's own is logged beside it
            self.wait()
        except BaseException as write_error:  # noqa: BLE001
            self.warn(f"the checkpoint being written when training stopped was not saved either: "
                      f"{type(write_error).__name__}: {write_error}")


def _snapshot(obj: Any) -> Any:
    """`obj` with every tensor copied to CPU memory and every container rebuilt, so that training
    cannot change it. GPU tensors are copied into pinned memory without blocking, then waited for at
    once."""
    devices: set[torch.device] = set()
    copy = _copy_to_cpu(obj, devices)
    for device in devices:
        torch.cuda.synchronize(device)
    return copy


def _copy_to_cpu(obj: Any, devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            return obj.detach().to("cpu", copy=True)  # a clone on the CPU: never the live tensor
        devices.add(obj.device)
        return torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True).copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        return {key: _copy_to_cpu(value, devices) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_copy_to_cpu(item, devices) for item in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_to_cpu(item, devices) for item in obj)
    return obj


def relink_best(save_dir: Path, update: int) -> None:
    """Point checkpoint_best.pt at checkpoint_{update}.pt unless it already is: a crash between
    writing a best checkpoint and linking it would otherwise leave an older best in its place."""
    path = Path(save_dir) / f"checkpoint_{update}.pt"
    best = Path(save_dir) / BEST
    if path.is_file() and not (best.exists() and os.path.samefile(best, path)):
        _replace_with(path, best)


def _replace_with(source: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (some network or FAT filesystems): copy instead
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def remove_temporaries(save_dir: Path) -> list[Path]:
    """Delete what interrupted writes left behind (checkpoints, train.jsonl, config.yaml); returns
    what it removed."""
    removed = []
    for pattern in _TEMPORARIES:
        for tmp in Path(save_dir).glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def load_latest(save_dir: Path) -> tuple[Path, dict[str, Any], list[str]] | None:
    """The newest intact training checkpoint in `save_dir`: checkpoint_last.pt unless a numbered
    checkpoint is newer (a crash between writing the two) or it is damaged, then the numbered ones
    from the newest down, then checkpoint_best.pt. Returns (path, state, problems with the files
    skipped), or None for a folder without any checkpoint file. A folder whose checkpoints are all
    unreadable is an error, never a fresh start.
    """
    save_dir = Path(save_dir)
    problems: list[str] = []
    last = _load_training(save_dir / LAST, problems)
    last_update = last["train"]["update"] if last is not None else -1
    for update, path in reversed(numbered_checkpoints(save_dir)):
        if update <= last_update:
            break
        if (state := _load_training(path, problems)) is not None:
            return path, state, problems
    if last is not None:
        return save_dir / LAST, last, problems
    if (best := _load_training(save_dir / BEST, problems)) is not None:
        return save_dir / BEST, best, problems
    if problems or any(save_dir.glob("checkpoint*.pt")):
        raise NmtError(f"{save_dir} holds checkpoints but none can be resumed from: " + "; ".join(problems)
                       + ". Move the damaged files away (training then starts afresh) "
                         "or pass another --save-dir")
    return None


def _load_training(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The training checkpoint at `path`, or None (with the reason added to `problems`)."""
    if not path.exists():
        return None
    try:
        state = load(path)
    except NmtError as e:
        problems.append(str(e))
        return None
    if state.get("kind") != "checkpoint" or not isinstance(state.get("train"), dict):
        problems.append(f"{path} holds a model without training state")
        return None
    return state
