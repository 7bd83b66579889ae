"""Training speed of `transformer_small` on this CPU, against the CPU's own matrix-multiply peak.

    python benchmarks/train_speed.py [--threads 2] [--seconds 20] [--max-tokens 6144] [--vocab 8000]
    python benchmarks/train_speed.py --threads 1,2      # one table row per thread count and precision
    python benchmarks/train_speed.py --steps eager,compiled   # and through torch.compile (--compile)

Prints, from one run: the matmul peak (fp32, bf16; large square products on --threads threads),
the target tokens per second of real training updates (`train.Trainer.update`: forward, label-smoothed
loss, backward, Adam) in fp32 and bf16, and the model-FLOPs utilisation, counted as `nmt train`
logs it (`nmt_cli/training/flops.py`: the model's matrix products for the real tokens of each
batch, 3 x the forward's, over the peak). The data is synthetic (random ids,
sentence lengths like WMT: about 27 tokens), binarized the way `nmt binarize` writes it.
"warm-up s": the untimed updates first (with --steps compiled, one batch of each shape class that
needs its own graph, then until --warmup updates in a row made no new graph: the compiling);
"graphs": those torch.compile made for the row; "batches": how many of the corpus's batches the row
cycles through (--batches main: those of the commonest shape class only, the same in every row).
"CPU busy" is the process's CPU time over wall time x threads: below ~95%, other processes took
the cores for part of the run, and with 2 threads every parallel operation then waits for its
descheduled partner, so the numbers say more about the neighbours than about the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nmt_cli.artifacts import StageOutput  # noqa: E402
from nmt_cli.config.data import BinarizeConfig  # noqa: E402
from nmt_cli.config.train import BatchConfig, train_base  # noqa: E402
from nmt_cli.data.dataset import Dictionary, IndexedWriter, token_dtype  # noqa: E402
from nmt_cli.training import (
    corpus,  # noqa: E402
    distributed,  # noqa: E402
)
from nmt_cli.training.flops import measured_peak, training_flops  # noqa: E402
from nmt_cli.training.step import COMPILED_MULTIPLE, compiled_graphs  # noqa: E402
from nmt_cli.training.train import Trainer  # noqa: E402
from nmt_cli.training.trainlog import TrainLog  # noqa: E402

CPU = torch.device("cpu")


def idle_share(seconds: float = 2.0) -> float:
    """Share of the machine's CPU time that was idle over the next `seconds` (Linux /proc/stat)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        return sum(fields), fields[3] + fields[4]
    (total0, idle0), _ = sample(), time.sleep(seconds)
    total1, idle1 = sample()
    return (idle1 - idle0) / max(total1 - total0, 1)


def wait_until_idle(minutes: float) -> None:
    """Wait (at most `minutes`) for a moment when other processes leave the CPU at least 90% idle."""
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline and idle_share() < 0.9:
        time.sleep(5)


def tiny_sentencepiece_model(symbols: list[str]) -> bytes:
    """A real sentencepiece model (training checks that the folder has one); the ids are synthetic."""
    model = io.BytesIO()
    lines = (" ".join(symbols[i : i + 20]) for i in range(0, len(symbols), 20))
    spm.SentencePieceTrainer.train(sentence_iterator=lines, model_writer=model, vocab_size=40,
                                   model_type="bpe", minloglevel=2)
    return model.getvalue()


def synthetic_corpus(out: Path, vocab: int, pairs: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    symbols = [f"w{i}" for i in range(vocab - 4)]
    dictionary = Dictionary(["<pad>", "<s>", "</s>", "<unk>", *symbols], [0] * 4 + [1] * len(symbols))
    src_len = np.clip(rng.gamma(3.0, 9.0, pairs), 2, 200).astype(np.int64)  # mean ~27, long tail
    tgt_len = np.clip(src_len * rng.normal(1.1, 0.15, pairs), 2, 200).astype(np.int64)
    with StageOutput(out, "binarize", BinarizeConfig(bpe=Path("synthetic"), out=out)) as stage:
        dictionary.save(out / "dict.txt")
        (out / "spm.model").write_bytes(tiny_sentencepiece_model(symbols))  # read only at loading
        for split, n in (("train", pairs), ("valid", 16)):
            for lang, lengths in (("src", src_len[:n]), ("tgt", tgt_len[:n])):
                writer = IndexedWriter(out / f"{split}.{lang}", token_dtype(vocab))
                writer.add_many(rng.integers(4, vocab, int(lengths.sum())), lengths)
                writer.close()
        stage.info.update(src_lang="src", tgt_lang="tgt", dict_size=vocab, splits={})
    return out


def measure(data: Path, precision: str, step: str, args: argparse.Namespace) -> dict[str, float]:
    cfg = dataclasses.replace(train_base(args.arch), data=data, save_dir=Path(tempfile.mkdtemp()),
                              precision=precision, threads=args.threads, compile=step == "compiled",
                              batch=BatchConfig(max_tokens=args.max_tokens, micro_batches_per_update=1))
    trainer = Trainer(cfg, distributed.setup(cfg), corpus.load(cfg), TrainLog(cfg.save_dir, enabled=False))
    split = trainer.data.train
    order = corpus.order_of(split, 1, cfg.seed)
    done = 0

    # Inductor's CPU code specialises on whether batch x source and batch x target positions exceed
    # 4096 (its `need_use_acc_helper`), and dynamic shapes on a batch of one sentence: a graph for each
    # class of batch. Compiled, one batch of each class the timed batches have is run first (untimed);
    # `--batches main` times only the batches of the commonest class, in every row (one graph).
    classes = np.array([shape_class(split, ids) for ids in split.batches])
    values, counts = np.unique(classes, return_counts=True)
    if args.batches == "main":
        order = order[classes[order] == values[np.argmax(counts)]]
    firsts = [int(order[np.argmax(classes[order] == c)]) for c in np.unique(classes[order])]
    firsts = firsts if step == "compiled" else []
    order = np.concatenate([firsts, order]).astype(np.int64)

    def update() -> tuple[int, int, int]:
        nonlocal done
        batch = order[done % len(order)]
        ids = split.batches[batch]
        trainer.update([ids], int(split.tgt_tokens[batch]), 1)
        done += 1
        return int(split.src_tokens[batch]), int(split.tgt_tokens[batch]), len(ids)

    # Warm-up: `--warmup` updates; compiled, one batch of each class, then until that many in a row
    # made no new graph
    first = compiled_graphs()
    warm_start, quiet, graphs = time.perf_counter(), 0, first
    while quiet < args.warmup or done < len(firsts):
        update()
        quiet, graphs = (quiet + 1, graphs) if compiled_graphs() == graphs else (0, compiled_graphs())
    warmup_seconds = time.perf_counter() - warm_start
    flops, tgt, start, cpu, timed = 0.0, 0, time.perf_counter(), _cpu_seconds(), done
    while time.perf_counter() - start < args.seconds:
        s, t, n = update()
        flops += training_flops(cfg.model, len(trainer.data.dictionary), s, t, n)
        tgt += t
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
    return {"tokens_per_second": tgt / seconds, "flops_per_second": flops / seconds,
            "updates": done - timed, "cpu_busy": cpu / (seconds * args.threads),
            "warmup_seconds": warmup_seconds, "graphs": compiled_graphs() - first,
            "timed_graphs": compiled_graphs() - graphs, "batches": len(order) - len(firsts)}


def shape_class(split: corpus.Split, ids: np.ndarray) -> int:
    """Which of the compiled step's graphs a batch needs (see `measure`): one sentence, batch x
    source positions > 4096, batch x target positions > 4096, as bits."""
    S, T = (COMPILED_MULTIPLE * -(-(int(side.sizes[ids].max()) + 1) // COMPILED_MULTIPLE)
            for side in (split.src, split.tgt))
    return (len(ids) == 1) * 4 + (len(ids) * S > 4096) * 2 + (len(ids) * T > 4096)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2", help="thread counts to measure, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per precision")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates first (and compiling)")
    parser.add_argument("--steps", default="eager", help="eager, compiled (`nmt train --compile`) or both, "
                        "comma-separated")
    parser.add_argument("--batches", choices=("all", "main"), default="all",
                        help="time every batch, or only those of the commonest shape class (one graph)")
    parser.add_argument("--max-tokens", type=int, default=6144)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--arch", default="transformer_small")
    parser.add_argument("--wait-idle-minutes", type=float, default=0.0,
                        help="on a shared machine: before each row, wait up to this long for an idle CPU")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(describe())
    print(f"{args.arch}, vocabulary {args.vocab}, max_tokens {args.max_tokens}, torch {torch.__version__}, "
          f"load average before: {os.getloadavg()[0]:.1f} (other processes on the CPU lower every number)")
    print("MFU = model FLOPs of the real tokens (nmt_cli/training/flops.py) / s / matmul peak")
    print(f"{'threads':<8}{'step':<10}{'precision':<10}{'tgt tok/s':>12}{'model GFLOP/s':>15}"
          f"{'matmul peak GFLOP/s':>22}{'MFU':>8}{'updates':>9}{'CPU busy':>10}{'warm-up s':>11}"
          f"{'graphs':>8}{'batches':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_corpus(Path(tmp) / "bin", args.vocab, pairs=20000)
        for count in threads:
            torch.set_num_threads(count)
            args.threads = count
            for step, precision in itertools.product(args.steps.split(","), ("fp32", "bf16")):
                wait_until_idle(args.wait_idle_minutes)
                before = measured_peak(CPU, precision, size=2048)
                row = measure(data, precision, step, args)
                peak = max(before, measured_peak(CPU, precision, size=2048))  # others share the CPU
                print(f"{count:<8}{step:<10}{precision:<10}{row['tokens_per_second']:>12,.0f}"
                      f"{row['flops_per_second'] / 1e9:>15,.1f}{peak / 1e9:>22,.1f}"
                      f"{row['flops_per_second'] / peak:>8.1%}{row['updates']:>9}{row['cpu_busy']:>10.0%}"
                      f"{row['warmup_seconds']:>11.0f}{row['graphs']:>8}{row['batches']:>9}"
                      + (f" ({row['timed_graphs']} while timed)" if row["timed_graphs"] else ""),
                      flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
