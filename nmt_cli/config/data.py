"""The configs of the data stages: `nmt prepare`, `nmt bpe` and `nmt binarize`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config.core import opt, required

Dataset = Literal["wmt14-en-de", "wmt14-en-fr", "local", "toy", "ptb"]


@dataclass
class PrepareConfig:
    dataset: Dataset = required(
        "wmt14-en-de, wmt14-en-fr, local (your own files), toy (generated, offline) or ptb (Penn Treebank "
        "parsing: words to linearised trees)", argument=True)
    out: Path = required("output folder for {train,valid,test}.{SRC,TGT} and manifest.json",
                         flag="--out", short="-o")
    src_lang: str | None = opt(None, "source language code (default: en; required for local)",
                               flag="--src-lang", short="-s")
    tgt_lang: str | None = opt(None, "target language code (default: de or fr; required for local)",
                               flag="--tgt-lang", short="-t")
    downloads: Path | None = opt(None, "where archives are downloaded (default: OUT/downloads)",
                                 flag="--downloads")
    from_dir: Path | None = opt(None, "folder of already-downloaded archives; the network is never used",
                                flag="--from")
    mirror: str | None = opt(None, "base URL replacing http(s)://statmt.org in every download URL",
                             flag="--mirror")
    retries: int = opt(5, "download attempts per file before giving up (with exponential backoff)",
                       at_least=1)
    timeout_seconds: float = opt(60.0, "network timeout per connection attempt", above=0)
    retry_wait_seconds: float = opt(
        2.0, "wait before the second download attempt; doubles for each further one", at_least=0)
    checksums: Path | None = opt(
        None, "a file of 'md5-or-sha256  filename' lines (as sha256sum prints them); an entry replaces the "
        "built-in size and checksum of that file, e.g. for a verified mirror", flag="--checksums")
    train: str | None = opt(None, "local: training prefix; PREFIX.SRC and PREFIX.TGT must exist",
                            flag="--train")
    valid: str | None = opt(None, "local: validation prefix", flag="--valid")
    test: str | None = opt(None, "local: test prefix (optional)", flag="--test")
    normalize_punctuation: bool = opt(True, "Moses punctuation normalisation of the training text")
    remove_non_printing: bool = opt(True, "Moses non-printing-character removal of the training text")
    drop_empty: bool = opt(True, "drop training pairs with an empty or whitespace-only side")
    max_words: int = opt(
        250, "drop training pairs longer than this many words on either side (0: keep all)", at_least=0)
    max_ratio: float = opt(
        1.5, "drop training pairs whose word-length ratio exceeds this (0: keep all)", at_least=0)
    dedup: bool = opt(False, "drop exact duplicate training pairs (keeps a hash per pair in memory)",
                      flag="--dedup/--no-dedup")
    seed: int = opt(1, "toy: random seed of the generated corpus", flag="--seed")
    toy_train: int = opt(20000, "toy: number of training pairs", at_least=1)
    toy_valid: int = opt(500, "toy: number of validation pairs", at_least=1)
    toy_test: int = opt(500, "toy: number of test pairs", at_least=0)
    invalid_utf8: Literal["auto", "error", "replace"] = opt(
        "auto", "auto: error for local files, replace (counted, reported) for downloaded corpora")
    workers: int = opt(0, "processes for cleaning (0: one per CPU core)", flag="--workers", at_least=0)
    treebank: Path | None = opt(None, "ptb: the Penn Treebank folder (LDC99T42's parsed/mrg/wsj, or any "
                                "folder holding wsj_NNNN.mrg files)", flag="--treebank")
    split_files: str | None = opt(
        None, "ptb: the files of each split by their number NNNN, e.g. train=1-79,valid=80-89,test=90-99 "
        "(default: the standard split, sections 02-21, 22 and 23)", flag="--split-files")
    pos_tags: Literal["normalise", "keep"] = opt(
        "normalise", "ptb: in the linearised tree a word is XX (normalise; the punctuation tags EVALB "
        "deletes stay) or its part-of-speech tag (keep)", flag="--pos-tags")


@dataclass
class BpeConfig:
    raw: Path = required("folder written by `nmt prepare`", argument=True)
    out: Path = required("output folder for spm.model, spm.vocab and {split}.{lang} pieces",
                         flag="--out", short="-o")
    vocab_size: int = opt(37000, "joint source+target sentencepiece vocabulary size (paper: 37000 en-de)",
                          flag="--vocab-size", at_least=1)
    model: Path | None = opt(None, "reuse this sentencepiece model instead of training one", flag="--model")
    target_model: Path | None = opt(
        None, "with --model: the target side's own sentencepiece model (an imported MarianMT model's "
        "target.spm, for fine-tuning it); default: --model for both sides", flag="--target-model")
    sample_sentences: int = opt(4_000_000, "train sentencepiece on at most this many sentences (sampled)",
                                flag="--sample-sentences", at_least=1)
    character_coverage: float = opt(
        1.0, "share of characters the model must cover, 0.98 to 1 (below 1 the rest become UTF-8 byte "
        "pieces)", at_least=0.98, at_most=1)
    workers: int = opt(0, "processes for encoding (0: one per CPU core)", flag="--workers", at_least=0)
    seed: int = opt(1, "seed of the sample of training sentences")


@dataclass
class BinarizeConfig:
    bpe: Path = required("folder written by `nmt bpe`", argument=True, metavar="bpe_dir")
    out: Path = required("output folder for dict.txt, {split}.{lang}.bin/.idx and spm.model",
                         flag="--out", short="-o")
    dictionary: Path | None = opt(None, "reuse this dict.txt instead of building one from the training text",
                                  flag="--dictionary")
    min_count: int = opt(0, "leave symbols seen fewer times out of a new dictionary (0: keep all)",
                         at_least=0)
    workers: int = opt(0, "processes for encoding (0: one per CPU core)", flag="--workers", at_least=0)
