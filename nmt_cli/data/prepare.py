"""`nmt prepare`: raw parallel text in, `OUT/{train,valid,test}.{SRC,TGT}` and a manifest out.

Datasets: `wmt14-en-de` and `wmt14-en-fr` (official archives, see `wmt.py`), `local` (the user's
`PREFIX.SRC`/`PREFIX.TGT` files) and `toy` (generated offline by `toy.py`). Only the training split
is cleaned and filtered (`clean.py`); valid and test are written as published, since references
must stay the text that BLEU is reported against.

The manifest (the contract with `nmt bpe`) has `src_lang`, `tgt_lang`, `splits` with the line count
of each split (no `test` for a local dataset without one), the inputs with their sizes and checksums,
and the counts before and after every cleaning step of every training corpus.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nmt_cli.artifacts import (
    StageOutput,
    atomic_writer,
    count_lines,
    file_record,
    is_done,
    read_manifest,
    say_done,
)
from nmt_cli.config.data import PrepareConfig
from nmt_cli.data import clean, wmt
from nmt_cli.data.download import Retries
from nmt_cli.errors import NmtError, shown

SMALL_INPUT_BYTES = 8 << 20
VALID_TEST_NOTE = ("valid and test are not normalised or filtered: each line is the published text with "
                   "its line ending removed (test: the <seg> text of the SGML with entities decoded and "
                   "whitespace collapsed, as sacreBLEU reads it); in-line line-break characters (CR, VT, FF, "
                   "FS, GS, RS, NEL, U+2028, U+2029) become a space in every split so that all readers count "
                   "the same lines")


def run(cfg: PrepareConfig) -> None:
    src, tgt = languages(cfg)
    _check_options(cfg)
    if _already_done(cfg):
        return say_done(cfg.out, "prepare")
    with StageOutput(cfg.out, "prepare", cfg) as stage:
        stage.info.update(dataset=cfg.dataset, src_lang=src, tgt_lang=tgt)
        # the toy corpus is generated clean: nothing to do to its source, in training or after
        applied = cfg.dataset != "toy"
        stage.info["source_normalization"] = clean.Normalization(
            src if applied and cfg.normalize_punctuation else None,
            applied and cfg.remove_non_printing).record()
        match cfg.dataset:
            case "wmt14-en-de" | "wmt14-en-fr":
                _prepare_wmt(cfg, stage, src, tgt)
            case "local":
                _prepare_local(cfg, stage, src, tgt)
            case "toy":
                _prepare_toy(cfg, stage, src, tgt)
            case "ptb":
                _prepare_ptb(cfg, stage, src, tgt)
    _summary(cfg.out, stage.info)


# ---------------------------------------------------------------------------------------------
# Options


def languages(cfg: PrepareConfig) -> tuple[str, str]:
    """(source, target) language codes: defaults per dataset, either direction of a fixed pair."""
    match cfg.dataset:
        case "wmt14-en-de" | "wmt14-en-fr":
            src, tgt = _direction(cfg, cfg.dataset, ("en", cfg.dataset.removeprefix("wmt14-en-")))
        case "toy":
            from nmt_cli.data import toy

            src, tgt = _direction(cfg, "toy", (toy.SRC_LANG, toy.TGT_LANG))
        case "ptb":
            from nmt_cli.data import ptb

            src, tgt = cfg.src_lang or ptb.SRC_LANG, cfg.tgt_lang or ptb.TGT_LANG
            if (src, tgt) != (ptb.SRC_LANG, ptb.TGT_LANG):
                raise NmtError(f"ptb parses {ptb.SRC_LANG} words into trees ({ptb.TGT_LANG}); leave out "
                               "--src-lang and --tgt-lang")
        case "local":
            if not cfg.src_lang or not cfg.tgt_lang:
                raise NmtError("`nmt prepare local` needs --src-lang and --tgt-lang: the suffixes of your "
                               "files PREFIX.SRC and PREFIX.TGT")
            src, tgt = cfg.src_lang, cfg.tgt_lang
    for lang in (src, tgt):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", lang):
            raise NmtError(f"language code {shown(lang)} must be letters, digits, '_' or '-' "
                           "(it names files)")
    if src == tgt:
        raise NmtError(f"--src-lang and --tgt-lang are both {shown(src)}; they must differ")
    return src, tgt


def _direction(cfg: PrepareConfig, name: str, pair: tuple[str, str]) -> tuple[str, str]:
    def other(lang: str) -> str:
        return pair[1] if lang == pair[0] else pair[0] if lang == pair[1] else lang

    src = cfg.src_lang or (other(cfg.tgt_lang) if cfg.tgt_lang else pair[0])
    tgt = cfg.tgt_lang or other(src)
    if {src, tgt} != set(pair):
        raise NmtError(f"{name} translates between {pair[0]} and {pair[1]} (either way); got --src-lang "
                       f"{src} --tgt-lang {tgt}")
    return src, tgt


def _check_options(cfg: PrepareConfig) -> None:
    wmt14 = cfg.dataset.startswith("wmt14-")
    given = {"--train": cfg.train, "--valid": cfg.valid, "--test": cfg.test}
    if cfg.dataset != "local" and any(v is not None for v in given.values()):
        raise NmtError("--train, --valid and --test are for `nmt prepare local`")
    network = {"--from": cfg.from_dir, "--mirror": cfg.mirror, "--downloads": cfg.downloads,
               "--checksums": cfg.checksums}
    treebank = {"--treebank": cfg.treebank, "--split-files": cfg.split_files}
    if cfg.dataset != "ptb" and any(v is not None for v in treebank.values()):
        raise NmtError("--treebank and --split-files are for `nmt prepare ptb`")
    if cfg.dataset == "ptb" and cfg.treebank is None:
        raise NmtError("`nmt prepare ptb` needs --treebank DIR: the Penn Treebank's folder (LDC99T42, "
                       "licensed: it cannot be downloaded), or any folder holding its wsj_NNNN.mrg files")
    if not wmt14 and any(v is not None for v in network.values()):
        names = ", ".join(k for k, v in network.items() if v is not None)
        raise NmtError(f"{names}: only the wmt14 datasets download anything")
    if cfg.from_dir is not None and cfg.mirror is not None:
        raise NmtError("give --from (no network) or --mirror (download from there), not both")
    if cfg.from_dir is not None and not cfg.from_dir.is_dir():
        raise NmtError(f"--from {cfg.from_dir} is not a folder")
    if cfg.retries < 1 or cfg.timeout_seconds <= 0 or cfg.retry_wait_seconds < 0:
        raise NmtError("retries must be at least 1, timeout_seconds above 0, retry_wait_seconds not negative")
    if cfg.max_words < 0 or cfg.max_ratio < 0 or 0 < cfg.max_ratio < 1:
        raise NmtError(f"max_words must be >= 0 and max_ratio 0 (off) or >= 1; "
                       f"got {cfg.max_words}, {cfg.max_ratio}")
    if cfg.workers < 0:
        raise NmtError(f"workers must be >= 0 (0: one per CPU core); got {cfg.workers}")
    if cfg.dataset == "toy" and (cfg.toy_train < 1 or cfg.toy_valid < 1 or cfg.toy_test < 0):
        raise NmtError("toy_train and toy_valid must be at least 1 and toy_test at least 0")


def _already_done(cfg: PrepareConfig) -> bool:
    if not is_done(cfg.out, "prepare", cfg):
        return False
    if cfg.dataset != "local":
        return True
    inputs = read_manifest(cfg.out, "prepare", "nmt prepare").get("inputs", {})
    return all(isinstance(r, dict) and isinstance(r.get("path"), str) and Path(r["path"]).is_file()
               and Path(r["path"]).stat().st_size == r.get("bytes") for r in inputs.values())


# ---------------------------------------------------------------------------------------------
# Datasets


def _prepare_wmt(cfg: PrepareConfig, stage: StageOutput, src: str, tgt: str) -> None:
    downloads = cfg.downloads or cfg.out / "downloads"
    retries = Retries(cfg.retries, cfg.timeout_seconds, cfg.retry_wait_seconds)
    other = cfg.dataset.removeprefix("wmt14-en-")
    files = wmt.fetch(other, src, tgt, downloads, cfg.from_dir, cfg.mirror, retries, cfg.checksums)
    stage.inputs.update(files.archives)
    errors: clean.Errors = "strict" if cfg.invalid_utf8 == "error" else "replace"
    _clean_train(cfg, stage, src, tgt, files.train, errors)
    _copy_split(stage, "valid", src, tgt, files.valid, errors)
    _sgml_split(stage, "test", src, tgt, files.test, errors)


def _prepare_local(cfg: PrepareConfig, stage: StageOutput, src: str, tgt: str) -> None:
    if cfg.train is None or cfg.valid is None:
        raise NmtError("`nmt prepare local` needs --train PREFIX and --valid PREFIX (and optionally --test "
                       f"PREFIX), where PREFIX.{src} and PREFIX.{tgt} are your files")
    prefixes = {"train": cfg.train, "valid": cfg.valid, "test": cfg.test}
    files = {split: _local_pair(split, p, src, tgt) for split, p in prefixes.items() if p is not None}
    for a, b in files.values():
        stage.inputs.update({str(p): {"path": str(p), **file_record(p, checksum=True)} for p in (a, b)})
    errors: clean.Errors = "replace" if cfg.invalid_utf8 == "replace" else "strict"
    _clean_train(cfg, stage, src, tgt, [(Path(cfg.train).name, *files["train"])], errors)
    _copy_split(stage, "valid", src, tgt, (str(Path(cfg.valid).name), *files["valid"]), errors)
    if "test" in files:
        _copy_split(stage, "test", src, tgt, (str(Path(cfg.test).name), *files["test"]), errors)


def _local_pair(split: str, prefix: str, src: str, tgt: str) -> tuple[Path, Path]:
    """PREFIX.SRC and PREFIX.TGT, checked to exist, to be non-empty and to have equal line counts."""
    paths = (Path(f"{prefix}.{src}").expanduser().absolute(), Path(f"{prefix}.{tgt}").expanduser().absolute())
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise NmtError(f"--{split} {prefix}: {' and '.join(missing)} not found "
                       f"(need PREFIX.{src} and PREFIX.{tgt})")
    counts = [count_lines(p) for p in paths]
    if counts[0] != counts[1]:
        raise NmtError(f"{paths[0]} has {counts[0]} lines but {paths[1]} has {counts[1]}: a parallel "
                       "corpus needs one target line per source line")
    if counts[0] == 0:
        raise NmtError(f"{paths[0]} and {paths[1]} are empty: the {split} split needs at least one pair")
    return paths


def _prepare_toy(cfg: PrepareConfig, stage: StageOutput, src: str, tgt: str) -> None:
    from nmt_cli.data import toy

    reverse = src != toy.SRC_LANG
    for split, size in (("train", cfg.toy_train), ("valid", cfg.toy_valid), ("test", cfg.toy_test)):
        if size == 0:
            continue
        with _split_writer(stage, split, src, tgt, f"toy.pairs({split!r}, {size}, seed={cfg.seed})") as write:
            for a, b in toy.pairs(split, size, cfg.seed):
                a, b = a.translate(clean.LINE_BREAKS), b.translate(clean.LINE_BREAKS)
                write(*((b, a) if reverse else (a, b)))
    stage.info["cleaning"] = {"applied_to": "nothing: the toy corpus is generated clean"}


def _prepare_ptb(cfg: PrepareConfig, stage: StageOutput, src: str, tgt: str) -> None:
    from nmt_cli.data import ptb

    assert cfg.treebank is not None  # _check_options
    files = ptb.find_files(Path(cfg.treebank))
    splits = ptb.split_files(files, cfg.split_files)
    stage.inputs["treebank"] = {"path": str(Path(cfg.treebank).absolute()), "files": len(files),
                                "bytes": sum(p.stat().st_size for p in files.values())}
    symbols: set[str] = set()  # of the training trees
    for split, paths in splits.items():
        name = f"{split}.{ptb.TREES}"
        origin = f"{paths[0].name} .. {paths[-1].name}"
        with _split_writer(stage, split, src, tgt, origin) as write, \
                atomic_writer(stage.out / name, "wb") as trees:
            counts = ptb.write_split(paths, cfg.pos_tags, write, trees, split,
                                     cfg.max_words if split == "train" else 0,
                                     symbols if split == "train" else None)
        stage.add_output(name, lines=counts["trees"])
        stage.info["splits"][split].update(counts, references=name)
    stage.info["cleaning"] = {"applied_to": "nothing: every tree is kept as the treebank has it"}
    stage.info["parsing"] = {"pos_tags": cfg.pos_tags, "split_files": cfg.split_files or ptb.STANDARD_SPLIT,
                             "target_symbols": sorted(symbols)}


# ---------------------------------------------------------------------------------------------
# Writing the splits


@contextlib.contextmanager
def _split_writer(stage: StageOutput, split: str, src: str, tgt: str,
                  origin: Any) -> Iterator[Callable[[str, str], None]]:
    """Write `split`.`src`/`split`.`tgt` atomically, one pair per call; register them when complete."""
    lines = 0
    names = (f"{split}.{src}", f"{split}.{tgt}")
    with atomic_writer(stage.out / names[0], "wb") as fs, atomic_writer(stage.out / names[1], "wb") as ft:
        def write(a: str, b: str) -> None:
            nonlocal lines
            fs.write(a.encode() + b"\n")
            ft.write(b.encode() + b"\n")
            lines += 1
        yield write
        if lines == 0:
            raise NmtError(f"no {split} pair is left (from {origin}); "
                           "check the input and the cleaning settings")
    for name in names:
        stage.add_output(name, lines=lines)
    stage.info.setdefault("splits", {})[split] = {"lines": lines, "from": origin}


def _clean_train(cfg: PrepareConfig, stage: StageOutput, src: str, tgt: str,
                 corpora: list[tuple[str, Path, Path]], errors: clean.Errors) -> None:
    opts = clean.Options.of(cfg, src, tgt, errors)
    records = {}
    origin = [name for name, _, _ in corpora]
    workers = cfg.workers or os.cpu_count() or 1
    if cfg.workers == 0 and sum(p.stat().st_size for _, a, b in corpora for p in (a, b)) < SMALL_INPUT_BYTES:
        workers = 1  # starting worker processes (about a second) would cost more than they save
    with clean.Cleaner(opts, workers) as cleaner, \
            _split_writer(stage, "train", src, tgt, origin) as write:
        for name, a, b in corpora:
            records[name] = cleaner.clean(name, a, b, write)
    from sacremoses import __version__ as sacremoses_version

    stage.info["cleaning"] = {
        "applied_to": "train",
        "settings": {"normalize_punctuation": cfg.normalize_punctuation,
                     "remove_non_printing": cfg.remove_non_printing,
                     "drop_empty": cfg.drop_empty, "max_words": cfg.max_words, "max_ratio": cfg.max_ratio,
                     "dedup": cfg.dedup, "invalid_utf8": errors, "word_counts": "whitespace-separated words",
                     "sacremoses": f"{sacremoses_version} MosesPunctNormalizer(lang) with its defaults"},
        "corpora": records,
        "valid_and_test": VALID_TEST_NOTE,
    }


def _copy_split(stage: StageOutput, split: str, src: str, tgt: str, files: tuple[str, Path, Path],
                errors: clean.Errors) -> None:
    name, a, b = files
    repaired = 0
    with _split_writer(stage, split, src, tgt, name) as write:
        for chunk in clean.read_chunks(a, b):
            for number, (raw_a, raw_b) in enumerate(chunk.pairs, start=chunk.first_line):
                text_a, bad_a = clean.decode(raw_a, errors, str(a), number)
                text_b, bad_b = clean.decode(raw_b, errors, str(b), number)
                repaired += bad_a or bad_b
                write(text_a.translate(clean.LINE_BREAKS), text_b.translate(clean.LINE_BREAKS))
    stage.info["splits"][split]["invalid_utf8_pairs"] = repaired


def _sgml_split(stage: StageOutput, split: str, src: str, tgt: str, files: tuple[str, Path, Path],
                errors: clean.Errors) -> None:
    name, a, b = files
    segments = list(zip_longest(wmt.sgml_segments(a, errors), wmt.sgml_segments(b, errors)))
    if any(x is None or y is None for x, y in segments):
        counts = [sum(1 for pair in segments if pair[i] is not None) for i in (0, 1)]
        raise NmtError(f"{a} has {counts[0]} segments but {b} has {counts[1]}; the test set is damaged: "
                       "delete its archive and download it again")
    with _split_writer(stage, split, src, tgt, name) as write:
        for (text_a, _), (text_b, _) in segments:
            write(text_a.translate(clean.LINE_BREAKS), text_b.translate(clean.LINE_BREAKS))
    stage.info["splits"][split]["invalid_utf8_pairs"] = sum(x[1] or y[1] for x, y in segments)


# ---------------------------------------------------------------------------------------------
# Telling the user


def _summary(out: Path, info: dict[str, Any]) -> None:
    console = Console()
    splits = Table(title=f"nmt prepare {info['dataset']}: {info['src_lang']}->{info['tgt_lang']} in {out}")
    for column in ("split", "pairs", "from"):
        splits.add_column(column, justify="right" if column == "pairs" else "left")
    for split, record in info["splits"].items():
        origin = record["from"] if isinstance(record["from"], str) else ", ".join(record["from"])
        splits.add_row(split, f"{record['lines']:,}", origin)
    console.print(splits)
    corpora = info.get("cleaning", {}).get("corpora")
    if not corpora:
        return
    steps = [s["step"] for s in next(iter(corpora.values()))["steps"]]
    table = Table(title="training pairs removed by each cleaning step")
    for column in ("corpus", "read", *steps, "kept", "bad UTF-8"):
        table.add_column(column, justify="left" if column == "corpus" else "right")
    for name, r in corpora.items():
        removed = [f"{s['before'] - s['after']:,}" for s in r["steps"]]
        table.add_row(name, f"{r['pairs_in']:,}", *removed, f"{r['pairs_out']:,}",
                      f"{r['invalid_utf8_pairs']:,}")
    console.print(table)
