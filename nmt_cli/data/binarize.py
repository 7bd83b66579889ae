"""`nmt binarize`: the joint dictionary and memory-mapped token arrays of every split and language.

Reads a folder written by `nmt bpe` and writes ``dict.txt`` (pad/bos/eos/unk with ids 0..3, then the
pieces of both languages' training text by descending count), ``{split}.{lang}.bin/.idx`` (see
`dataset.py`) and a copy of ``spm.model``, so `nmt train` and `nmt translate` need only this folder.
The share of pieces that became ``<unk>`` is reported per split and language.

Work is streamed in blocks through worker processes (`streaming.py`); memory holds the dictionary
and a few blocks, whatever the corpus size. The training text is read once: while its pieces are
counted they are written with provisional ids (sentencepiece's own piece ids, known before anything
is counted; pieces outside the model get ids after those), and once the dictionary is built from the
counts a vectorised pass maps the provisional ids to dictionary ids. The other splits, and every
split when `--dictionary` is given, are written with dictionary ids directly.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
from rich.console import Console
from rich.table import Table

from nmt_cli.artifacts import (
    StageOutput,
    atomic_writer,
    is_done,
    read_text_input,
    say_done,
    sha256_file,
)
from nmt_cli.config.data import BinarizeConfig
from nmt_cli.data.bpe import TARGET_SPM, sentencepiece_processor
from nmt_cli.data.clean import Normalization
from nmt_cli.data.dataset import UNK, Dictionary, IndexedWriter, read_sequential, token_dtype
from nmt_cli.data.streaming import Block, WorkerPool, line_blocks, line_progress, worker_count
from nmt_cli.errors import NmtError, shown
from nmt_cli.progress import ProgressReport

BPE_COMMAND = "nmt bpe RAW --out BPE"


def run(cfg: BinarizeConfig) -> None:
    if is_done(cfg.out, "binarize", cfg):
        return say_done(cfg.out, "binarize")
    src, tgt, lines, manifest = read_text_input(cfg.bpe, "bpe", BPE_COMMAND, cfg.out)
    Normalization.from_record(manifest.get("source_normalization"), f"{cfg.bpe}/manifest.json",
                              f"run `{BPE_COMMAND}` again")  # refused now, not by `nmt train`
    if not (cfg.bpe / "spm.model").is_file():
        raise NmtError(f"{cfg.bpe}/spm.model is missing; run `{BPE_COMMAND}` again")
    sentencepiece_processor((cfg.bpe / "spm.model").read_bytes(), f"{cfg.bpe}/spm.model",
                            f"run `{BPE_COMMAND}` again")
    worker_count(cfg.workers)  # refuse a bad value before the output folder is touched
    dictionary = Dictionary.load(cfg.dictionary) if cfg.dictionary is not None else None
    with StageOutput(cfg.out, "binarize", cfg) as stage, WorkerPool(cfg.workers) as pool:
        stage.inputs["bpe"] = {"folder": str(cfg.bpe.resolve()),
                               "manifest_sha256": sha256_file(cfg.bpe / "manifest.json")}
        with atomic_writer(cfg.out / "spm.model") as f:
            f.write((cfg.bpe / "spm.model").read_bytes())
        if (cfg.bpe / TARGET_SPM).is_file():  # the target side's own model goes on to `nmt train`
            with atomic_writer(cfg.out / TARGET_SPM) as f:
                f.write((cfg.bpe / TARGET_SPM).read_bytes())
            stage.add_output(TARGET_SPM, checksum=True)
        splits: dict[str, dict[str, Any]] = {}
        if dictionary is None:
            dictionary, splits["train"] = _binarize_training_text(pool, cfg, (src, tgt), lines["train"])
        else:
            stage.inputs["dictionary"] = {"path": str(cfg.dictionary.resolve()),
                                          "sha256": sha256_file(cfg.dictionary)}
            dictionary.save(cfg.out / "dict.txt")
        rest = {split: n for split, n in lines.items() if split not in splits}
        splits.update(_binarize_with_dictionary(pool, cfg, (src, tgt), rest, len(dictionary)))
        splits = {split: splits[split] for split in lines}
        stage.add_output("dict.txt", checksum=True)
        stage.add_output("spm.model", checksum=True)
        for split in splits:
            for lang in (src, tgt):
                stage.add_output(f"{split}.{lang}.bin")
                stage.add_output(f"{split}.{lang}.idx")
        stage.info.update(src_lang=src, tgt_lang=tgt, dict_size=len(dictionary), splits=splits,
                          source_normalization=manifest.get("source_normalization"))
    _print_summary(cfg.out, splits, len(dictionary))


# ---------------------------------------------------------------------------------------------
# Blocks of piece lines to ids (in the worker processes)


_TABLES: dict[tuple[str, int, int], dict[bytes, int]] = {}  # per process, by file identity
_EMPTY, _LINE_END, _OTHER = -1, -2, -3  # ids of the markers in a split block, and of unlisted pieces


def _model_symbols(model_path: Path) -> list[str]:
    processor = spm.SentencePieceProcessor(model_file=str(model_path))
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def _piece_table(path: str) -> dict[bytes, int]:
    """UTF-8 piece -> id, from a dict.txt or (provisional ids) a sentencepiece model; loaded once
    per worker process, since tasks carry the file's path, not the table."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _TABLES:
        if path.endswith(".model"):
            symbols = _model_symbols(Path(path))
        else:
            symbols = Dictionary.load(Path(path)).symbols
        table = {symbol.encode(): i for i, symbol in enumerate(symbols)}
        table.update({b"": _EMPTY, b"\n": _LINE_END})  # no symbol is empty or holds a line break
        _TABLES.clear()
        _TABLES[key] = table
    return _TABLES[key]


def _block_ids(task: tuple[str, Block]) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """(ids of all pieces, pieces per line, the pieces missing from the table in order) of one block.

    A missing piece gets the id _OTHER; the caller decides what it becomes. One split and one `map`
    over the whole block, no per-line Python or numpy call: each line break becomes a token of its
    own, and line lengths come from the positions of its id. Bytes, not str: decoding and splitting
    str costs twice as much; a piece that is not UTF-8 matches no symbol. Pieces are separated by
    single spaces only: bytes.split() would also split at control characters sentencepiece can
    leave inside a piece.
    """
    table_path, block = task
    table = _piece_table(table_path)
    data = block.data if block.data.endswith(b"\n") else block.data + b"\n"
    tokens = data.replace(b"\n", b" \n ").split(b" ")  # "a b\n\nc\n" -> a b \n '' \n c \n ''
    ids = np.fromiter(map(table.get, tokens, repeat(_OTHER)), np.int32, len(tokens))
    others = [tokens[i] for i in np.flatnonzero(ids == _OTHER).tolist()]
    ids = ids[ids != _EMPTY]
    lengths = np.diff(np.flatnonzero(ids == _LINE_END), prepend=-1) - 1
    return ids[ids != _LINE_END], lengths, others


# ---------------------------------------------------------------------------------------------
# Writing files (in the main process)


def _write_file(pool: WorkerPool, source: Path, prefix: Path, table_path: Path, dtype: np.dtype,
                expected_lines: int, progress: ProgressReport,
                resolve: Callable[[np.ndarray, list[bytes]], np.ndarray]) -> int:
    """Write the pieces of `source` as PREFIX.bin/.idx; `resolve(ids, others)` replaces the
    _OTHER ids of each block. Returns the number of tokens."""
    writer = IndexedWriter(prefix, dtype)
    try:
        tasks = ((str(table_path.resolve()), block) for block in line_blocks(source))
        for ids, lengths, others in pool.map(_block_ids, tasks):
            writer.add_many(resolve(ids, others), lengths)
            progress.advance(len(lengths))
        if writer.count != expected_lines:
            raise NmtError(f"{source} has {writer.count} lines but {source.parent}/manifest.json records "
                           f"{expected_lines}: it changed after `nmt bpe` wrote it; "
                           f"run `{BPE_COMMAND}` again")
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.tokens


def _binarize_with_dictionary(pool: WorkerPool, cfg: BinarizeConfig, langs: tuple[str, str],
                              lines: dict[str, int], dict_size: int) -> dict[str, dict[str, Any]]:
    """Write OUT/{split}.{lang}.bin/.idx with the ids of OUT/dict.txt; the manifest's split entries."""
    dtype = token_dtype(dict_size)
    splits: dict[str, dict[str, Any]] = {}
    with line_progress("binarize", "write ids", 2 * sum(lines.values())) as progress:
        for split, expected in lines.items():
            splits[split] = {"sentences": expected, "tokens": {}, "unk_rate": {}}
            for lang in langs:
                unknown = _Unknown(dtype)
                tokens = _write_file(pool, cfg.bpe / f"{split}.{lang}", cfg.out / f"{split}.{lang}",
                                     cfg.out / "dict.txt", dtype, expected, progress, unknown)
                splits[split]["tokens"][lang] = tokens
                splits[split]["unk_rate"][lang] = unknown.count / max(tokens, 1)
    return splits


class _Unknown:
    """Turns the ids of pieces missing from the dictionary into <unk>, counting them."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype, self.count = dtype, 0

    def __call__(self, ids: np.ndarray, others: list[bytes]) -> np.ndarray:
        ids[ids == _OTHER] = UNK
        self.count += len(others)
        return ids.astype(self.dtype)


class _ProvisionalCounts:
    """Counts of provisional ids: the model's pieces first, then pieces outside it as they appear
    (a character that sentencepiece never saw in its training sample stays a piece of its own)."""

    def __init__(self, symbols: list[str]) -> None:
        self.symbols = symbols
        self.others: dict[bytes, int] = {}
        self.counts = np.zeros(len(symbols), np.int64)

    def add(self, ids: np.ndarray, others: list[bytes]) -> np.ndarray:
        if others:
            ids[ids == _OTHER] = [self.others.setdefault(p, len(self.symbols) + len(self.others))
                                  for p in others]
        block = np.bincount(ids, minlength=len(self.counts))
        if len(block) > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(len(block) - len(self.counts), np.int64)])
        self.counts += block
        return ids

    def dictionary(self, min_count: int, source: str) -> tuple[Dictionary, np.ndarray]:
        """The dictionary of the counted pieces, and the map from provisional to dictionary ids."""
        try:
            names = self.symbols + [piece.decode("utf-8") for piece in self.others]
        except UnicodeDecodeError as e:
            raise NmtError(f"{source} holds a piece that is not UTF-8 ({shown(e.object)}); "
                           f"run `{BPE_COMMAND}` again") from None
        counts = np.pad(self.counts, (0, len(names) - len(self.counts)))
        nonzero = Counter({n: int(c) for n, c in zip(names, counts, strict=True) if c})
        dictionary = Dictionary.from_counts(nonzero, min_count)
        return dictionary, np.array([dictionary.index.get(n, UNK) for n in names], np.int64)


def _binarize_training_text(pool: WorkerPool, cfg: BinarizeConfig, langs: tuple[str, str],
                            train_lines: int) -> tuple[Dictionary, dict[str, Any]]:
    """Count and write the training text in one pass, then build dict.txt and map the ids to it."""
    model = cfg.out / "spm.model"
    counts = _ProvisionalCounts(_model_symbols(model))
    provisional = {lang: cfg.out / f".train.{lang}.provisional" for lang in langs}
    try:
        with line_progress("binarize", "count and write train", 2 * train_lines) as progress:
            for lang in langs:
                _write_file(pool, cfg.bpe / f"train.{lang}", provisional[lang], model, np.dtype(np.int32),
                            train_lines, progress, counts.add)
        dictionary, to_final = counts.dictionary(cfg.min_count, f"{cfg.bpe}/train.*")
        dictionary.save(cfg.out / "dict.txt")
        info: dict[str, Any] = {"sentences": train_lines, "tokens": {}, "unk_rate": {}}
        for lang in langs:
            tokens, unknown = _map_ids(provisional[lang], cfg.out / f"train.{lang}", to_final,
                                       token_dtype(len(dictionary)))
            info["tokens"][lang], info["unk_rate"][lang] = tokens, unknown / max(tokens, 1)
    finally:
        for prefix in provisional.values():
            for suffix in (".bin", ".idx"):
                Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    return dictionary, info


def _map_ids(source: Path, prefix: Path, to_final: np.ndarray, dtype: np.dtype) -> tuple[int, int]:
    """Copy the pair `source` to `prefix` with every id x replaced by to_final[x]; (tokens, unknown)."""
    writer = IndexedWriter(prefix, dtype)
    unknown = 0
    try:
        for provisional, sizes in read_sequential(source):
            ids = to_final[provisional]
            unknown += int(np.count_nonzero(ids == UNK))
            writer.add_many(ids.astype(dtype), sizes)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.tokens, unknown


def _print_summary(out: Path, splits: dict[str, dict[str, Any]], dict_size: int) -> None:
    table = Table(title=f"nmt binarize: {dict_size} symbols, written to {out}")
    for name in ("split", "lang", "sentences", "tokens", "unknown"):
        table.add_column(name, justify="left" if name in ("split", "lang") else "right")
    for split, info in splits.items():
        for lang, tokens in info["tokens"].items():
            table.add_row(split, lang, str(info["sentences"]), str(tokens),
                          f"{100 * info['unk_rate'][lang]:.3f}%")
    Console().print(table)
