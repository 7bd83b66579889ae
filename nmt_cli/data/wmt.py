"""WMT14 English-German and English-French: the official archives and what `nmt prepare` takes from them.

Training data as in the shared task (and fairseq's prepare-wmt14en2{de,fr}.sh): Europarl v7,
CommonCrawl and News Commentary v9, plus for French the UN corpus (undoc.2000) and the 10^9 French-
English corpus. Valid: newstest2013 (plain text in dev.tgz). Test: the full newstest2014 (3003
segments, SGML in test-full.tgz), read the way sacreBLEU reads it, so `nmt score` on `test.*` agrees
with `sacrebleu -t wmt14/full`.

Published sizes and checksums, where found (a file without one is checked against the
Content-Length the server sends):
- the five training archives: tensorflow-datasets, `tensorflow_datasets/url_checksums/
  wmt14_translate.txt` and `wmt13_translate.txt` (size and sha256 of each download); the
  Europarl and CommonCrawl sha256 also appear in stagedml's WMT fetch code;
- test-full.tgz: the md5 in sacreBLEU's dataset table (`wmt14/full`);
- dev.tgz: the md5 in the download table of Sockeye's autopilot (`contrib/autopilot/tasks.py`,
  `RAW_FILES["wmt14_dev"]`; the table names the same URL).
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt_cli.artifacts import bounded_lines
from nmt_cli.data import archive, download
from nmt_cli.data.clean import Errors, decode
from nmt_cli.data.download import Remote
from nmt_cli.errors import NmtError
from nmt_cli.progress import log

_TFDS = "tensorflow-datasets url_checksums"
ARCHIVES = {remote.name: remote for remote in [
    Remote("training-parallel-europarl-v7.tgz", "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
           657632379, origin=_TFDS,
           sha256="0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
    Remote("training-parallel-commoncrawl.tgz", "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
           918311367, origin=_TFDS,
           sha256="c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
    Remote("training-parallel-nc-v9.tgz", "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
           80418416, origin=_TFDS,
           sha256="cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
    Remote("training-parallel-un.tgz", "http://statmt.org/wmt13/training-parallel-un.tgz",
           2365634246, origin=_TFDS,
           sha256="29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47"),
    Remote("training-giga-fren.tar", "http://statmt.org/wmt10/training-giga-fren.tar",
           2595102720, origin=_TFDS,
           sha256="3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a"),
    Remote("dev.tgz", "http://statmt.org/wmt14/dev.tgz", md5="88ba3fc60b2278d59277122e1c7dd6e7",
           origin="the download table of Sockeye's autopilot (wmt14_dev)"),
    Remote("test-full.tgz", "http://statmt.org/wmt14/test-full.tgz",
           md5="a8cd784e006feb32ac6f3d9ec7eb389a", origin="sacreBLEU's dataset table (wmt14/full)"),
]}


@dataclass(frozen=True)
class Corpus:
    """A parallel corpus inside an archive; `member` has {pair} (e.g. de-en) and {lang} fields."""

    name: str
    archive: str
    member: str

    def members(self, pair: str, src: str, tgt: str) -> tuple[str, str]:
        return self.member.format(pair=pair, lang=src), self.member.format(pair=pair, lang=tgt)


_EUROPARL = Corpus("europarl-v7", "training-parallel-europarl-v7.tgz", "training/europarl-v7.{pair}.{lang}")
_COMMONCRAWL = Corpus("commoncrawl", "training-parallel-commoncrawl.tgz", "commoncrawl.{pair}.{lang}")
_NEWS_COMMENTARY = Corpus("news-commentary-v9", "training-parallel-nc-v9.tgz",
                          "training/news-commentary-v9.{pair}.{lang}")
TRAIN = {
    "de": [_EUROPARL, _COMMONCRAWL, _NEWS_COMMENTARY],
    "fr": [_EUROPARL, _COMMONCRAWL,
           Corpus("un-undoc2000", "training-parallel-un.tgz", "un/undoc.2000.{pair}.{lang}"),
           _NEWS_COMMENTARY,
           Corpus("giga-fren", "training-giga-fren.tar", "giga-fren.release2.fixed.{lang}.gz")],
}
VALID = Corpus("newstest2013", "dev.tgz", "dev/newstest2013.{lang}")
TEST_NAME, TEST_ARCHIVE = "newstest2014-full", "test-full.tgz"


def newstest2014_members(other: str, src: str, tgt: str) -> tuple[str, str]:
    """sacreBLEU's choice: the "src" file of the source language and the "ref" file of the target
    (both directions share one text: deen-src.en equals deen-ref.en)."""
    return (f"test-full/newstest2014-{other}en-src.{src}.sgm",
            f"test-full/newstest2014-{other}en-ref.{tgt}.sgm")


@dataclass
class Files:
    """The extracted files of each split and the records of the archives they came from."""

    train: list[tuple[str, Path, Path]]  # (corpus name, source file, target file)
    valid: tuple[str, Path, Path]
    test: tuple[str, Path, Path]  # SGML
    archives: dict[str, dict[str, Any]]


def fetch(other: str, src: str, tgt: str, downloads: Path, from_dir: Path | None, mirror: str | None,
          retries: download.Retries, checksums: Path | None) -> Files:
    """Download (or take from `from_dir`), verify and extract what WMT14 en-`other` needs."""
    pair = f"{other}-en"
    wanted: dict[str, list[str]] = {}  # archive -> members, in the order of use
    train = []
    for corpus in TRAIN[other]:
        members = corpus.members(pair, src, tgt)
        wanted.setdefault(corpus.archive, []).extend(members)
        train.append((corpus.name, *members, corpus.archive))
    valid_members = VALID.members(pair, src, tgt)
    test = newstest2014_members(other, src, tgt)
    wanted[VALID.archive] = list(valid_members)
    wanted[TEST_ARCHIVE] = list(test)

    remotes = [ARCHIVES[name] for name in wanted]
    if checksums is not None:
        table = download.read_checksums(checksums)
        remotes = [download.with_checksums(r, table, str(checksums)) for r in remotes]
    if from_dir is not None:
        located = download.from_folder(remotes, from_dir)
    else:
        located = [download.download(r, downloads, retries, mirror) for r in remotes]
    records = {r.name: record for r, (_, record) in zip(remotes, located, strict=True)}
    paths: dict[str, Path] = {}
    for remote, (path, _) in zip(remotes, located, strict=True):
        log(f"reading {remote.name}")
        paths |= archive.extract(path, wanted[remote.name], downloads / "extracted" / remote.name)
    return Files(
        train=[(name, paths[s], paths[t]) for name, s, t, _ in train],
        valid=(VALID.name, paths[valid_members[0]], paths[valid_members[1]]),
        test=(TEST_NAME, paths[test[0]], paths[test[1]]),
        archives=records,
    )


# ---------------------------------------------------------------------------------------------
# WMT SGML ("fake SGML": one <seg> per line)

_SEG = re.compile(r"<seg(?:\s[^>]*)?>(.*)</seg>")
_ENTITY = re.compile(r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);")
_WHITESPACE = re.compile(r"\s+")


def clean_segment(text: str) -> str:
    """Entities decoded (only `&...;` ones: a bare `&` stays), stripped, whitespace runs -> one space.

    The whitespace rule is sacreBLEU's (`re.sub(r"\\s+", " ", s.strip())`, which includes NBSP).
    """
    text = _ENTITY.sub(lambda m: html.unescape(m.group(0)), text)
    return _WHITESPACE.sub(" ", text.strip())


def sgml_segments(path: Path, errors: Errors) -> Iterator[tuple[str, bool]]:
    """The text of each `<seg>` of a WMT SGML file and whether its bytes had to be repaired."""
    with open(path, "rb") as f:
        for number, raw in enumerate(bounded_lines(f, path), start=1):
            line, repaired = decode(raw, errors, str(path), number)
            if not line.lstrip().startswith("<seg"):
                continue
            match = _SEG.search(line)
            if not match:
                raise NmtError(f"{path}, line {number}: a <seg> without its </seg> on the same line; "
                               "this is not a WMT SGML file")
            yield clean_segment(match.group(1)), repaired
