"""Every `nmt` command against hostile input (made by `hostile.py`): each case ends in a clear message
and exit status 2, or in a correct result; never in a traceback, and never in a half-written output
that the next stage would accept.

How the cases run (a CLI call costs ~1 s of start-up, torch ~1 s more):
- `test_hostile_input` runs every case in this process through Typer's CliRunner on the real `nmt`
  app: the same argument parsing, config resolution and `cli._run` error printing and exit status as
  the command line, without a new Python per case.
- `test_hostile_input_through_the_real_cli` runs a representative case of every command through the
  real command line (`python -m nmt_cli`, conftest's `nmt`): see `REAL_CLI`.
- Outputs: before each case the output location holds the result of an earlier good run. After a
  failure, an output folder must have no manifest.json or be exactly as before, and an output file
  (model, translation, scores) must be absent or exactly as before.
- The working pipeline is small and generated (no shared data needed): `nmt prepare local` of toy
  sentences, a 60-piece sentencepiece model, a 1+1-layer model trained for 2 updates and averaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hostile import (
    damage_folder,
    lines_of,
    model_files,
    plain_lines,
    replace_text,
    text_files,
    yaml_files,
)
from typer.testing import CliRunner

from conftest import assert_user_error, nmt, toy_sentences
from nmt_cli.artifacts import read_manifest
from nmt_cli.cli import app

SRC, TGT = "en", "de"
TINY = ["--arch", "transformer_tiny", "--set", "model.d_model=32", "--set", "model.heads=2", "--set",
        "model.d_ff=64", "--set", "model.encoder_layers=1", "--set", "model.decoder_layers=1", "--set",
        "model.max_positions=64", "--max-tokens", 256, "--tokens-per-update", 256,
        "--save-interval-minutes", 0, "--set", "valid.interval_updates=0", "--set", "threads=1"]


def invoke(*args: object) -> tuple[int, str]:
    """(exit status, stdout+stderr) of `nmt ARGS` run in this process; a traceback fails the test."""
    threads = torch.get_num_threads()  # translate sets one thread per search worker
    try:
        result = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        trace = "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"nmt {' '.join(map(str, args))} raised:\n{result.output}\n{trace}")
    return result.exit_code, result.output


def ok(*args: object) -> str:
    code, output = invoke(*args)
    assert code == 0, f"nmt {' '.join(map(str, args))} failed ({code}):\n{output}"
    return output


@dataclass
class World:
    """Good outputs of every stage, and hostile inputs, shared by the cases."""

    folder: Path
    texts: dict[str, Path]
    good_train: tuple[bytes, bytes]  # the clean training text (source, target)
    raw: Path
    bpe: Path
    bin: Path
    checkpoints: Path
    model: Path
    models: dict[str, Path]
    marker: Path  # created if a hostile pickle ever runs code

    def yaml(self, command: str, number_field: str | None, path_field: str) -> dict[str, Path]:
        return yaml_files(self.folder / "yaml" / command, number_field, path_field)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    folder = tmp_path_factory.mktemp("hostile")
    data = folder / "data"
    data.mkdir()
    for split, count, seed in (("train", 300, 1), ("valid", 20, 2)):
        text = "\n".join(toy_sentences(count, seed)) + "\n"
        (data / f"{split}.{SRC}").write_text(text)
        (data / f"{split}.{TGT}").write_text(text.upper())
    raw, bpe, binarized, checkpoints = (folder / name for name in ("raw", "bpe", "bin", "checkpoints"))
    ok("prepare", "local", "-s", SRC, "-t", TGT, "--train", data / "train", "--valid", data / "valid",
       "--out", raw, "--workers", 1)
    ok("bpe", raw, "--out", bpe, "--vocab-size", 60, "--workers", 1)
    ok("binarize", bpe, "--out", binarized, "--workers", 1)
    ok("train", binarized, "--save-dir", checkpoints, *TINY, "--max-update", 2, "--save-interval-updates", 1)
    ok("average", checkpoints, "--last", 2, "--out", folder / "model.pt")
    marker = folder / "pickle-ran-code"
    return World(folder, text_files(folder / "texts"), ((raw / f"train.{SRC}").read_bytes(),
                 (raw / f"train.{TGT}").read_bytes()), raw, bpe, binarized, checkpoints, folder / "model.pt",
                 model_files(folder / "model.pt", folder / "models", marker), marker)


# ---------------------------------------------------------------------------------------------
# The cases


Build = Callable[[World, Path], tuple[list[object], Path | None]]  # -> (arguments, output location)
Check = Callable[[World, Path | None, str], None]  # (world, output, printed text) of a success


@dataclass(frozen=True)
class Case:
    command: str
    fault: str
    build: Build
    needles: tuple[str, ...] = ()  # an error is expected, and these are in its message
    check: Check | None = None  # a success is expected, and this checks its result

    @property
    def id(self) -> str:
        return f"{self.command}/{self.fault}"


CASES: list[Case] = []


def refused(command: str, fault: str, build: Build, *needles: str) -> None:
    CASES.append(Case(command, fault, build, needles=needles or ("error",)))


def works(command: str, fault: str, build: Build, check: Check) -> None:
    CASES.append(Case(command, fault, build, check=check))


def write_pair(folder: Path, src: bytes, tgt: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"c.{SRC}").write_bytes(src)
    (folder / f"c.{TGT}").write_bytes(tgt)
    return folder / "c"


def a_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("not a folder\n")
    return tmp / "a_file"


YAML_MESSAGES = {
    "a_list": "must hold a mapping", "unknown_key": "unknown option 'no_such_option'",
    "key_not_a_word": "option names are words", "broken_yaml": "not valid YAML",
    "invalid_utf8": "cannot read config", "path_given_a_mapping": "must be a path",
    "a_folder": "cannot read config", "wrong_type": "must be a whole number",
    "nan": "must be a whole number", "out_of_range": "must be at least",
}


def yaml_cases(command: str, number_field: str | None, path_field: str, args: Build) -> None:
    """Every hostile config file given with --config to an otherwise good command."""
    for name, message in YAML_MESSAGES.items():
        if number_field is None and name in ("wrong_type", "nan", "out_of_range"):
            continue

        def build(w: World, tmp: Path, name: str = name) -> tuple[list[object], Path | None]:
            arguments, out = args(w, tmp)
            return [*arguments, "--config", w.yaml(command, number_field, path_field)[name]], out
        refused(command, f"config_{name}", build, message)


# -- prepare local --------------------------------------------------------------------------------


def prepare_args(w: World, tmp: Path, prefix: Path, out: Path | None = None) -> tuple[list[object], Path]:
    out = out or tmp / "raw"
    return ["prepare", "local", "-s", SRC, "-t", TGT, "--train", prefix, "--valid", w.raw / "valid",
            "--out", out, "--workers", 1], out


def prepare_text(fault: str) -> Build:
    def build(w: World, tmp: Path) -> tuple[list[object], Path]:
        data = w.texts[fault].read_bytes()
        good_src, good_tgt = w.good_train if fault != "empty" else (b"", b"")
        prefix = write_pair(tmp / "in", good_src + data, good_tgt + plain_lines(lines_of(data)))
        return prepare_args(w, tmp, prefix)
    return build


def prepare_contract(w: World, out: Path | None, printed: str) -> None:
    """What `nmt bpe` relies on: every split's files have the manifest's line count, LF only."""
    manifest = read_manifest(out, "prepare", "nmt prepare")
    for split, info in manifest["splits"].items():
        for lang in (SRC, TGT):
            text = (out / f"{split}.{lang}").read_bytes()
            assert (text.count(b"\n") == info["lines"] and b"\r" not in text
                    and (not text or text.endswith(b"\n")))


refused("prepare", "empty", prepare_text("empty"), "empty")
refused("prepare", "invalid_utf8", prepare_text("invalid_utf8"), "c.en, line 302: invalid UTF-8")
refused("prepare", "nul", prepare_text("nul"), "c.en, line 301: a NUL byte")
for fault in ("huge_line", "crlf", "lone_cr", "blank_lines", "long_line", "no_final_newline"):
    works("prepare", fault, prepare_text(fault), prepare_contract)
refused("prepare", "mismatched_lines", lambda w, tmp: prepare_args(w, tmp, write_pair(
    tmp / "in", w.good_train[0] + b"one more\n", w.good_train[1])), "has 301 lines but", "has 300")
def source_is_a_folder(w: World, tmp: Path) -> tuple[list[object], Path]:
    prefix = write_pair(tmp / "in", *w.good_train)
    Path(f"{prefix}.{SRC}").unlink()
    Path(f"{prefix}.{SRC}").mkdir()
    return prepare_args(w, tmp, prefix)


refused("prepare", "file_is_a_folder", source_is_a_folder, "c.en not found")
refused("prepare", "missing_file", lambda w, tmp: prepare_args(w, tmp, tmp / "nothing"),
        "nothing.en", "not found")
refused("prepare", "out_is_a_file", lambda w, tmp: prepare_args(w, tmp, w.raw / "train", a_file(tmp)),
        "is a file")
refused("prepare", "out_below_a_file",
        lambda w, tmp: prepare_args(w, tmp, w.raw / "train", a_file(tmp) / "raw"),
        "a_file", "Not a directory")
yaml_cases("prepare", "workers", "out", lambda w, tmp: prepare_args(w, tmp, w.raw / "train"))


# -- bpe ------------------------------------------------------------------------------------------


def bpe_args(source: Path, tmp: Path, *extra: object, out: Path | None = None) -> tuple[list[object], Path]:
    out = out or tmp / "bpe"
    return ["bpe", source, "--out", out, "--vocab-size", 60, "--workers", 1, *extra], out


def damaged(good: Callable[[World], Path], damage: str,
            args: Callable[[Path, Path], tuple[list[object], Path]]) -> Build:
    return lambda w, tmp: args(damage_folder(good(w), tmp / "damaged", damage), tmp)


def hostile_text(good: Callable[[World], Path], fault: str,
                 args: Callable[[Path, Path], tuple[list[object], Path]], good_lines: bool = True) -> Build:
    """The input folder of a stage, as its stage would have written it from hostile text."""
    def build(w: World, tmp: Path) -> tuple[list[object], Path]:
        folder = good(w)
        data = w.texts[fault].read_bytes()
        src, tgt = (folder / f"train.{SRC}").read_bytes(), (folder / f"train.{TGT}").read_bytes()
        if not good_lines:
            src, tgt = b"", b""
        return args(replace_text(folder, tmp / "input", src + data, tgt + plain_lines(lines_of(data))), tmp)
    return build


def same_lines_as_input(stage: str, key: str) -> Check:
    """The output manifest's per-split count equals the input's, and the files agree with it."""
    def check(w: World, out: Path | None, printed: str) -> None:
        manifest = read_manifest(out, stage, f"nmt {stage}")
        upstream = read_manifest(Path(manifest["inputs"][next(iter(manifest["inputs"]))]["folder"]),
                                 {"bpe": "prepare", "binarize": "bpe"}[stage], "")
        for split, info in manifest["splits"].items():
            assert info[key] == upstream["splits"][split]["lines"]
            if stage == "bpe":
                for lang in (SRC, TGT):
                    assert (out / f"{split}.{lang}").read_bytes().count(b"\n") == info[key]
    return check


FOLDER_MESSAGES = {
    "no_manifest": "has no manifest.json", "manifest_not_json": "is corrupt",
    "manifest_a_list": "written by `nmt None`",
    "manifest_of_another_stage": "written by `nmt score`", "manifest_bad_layout": "layout nmt writes",
    "manifest_escaping_split": "split '../../escaped'",
    "manifest_escaping_language": "two different languages",
    "manifest_without_languages": "two different languages", "output_truncated": "changed or truncated",
    "bin_truncated": "points to", "idx_points_past_bin": "points to 1000000000 tokens",
    "idx_bad_header": "not an nmt index file", "idx_offsets_out_of_order": "offsets out of order",
    "ids_beyond_dictionary": "token ids beyond", "dict_duplicate_symbol": "already appears on line",
    "bin_is_a_folder": "not a file", "spm_garbage": "not a sentencepiece model",
    "spm_garbage_unsealed": "sha256",
}
for damage in ("no_manifest", "manifest_not_json", "manifest_a_list", "manifest_of_another_stage",
               "manifest_bad_layout", "manifest_escaping_split", "manifest_escaping_language",
               "output_truncated"):
    refused("bpe", damage, damaged(lambda w: w.raw, damage, bpe_args), FOLDER_MESSAGES[damage])
refused("bpe", "input_of_another_stage", lambda w, tmp: bpe_args(w.bpe, tmp), "written by `nmt bpe`")
refused("bpe", "invalid_utf8", hostile_text(lambda w: w.raw, "invalid_utf8", bpe_args),
        "line 302: invalid UTF-8")
refused("bpe", "empty", hostile_text(lambda w: w.raw, "empty", bpe_args, good_lines=False),
        "no text to train on")
for fault in ("huge_line", "nul", "crlf", "lone_cr", "blank_lines", "no_final_newline"):
    works("bpe", fault, hostile_text(lambda w: w.raw, fault, bpe_args), same_lines_as_input("bpe", "lines"))
refused("bpe", "model_garbage", lambda w, tmp: bpe_args(w.raw, tmp, "--model", w.models["garbage"]),
        "not a sentencepiece model")
refused("bpe", "model_is_a_folder", lambda w, tmp: bpe_args(w.raw, tmp, "--model", tmp), "Is a directory")
refused("bpe", "model_missing", lambda w, tmp: bpe_args(w.raw, tmp, "--model", tmp / "nothing"),
        "does not exist")
refused("bpe", "input_is_a_file", lambda w, tmp: bpe_args(a_file(tmp), tmp), "not a folder")
refused("bpe", "out_is_a_file", lambda w, tmp: bpe_args(w.raw, tmp, out=a_file(tmp)), "is a file")
yaml_cases("bpe", "vocab_size", "out", lambda w, tmp: bpe_args(w.raw, tmp))


# -- binarize -------------------------------------------------------------------------------------


def binarize_args(source: Path, tmp: Path, *extra: object,
                  out: Path | None = None) -> tuple[list[object], Path]:
    out = out or tmp / "bin"
    return ["binarize", source, "--out", out, "--workers", 1, *extra], out


def dictionary(content: bytes | None) -> Build:
    def build(w: World, tmp: Path) -> tuple[list[object], Path]:
        path = tmp / "dict.txt"
        if content is None:
            path.mkdir()
        else:
            good = (w.bin / "dict.txt").read_bytes()
            path.write_bytes(good + good.splitlines(keepends=True)[6] if content == b"duplicate" else content)
        return binarize_args(w.bpe, tmp, "--dictionary", path)
    return build


for damage in ("no_manifest", "manifest_not_json", "manifest_of_another_stage", "manifest_bad_layout",
               "manifest_escaping_split", "output_truncated", "spm_garbage", "spm_garbage_unsealed"):
    refused("binarize", damage, damaged(lambda w: w.bpe, damage, binarize_args), FOLDER_MESSAGES[damage])
refused("binarize", "input_of_another_stage", lambda w, tmp: binarize_args(w.raw, tmp),
        "written by `nmt prepare`")
refused("binarize", "dictionary_duplicate_symbol", dictionary(b"duplicate"), "already appears on line")
refused("binarize", "dictionary_empty", dictionary(b""), "special symbols")
refused("binarize", "dictionary_invalid_utf8", dictionary(b"<pad> 0\n<s> 0\n</s> 0\n<unk> 0\n\xff 1\n"),
        "invalid UTF-8")
refused("binarize", "dictionary_is_a_folder", dictionary(None), "is a folder, not a file")
refused("binarize", "dictionary_missing",
        lambda w, tmp: binarize_args(w.bpe, tmp, "--dictionary", tmp / "no"), "does not exist")
refused("binarize", "invalid_utf8", hostile_text(lambda w: w.bpe, "invalid_utf8", binarize_args), "not UTF-8")
for fault in ("huge_line", "nul", "lone_cr", "blank_lines", "no_final_newline"):
    works("binarize", fault, hostile_text(lambda w: w.bpe, fault, binarize_args),
          same_lines_as_input("binarize", "sentences"))
refused("binarize", "out_is_a_file", lambda w, tmp: binarize_args(w.bpe, tmp, out=a_file(tmp)), "is a file")
yaml_cases("binarize", "workers", "out", lambda w, tmp: binarize_args(w.bpe, tmp))


# -- train ----------------------------------------------------------------------------------------


def train_args(data: Path, tmp: Path, dry_run: bool = True,
               save_dir: Path | None = None) -> tuple[list[object], Path]:
    save_dir = save_dir or tmp / "checkpoints"
    return ["train", data, "--save-dir", save_dir, *TINY, "--max-update", 3,
            *(["--dry-run"] if dry_run else [])], save_dir


def save_dir_holding(model: str) -> Build:
    """A --save-dir whose only checkpoint_last.pt is a hostile file: training must not start afresh."""
    def build(w: World, tmp: Path) -> tuple[list[object], Path]:
        (tmp / "checkpoints").mkdir()
        source = w.models[model]
        target = tmp / "checkpoints" / "checkpoint_last.pt"
        shutil.copytree(source, target) if source.is_dir() else shutil.copyfile(source, target)
        return train_args(w.bin, tmp, dry_run=False)
    return build


def train_on_huge_line(w: World, tmp: Path) -> tuple[list[object], Path]:
    args, bin_folder = hostile_text(lambda w: w.bpe, "huge_line", binarize_args)(w, tmp)
    ok(*args)
    return train_args(bin_folder, tmp)


for damage in ("no_manifest", "manifest_not_json", "manifest_of_another_stage", "manifest_bad_layout",
               "manifest_escaping_language", "manifest_without_languages", "output_truncated",
               "bin_truncated", "idx_points_past_bin", "idx_bad_header", "idx_offsets_out_of_order",
               "ids_beyond_dictionary", "dict_duplicate_symbol", "bin_is_a_folder", "spm_garbage",
               "spm_garbage_unsealed"):
    refused("train", damage, damaged(lambda w: w.bin, damage, train_args), FOLDER_MESSAGES[damage])
refused("train", "input_of_another_stage", lambda w, tmp: train_args(w.bpe, tmp), "written by `nmt bpe`")
refused("train", "save_dir_is_a_file", lambda w, tmp: train_args(w.bin, tmp, False, a_file(tmp)),
        "a_file", "File exists")
for model in ("garbage", "truncated", "pickle_with_code", "foreign_torch_file", "nmt_without_weights",
              "a_folder"):
    refused("train", f"save_dir_with_{model}", save_dir_holding(model), "none can be resumed from")
works("train", "huge_line", train_on_huge_line, lambda w, out, printed: (
    "(1 skipped as too long)" in printed or pytest.fail(printed)))
yaml_cases("train", "batch.max_tokens", "save_dir", lambda w, tmp: train_args(w.bin, tmp))


# -- average --------------------------------------------------------------------------------------


MODEL_MESSAGES = {
    "truncated": "not the zip archive", "garbage": "not the zip archive", "empty": "not the zip archive",
    "raw_pickle": "not the zip archive", "pickle_with_code": "could run code",
    "foreign_torch_file": "no 'nmt/1' format marker", "nmt_without_weights": "its model is missing",
    "nmt_weights_not_tensors": "its model is missing",
    "nmt_config_wrong_type": "'d_model' must be a whole number",
    "nmt_config_negative": "'d_model' must be at least 2",
    "nmt_dictionary_without_specials": "special symbols", "nmt_garbage_spm": "sentencepiece model",
    "nmt_meta_not_a_mapping": "its meta is missing", "a_folder": "folder",
}


def average_args(w: World, tmp: Path, *checkpoints: object,
                 out: Path | None = None) -> tuple[list[object], Path]:
    out = out or tmp / "model.pt"
    return ["average", *(checkpoints or (w.checkpoints,)), "--out", out,
            *([] if checkpoints else ["--last", 2])], out


for model, message in MODEL_MESSAGES.items():
    if model == "nmt_dictionary_without_specials":
        message = "different dictionaries"  # compared with the first file before it is used
    elif model == "nmt_garbage_spm":
        message = "different sentencepiece models"
    refused("average", model, lambda w, tmp, model=model: average_args(
        w, tmp, w.checkpoints / "checkpoint_2.pt", w.models[model]), message)
refused("average", "out_is_a_folder", lambda w, tmp: average_args(w, tmp, out=tmp), "is a folder")
refused("average", "out_below_a_file", lambda w, tmp: average_args(w, tmp, out=a_file(tmp) / "m.pt"),
        "is a file")
refused("average", "folder_without_checkpoints", lambda w, tmp: average_args(w, tmp, tmp),
        "no checkpoint_<update>.pt")
refused("average", "missing_file", lambda w, tmp: average_args(w, tmp, tmp / "nothing.pt"), "does not exist")
yaml_cases("average", "last", "out", lambda w, tmp: average_args(w, tmp))


# -- translate ------------------------------------------------------------------------------------


def translate_args(model: Path, source: Path, tmp: Path,
                   out: Path | None = None) -> tuple[list[object], Path]:
    out = out or tmp / "out.txt"
    return ["translate", model, "-i", source, "-o", out, "--beam", 2, "--set", "threads=1"], out


def one_line_per_line(fault: str) -> Check:
    def check(w: World, out: Path | None, printed: str) -> None:
        data = out.read_bytes()
        assert (data.count(b"\n") == lines_of(w.texts[fault].read_bytes())
                and (not data or data.endswith(b"\n")))
        if fault == "invalid_utf8":
            assert "line 2: invalid UTF-8" in printed and "line 3: invalid UTF-8" in printed
        if fault == "huge_line":
            assert "line 1: more pieces than the model's max_positions" in printed
    return check


for model, message in MODEL_MESSAGES.items():
    refused("translate", model, lambda w, tmp, model=model: translate_args(
        w.models[model], w.texts["crlf"], tmp),
        "does not exist or is not a file" if model == "a_folder" else message)
for fault in ("empty", "huge_line", "invalid_utf8", "nul", "crlf", "lone_cr", "blank_lines", "long_line",
              "no_final_newline"):
    works("translate", fault, lambda w, tmp, fault=fault: translate_args(w.model, w.texts[fault], tmp),
          one_line_per_line(fault))


def exported(w: World) -> Path:
    """w.model exported by `nmt export ctranslate2`, once (these cases skip without the package)."""
    pytest.importorskip("ctranslate2")
    out = w.folder / "ctranslate2"
    if not out.is_dir():
        ok("export", "ctranslate2", w.model, "--out", out)
    return out


for fault in ("empty", "huge_line", "invalid_utf8", "nul", "crlf", "blank_lines", "no_final_newline"):
    works("translate", f"ctranslate2_{fault}", lambda w, tmp, fault=fault: translate_args(
        exported(w), w.texts[fault], tmp), one_line_per_line(fault))


def damaged_export(w: World, tmp: Path, settings: object) -> Path:
    """A copy of the exported folder whose nmt.json holds `settings` instead."""
    folder = tmp / "damaged"
    shutil.copytree(exported(w), folder)
    (folder / "nmt.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


def exported_settings(w: World, **changes: object) -> dict[str, object]:
    return {**json.loads((exported(w) / "nmt.json").read_text()), **changes}


refused("translate", "ctranslate2_settings_not_an_object", lambda w, tmp: translate_args(
    damaged_export(w, tmp, [1, 2]), w.texts["crlf"], tmp), "nmt.json", "export the model again")
refused("translate", "ctranslate2_max_positions_damaged", lambda w, tmp: translate_args(
    damaged_export(w, tmp, exported_settings(w, max_positions="many")), w.texts["crlf"], tmp),
    "nmt.json", "max_positions", "export the model again")
refused("translate", "ctranslate2_normalization_damaged", lambda w, tmp: translate_args(
    damaged_export(w, tmp, exported_settings(w, source_normalization={"normalize_punctuation": "yes"})),
    w.texts["crlf"], tmp), "nmt.json", "normalisation record is damaged", "export the model again")

refused("translate", "input_is_a_folder", lambda w, tmp: translate_args(w.model, tmp, tmp), "is a folder")
refused("translate", "input_missing", lambda w, tmp: translate_args(w.model, tmp / "nothing", tmp),
        "does not exist")
refused("translate", "output_is_a_folder", lambda w, tmp: translate_args(w.model, w.texts["crlf"], tmp, tmp),
        "--output", "is a folder")
yaml_cases("translate", "beam", "model", lambda w, tmp: translate_args(w.model, w.texts["crlf"], tmp))


# -- score ----------------------------------------------------------------------------------------


def score_args(hyp: Path, ref: Path, tmp: Path, *extra: object,
               out: Path | None = None) -> tuple[list[object], Path]:
    out = out or tmp / "scores.json"
    return ["score", "--hyp", hyp, "--ref", ref, "--json", out, *extra], out


def against_plain_reference(fault: str, *extra: object) -> Build:
    def build(w: World, tmp: Path) -> tuple[list[object], Path]:
        ref = tmp / "ref.txt"
        ref.write_bytes(plain_lines(lines_of(w.texts[fault].read_bytes())))
        return score_args(w.texts[fault], ref, tmp, *extra)
    return build


def scored(fault: str) -> Check:
    def check(w: World, out: Path | None, printed: str) -> None:
        report = json.loads(out.read_text(encoding="utf-8"))
        assert report["segments"] == lines_of(w.texts[fault].read_bytes()) and "sacreBLEU" in printed
        assert 0 <= report["sacrebleu"]["score"] <= 100
    return check


refused("score", "empty", against_plain_reference("empty"), "nothing to score")
refused("score", "invalid_utf8", against_plain_reference("invalid_utf8"), "line 2: invalid UTF-8")
refused("score", "mismatched_lines", lambda w, tmp: score_args(w.texts["crlf"], w.texts["blank_lines"], tmp),
        "crlf.txt has 3 lines but the reference", "has 5")
refused("score", "hyp_is_a_folder", lambda w, tmp: score_args(tmp, w.texts["crlf"], tmp),
        "is a folder, not a file")
refused("score", "hyp_missing", lambda w, tmp: score_args(tmp / "nothing", w.texts["crlf"], tmp),
        "does not exist")
refused("score", "json_is_a_folder",
        lambda w, tmp: score_args(w.texts["crlf"], w.texts["crlf"], tmp, out=tmp), "--json", "is a folder")
refused("score", "langpair_a_path", against_plain_reference("crlf", "--langpair", "../../en-de"),
        "--langpair")
for fault in ("nul", "crlf", "lone_cr", "blank_lines", "long_line", "no_final_newline"):
    works("score", fault, against_plain_reference(fault), scored(fault))
yaml_cases("score", None, "hyp", lambda w, tmp: score_args(w.texts["crlf"], w.texts["crlf"], tmp))


# ---------------------------------------------------------------------------------------------
# Running a case


def put_previous_output(w: World, command: str, out: Path | None) -> None:
    """Where the case writes, the result of an earlier good run (unless the case put something there)."""
    if out is None or out.exists() or any(parent.is_file() for parent in out.parents):
        return
    folders = {"prepare": w.raw, "bpe": w.bpe, "binarize": w.bin, "train": w.checkpoints}
    if command in folders:
        shutil.copytree(folders[command], out)
    elif command == "average":
        shutil.copyfile(w.model, out)
    else:
        out.write_text("an earlier result\n")


def snapshot(path: Path | None) -> dict[str, str]:
    if path is None or not path.exists():
        return {}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def verify(case: Case, w: World, out: Path | None, before: dict[str, str], code: int, output: str) -> None:
    assert "Traceback" not in output, output
    if case.check is not None:
        assert code == 0, f"{case.id}: expected success, got {code}:\n{output}"
        case.check(w, out, output)
        return
    assert code == 2, f"{case.id}: expected exit status 2, got {code}:\n{output}"
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"{case.id}: expected one error line:\n{output}"
    for needle in case.needles:
        assert needle in errors[0], f"{case.id}: {needle!r} not in {errors[0]!r}"
    stage_folder = case.command in ("prepare", "bpe", "binarize") and out is not None and out.is_dir()
    if (stage_folder and (out / "manifest.json").exists()
            or not stage_folder and out is not None and out.exists()):
        assert snapshot(out) == before, f"{case.id}: the earlier output at {out} was changed by a failed run"
    assert not w.marker.exists(), "a hostile pickle ran code"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_input(case: Case, world: World, tmp_path: Path) -> None:
    args, out = case.build(world, tmp_path)
    put_previous_output(world, case.command, out)
    before = snapshot(out)
    code, output = invoke(*args)
    verify(case, world, out, before, code, output)


REAL_CLI = ["prepare/invalid_utf8", "prepare/out_below_a_file", "bpe/manifest_not_json",
            "binarize/spm_garbage", "train/save_dir_with_pickle_with_code", "train/idx_points_past_bin",
            "average/truncated", "translate/lone_cr", "translate/garbage", "score/empty",
            "score/config_a_list"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in REAL_CLI], ids=lambda c: c.id)
def test_hostile_input_through_the_real_cli(case: Case, world: World, tmp_path: Path) -> None:
    args, out = case.build(world, tmp_path)
    put_previous_output(world, case.command, out)
    before = snapshot(out)
    proc = nmt(*args, check=False, timeout=300, env={"OMP_NUM_THREADS": "1"})
    if case.check is None:
        assert_user_error(proc)
    verify(case, world, out, before, proc.returncode, proc.stdout + proc.stderr)


def test_every_real_cli_case_exists() -> None:
    assert set(REAL_CLI) <= {case.id for case in CASES}


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod 000 does not stop root from reading")
def test_an_unreadable_file_is_a_clear_error(world: World, tmp_path: Path) -> None:
    prefix = write_pair(tmp_path / "in", *world.good_train)
    Path(f"{prefix}.{SRC}").chmod(0)
    args, out = prepare_args(world, tmp_path, prefix)
    code, output = invoke(*args)
    verify(Case("prepare", "unreadable", prepare_args, needles=("c.en", "Permission denied")), world, out, {},
           code, output)
