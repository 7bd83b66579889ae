"""Throughput and peak memory of `nmt bpe` (encoding) and `nmt binarize` on a large corpus.

Builds a `nmt prepare`-style folder of N lines per side by repeating the shared WMT training sample
and Multi30k (../shared/data), trains one sentencepiece model on the distinct sentences, then runs
each stage's `run(cfg)` in a fresh process (bpe with `--model`, so only encoding is timed) and
reports lines per second (lines of both languages, all splits) and peak resident memory of the
stage's main process and of its largest worker. Two corpus sizes show whether memory stays flat.

Wall-clock rates depend on what else runs on the machine; "lines per CPU-s" (lines divided by the
CPU time of the stage and its workers) does much less, and times the number of idle cores it
estimates the wall-clock rate of an otherwise idle machine. Run it more than once.

    python benchmarks/data_pipeline.py --lines 1000000 2000000 --workers 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SOURCES = [("wmt-train-sample-10k", "train"), ("multi30k/en-de", "train")]

STAGE_SCRIPT = """
import json, resource, sys
from pathlib import Path
from nmt_cli.data import {stage}
from nmt_cli.config.data import {config}
{stage}.run({config}(**{{k: (Path(v) if k in ("raw", "out", "bpe", "model") and v else v)
                       for k, v in json.loads(sys.argv[1]).items()}}))
me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({{"main_kib": me.ru_maxrss, "worker_kib": workers.ru_maxrss,
                  "main_cpu": me.ru_utime + me.ru_stime, "worker_cpu": workers.ru_utime + workers.ru_stime}}))
"""


def make_corpus(out: Path, lines_per_side: int) -> None:
    """A prepare-like folder: train of `lines_per_side` lines; valid/test from newstest2013/2014."""
    from nmt_cli.artifacts import StageOutput, count_lines
    from nmt_cli.config.data import PrepareConfig

    cfg = PrepareConfig(dataset="local", out=out, src_lang="en", tgt_lang="de", train="benchmark")
    with StageOutput(out, "prepare", cfg) as stage:
        for lang in ("en", "de"):
            pool = [line for folder, name in SOURCES
                    for line in (DATA / folder / f"{name}.{lang}").read_text(encoding="utf-8").splitlines()]
            with open(out / f"train.{lang}", "w", encoding="utf-8") as f:
                f.writelines(f"{line}\n" for line in itertools.islice(itertools.cycle(pool), lines_per_side))
            shutil.copyfile(DATA / "wmt13-newstest2013/en-de" / f"newstest2013.{lang}", out / f"valid.{lang}")
            shutil.copyfile(DATA / "wmt14-newstest2014/en-de" / f"newstest2014.{lang}", out / f"test.{lang}")
        for name in ("train", "valid", "test"):
            for lang in ("en", "de"):
                stage.add_output(f"{name}.{lang}")
        splits = {s: {"lines": count_lines(out / f"{s}.en")} for s in ("train", "valid", "test")}
        stage.info.update(src_lang="en", tgt_lang="de", splits=splits)


def train_model(work: Path, vocab_size: int) -> Path:
    """The sentencepiece model every run reuses, trained once on the distinct sentences."""
    make_corpus(work / "small", 39000)
    run_stage("bpe", "BpeConfig", {"raw": str(work / "small"), "out": str(work / "small-bpe"),
                                   "vocab_size": vocab_size, "workers": 2})
    return work / "small-bpe" / "spm.model"


def run_stage(stage: str, config: str, fields: dict) -> dict:
    start = time.perf_counter()
    script = STAGE_SCRIPT.format(stage=stage, config=config)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(fields)],
                          capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{stage} failed:\n{proc.stdout}\n{proc.stderr}")
    return {"seconds": seconds, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[1_000_000, 2_000_000],
                        help="training lines per side")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=16000)
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the corpora (default: a temp folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="nmt-bench-"))
    model = train_model(work, args.vocab_size)
    print(describe())
    print("| stage | lines per side | lines (both sides, all splits) | seconds | lines/s | CPU s main | "
          "CPU s workers | lines per CPU-s | peak main MiB | peak worker MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.lines:
        raw, bpe, out = work / f"raw-{n}", work / f"bpe-{n}", work / f"bin-{n}"
        make_corpus(raw, n)
        total = 2 * sum(json.loads((raw / "manifest.json").read_text())["splits"][s]["lines"]
                        for s in ("train", "valid", "test"))
        runs = {
            "bpe encode": run_stage("bpe", "BpeConfig", {"raw": str(raw), "out": str(bpe),
                                                         "model": str(model), "workers": args.workers}),
            "binarize": run_stage("binarize", "BinarizeConfig", {"bpe": str(bpe), "out": str(out),
                                                                 "workers": args.workers}),
        }
        for name, r in runs.items():
            print(f"| {name} | {n:,} | {total:,} | {r['seconds']:.1f} | {total / r['seconds']:,.0f} | "
                  f"{r['main_cpu']:.1f} | {r['worker_cpu']:.1f} | "
                  f"{total / (r['main_cpu'] + r['worker_cpu']):,.0f} | "
                  f"{r['main_kib'] / 1024:.0f} | "
                  f"{r['worker_kib'] / 1024:.0f} |", flush=True)
        for folder in (raw, bpe, out):
            shutil.rmtree(folder)
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
