"""Adversarial inputs for every `nmt` command, made by the tests in a temporary folder.

Nothing here is committed as a file: each function writes its hostile inputs under a folder it is
given and returns their paths by name. Used by `test_hostile.py`.

- `text_files`: text that breaks naive line handling (empty, one 5 MB line without a newline,
  invalid UTF-8, NUL bytes, CRLF, a lone CR, blank lines, a long line).
- `damage_folder`: a copy of a good stage output folder with one thing wrong (no manifest, a manifest
  that is not JSON, from another stage, with a damaged layout or a path-escaping split name; a
  truncated .bin, an .idx pointing past its .bin or with a bad header, a dict.txt with a duplicate
  symbol, a garbage spm.model, token ids beyond the dictionary, a folder where a file belongs).
  `reseal` rewrites the manifest's sizes and checksums after a damage, so that the check behind the
  manifest (the one a crafted or unlucky folder meets) is what refuses it.
- `model_files`: checkpoint/model files that are truncated, garbage, empty, a pickle that runs code
  when loaded, a valid torch file that is not an nmt one, nmt files with a valid checksum but a
  missing or wrong part, and a folder.
- `yaml_files`: config files with a wrong type, an unknown key, a list instead of a mapping, a
  non-word key, nan, a value out of range, a mapping for a path, broken YAML, invalid UTF-8, a folder.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

HUGE_LINE_BYTES = 5 << 20
WORDS = ("red cat", "the dog sees a bird", "old tree near the river", "small fish")


def text_files(folder: Path) -> dict[str, Path]:
    """Hostile text files by name (see the module docstring); each has LF-separated lines."""
    folder.mkdir(parents=True, exist_ok=True)
    contents = {
        "empty": b"",
        "huge_line": (b"red cat sees the dog " * (HUGE_LINE_BYTES // 21))[:-1],  # no newline at all
        "invalid_utf8": b"red cat\nthe \xff\xfe dog\n\xc3\n",
        "nul": b"red\x00cat\n\x00\x00\nthe dog\n",
        "crlf": b"red cat\r\nthe dog sees a bird\r\nsmall fish\r\n",
        "lone_cr": b"red cat\rthe dog\nsmall\r fish\nold tree\r",
        "blank_lines": b"\n \n\t\nred cat\n\n",
        "long_line": b"red cat " * 32768 + b"\n",  # 256 KB
        "no_final_newline": b"red cat\nthe dog",
    }
    paths = {}
    for name, data in contents.items():
        paths[name] = folder / f"{name}.txt"
        paths[name].write_bytes(data)
    return paths


def lines_of(data: bytes) -> int:
    """Lines as every nmt reader counts them: LF-terminated, plus a last one without LF."""
    return data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))


def plain_lines(count: int) -> bytes:
    """`count` harmless lines: the other side of a parallel pair."""
    return b"".join(WORDS[i % len(WORDS)].encode() + b"\n" for i in range(count))


# ---------------------------------------------------------------------------------------------
# Stage output folders


def reseal(folder: Path) -> None:
    """Record the current size (and sha256, where one was recorded) of every output in the manifest,
    as if the stage had written the damaged files itself."""
    from nmt_cli.artifacts import sha256_file

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    for name, record in manifest["outputs"].items():
        file = folder / name
        if file.is_file():
            record["bytes"] = file.stat().st_size
            if "sha256" in record:
                record["sha256"] = sha256_file(file)
    path.write_text(json.dumps(manifest), encoding="utf-8")


def _edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / "manifest.json"
        manifest = json.loads(path.read_text(encoding="utf-8"))
        edit(manifest)
        path.write_text(json.dumps(manifest), encoding="utf-8")
    return damage


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def _truncate_first_output(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    first = folder / next(name for name in manifest["outputs"] if (folder / name).stat().st_size > 0)
    first.write_bytes(first.read_bytes()[:-1])


def _idx(folder: Path) -> Path:
    return next(iter(sorted(folder.glob("train.*.idx"))))


def _patch_idx(offset: int, data: bytes) -> Callable[[Path], None]:
    """Overwrite bytes of the first training .idx at `offset` (negative: from the end)."""
    def damage(folder: Path) -> None:
        raw = bytearray(_idx(folder).read_bytes())
        start = offset % len(raw)
        raw[start : start + len(data)] = data
        _idx(folder).write_bytes(bytes(raw))
    return damage


def _truncate_bin(folder: Path) -> None:
    path = _idx(folder).with_suffix(".bin")
    path.write_bytes(path.read_bytes()[:-2])  # one uint16 token less than the .idx points to


def _ids_beyond_dictionary(folder: Path) -> None:
    path = _idx(folder).with_suffix(".bin")
    raw = bytearray(path.read_bytes())
    raw[:2] = np.array([65535], np.uint16).tobytes()  # a dictionary of the tests has far fewer symbols
    path.write_bytes(bytes(raw))


def _duplicate_symbol(folder: Path) -> None:
    lines = (folder / "dict.txt").read_text(encoding="utf-8").splitlines()
    lines[5] = lines[4]
    (folder / "dict.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _garbage_spm(folder: Path) -> None:
    size = (folder / "spm.model").stat().st_size
    (folder / "spm.model").write_bytes(os.urandom(size))  # same size: only a checksum or the parser notices


def _bin_is_a_folder(folder: Path) -> None:
    path = _idx(folder).with_suffix(".bin")
    path.unlink()
    path.mkdir()


# name -> (what it does to a folder, whether the manifest is resealed afterwards)
FOLDER_DAMAGES: dict[str, tuple[Callable[[Path], None], bool]] = {
    "no_manifest": (lambda folder: (folder / "manifest.json").unlink(), False),
    "manifest_not_json": (_write("manifest.json", b'{"stage": "prepare", '), False),
    "manifest_a_list": (_write("manifest.json", b"[1, 2, 3]"), False),
    "manifest_of_another_stage": (_edit_manifest(lambda m: m.update(stage="score")), False),
    "manifest_bad_layout": (_edit_manifest(lambda m: m.update(outputs=[1, 2])), False),
    "manifest_escaping_split": (_edit_manifest(
        lambda m: m["splits"].update({"../../escaped": {"lines": 1}})), False),
    "manifest_escaping_language": (_edit_manifest(lambda m: m.update(src_lang="../../x")), False),
    "manifest_without_languages": (_edit_manifest(lambda m: m.pop("src_lang")), False),
    "output_truncated": (_truncate_first_output, False),
    # binarized folders only
    "bin_truncated": (_truncate_bin, True),
    "idx_points_past_bin": (_patch_idx(-8, np.array([10**9], np.int64).tobytes()), True),
    "idx_bad_header": (_patch_idx(0, b"GARBAGE!"), True),
    "idx_offsets_out_of_order": (_patch_idx(24 + 8 * 3, np.array([-7], np.int64).tobytes()), True),
    "ids_beyond_dictionary": (_ids_beyond_dictionary, True),
    "dict_duplicate_symbol": (_duplicate_symbol, True),
    "bin_is_a_folder": (_bin_is_a_folder, False),
    # bpe and binarized folders
    "spm_garbage": (_garbage_spm, True),
    "spm_garbage_unsealed": (_garbage_spm, False),
}


def damage_folder(good: Path, out: Path, damage: str) -> Path:
    """A copy of the stage output folder `good` at `out`, damaged in the way named `damage`."""
    shutil.copytree(good, out)
    change, sealed = FOLDER_DAMAGES[damage]
    change(out)
    if sealed:
        reseal(out)
    return out


def replace_text(good: Path, out: Path, src: bytes, tgt: bytes, split: str = "train") -> Path:
    """A copy of a prepare or bpe folder whose `split` text is `src`/`tgt`, with the manifest's line
    count and records made to fit, as if the stage had written that text."""
    shutil.copytree(good, out)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    for lang, data in ((manifest["src_lang"], src), (manifest["tgt_lang"], tgt)):
        (out / f"{split}.{lang}").write_bytes(data)
    manifest["splits"][split]["lines"] = lines_of(src)
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    reseal(out)
    return out


# ---------------------------------------------------------------------------------------------
# Model files


class _RunsCode:
    """Unpickling this creates `marker`: proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def model_files(good: Path, folder: Path, marker: Path) -> dict[str, Path]:
    """Hostile model files by name, next to each other in `folder`; `good` is an intact model file.
    Loading "pickle_with_code" or "raw_pickle" unsafely would create `marker`."""
    import torch

    from nmt_cli.model import file as model_file

    folder.mkdir(parents=True, exist_ok=True)
    data = good.read_bytes()
    files = {
        "truncated": data[: len(data) // 2],
        "garbage": os.urandom(4096),
        "empty": b"",
        "raw_pickle": pickle.dumps(_RunsCode(marker)),
    }
    paths = {}
    for name, content in files.items():
        paths[name] = folder / f"{name}.pt"
        paths[name].write_bytes(content)
    paths["pickle_with_code"] = folder / "pickle_with_code.pt"
    torch.save({"format": model_file.FORMAT, "model": _RunsCode(marker)}, paths["pickle_with_code"])
    paths["foreign_torch_file"] = folder / "foreign_torch_file.pt"
    torch.save({"state_dict": {"weight": torch.zeros(3)}}, paths["foreign_torch_file"])
    state = model_file.load(good)
    parts = {  # valid checksums, parts nmt does not write
        "nmt_without_weights": {k: v for k, v in state.items() if k != "model"},
        "nmt_weights_not_tensors": {**state, "model": {"w": 5}},
        "nmt_config_wrong_type": {**state, "model_config": {**state["model_config"], "d_model": "big"}},
        "nmt_config_negative": {**state, "model_config": {**state["model_config"], "d_model": -4}},
        "nmt_dictionary_without_specials": {**state, "dictionary": {"symbols": ["a"], "counts": [1]}},
        "nmt_garbage_spm": {**state, "spm_model": b"not a sentencepiece model"},
        "nmt_meta_not_a_mapping": {**state, "meta": "x"},
    }
    for name, broken in parts.items():
        paths[name] = folder / f"{name}.pt"
        model_file.save(paths[name], broken)
    paths["a_folder"] = folder / "a_folder.pt"
    paths["a_folder"].mkdir()
    return paths


# ---------------------------------------------------------------------------------------------
# Config files


def yaml_files(folder: Path, number_field: str | None, path_field: str) -> dict[str, Path]:
    """Hostile YAML configs by name, for a command with the numeric option `number_field` (None: it
    has none; one level of section at most) and the path option `path_field`."""
    folder.mkdir(parents=True, exist_ok=True)
    texts: dict[str, bytes] = {
        "a_list": b"- one\n- two\n",
        "unknown_key": b"no_such_option: 1\n",
        "key_not_a_word": b"1: 2\n",
        "broken_yaml": b"key: [unclosed\n",
        "invalid_utf8": b"key: \xff\xfe\n",
        "path_given_a_mapping": f"{path_field}: {{a: 1}}\n".encode(),
    }
    if number_field is not None:  # a dotted field (batch.max_tokens) is a key of its section
        *section, key = number_field.split(".")
        line = "".join(f"{part}:\n  " for part in section) + key + ": {}\n"
        texts |= {"wrong_type": line.format("lots").encode(), "nan": line.format(".nan").encode(),
                  "out_of_range": line.format(-5).encode()}
    paths = {}
    for name, text in texts.items():
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_bytes(text)
    paths["a_folder"] = folder / "a_folder.yaml"
    paths["a_folder"].mkdir(exist_ok=True)
    return paths
