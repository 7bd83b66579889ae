"""Cleaning of training pairs, streamed in chunks over worker processes, with every step counted.

The steps, in order (each switchable in `PrepareConfig`):

1. Decoding: only LF ends a line (a CRLF loses its CR). Invalid UTF-8 or a NUL byte (a sign of a
   UTF-16 or binary file) is an error naming the file and line, or, with `errors="replace"`, becomes
   U+FFFD and is counted.
2. Moses punctuation normalisation (normalize-punctuation.perl as ported by sacremoses, with the
   perl script's defaults), then non-printing-character removal as remove-non-printing-char.perl
   does it: each character of Unicode category C becomes a space, except format characters (Cf: soft
   hyphens, zero-width joiners, byte-order marks), which are deleted so they do not split a word.
3. Filters from Moses clean-corpus-n.perl (fairseq runs it with `-ratio 1.5 ... 1 250`), here on
   whitespace-separated words: an empty side, more than `max_words` words on a side, or a word-count
   ratio `max(a, b) / min(a, b)` above `max_ratio` (strictly above, as the perl script tests).
4. Exact-duplicate removal (optional): the first occurrence of a (source, target) pair is kept;
   the main process keeps an 8-byte hash per pair seen.

Every output line also has the characters that some readers take as a line break (CR, VT, FF, the
separators FS/GS/RS, NEL, U+2028, U+2029) turned into spaces, so all tools count the same lines.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import itertools
import multiprocessing
import re
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import regex
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from nmt_cli.artifacts import bounded_lines
from nmt_cli.config.data import PrepareConfig
from nmt_cli.errors import NmtError, shown
from nmt_cli.progress import ProgressReport

Errors = Literal["strict", "replace"]
STEPS = ("drop_empty", "max_words", "max_ratio", "dedup")
CHUNK_PAIRS = 4000
LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})
_FORMAT_CHARS = regex.compile(r"\p{Cf}")
_OTHER_CHARS = regex.compile(r"\p{C}")
_SPACE_RUNS = re.compile(r" {2,}")


@dataclass(frozen=True)
class Options:
    """The cleaning steps of a PrepareConfig (which holds their defaults), for one language pair."""

    src_lang: str
    tgt_lang: str
    normalize_punctuation: bool
    remove_non_printing: bool
    drop_empty: bool
    max_words: int
    max_ratio: float
    dedup: bool
    errors: Errors

    @classmethod
    def of(cls, cfg: PrepareConfig, src_lang: str, tgt_lang: str, errors: Errors = "strict") -> Options:
        return cls(src_lang, tgt_lang, cfg.normalize_punctuation, cfg.remove_non_printing, cfg.drop_empty,
                   cfg.max_words, cfg.max_ratio, cfg.dedup, errors)

    def steps(self) -> list[str]:
        on = {"drop_empty": self.drop_empty, "max_words": self.max_words > 0,
              "max_ratio": self.max_ratio > 0, "dedup": self.dedup}
        return [step for step in STEPS if on[step]]


# ---------------------------------------------------------------------------------------------
# One line, one pair


def decode(raw: bytes, errors: Errors, path: str, line: int) -> tuple[str, bool]:
    """The text of one raw line (LF and a CR before it removed) and whether it had to be repaired."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if b"\x00" not in raw:
        try:
            return raw.decode("utf-8"), False
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 (byte {e.start + 1} of the line)"
    else:
        problem = "a NUL byte (is it a UTF-16 or binary file?)"
    if errors == "strict":
        raise NmtError(f"{path}, line {line}: {problem}; convert the file to UTF-8 text (e.g. with iconv) "
                       "or pass --set invalid_utf8=replace to replace bad bytes with U+FFFD")
    return raw.decode("utf-8", errors="replace").replace("\x00", "\ufffd"), True


@functools.cache
def _moses_substitutions(lang: str) -> list[tuple[re.Pattern, str]]:
    """sacremoses' own substitution list for `lang`, compiled once (its normalize() recompiles per call)."""
    from sacremoses import MosesPunctNormalizer

    substitutions = MosesPunctNormalizer(lang=lang).substitutions
    return [(re.compile(pattern), replacement) for pattern, replacement in substitutions]


def normalize_punctuation(text: str, lang: str) -> str:
    """Equal to `sacremoses.MosesPunctNormalizer(lang).normalize(text)` (tested), and faster: the
    patterns are compiled once, not on every call."""
    for pattern, replacement in _moses_substitutions(lang):
        text = pattern.sub(replacement, text)
    return text.strip()


def remove_non_printing(text: str) -> str:
    if text.isascii() and text.isprintable():
        return text
    text = _OTHER_CHARS.sub(" ", _FORMAT_CHARS.sub("", text))
    return _SPACE_RUNS.sub(" ", text).strip()


@dataclass(frozen=True)
class Normalization:
    """What `nmt prepare` did to the training source text. The manifests of prepare, bpe and binarize
    and then the model file carry it, so that the source text of validation (`nmt bpe`) and of
    `nmt translate` gets exactly the same: a model trained on Moses-normalised quotes and dashes never
    sees others. References are never normalised."""

    punctuation_lang: str | None  # Moses punctuation normalisation for this language; None: not applied
    remove_non_printing: bool

    def apply(self, text: str) -> str:
        """`text` as `clean_chunk` leaves a training source line (before its line-break mapping)."""
        if self.punctuation_lang is not None:
            text = normalize_punctuation(text, self.punctuation_lang)
        if self.remove_non_printing:
            text = remove_non_printing(text)
        return text

    def record(self) -> dict[str, Any]:
        return {"normalize_punctuation": self.punctuation_lang is not None, "lang": self.punctuation_lang,
                "remove_non_printing": self.remove_non_printing}

    @classmethod
    def from_record(cls, record: Any, where: str, fix: str) -> Normalization | None:
        """The normalisation `record` describes; None (nothing recorded: an older file) stays None."""
        if record is None:
            return None
        valid = (isinstance(record, dict) and type(record.get("normalize_punctuation")) is bool
                 and type(record.get("remove_non_printing")) is bool
                 and (isinstance(record.get("lang"), str) or not record["normalize_punctuation"]))
        if not valid:
            raise NmtError(f"{where}: the source normalisation record is damaged ({shown(record)}); {fix}")
        lang = record["lang"] if record["normalize_punctuation"] else None
        return cls(lang, record["remove_non_printing"])


def too_uneven(src_words: int, tgt_words: int, max_ratio: float) -> bool:
    """clean-corpus-n.perl: drop when src/tgt > ratio or tgt/src > ratio. One empty side is
    infinitely uneven."""
    if src_words == 0 or tgt_words == 0:
        return src_words != tgt_words
    return src_words / tgt_words > max_ratio or tgt_words / src_words > max_ratio


def drop_reason(src: str, tgt: str, opts: Options) -> str | None:
    """The first filter step that removes the pair, or None when it is kept."""
    if opts.drop_empty and (not src.strip() or not tgt.strip()):
        return "drop_empty"
    src_words, tgt_words = len(src.split()), len(tgt.split())
    if opts.max_words > 0 and (src_words > opts.max_words or tgt_words > opts.max_words):
        return "max_words"
    if opts.max_ratio > 0 and too_uneven(src_words, tgt_words, opts.max_ratio):
        return "max_ratio"
    return None


def pair_hash(src: str, tgt: str) -> int:
    digest = hashlib.blake2b(src.encode() + b"\x00" + tgt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# ---------------------------------------------------------------------------------------------
# Chunks (what a worker process gets and returns)


@dataclass
class Chunk:
    src_path: str
    tgt_path: str
    first_line: int
    pairs: list[tuple[bytes, bytes]]


@dataclass
class Cleaned:
    kept: list[tuple[str, str]] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)


def clean_chunk(chunk: Chunk, opts: Options) -> Cleaned:
    out = Cleaned()
    for number, (raw_src, raw_tgt) in enumerate(chunk.pairs, start=chunk.first_line):
        src, bad_src = decode(raw_src, opts.errors, chunk.src_path, number)
        tgt, bad_tgt = decode(raw_tgt, opts.errors, chunk.tgt_path, number)
        out.counts["invalid_utf8"] += bad_src or bad_tgt
        if opts.normalize_punctuation:
            new_src = normalize_punctuation(src, opts.src_lang)
            new_tgt = normalize_punctuation(tgt, opts.tgt_lang)
            out.counts["normalize_punctuation"] += new_src != src or new_tgt != tgt
            src, tgt = new_src, new_tgt
        if opts.remove_non_printing:
            new_src, new_tgt = remove_non_printing(src), remove_non_printing(tgt)
            out.counts["remove_non_printing"] += new_src != src or new_tgt != tgt
            src, tgt = new_src, new_tgt
        src, tgt = src.translate(LINE_BREAKS), tgt.translate(LINE_BREAKS)
        reason = drop_reason(src, tgt, opts)
        if reason:
            out.counts[reason] += 1
            continue
        out.kept.append((src, tgt))
        if opts.dedup:
            out.hashes.append(pair_hash(src, tgt))
    return out


def open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb", buffering=1 << 20)


def read_chunks(src: Path, tgt: Path, chunk_pairs: int = CHUNK_PAIRS) -> Iterator[Chunk]:
    """Chunks of raw line pairs read in lockstep; unequal line counts are an error naming both."""
    try:
        yield from _read_chunks(src, tgt, chunk_pairs)
    except (OSError, EOFError, zlib.error) as e:  # a damaged .gz, a disk error
        raise NmtError(f"cannot read {src} or {tgt}: {e}; if it came from an archive, delete the archive "
                       "and its extracted folder and run again") from None


def _read_chunks(src: Path, tgt: Path, chunk_pairs: int) -> Iterator[Chunk]:
    with open_binary(src) as raw_src, open_binary(tgt) as raw_tgt:
        fs, ft = bounded_lines(raw_src, src), bounded_lines(raw_tgt, tgt)
        line = 1
        while True:
            pairs = list(itertools.islice(itertools.zip_longest(fs, ft), chunk_pairs))
            short = next((i for i, (a, b) in enumerate(pairs) if a is None or b is None), None)
            if short is not None:
                done = line - 1 + short
                rest_src = done + sum(1 for a, _ in pairs[short:] if a is not None) + sum(1 for _ in fs)
                rest_tgt = done + sum(1 for _, b in pairs[short:] if b is not None) + sum(1 for _ in ft)
                raise NmtError(f"{src} has {rest_src} lines but {tgt} has {rest_tgt}: a parallel corpus "
                               "needs one target line per source line")
            if not pairs:
                return
            yield Chunk(str(src), str(tgt), line, pairs)
            line += len(pairs)


# ---------------------------------------------------------------------------------------------
# A whole corpus


class Cleaner:
    """Cleans corpora over `workers` processes (1: in this process), keeping the input order."""

    def __init__(self, opts: Options, workers: int, chunk_pairs: int = CHUNK_PAIRS) -> None:
        self.opts, self.workers, self.chunk_pairs = opts, max(1, workers), chunk_pairs
        self.seen: set[int] = set()  # hashes of the pairs written so far (dedup across corpora)
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Cleaner:
        if self.workers > 1:
            # spawn: no fork of a process that runs threads (rich's progress refresh)
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def clean(self, name: str, src: Path, tgt: Path, write: Callable[[str, str], None]) -> dict[str, Any]:
        """Clean one corpus, writing kept pairs through `write`; return its counts for the manifest."""
        counts: Counter = Counter()
        pairs_in = 0
        sizes = (_size(src), _size(tgt))
        with _progress(name, None if None in sizes else sum(sizes)) as progress:
            for chunk, result in self._cleaned(read_chunks(src, tgt, self.chunk_pairs)):
                pairs_in += len(chunk.pairs)
                counts.update(result.counts)
                for (s, t), digest in itertools.zip_longest(result.kept, result.hashes):
                    if digest is not None and digest in self.seen:
                        counts["dedup"] += 1
                        continue
                    if digest is not None:
                        self.seen.add(digest)
                    write(s, t)
                progress.advance(sum(len(a) + len(b) for a, b in chunk.pairs), pairs=pairs_in)
        return _record(src, tgt, pairs_in, counts, self.opts)

    def _cleaned(self, chunks: Iterator[Chunk]) -> Iterator[tuple[Chunk, Cleaned]]:
        if self.pool is None:
            yield from ((chunk, clean_chunk(chunk, self.opts)) for chunk in chunks)
            return
        pending: deque = deque()  # at most 2 chunks per worker in flight: memory stays flat
        try:
            for chunk in chunks:
                pending.append((chunk, self.pool.submit(clean_chunk, chunk, self.opts)))
                if len(pending) >= 2 * self.workers:
                    chunk, future = pending.popleft()
                    yield chunk, future.result()
            while pending:
                chunk, future = pending.popleft()
                yield chunk, future.result()
        except BrokenProcessPool:
            raise NmtError("a cleaning worker process died (out of memory, or killed); run again, with "
                           "fewer --workers if memory is short") from None
        finally:
            for _, future in pending:
                future.cancel()


def _record(src: Path, tgt: Path, pairs_in: int, counts: Counter, opts: Options) -> dict[str, Any]:
    steps, remaining = [], pairs_in
    for step in opts.steps():
        steps.append({"step": step, "before": remaining, "after": remaining - counts[step]})
        remaining -= counts[step]
    changed = {k: counts[k] for k in ("normalize_punctuation", "remove_non_printing") if getattr(opts, k)}
    return {"src": str(src), "tgt": str(tgt), "pairs_in": pairs_in,
            "invalid_utf8_pairs": counts["invalid_utf8"], "pairs_changed_by": changed, "steps": steps,
            "pairs_out": remaining}


def _size(path: Path) -> int | None:
    return None if path.suffix == ".gz" else path.stat().st_size


def _progress(name: str, total_bytes: int | None) -> ProgressReport:
    """A bar over the input bytes on a terminal; one line per corpus otherwise."""
    columns = (TextColumn("cleaning {task.description}"), BarColumn(),
               TextColumn("{task.fields[pairs]} pairs"), TimeElapsedColumn())
    return ProgressReport(name, total_bytes, lambda p: f"cleaned {name}: {p.fields['pairs']} pairs read",
                          columns=columns, pairs=0)
