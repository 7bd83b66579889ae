"""What bf16 costs in quality and buys in speed on this CPU: train in fp32 and in bf16 (same seed, same
updates), translate each model in fp32 and in bf16, and score each output with sacreBLEU.

    python benchmarks/precision_table.py --work DIR [--corpora quickstart,multi30k] [--threads 2]

Corpora: `quickstart` is `recipes/quickstart.sh` (the toy corpus, `recipes/quickstart.yaml`);
`multi30k` is the Multi30k en-de run of `tests/test_pipeline.py` (../shared/data/multi30k,
transformer_tiny, 400 updates of 4000 target tokens, the last 3 checkpoints averaged), tested on
test_2016_flickr. Every stage is the `nmt` command a user runs; only `--precision` and `--dtype`
differ between rows. Training tok/s is the mean of train.jsonl's `tokens_per_second`; translation
sent/s and tok/s time the search with sentencepiece (`nmt translate`'s defaults otherwise: beam 4,
`--threads` batches at once), not the loading of the model. Stages already done in DIR are reused,
so an interrupted run picks up where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `nmt translate` does; must precede `import torch`

import sacrebleu
from machine import describe

from nmt_cli.config.inference import TranslateConfig
from nmt_cli.inference.translate import load_translator

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))
MULTI30K_TRAIN = ["--arch", "transformer_tiny", "--max-update", "400", "--tokens-per-update", "4000",
                  "--max-tokens", "4000", "--save-interval-minutes", "0", "--save-interval-updates", "100",
                  "--keep-last", "3", "--set", "optim.warmup_updates=250", "--set",
                  "valid.interval_updates=100", "--set", "log.interval=50", "--device", "cpu"]


def nmt(*args: object) -> None:
    subprocess.run([sys.executable, "-m", "nmt_cli", *map(str, args)], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)


def prepared(corpus: str, work: Path) -> tuple[Path, Path, Path]:
    """(binarized folder, test source, test reference) of `corpus`, made once under `work`."""
    raw, bpe, binarized = work / "raw", work / "bpe", work / "bin"
    if corpus == "quickstart":
        tests, vocab = (raw / "test.en", raw / "test.ty"), 1000
        if not (raw / "manifest.json").exists():
            nmt("prepare", "toy", "--out", raw)
    else:
        folder = SHARED / "multi30k" / "en-de"
        tests, vocab = (folder / "test_2016_flickr.en", folder / "test_2016_flickr.de"), 8000
        if not (raw / "manifest.json").exists():
            nmt("prepare", "local", "--src-lang", "en", "--tgt-lang", "de", "--out", raw,
                f"--train={folder / 'train'}", f"--valid={folder / 'valid'}",
                f"--test={folder / 'test_2016_flickr'}")
    if not (bpe / "manifest.json").exists():
        nmt("bpe", raw, "--out", bpe, "--vocab-size", vocab)
    if not (binarized / "manifest.json").exists():
        nmt("binarize", bpe, "--out", binarized)
    return binarized, *tests


def trained(corpus: str, binarized: Path, precision: str, work: Path) -> tuple[Path, float]:
    """(averaged model file, mean training tok/s) of one training run in `precision`."""
    save, model = work / f"train-{precision}", work / f"model-{precision}.pt"
    if not model.exists():
        settings = (["--config", REPO / "recipes" / "quickstart.yaml"] if corpus == "quickstart"
                    else MULTI30K_TRAIN)
        nmt("train", binarized, "--save-dir", save, *settings, "--precision", precision)
        nmt("average", save, "--last", 5 if corpus == "quickstart" else 3, "--out", model)
    records = [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_second"] for r in records if r.get("kind") == "train"]
    return model, statistics.fmean(speeds)


def translated(model: Path, dtype: str, lines: list[str], threads: int) -> tuple[list[str], float, int]:
    """(outputs, seconds, output pieces) of `nmt translate`'s search of `lines` in `dtype`."""
    translator = load_translator(TranslateConfig(model=model, dtype=dtype, device="cpu", threads=threads),
                                 lambda message: print(f"  ({message})", file=sys.stderr))
    try:
        start = time.perf_counter()
        found = translator.translate(lines)
        seconds = time.perf_counter() - start
    finally:
        translator.close()
    outputs = [nbest[0][1] if nbest else "" for nbest in found]
    return outputs, seconds, sum(len(translator.sp.encode(o)) + 1 for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a folder for the runs (reused)")
    parser.add_argument("--corpora", default="quickstart,multi30k")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(describe())
    print("| corpus | train | translate | BLEU | train tok/s | translate sent/s | translate tok/s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for corpus in args.corpora.split(","):
        work = args.work / corpus
        binarized, source, reference = prepared(corpus, work)
        lines = source.read_text(encoding="utf-8").splitlines()
        refs = [reference.read_text(encoding="utf-8").splitlines()]
        for train_precision in ("fp32", "bf16"):
            model, train_speed = trained(corpus, binarized, train_precision, work)
            for dtype in ("fp32", "bf16"):
                outputs, seconds, pieces = translated(model, dtype, lines, args.threads)
                bleu = sacrebleu.corpus_bleu(outputs, refs).score
                print(f"| {corpus} | {train_precision} | {dtype} | {bleu:.2f} | {train_speed:,.0f} | "
                      f"{len(lines) / seconds:.1f} | {pieces / seconds:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
