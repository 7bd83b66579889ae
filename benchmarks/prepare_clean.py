"""Throughput of `nmt prepare`'s training-text cleaning, and of its normaliser against sacremoses'.

    python benchmarks/prepare_clean.py [--pairs 200000] [--workers 1 2]

Builds a corpus by repeating the shared 10k-pair WMT sample, then runs the real cleaning
(`clean.Cleaner`, default settings) writing to /dev/null. Prints pairs per second; multiply out to
judge WMT14 (4.5M pairs en-de, 40.8M en-fr before cleaning).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from machine import describe
from rich.console import Console
from rich.table import Table
from sacremoses import MosesPunctNormalizer

from nmt_cli.config.data import PrepareConfig
from nmt_cli.data import clean

SAMPLE = Path(os.environ.get("NMT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data"))
SAMPLE = SAMPLE / "wmt-train-sample-10k/train"


def make_corpus(folder: Path, pairs: int) -> tuple[Path, Path]:
    paths = []
    for lang in ("en", "de"):
        lines = Path(f"{SAMPLE}.{lang}").read_bytes().splitlines(keepends=True)
        path = folder / f"corpus.{lang}"
        with open(path, "wb") as f:
            for i in range(pairs):
                f.write(lines[i % len(lines)])
        paths.append(path)
    return paths[0], paths[1]


def clean_rate(src: Path, tgt: Path, workers: int, pairs: int) -> tuple[float, float]:
    """Pairs per second of wall time, and CPU seconds (this process and its workers) per 1M pairs."""
    opts = clean.Options.of(PrepareConfig(dataset="local", out=Path("unused")), "en", "de")  # the defaults
    start, cpu = time.perf_counter(), os.times()
    with clean.Cleaner(opts, workers) as cleaner, open(os.devnull, "w") as sink:
        cleaner.clean("bench", src, tgt, lambda a, b: sink.write(a + b))
    wall, end = time.perf_counter() - start, os.times()
    fields = ("user", "system", "children_user", "children_system")
    cpu_seconds = sum(getattr(end, k) - getattr(cpu, k) for k in fields)
    return pairs / wall, cpu_seconds / pairs * 1e6


def normalise_rates(lines: list[str]) -> tuple[float, float]:
    moses = MosesPunctNormalizer(lang="de")
    start = time.perf_counter()
    for line in lines:
        moses.normalize(line)
    reference = len(lines) / (time.perf_counter() - start)
    start = time.perf_counter()
    for line in lines:
        clean.normalize_punctuation(line, "de")
    return reference, len(lines) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    table = Table(title=f"cleaning {args.pairs:,} pairs (CPUs: {os.cpu_count()})")
    for column in ("what", "lines or pairs / s (wall)", "CPU s per 1M pairs"):
        table.add_column(column, justify="right" if column != "what" else "left")
    reference, fast = normalise_rates(Path(f"{SAMPLE}.de").read_text(encoding="utf-8").splitlines())
    table.add_row("sacremoses MosesPunctNormalizer.normalize (de lines)", f"{reference:,.0f}", "")
    table.add_row("clean.normalize_punctuation (de lines)", f"{fast:,.0f}", "")
    with tempfile.TemporaryDirectory() as folder:
        src, tgt = make_corpus(Path(folder), args.pairs)
        for workers in args.workers:
            rate, cpu = clean_rate(src, tgt, workers, args.pairs)
            table.add_row(f"Cleaner, all steps, workers={workers} (pairs)", f"{rate:,.0f}", f"{cpu:,.0f}")
    print(describe())
    Console().print(table)


if __name__ == "__main__":
    main()
