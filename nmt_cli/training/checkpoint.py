"""A training run's folder: checkpoint_{update}.pt, checkpoint_last.pt, checkpoint_best.pt, written
so that a crash at any point leaves a checkpoint to resume from (the file format: `model.file`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Any

from nmt_cli import hooks
from nmt_cli.artifacts import atomic_writer, fsync_dir
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
    _replace_with(path, save_dir / LAST)
    if best:
        _replace_with(path, save_dir / BEST)
    for _, old in numbered_checkpoints(save_dir)[: -keep_last if keep_last > 0 else None]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def copy_to_last(path: Path) -> None:
    """Make checkpoint_last.pt beside `path` a copy of it (atomically): what a resume from a newer
    file than checkpoint_last.pt does, once at start-up (a crash between the two names left it behind)."""
    with open(path, "rb") as source, atomic_writer(Path(path).with_name(LAST)) as target:
        shutil.copyfileobj(source, target, 1 << 24)


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
