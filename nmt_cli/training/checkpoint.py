"""Checkpoint and model files: self-describing, checksummed, written atomically, loaded without pickle code.

One format serves both kinds of file:

    {"format": "nmt/1", "kind": "checkpoint" | "model",
     "model": state_dict, "model_config": {...}, "dictionary": {"symbols": [...], "counts": [...]},
     "spm_model": bytes, "meta": {...}, "train": {...training state, checkpoints only...},
     "sha256": checksum of everything above}

so `translate` needs nothing but the file. Files are written with `torch.save` to a temporary file,
fsynced and renamed (a crash leaves the previous file intact), and read with
``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers: a file
cannot run code. The checksum covers every tensor's bytes, so a flipped bit is caught even where
the zip container would not notice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from nmt_cli.artifacts import atomic_writer, fsync_dir
from nmt_cli.config.core import build
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import Dictionary
from nmt_cli.errors import NmtError

FORMAT = "nmt/1"


def checksum(obj: Any) -> str:
    """sha256 over a nested structure of dicts, lists, tuples, tensors and scalars, in a fixed order."""
    digest = hashlib.sha256()
    _hash_into(digest, obj)
    return digest.hexdigest()


def _hash_into(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        digest.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=repr):
            _hash_into(digest, key)
            _hash_into(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for item in obj:
            _hash_into(digest, item)
    elif isinstance(obj, bytes):
        digest.update(b"B%d" % len(obj))
        digest.update(obj)
    else:
        digest.update(f"{type(obj).__name__}:{obj!r}".encode())


def save(path: Path, state: dict[str, Any]) -> None:
    """Write `state` (without "sha256") atomically, with its checksum."""
    state = {"format": FORMAT, **state}
    state["sha256"] = checksum(state)
    with atomic_writer(path) as f:
        torch.save(state, f)
        _pause_for_tests()


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint or model file; any problem is an NmtError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise NmtError(f"{path} does not exist or is not a file")
    try:
        open(path, "rb").close()
    except OSError as e:
        raise NmtError(f"cannot read {path}: {e.strerror or e}") from None
    if not _is_zip(path):  # else torch.load reads it as a legacy pickle and blames unsafe objects
        raise NmtError(f"{path} is not an nmt checkpoint or model file: it is not the zip archive torch.save "
                       "writes (corrupt, truncated, or another kind of file)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise NmtError(f"{path} was refused: it is corrupt, or it holds objects other than tensors and plain "
                       f"data, which could run code when loaded ({str(e).splitlines()[0]}). Only load files "
                       "written by nmt, or convert the file in a trusted environment.") from None
    except Exception as e:  # a damaged archive fails in many ways (KeyError, TypeError, ...): all are damage
        raise NmtError(f"{path} is truncated or corrupt and cannot be read "
                       f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise NmtError(f"{path} is not an nmt checkpoint or model file (no '{FORMAT}' format marker)")
    stored = state.pop("sha256", None)
    if stored != checksum(state):
        raise NmtError(f"{path} is corrupt: its checksum does not match its contents (damaged on disk or in copy)")
    _check_layout(state, path)
    return state


def _check_layout(state: dict[str, Any], path: Path) -> None:
    """Refuse a file with a valid checksum whose parts are not what nmt writes (made by another
    program or version), naming the parts, before anything fails deep inside torch."""
    model, vocab = state.get("model"), state.get("dictionary")
    parts = {
        "kind": state.get("kind") in ("checkpoint", "model"),
        "model": isinstance(model, dict) and bool(model)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()),
        "model_config": isinstance(state.get("model_config"), dict),
        "dictionary": isinstance(vocab, dict) and isinstance(vocab.get("symbols"), list)
        and isinstance(vocab.get("counts"), list) and len(vocab["symbols"]) == len(vocab["counts"])
        and all(isinstance(s, str) for s in vocab["symbols"]) and all(type(c) is int for c in vocab["counts"]),
        "spm_model": isinstance(state.get("spm_model"), bytes),
        "meta": isinstance(state.get("meta", {}), dict),
        "train": isinstance(state.get("train", {}), dict),  # its contents are resume.py's to check
    }
    damaged = [name for name, ok in parts.items() if not ok]
    if damaged:
        raise NmtError(f"{path} is not a usable nmt file: its {', '.join(damaged)} {'is' if len(damaged) == 1 else 'are'} "
                       "missing or not what nmt writes (was it written by another program or nmt version?)")


def _is_zip(path: Path) -> bool:
    try:
        return zipfile.is_zipfile(path)
    except Exception:  # noqa: BLE001 (zipfile raises BadZipFile for some damaged end records)
        return False


def model_state(model: torch.nn.Module, cfg: ModelConfig, dictionary: Dictionary, spm_model: bytes) -> dict[str, Any]:
    """The parts of a file that describe the model: what `translate` and `average` need."""
    return {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "model_config": dataclasses.asdict(cfg),
        "dictionary": {"symbols": list(dictionary.symbols), "counts": list(dictionary.counts)},
        "spm_model": spm_model,
    }


def model_config_of(state: dict[str, Any], path: Path) -> ModelConfig:
    """The file's model config, each field checked as a YAML value would be (a field it lacks, from
    an older version, takes its default)."""
    return build(ModelConfig, [(f"{path}: model_config", state["model_config"])])


def dictionary_of(state: dict[str, Any], path: Path) -> Dictionary:
    return Dictionary.checked(list(state["dictionary"]["symbols"]), list(state["dictionary"]["counts"]),
                              f"{path}: the dictionary", "the file is damaged", unit="entry")


def differing_fields(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the fields whose values differ, as 'name: A vs B'."""
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def load_model(path: Path, device: str | torch.device = "cpu"):
    """(model in eval mode, dictionary, sentencepiece model bytes) from a checkpoint or model file."""
    from nmt_cli.model.transformer import Transformer

    state = load(path)
    cfg = model_config_of(state, path)
    dictionary = dictionary_of(state, path)
    model = Transformer(cfg, len(dictionary))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise NmtError(f"{path}: the weights do not fit the stored model config ({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), dictionary, bytes(state["spm_model"])


def _pause_for_tests() -> None:
    """Sleep where a crash is most interesting, when the tests ask for it (NMT_TEST_SAVE_PAUSE_SECONDS):
    after a checkpoint's temporary file is written but before it is renamed into place, and after a
    numbered checkpoint is in place but before checkpoint_last.pt is. The tests kill the process there."""
    seconds = float(os.environ.get("NMT_TEST_SAVE_PAUSE_SECONDS", "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


# ---------------------------------------------------------------------------------------------
# A training run's folder: checkpoint_{update}.pt, checkpoint_last.pt, checkpoint_best.pt

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
_NUMBERED = re.compile(r"checkpoint_(\d+)\.pt")
# What an interrupted atomic write leaves in a save folder (artifacts.atomic_writer, _replace_with).
_TEMPORARIES = (".checkpoint_*.tmp", ".train.jsonl.*.tmp", ".config.yaml.*.tmp")


def numbered_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(update, path) of every checkpoint_{update}.pt in `save_dir`, oldest first."""
    found = []
    for path in Path(save_dir).glob("checkpoint_*.pt"):
        if match := _NUMBERED.fullmatch(path.name):
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_training(save_dir: Path, update: int, state: dict[str, Any], best: bool, keep_last: int) -> Path:
    """Write checkpoint_{update}.pt, then checkpoint_last.pt as a second, independent copy of it,
    point checkpoint_best.pt at it when `best`, and delete all but the newest `keep_last` numbered
    checkpoints.

    checkpoint_last.pt is a copy, not a link: damage to one file (a flipped bit on disk, a file
    truncated by hand or by a full disk) then leaves the other intact, and a resume loses nothing.
    A link would share the damage and cost a checkpoint interval. checkpoint_best.pt is a hard link
    (a copy where the filesystem has none): a name for `translate`, never what a resume needs.
    Each name is swapped in by an atomic rename, so a crash at any point leaves every name readable;
    `load_latest` then takes whichever intact file is newest.
    """
    save_dir = Path(save_dir)
    path = save_dir / f"checkpoint_{update}.pt"
    save(path, state)
    _pause_for_tests()  # the numbered file is in place, checkpoint_last.pt not yet
    copy_to_last(path)
    if best:
        _replace_with(path, save_dir / BEST)
    for _, old in numbered_checkpoints(save_dir)[: -keep_last if keep_last > 0 else None]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def copy_to_last(path: Path) -> None:
    """Make checkpoint_last.pt beside `path` a copy of it (atomically). Also what a resume from a
    newer file than checkpoint_last.pt does: a crash between the two writes left it behind."""
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
                       + ". Move the damaged files away (training then starts afresh) or pass another --save-dir")
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
