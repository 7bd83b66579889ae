"""Model files and training checkpoints: self-describing, checksummed, written atomically, loaded
without pickle code.

One format serves both kinds of file:

    {"format": "nmt/1", "kind": "checkpoint" | "model",
     "model": state_dict, "model_config": {...}, "dictionary": {"symbols": [...], "counts": [...]},
     "spm_model": bytes, "source_normalization": {...} or None (absent in files before it),
     "target_spm_model": bytes (only where the target side has its own sentencepiece model, as an
     imported MarianMT model's; absent: `spm_model` makes the pieces of both sides),
     "meta": {...}, "train": {...training state, checkpoints only...},
     "sha256": checksum of everything above}

so `translate` needs nothing but the file. Files are written with `torch.save` to a temporary file,
fsynced and renamed (a crash leaves the previous file intact), and read with
``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers: a file
cannot run code. The checksum covers every tensor's bytes, so a flipped bit is caught even where
the zip container would not notice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from nmt_cli import hooks
from nmt_cli.artifacts import atomic_writer
from nmt_cli.config.core import build
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.clean import Normalization
from nmt_cli.data.dataset import Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model.transformer import Transformer, build_model

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
        # the tensor's memory itself, not a copy of it; hashlib lets other threads run meanwhile
        digest.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
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
        hooks.at("file_written", path=path)  # tests: a crash before the rename


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
        raise NmtError(f"{path} is corrupt: its checksum does not match its contents "
                       "(damaged on disk or in copy)")
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
        and all(isinstance(s, str) for s in vocab["symbols"])
        and all(type(c) is int for c in vocab["counts"]),
        "spm_model": isinstance(state.get("spm_model"), bytes),
        "meta": isinstance(state.get("meta", {}), dict),
        "train": isinstance(state.get("train", {}), dict),
        "target_spm_model": isinstance(state.get("target_spm_model", b""), bytes),
        "source_normalization": state.get("source_normalization") is None
        or isinstance(state["source_normalization"], dict),  # its contents are resume.py's to check
    }
    damaged = [name for name, ok in parts.items() if not ok]
    if damaged:
        raise NmtError(f"{path} is not a usable nmt file: its {', '.join(damaged)} "
                       f"{'is' if len(damaged) == 1 else 'are'} missing or not what nmt writes "
                       "(was it written by another program or nmt version?)")


def _is_zip(path: Path) -> bool:
    try:
        return zipfile.is_zipfile(path)
    except Exception:  # noqa: BLE001 (zipfile raises BadZipFile for some damaged end records)
        return False


def model_state(model: torch.nn.Module, cfg: ModelConfig, dictionary: Dictionary,
                spm_model: bytes, source_normalization: dict[str, Any] | None = None,
                target_spm_model: bytes | None = None) -> dict[str, Any]:
    """The parts of a file that describe the model: what `translate` and `average` need
    (`source_normalization`: the record `nmt prepare` wrote, see `data.clean.Normalization`;
    `target_spm_model`: the target side's own sentencepiece model, if it has one)."""
    state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
             **model_description(cfg, dictionary, spm_model, source_normalization)}
    if target_spm_model is not None:
        state["target_spm_model"] = target_spm_model
    return state


def target_spm_of(state: dict[str, Any]) -> bytes:
    """The sentencepiece model that turns the file's output pieces into text: the target side's own,
    or the one model of both sides (every file nmt trains, and files written before the key)."""
    return bytes(state.get("target_spm_model", state["spm_model"]))


def model_description(cfg: ModelConfig, dictionary: Dictionary, spm_model: bytes,
                      source_normalization: dict[str, Any] | None = None) -> dict[str, Any]:
    """`model_state` but the weights: for a caller that copies them itself (a training checkpoint)."""
    return {
        "source_normalization": source_normalization,
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


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, Dictionary, bytes]:
    """(model in eval mode, dictionary, sentencepiece model bytes) from a checkpoint or model file."""
    model, dictionary, spm_model, _ = load_model_for_text(path, device)
    return model, dictionary, spm_model


def load_model_for_text(path: Path, device: str | torch.device = "cpu"
                        ) -> tuple[Transformer, Dictionary, bytes, Normalization | None]:
    """`load_model` and the normalisation of the source text the model was trained on (None: the
    file does not say, it was written before nmt recorded it)."""
    model, dictionary, spm_model, normalization, _ = load_text_model(path, device)
    return model, dictionary, spm_model, normalization


class TextModel(NamedTuple):
    """A model file loaded for text in and text out (`nmt translate`)."""

    model: Transformer  # in eval mode
    dictionary: Dictionary
    spm_model: bytes  # makes the source pieces
    normalization: Normalization | None  # of the source text, as in training (None: not recorded)
    target_spm_model: bytes  # turns output pieces into text (`target_spm_of`)


def load_text_model(path: Path, device: str | torch.device = "cpu") -> TextModel:
    state = load(path)
    normalization = Normalization.from_record(state.get("source_normalization"), str(path),
                                              "the file is damaged")
    cfg = model_config_of(state, path)
    dictionary = dictionary_of(state, path)
    model = build_model(cfg, dictionary, state["model"], str(path))
    return TextModel(model.to(device).eval(), dictionary, bytes(state["spm_model"]), normalization,
                     target_spm_of(state))
