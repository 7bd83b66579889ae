"""`nmt bpe`: learn one sentencepiece BPE model for both languages and split every sentence into pieces.

Reads a folder written by `nmt prepare` ({split}.{lang} text and its manifest) and writes
``spm.model``/``spm.vocab`` and ``{split}.{lang}`` as space-separated pieces, one line per input
line (an empty line stays empty), so `nmt binarize` can build the joint dictionary. With `--model`
and `--target-model` (an imported MarianMT model's source.spm and target.spm), each side is split
with its own model and ``target_spm.model`` is written beside ``spm.model``.

How the model is trained (the paper: "byte-pair encoding with a shared source-target vocabulary of
about 37000 tokens"):
- On at most `sample_sentences` training sentences of both languages, drawn uniformly without
  replacement with our own seed. We sample here rather than with sentencepiece's
  `input_sentence_size`, whose reservoir sampler has a fixed seed built into the library.
- No bos/eos/pad pieces: `dataset.Dictionary` adds its own specials; sentencepiece keeps only `<unk>`.
- Byte fallback only when `character_coverage < 1`: then the rare characters left out of the
  alphabet become UTF-8 byte pieces the model can learn instead of `<unk>`. With full coverage every
  training character is a piece, byte pieces would never occur in the training text and never reach
  the dictionary, and they would only take 256 slots of the vocabulary.
- Lines longer than `MAX_TRAIN_SENTENCE_BYTES` (sentencepiece's default, stated here) are left out of
  training (they are mostly noise, and slow the trainer); they are still encoded. The count is reported.
- The target symbols the manifest names (`parsing.target_symbols`: the tree symbols of `nmt prepare
  ptb`) are user-defined pieces, each always one piece.
"""

from __future__ import annotations

import io
import os
import re
import sys
from collections.abc import Iterator, Sequence
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
from nmt_cli.config.data import BpeConfig
from nmt_cli.data.clean import Normalization
from nmt_cli.data.streaming import Block, WorkerPool, cpu_cores, line_blocks, line_progress, worker_count
from nmt_cli.errors import NmtError

MAX_TRAIN_SENTENCE_BYTES = 4192
TARGET_SPM = "target_spm.model"  # the target side's own model (`--target-model`), in bpe and bin folders
PREPARE_COMMAND = "nmt prepare ... --out RAW"


def run(cfg: BpeConfig) -> None:
    if is_done(cfg.out, "bpe", cfg):
        return say_done(cfg.out, "bpe")
    src, tgt, lines, manifest = read_text_input(cfg.raw, "prepare", PREPARE_COMMAND, cfg.out)
    record = manifest.get("source_normalization")
    normalization = Normalization.from_record(record, f"{cfg.raw}/manifest.json",
                                              f"run `{PREPARE_COMMAND}` again")
    _check_settings(cfg)
    reused = load_model(cfg.model) if cfg.model is not None else None
    target = load_model(cfg.target_model) if cfg.target_model is not None else None
    with StageOutput(cfg.out, "bpe", cfg) as stage:
        stage.inputs["raw"] = {"folder": str(cfg.raw.resolve()),
                               "manifest_sha256": sha256_file(cfg.raw / "manifest.json")}
        if reused is not None:
            stage.inputs["model"] = {"path": str(cfg.model.resolve()), "sha256": sha256_file(cfg.model)}
            model, training = reused, {"trained": False}
        else:
            train_files = [cfg.raw / f"train.{src}", cfg.raw / f"train.{tgt}"]
            symbols = _whole_symbols(manifest, cfg.raw / "manifest.json")
            model, training = train_model(cfg, train_files, 2 * lines["train"], symbols)
        with atomic_writer(cfg.out / "spm.model") as f:
            f.write(model)
        models = [cfg.out / "spm.model"] * 2
        if target is not None:  # the target side's own model: written beside, for binarize and train
            stage.inputs["target_model"] = {"path": str(cfg.target_model.resolve()),
                                            "sha256": sha256_file(cfg.target_model)}
            with atomic_writer(cfg.out / TARGET_SPM) as f:
                f.write(target)
            stage.add_output(TARGET_SPM, checksum=True)
            models[1] = cfg.out / TARGET_SPM
        processor = spm.SentencePieceProcessor(model_proto=model)
        write_vocab(processor, cfg.out / "spm.vocab")
        pieces = encode_corpus(cfg, models, lines, (src, tgt), normalization)
        stage.add_output("spm.model", checksum=True)
        stage.add_output("spm.vocab")
        for split in lines:
            for lang in (src, tgt):
                stage.add_output(f"{split}.{lang}")
        stage.info.update(src_lang=src, tgt_lang=tgt, vocab_size=processor.get_piece_size(),
                          splits={s: {"lines": n, "pieces": pieces[s]} for s, n in lines.items()},
                          sentencepiece={"version": spm.__version__, **training},
                          source_normalization=record)
    _print_summary(cfg.out, lines, pieces, processor.get_piece_size())


def _check_settings(cfg: BpeConfig) -> None:
    """Refuse bad settings before the output folder is touched."""
    if not 0.98 <= cfg.character_coverage <= 1.0:  # sentencepiece's own range, said clearly
        raise NmtError(f"character_coverage must be between 0.98 and 1.0, not {cfg.character_coverage}")
    if cfg.sample_sentences <= 0:
        raise NmtError(f"sample_sentences must be positive, not {cfg.sample_sentences}")
    if cfg.target_model is not None and cfg.model is None:
        raise NmtError("--target-model needs --model (the source side's model): both come from a model's "
                       "folder, such as an imported MarianMT model's source.spm and target.spm")
    if cfg.vocab_size <= 0:
        raise NmtError(f"--vocab-size must be positive, not {cfg.vocab_size}")
    worker_count(cfg.workers)


# ---------------------------------------------------------------------------------------------
# The sentencepiece model


def load_model(path: Path) -> bytes:
    """The bytes of a sentencepiece model file, checked to load and to give pieces without spaces."""
    try:
        model = path.read_bytes()
    except FileNotFoundError:
        raise NmtError(f"--model {path} does not exist") from None
    except OSError as e:
        raise NmtError(f"cannot read --model {path}: {e.strerror}") from None
    processor = sentencepiece_processor(model, f"--model {path}",
                                        "pass the spm.model written by `nmt bpe` or by spm_train, "
                                        "or leave --model out to train one")
    if any(" " in piece for piece in processor.encode("a b", out_type=str)):
        raise NmtError(f"--model {path} keeps spaces inside pieces (trained without whitespace escaping), "
                       "so pieces could not be written space-separated; train a model with `nmt bpe`")
    return model


def sentencepiece_processor(model: bytes, source: str, fix: str) -> spm.SentencePieceProcessor:
    """A processor of the sentencepiece model `model`; bytes that do not parse as one (a damaged or
    foreign file) are an NmtError naming `source`, with `fix`."""
    try:
        return spm.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, OSError):  # what sentencepiece raises for bytes it cannot parse
        raise NmtError(f"{source} is not a sentencepiece model (it does not load as one); {fix}") from None


def _whole_symbols(manifest: dict[str, Any], path: Path) -> list[str]:
    """The target symbols the manifest asks to keep whole (`nmt prepare ptb`'s tree symbols), checked."""
    symbols = manifest.get("parsing", {}).get("target_symbols", [])
    if not isinstance(symbols, list) or not all(isinstance(s, str) and s and not any(c.isspace() for c in s)
                                                for s in symbols):
        raise NmtError(f"{path}: parsing.target_symbols must be a list of tokens without spaces; run "
                       f"`{PREPARE_COMMAND}` again")
    return symbols


def train_model(cfg: BpeConfig, files: list[Path], total_sentences: int,
                symbols: Sequence[str] = ()) -> tuple[bytes, dict[str, Any]]:
    """Train a BPE model on a seeded sample of the lines of `files`; returns (model bytes, facts).
    Each of `symbols` is one piece wherever it stands as a word (a user-defined symbol with its
    leading space, so that it stays one token of the line, not a space and the symbol)."""
    chosen = _choose_lines(total_sentences, cfg.sample_sentences, cfg.seed)
    facts: dict[str, Any] = {
        "trained": True, "model_type": "bpe", "training_sentences": total_sentences,
        "sampled_sentences": total_sentences if chosen is None else len(chosen), "too_long_sentences": 0,
        "byte_fallback": cfg.character_coverage < 1.0, "whole_symbols": len(symbols)}
    failure: list[BaseException] = []  # sentencepiece turns an error in our iterator into a bare RuntimeError
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_sentences(cfg, files, chosen, facts, failure), model_writer=model,
            model_type="bpe", vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage,
            byte_fallback=facts["byte_fallback"], unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
            input_sentence_size=0, max_sentence_length=MAX_TRAIN_SENTENCE_BYTES,
            user_defined_symbols=[f"\N{LOWER ONE EIGHTH BLOCK}{symbol}" for symbol in symbols],
            num_threads=min(cpu_cores(), 128), minloglevel=2)
    except RuntimeError as e:
        if failure:
            raise failure[0] from None
        raise NmtError(_training_error(str(e), files)) from None
    return model.getvalue(), facts


def _choose_lines(total: int, sample: int, seed: int) -> np.ndarray | None:
    """Sorted line numbers (0-based over all files) of a uniform sample, or None to take every line."""
    if total <= sample:
        return None
    return np.sort(np.random.default_rng(seed).choice(total, size=sample, replace=False))


def _training_sentences(cfg: BpeConfig, files: list[Path], chosen: np.ndarray | None, facts: dict[str, Any],
                        failure: list[BaseException]) -> Iterator[str]:
    """The chosen lines of `files`, in file order, for sentencepiece's trainer (which keeps them all)."""
    try:
        with line_progress("bpe", "read training text", facts["training_sentences"]) as progress:
            number = 0  # of the block's first line, counted over all files
            for path in files:
                for block in line_blocks(path):
                    lines = block.lines()
                    if chosen is not None:
                        lo, hi = np.searchsorted(chosen, [number, number + len(lines)])
                        lines = [lines[i] for i in (chosen[lo:hi] - number).tolist()]
                    number += block.line_count
                    facts["too_long_sentences"] += sum(
                        len(line) * 4 > MAX_TRAIN_SENTENCE_BYTES
                        and len(line.encode()) > MAX_TRAIN_SENTENCE_BYTES for line in lines)
                    yield from lines
                    progress.advance(block.line_count)
    except BaseException as e:
        failure.append(e)
        raise
    print(f"stage=bpe step=train sentences={facts['sampled_sentences']} vocab_size={cfg.vocab_size} "
          f"too_long_sentences={facts['too_long_sentences']} (sentencepiece; this can take a while)",
          file=sys.stderr, flush=True)


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def _training_error(message: str, files: list[Path]) -> str:
    text = " and ".join(map(str, files))
    if match := _TOO_HIGH.search(message):
        return (f"--vocab-size {match[1]} is larger than the training text allows: {text} yield at most "
                f"{match[2]} pieces; pass --vocab-size {match[2]} or less (or train on more text)")
    if match := _TOO_SMALL.search(message):
        return (f"--vocab-size {match[1]} is smaller than the alphabet of {text} ({match[2]} characters and "
                f"<unk>); pass --vocab-size {match[2]} or more, or lower character_coverage with --set")
    if "!sentences_.empty()" in message:
        return f"{text} hold no text to train on; check the output of `nmt prepare`"
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return f"sentencepiece could not train on {text}: {first}"


def write_vocab(processor: spm.SentencePieceProcessor, path: Path) -> None:
    """``piece<TAB>score`` per line, the format spm_train writes next to its model."""
    with atomic_writer(path, "w") as f:
        for i in range(processor.get_piece_size()):
            f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n")


# ---------------------------------------------------------------------------------------------
# Encoding every split


_PROCESSOR: dict[tuple[str, int, int], spm.SentencePieceProcessor] = {}  # per process, by file identity


def _encode_block(task: tuple[str, Block, Normalization | None]) -> tuple[int, int, bytes]:
    """(lines, pieces, encoded text) of one block, normalised first if a normalisation is given;
    every input line gives one output line."""
    model_path, block, normalization = task
    stat = os.stat(model_path)
    key = (model_path, stat.st_mtime_ns, stat.st_size)
    if key not in _PROCESSOR:  # once per worker: tasks carry the model's path, not its bytes
        _PROCESSOR.clear()
        _PROCESSOR[key] = spm.SentencePieceProcessor(model_file=model_path)
    lines = block.lines()
    if normalization is not None:
        lines = [normalization.apply(line) for line in lines]
    # one thread: the parallelism is across worker processes
    pieces = _PROCESSOR[key].encode(lines, out_type=str, num_threads=1)
    text = "\n".join(map(" ".join, pieces)) + "\n"
    return len(lines), sum(map(len, pieces)), text.encode()


def encode_corpus(cfg: BpeConfig, models: list[Path], lines: dict[str, int], langs: tuple[str, str],
                  normalization: Normalization | None = None) -> dict[str, dict[str, int]]:
    """Write OUT/{split}.{lang} for every split and language, each language with its model of `models`
    (source, target: one model twice unless `--target-model`); returns {split: {lang: pieces}}. The
    source side of every split but train (which `nmt prepare` normalised) gets `normalization`, as
    `nmt translate` gives it to its input: validation BLEU then sees what translation will."""
    pieces: dict[str, dict[str, int]] = {}
    model_paths = dict(zip(langs, (str(m.resolve()) for m in models), strict=True))
    with WorkerPool(cfg.workers) as pool, line_progress("bpe", "encode", 2 * sum(lines.values())) as progress:
        for split, expected in lines.items():
            pieces[split] = {}
            for lang in langs:
                source = cfg.raw / f"{split}.{lang}"
                done, count = 0, 0
                with atomic_writer(cfg.out / f"{split}.{lang}") as out:
                    todo = normalization if lang == langs[0] and split != "train" else None
                    tasks = ((model_paths[lang], block, todo) for block in line_blocks(source))
                    for n_lines, n_pieces, text in pool.map(_encode_block, tasks):
                        out.write(text)
                        done, count = done + n_lines, count + n_pieces
                        progress.advance(n_lines)
                    if done != expected:
                        raise NmtError(f"{source} has {done} lines but {cfg.raw}/manifest.json records "
                                       f"{expected}: it changed after `nmt prepare` wrote it; "
                                       f"run `{PREPARE_COMMAND}` again")
                pieces[split][lang] = count
    return pieces


def _print_summary(out: Path, lines: dict[str, int], pieces: dict[str, dict[str, int]],
                   vocab_size: int) -> None:
    table = Table(title=f"nmt bpe: {vocab_size} pieces, written to {out}")
    table.add_column("split")
    table.add_column("lines", justify="right")
    for lang in next(iter(pieces.values())):
        table.add_column(f"pieces/line {lang}", justify="right")
    for split, n in lines.items():
        table.add_row(split, str(n), *(f"{c / max(n, 1):.1f}" for c in pieces[split].values()))
    Console().print(table)
