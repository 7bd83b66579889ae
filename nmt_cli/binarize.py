"""`nmt binarize`: the joint dictionary and memory-mapped token arrays of every split and language.

Reads a folder written by `nmt bpe` and writes ``dict.txt`` (pad/bos/eos/unk with ids 0..3, then the
pieces of both languages' training text by descending count), ``{split}.{lang}.bin/.idx`` (see
`data.py`) and a copy of ``spm.model``, so `nmt train` and `nmt translate` need only this folder.
The share of pieces that became ``<unk>`` is reported per split and language.

Work is streamed in blocks through worker processes (`streaming.py`): the training text is read
once to count pieces (unless `--dictionary` is given) and once more to write ids. Memory holds the
dictionary and a few blocks, whatever the corpus size.
"""

from __future__ import annotations

import os
from collections import Counter
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from nmt_cli.artifacts import (
    StageOutput,
    atomic_writer,
    check_distinct_folders,
    manifest_languages,
    manifest_split_counts,
    read_manifest,
    sha256_file,
)
from nmt_cli.data import UNK, Dictionary, IndexedWriter, token_dtype
from nmt_cli.errors import NmtError
from nmt_cli.stages import BinarizeConfig
from nmt_cli.streaming import Block, LineProgress, WorkerPool, line_blocks, worker_count

BPE_COMMAND = "nmt bpe RAW --out BPE"


def run(cfg: BinarizeConfig) -> None:
    bpe = read_manifest(cfg.bpe, "bpe", BPE_COMMAND)
    src, tgt = manifest_languages(bpe, cfg.bpe)
    lines = manifest_split_counts(bpe, cfg.bpe, "lines")
    check_distinct_folders(cfg.out, cfg.bpe)
    if not (cfg.bpe / "spm.model").is_file():
        raise NmtError(f"{cfg.bpe}/spm.model is missing; run `{BPE_COMMAND}` again")
    worker_count(cfg.workers)  # refuse a bad value before the output folder is touched
    given = Dictionary.load(cfg.dictionary) if cfg.dictionary is not None else None
    with StageOutput(cfg.out, "binarize", cfg) as stage, WorkerPool(cfg.workers) as pool:
        stage.inputs["bpe"] = {"folder": str(cfg.bpe.resolve()), "manifest_sha256": sha256_file(cfg.bpe / "manifest.json")}
        if given is not None:
            stage.inputs["dictionary"] = {"path": str(cfg.dictionary.resolve()), "sha256": sha256_file(cfg.dictionary)}
            dictionary = given
        else:
            train = [cfg.bpe / f"train.{src}", cfg.bpe / f"train.{tgt}"]
            dictionary = Dictionary.from_counts(count_pieces(pool, train, 2 * lines["train"]), cfg.min_count)
        dictionary.save(cfg.out / "dict.txt")
        with atomic_writer(cfg.out / "spm.model") as f:
            f.write((cfg.bpe / "spm.model").read_bytes())
        splits = binarize_corpus(pool, cfg, lines, (src, tgt), len(dictionary))
        stage.add_output("dict.txt", checksum=True)
        stage.add_output("spm.model", checksum=True)
        for split in splits:
            for lang in (src, tgt):
                stage.add_output(f"{split}.{lang}.bin")
                stage.add_output(f"{split}.{lang}.idx")
        stage.info.update(src_lang=src, tgt_lang=tgt, dict_size=len(dictionary), splits=splits)
    _print_summary(cfg.out, splits, len(dictionary))


# ---------------------------------------------------------------------------------------------
# Counting pieces for a new dictionary


def _count_block(block: Block) -> tuple[int, Counter[bytes]]:
    # Pieces are separated by single spaces only: bytes.split() would also split at the ASCII
    # control characters sentencepiece can leave inside a piece. Bytes, not str: decoding and
    # splitting str costs twice as much, and the few distinct pieces are decoded once at the end.
    counts = Counter(block.data.replace(b"\n", b" ").split(b" "))
    counts.pop(b"", None)  # from empty lines and the final line break
    return block.line_count, counts


def count_pieces(pool: WorkerPool, files: list[Path], total_lines: int) -> Counter[str]:
    counts: Counter[bytes] = Counter()
    with LineProgress("binarize", "count pieces", total_lines) as progress:
        for path in files:
            for block_lines, block_counts in pool.map(_count_block, line_blocks(path)):
                counts.update(block_counts)
                progress.advance(block_lines)
    try:
        return Counter({piece.decode("utf-8"): count for piece, count in counts.items()})
    except UnicodeDecodeError as e:
        raise NmtError(f"{' or '.join(map(str, files))} holds a piece that is not UTF-8 ({e.object!r}); "
                       f"run `{BPE_COMMAND}` again") from None


# ---------------------------------------------------------------------------------------------
# Writing token ids


_INDEX: dict[tuple[str, int, int], dict[bytes, int]] = {}  # per process, by file identity
_EMPTY, _LINE_END = -1, -2  # ids of the markers in a split block (see `_binarize_block`)


def _piece_index(dict_path: str) -> dict[bytes, int]:
    """UTF-8 piece -> id from dict.txt, loaded once per worker (tasks carry the path, not the table)."""
    stat = os.stat(dict_path)
    key = (dict_path, stat.st_mtime_ns, stat.st_size)
    if key not in _INDEX:
        _INDEX.clear()
        index = {symbol.encode(): i for symbol, i in Dictionary.load(Path(dict_path)).index.items()}
        index.update({b"": _EMPTY, b"\n": _LINE_END})  # no symbol is empty or holds a line break
        _INDEX[key] = index
    return _INDEX[key]


def _binarize_block(task: tuple[str, str, Block]) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids of all pieces, pieces per line, number of unknown pieces) of one block of piece lines.

    One split and one `map` over the whole block, no per-line Python or numpy call: each line break
    becomes a token of its own, so line lengths come from the positions of its id. Works on bytes
    (see `_count_block`); a piece that is not valid UTF-8 matches no symbol and counts as unknown.
    """
    dict_path, dtype, block = task
    index = _piece_index(dict_path)
    data = block.data if block.data.endswith(b"\n") else block.data + b"\n"
    tokens = data.replace(b"\n", b" \n ").split(b" ")  # "a b\n\nc\n" -> a b \n '' \n c \n ''
    ids = np.fromiter(map(index.get, tokens, repeat(UNK)), np.int32, len(tokens))
    ids = ids[ids != _EMPTY]
    ends = np.flatnonzero(ids == _LINE_END)
    lengths = np.diff(ends, prepend=-1) - 1
    ids = ids[ids >= 0]
    return ids.astype(dtype), lengths, int(np.count_nonzero(ids == UNK))


def binarize_corpus(pool: WorkerPool, cfg: BinarizeConfig, lines: dict[str, int], langs: tuple[str, str],
                    dict_size: int) -> dict[str, dict[str, Any]]:
    """Write OUT/{split}.{lang}.bin/.idx; returns the manifest's "splits" entry."""
    dtype = token_dtype(dict_size)
    dict_path = str((cfg.out / "dict.txt").resolve())
    splits: dict[str, dict[str, Any]] = {}
    with LineProgress("binarize", "write ids", 2 * sum(lines.values())) as progress:
        for split, expected in lines.items():
            splits[split] = {"sentences": expected, "tokens": {}, "unk_rate": {}}
            for lang in langs:
                source = cfg.bpe / f"{split}.{lang}"
                writer = IndexedWriter(cfg.out / f"{split}.{lang}", dtype)
                unknown = 0
                try:
                    tasks = ((dict_path, dtype.str, block) for block in line_blocks(source))
                    for ids, lengths, block_unknown in pool.map(_binarize_block, tasks):
                        writer.add_many(ids, lengths)
                        unknown += block_unknown
                        progress.advance(len(lengths))
                    if writer.count != expected:
                        raise NmtError(f"{source} has {writer.count} lines but {cfg.bpe}/manifest.json records "
                                       f"{expected}: it changed after `nmt bpe` wrote it; run `{BPE_COMMAND}` again")
                except BaseException:
                    writer.abort()
                    raise
                writer.close()
                splits[split]["tokens"][lang] = writer.tokens
                splits[split]["unk_rate"][lang] = unknown / max(writer.tokens, 1)
    return splits


def _print_summary(out: Path, splits: dict[str, dict[str, Any]], dict_size: int) -> None:
    table = Table(title=f"nmt binarize: {dict_size} symbols, written to {out}")
    for name in ("split", "lang", "sentences", "tokens", "unknown"):
        table.add_column(name, justify="left" if name in ("split", "lang") else "right")
    for split, info in splits.items():
        for lang, tokens in info["tokens"].items():
            table.add_row(split, lang, str(info["sentences"]), str(tokens), f"{100 * info['unk_rate'][lang]:.3f}%")
    Console().print(table)
