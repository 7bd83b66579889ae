"""`nmt prepare ptb`: the Wall Street Journal part of the Penn Treebank as a parsing corpus
(arXiv 1706.03762, section 6.3: train on sections 02-21, about 40K sentences; development section 22;
F1 reported on section 23).

The files are found by name, ``wsj_SSNN.mrg`` (section SS, file NN), anywhere under the folder
given: the LDC release's ``parsed/mrg/wsj/SS/`` layout or a flat folder of them. Each split is a set
of file-number ranges: the standard split by default, or ``--split-files`` (for a sample such as
NLTK's, files 0001-0099 of section 00). Per tree, in file order:

- ``{split}.en``: the words (empty elements removed), as the treebank tokenises them;
- ``{split}.parse``: the normalised tree, linearised (`treebank.linearise`, tags kept or not);
- ``{split}.trees``: the treebank's own tree on one line, root labelled TOP, function tags and empty
  elements left in: the reference of `nmt score --task parse` (EVALB removes them itself).

The manifest's ``parsing.target_symbols`` lists every token of the training trees' linearisations
(``(NP``, ``)NP``, ``XX``, the punctuation tags...): `nmt bpe` keeps each one a single piece, as
Vinyals et al. (2015) give each its own output symbol.

A tree with nothing but empty elements is left out of all three, and so is a training tree of more
than `max_words` words (by default none of WSJ's); both are counted in the manifest.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import IO

from nmt_cli.data import treebank
from nmt_cli.errors import NmtError
from nmt_cli.progress import ProgressReport

SRC_LANG, TGT_LANG, TREES = "en", "parse", "trees"
# Sections 02-21, 22 and 23, as file numbers (section SS holds files SS00-SS99).
STANDARD_SPLIT = "train=0200-2199,valid=2200-2299,test=2300-2399"
_FILE = re.compile(r"wsj_(\d{4})\.mrg")
_ITEM = re.compile(r"(train|valid|test)=(\d+)(?:-(\d+))?")

Ranges = dict[str, list[tuple[int, int]]]


def parse_split(spec: str) -> Ranges:
    """``train=1-79,valid=80-89,test=90-99`` as {split: [(first, last), ...]} (a split may be named
    more than once); train and valid are required, no file number may be in two splits."""
    ranges: Ranges = {}
    for item in filter(None, (part.strip() for part in spec.replace(" ", ",").split(","))):
        m = _ITEM.fullmatch(item)
        if m is None:
            raise NmtError(f"--split-files: {item!r} is not SPLIT=FIRST-LAST (SPLIT one of train, valid, "
                           f"test; file numbers as in wsj_NNNN.mrg), e.g. {STANDARD_SPLIT}")
        first, last = int(m[2]), int(m[3] or m[2])
        if first > last:
            raise NmtError(f"--split-files: {item!r} ends before it starts")
        ranges.setdefault(m[1], []).append((first, last))
    missing = [split for split in ("train", "valid") if split not in ranges]
    if missing:
        raise NmtError(f"--split-files {spec!r} names no {' and no '.join(missing)} files")
    spans = sorted((first, last, split) for split, pairs in ranges.items() for first, last in pairs)
    for (a_first, a_last, a), (b_first, _, b) in zip(spans, spans[1:], strict=False):  # neighbours
        if b_first <= a_last:
            raise NmtError(f"--split-files: file {b_first} is both in {a} ({a_first}-{a_last}) and in {b}")
    return ranges


def find_files(folder: Path) -> dict[int, Path]:
    """{file number: path} of every wsj_NNNN.mrg under `folder`."""
    if not folder.is_dir():
        raise NmtError(f"--treebank {folder} is not a folder: give the treebank's folder (the LDC release, "
                       "or any folder holding its wsj_NNNN.mrg files)")
    found: dict[int, Path] = {}
    for path in sorted(folder.rglob("wsj_*.mrg")):
        m = _FILE.fullmatch(path.name)
        if m is None:
            continue
        number = int(m[1])
        if number in found:
            raise NmtError(f"{found[number]} and {path} are both file {m[1]}: point --treebank at a folder "
                           "holding one copy of the treebank")
        found[number] = path
    if not found:
        raise NmtError(f"no wsj_NNNN.mrg file under {folder}: point --treebank at the treebank (for the LDC "
                       "release, its parsed/mrg/wsj folder or a folder above it)")
    return found


def split_files(files: dict[int, Path], spec: str | None) -> dict[str, list[Path]]:
    """The files of each split, in file order."""
    ranges = parse_split(spec or STANDARD_SPLIT)
    splits = {split: [files[n] for n in sorted(files) if any(a <= n <= b for a, b in pairs)]
              for split, pairs in ranges.items()}
    for split, paths in splits.items():
        if not paths:
            wanted = ", ".join(f"{a:04d}-{b:04d}" for a, b in ranges[split])
            have = f"{min(files):04d}-{max(files):04d}"
            how = "" if spec else " (the standard split by section; for other files give --split-files)"
            raise NmtError(f"no file of the {split} split ({wanted}){how}: the treebank's files are "
                           f"numbered {have} ({len(files)} files)")
    return splits


Write = Callable[[str, str], None]


def write_split(paths: list[Path], pos_tags: treebank.PosTags, write: Write, trees: IO[bytes],
                name: str, max_words: int = 0, symbols: set[str] | None = None) -> dict[str, int]:
    """Each tree of `paths` as a (words, linearised tree) pair through `write` and as a reference
    line in `trees`, leaving out trees of more than `max_words` words (0: none); returns the counts
    for the manifest. `symbols` collects the tokens of the linearised trees."""
    counts = {"files": len(paths), "trees": 0, "words": 0, "empty_trees_left_out": 0,
              "long_trees_left_out": 0}
    line = lambda p: f"prepare ptb {name}: {p.done}/{len(paths)} files, {counts['trees']} trees"  # noqa: E731
    with ProgressReport(f"reading {name}", len(paths), line, every_seconds=10) as report:
        for path in paths:
            for tree in treebank.read_mrg(path):
                normal = treebank.normalise(tree)
                if normal is None:
                    counts["empty_trees_left_out"] += 1
                    continue
                words = normal.words()
                if max_words and len(words) > max_words:
                    counts["long_trees_left_out"] += 1
                    continue
                linear = treebank.linearise(normal, pos_tags)
                write(" ".join(words), linear)
                if symbols is not None:
                    symbols.update(linear.split())
                trees.write((treebank.to_string(treebank.with_root(tree)) + "\n").encode("utf-8"))
                counts["trees"] += 1
                counts["words"] += len(words)
            report.advance(1)
    return counts
