"""What every stage writes and reads on disk: atomic files, text lines, folders with a manifest.

A stage's output folder is only valid once its `manifest.json` exists. The manifest is written last
and atomically, and a stage deletes any old manifest before it starts writing, so a crash or an
error leaves a folder that the next stage refuses instead of half-read files. The next stage calls
`read_manifest`, which also checks that every output the manifest lists still has its recorded size.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from nmt_cli import __version__
from nmt_cli.config.core import dump_yaml, read_small_text, to_dict
from nmt_cli.errors import NmtError, shown

MANIFEST = "manifest.json"
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkstemp creates files only the owner can read


@contextlib.contextmanager
def atomic_writer(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Write `path` through a temporary file in the same folder: fsync, then rename over `path`.

    Readers see the old file or the whole new one, never a part; a crash leaves at most a stray
    `.tmp` file, which is removed on the next attempt's failure path or ignored.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # the permissions a plain open() would give
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_writer(path, "w") as f:
        f.write(text)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in `folder` survive a power cut (the folder's entry is on disk)."""
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)




def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def count_lines(path: Path, chunk_bytes: int = 1 << 22) -> int:
    """Lines as `wc -l` counts them, plus a last line without a newline."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def open_input(path: Path) -> IO[bytes]:
    """`path` opened for binary reading; a missing or unreadable file is an NmtError naming it."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise NmtError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise NmtError(f"{path} is a folder, not a file") from None
    except OSError as e:
        raise NmtError(f"cannot read {path}: {e.strerror}") from None


# The longest line any text file may have. No sentence comes near; a stray megabytes-long line (a
# document without line breaks) is still read, and skipped where a stage skips what is too long.
# What passes the limit is a binary or corrupt file, or a device such as /dev/zero, whose one "line"
# would otherwise grow until memory runs out.
MAX_LINE_BYTES = 16 << 20


def line_too_long(name: str | Path, number: int, limit: int = MAX_LINE_BYTES) -> NmtError:
    return NmtError(f"{name}, line {number}: longer than {limit:,} bytes without a line break; this is "
                    "not a text file of sentences (a binary or corrupt file, or a device such as "
                    "/dev/zero?): give the text file meant here")


def bounded_lines(f: IO[bytes], name: str | Path, first_line: int = 1,
                  limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of the binary stream `f`, each with its LF (the last one perhaps without); a line
    longer than `limit` bytes is an NmtError naming `name` and the line, before more of it is read."""
    number = first_line
    while raw := f.readline(limit + 1):
        if len(raw) > limit and not raw.endswith(b"\n"):
            raise line_too_long(name, number, limit)
        yield raw
        number += 1


def read_text(path: Path) -> str:
    """The whole of a UTF-8 text file that `nmt` wrote (a training log), each line bounded as in
    `bounded_lines`. OSError and UnicodeDecodeError pass to the caller."""
    with open(path, "rb") as f:
        return b"".join(bounded_lines(f, path)).decode("utf-8")


def read_lines(path: Path, errors: str = "strict") -> Iterator[str]:
    """Yield the lines of a UTF-8 text file without their line ending, streaming.

    Only LF ends a line (a CRLF ending loses its CR too), so a stray CR, form feed or U+2028 inside
    a line never changes the line count. Invalid UTF-8 raises NmtError naming the file and line
    unless `errors="replace"`.
    """
    with open_input(path) as f:
        for number, raw in enumerate(bounded_lines(f, path), start=1):
            raw = raw.rstrip(b"\n")
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            try:
                yield raw.decode("utf-8", errors=errors)
            except UnicodeDecodeError as e:
                raise NmtError(
                    f"{path}, line {number}: invalid UTF-8 (byte {e.start + 1} of the line); "
                    "convert the file to UTF-8 (e.g. with iconv)"
                ) from None


# ---------------------------------------------------------------------------------------------
# Stage output folders


def file_record(path: Path, checksum: bool = False) -> dict[str, Any]:
    record: dict[str, Any] = {"bytes": path.stat().st_size}
    if checksum:
        record["sha256"] = sha256_file(path)
    return record


class StageOutput:
    """The output folder of one stage run; the manifest is written only if the run succeeds.

    >>> with StageOutput(out, "bpe", cfg) as stage:
    ...     write files into out, then stage.add_output("train.en")
    ...     stage.info["vocab_size"] = 37000
    """

    def __init__(self, out: Path, stage: str, cfg: Any) -> None:
        self.out, self.stage, self.cfg = Path(out), stage, cfg
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.info: dict[str, Any] = {}

    def __enter__(self) -> StageOutput:
        if self.out.exists() and not self.out.is_dir():
            raise NmtError(f"output folder {self.out} is a file; choose another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MANIFEST).unlink(missing_ok=True)  # from here on the folder is not done
        return self

    def add_output(self, name: str, checksum: bool = False, **extra: Any) -> None:
        self.outputs[name] = {**file_record(self.out / name, checksum), **extra}

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            return
        atomic_write_text(self.out / "config.yaml", dump_yaml(self.cfg))
        manifest = {
            "stage": self.stage,
            "run_id": uuid.uuid4().hex,  # every run differs, so later stages notice any redo of this one
            "nmt_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "config": to_dict(self.cfg),
            "inputs": self.inputs,
            "outputs": self.outputs,
            **self.info,
        }
        atomic_write_text(self.out / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def read_manifest(folder: Path, stage: str, command: str) -> dict[str, Any]:
    """The manifest of a finished `stage` run in `folder`, with every listed output checked: its size,
    and its sha256 where one was recorded (the small files that define a corpus: spm.model, dict.txt).

    `command` is what the user runs to (re)make the folder, for the error message.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise NmtError(f"{folder} does not exist or is not a folder; create it with `{command}`")
    if not path.is_file():
        raise NmtError(
            f"{folder} has no {MANIFEST}: it was not written by `nmt {stage}` or that run did not "
            f"finish; run `{command}` again")
    try:
        manifest = json.loads(read_small_text(path, "manifest"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NmtError(f"{path} is corrupt ({e}); run `{command}` again") from None
    if not isinstance(manifest, dict) or manifest.get("stage") != stage:
        found = manifest.get("stage") if isinstance(manifest, dict) else None
        raise NmtError(f"{folder} was written by `nmt {found}`, not `nmt {stage}`; "
                       f"pass the output of `{command}`")
    for name, record in _output_records(manifest, path, command).items():
        file = folder / name
        if not file.is_file():
            raise NmtError(f"{file} is missing or not a file although {path} lists it; run `{command}` again")
        if file.stat().st_size != record["bytes"]:
            raise NmtError(
                f"{file} has {file.stat().st_size} bytes but {path} recorded {record['bytes']}: it was "
                f"changed or truncated after `nmt {stage}` wrote it; run `{command}` again")
        if "sha256" in record and sha256_file(file) != record["sha256"]:
            raise NmtError(f"{file} does not match the sha256 that {path} recorded: it was changed after "
                           f"`nmt {stage}` wrote it; run `{command}` again")
    return manifest


def _output_records(manifest: dict[str, Any], path: Path, command: str) -> dict[str, dict[str, Any]]:
    """The manifest's "outputs", checked to be {plain file name: {"bytes": int, ...}}."""
    outputs, inputs = manifest.get("outputs", {}), manifest.get("inputs", {})
    valid = isinstance(outputs, dict) and isinstance(inputs, dict) and all(
        _NAME.fullmatch(name) and isinstance(r, dict) and type(r.get("bytes")) is int
        and isinstance(r.get("sha256", ""), str) for name, r in outputs.items())
    if not valid:
        raise NmtError(f"{path} does not have the layout nmt writes (its inputs or outputs are damaged); "
                       f"run `{command}` again")
    return outputs


# A language code, a split name or a stage output's file name: names files, so no '/' and no leading '.'.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_CODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def manifest_languages(manifest: dict[str, Any], folder: Path) -> tuple[str, str]:
    """(src_lang, tgt_lang) of a parallel-corpus folder (prepare, bpe, binarize)."""
    src, tgt = manifest.get("src_lang"), manifest.get("tgt_lang")
    if not (isinstance(src, str) and isinstance(tgt, str) and _CODE.fullmatch(src) and _CODE.fullmatch(tgt)
            and src != tgt):
        raise NmtError(f"{folder / MANIFEST} must name two different languages in src_lang and tgt_lang, "
                       f"as letters, digits, '_' or '-' (found {shown(src)}, {shown(tgt)}); write the folder "
                       f"again with `nmt {manifest.get('stage')}`")
    return src, tgt


def manifest_split_counts(manifest: dict[str, Any], folder: Path, key: str) -> dict[str, int]:
    """{split: count} from a manifest's ``"splits": {split: {key: count}}``, in file order; needs "train"."""
    splits = manifest.get("splits")
    redo = f"write the folder again with `nmt {manifest.get('stage')}`"
    if not isinstance(splits, dict) or "train" not in splits:
        raise NmtError(f"{folder / MANIFEST} lists no train split; {redo}")
    counts = {name: info.get(key) if isinstance(info, dict) else None for name, info in splits.items()}
    for name, count in counts.items():
        if not _CODE.fullmatch(name) or type(count) is not int or count < 0:
            raise NmtError(f"{folder / MANIFEST}: split {shown(name)} needs a name of letters, digits, '_' "
                           f"or '-' and a '{key}' count that is a whole number >= 0 (found {shown(count)}); "
                           f"{redo}")
    return counts


def read_text_input(folder: Path, stage: str, command: str,
                    out: Path) -> tuple[str, str, dict[str, int], dict[str, Any]]:
    """(source language, target language, {split: lines} in file order, the manifest) of the text
    folder `folder`, from its manifest (written by `stage`, remade by `command`); refuses an --out
    that is `folder`."""
    manifest = read_manifest(folder, stage, command)
    src, tgt = manifest_languages(manifest, folder)
    lines = manifest_split_counts(manifest, folder, "lines")
    check_distinct_folders(out, folder)
    return src, tgt, lines, manifest


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file that could not be written, before any work is done: a path that is a
    folder, or one below a file."""
    path = Path(path)
    if path.is_dir():
        raise NmtError(f"{option} {path} is a folder; give a file name")
    existing = next((p for p in path.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise NmtError(f"{option} {path}: {existing} is a file, not a folder; choose another path")


def check_distinct_folders(out: Path, source: Path) -> None:
    """Refuse --out equal to the folder being read: the stage would delete that folder's manifest."""
    if Path(out).resolve() == Path(source).resolve():
        raise NmtError(f"--out {out} is the input folder; choose another folder "
                       "(the input would be overwritten)")


# Config fields that change how a stage runs, not what it writes.
_RUN_ONLY_FIELDS = {"workers"}


def say_done(out: Path, stage: str) -> None:
    print(f"nothing to do: {out} already holds this {stage} run (same config, unchanged input); "
          "delete its manifest.json to run it again", file=sys.stderr)


def is_done(out: Path, stage: str, cfg: Any) -> bool:
    """True when `out` holds a finished run of `stage` with this config and unchanged input folders,
    so the run can be skipped (what lets a recipe be re-run from the top)."""
    try:
        manifest = read_manifest(out, stage, f"nmt {stage}")
    except NmtError:
        return False
    def comparable(config: Any) -> Any:
        if not isinstance(config, dict):
            return config
        return {k: v for k, v in config.items() if k not in _RUN_ONLY_FIELDS}
    if comparable(manifest.get("config")) != comparable(json.loads(json.dumps(to_dict(cfg)))):
        return False
    for record in manifest.get("inputs", {}).values():
        upstream = (Path(str(record.get("folder"))) / MANIFEST
                    if isinstance(record, dict) and "manifest_sha256" in record else None)
        if upstream is not None and (not upstream.is_file()
                                     or sha256_file(upstream) != record["manifest_sha256"]):
            return False
    return True
