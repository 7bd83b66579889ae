"""Training speed of `transformer_small` on this CPU, against the CPU's own matrix-multiply peak.

    python benchmarks/train_speed.py [--threads 2] [--seconds 20] [--max-tokens 6144] [--vocab 8000]
    python benchmarks/train_speed.py --threads 1,2      # one table row per thread count and precision

Prints, from one run: the matmul peak (fp32, bf16; large square products on --threads threads),
the target tokens per second of real training updates (`train.Trainer.update`: forward, label-smoothed
loss, backward, Adam) in fp32 and bf16, and the model-FLOPs utilisation

    MFU = (6 * (P_enc * src_tokens + P_dec * tgt_tokens) + attention) / seconds / matmul peak

where P_enc / P_dec are the parameters used in matrix products per source / target token (encoder
linears; decoder linears plus the tied output projection V x D), and attention counts the two
products QK^T and AV forward and backward: 12 * D * (sum S^2 + sum T^2 / 2 + sum S*T) per layer
(causal self-attention counted half), over real tokens only. The data is synthetic (random ids,
sentence lengths like WMT: about 27 tokens), binarized the way `nmt binarize` writes it.
"CPU busy" is the process's CPU time over wall time x threads: below ~95%, other processes took
the cores for part of the run, and with 2 threads every parallel operation then waits for its
descheduled partner, so the numbers say more about the neighbours than about the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
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
from nmt_cli.training.train import Trainer  # noqa: E402
from nmt_cli.training.trainlog import TrainLog  # noqa: E402


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


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 8) -> float:
    """Best FLOP/s of an n x n x n product (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


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


def matmul_params(trainer: Trainer) -> tuple[int, int]:
    """(encoder, decoder + output projection) weights used in matrix products, per token."""
    model = trainer.model
    encoder = sum(m.weight.numel() for m in model.encoder.modules() if isinstance(m, torch.nn.Linear))
    decoder = sum(m.weight.numel() for m in model.decoder.modules() if isinstance(m, torch.nn.Linear))
    return encoder, decoder + model.embed.weight.numel()


def attention_flops(split: corpus.Split, batches: list[np.ndarray], d_model: int, enc_layers: int,
                    dec_layers: int) -> float:
    flops = 0.0
    for ids in batches:
        s, t = split.src.sizes[ids].astype(np.float64) + 1, split.tgt.sizes[ids].astype(np.float64) + 1
        flops += 12 * d_model * (enc_layers * (s**2).sum() + dec_layers * ((t**2).sum() / 2 + (s * t).sum()))
    return flops


def measure(data: Path, precision: str, args: argparse.Namespace) -> dict[str, float]:
    cfg = dataclasses.replace(train_base(args.arch), data=data, save_dir=Path(tempfile.mkdtemp()),
                              precision=precision, threads=args.threads,
                              batch=BatchConfig(max_tokens=args.max_tokens, micro_batches_per_update=1))
    trainer = Trainer(cfg, distributed.setup(cfg), corpus.load(cfg), TrainLog(cfg.save_dir, enabled=False))
    split = trainer.data.train
    order = corpus.order_of(split, 1, cfg.seed)
    enc, dec = matmul_params(trainer)
    done, used, src, tgt, start, cpu = 0, [], 0, 0, None, 0.0
    while start is None or time.perf_counter() - start < args.seconds:
        ids = split.batches[order[done % len(order)]]
        s, t = (int(split.src_tokens[order[done % len(order)]]),
                int(split.tgt_tokens[order[done % len(order)]]))
        if done == args.warmup:
            start, used, src, tgt, cpu = time.perf_counter(), [], 0, 0, _cpu_seconds()
        trainer.update([ids], t, 1)
        used.append(ids)
        src, tgt, done = src + s, tgt + t, done + 1
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
    flops = 6 * (enc * src + dec * tgt) + attention_flops(split, used, cfg.model.d_model,
                                                         cfg.model.encoder_layers, cfg.model.decoder_layers)
    return {"tokens_per_second": tgt / seconds, "flops_per_second": flops / seconds, "updates": len(used),
            "cpu_busy": cpu / (seconds * args.threads)}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2", help="thread counts to measure, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per precision")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates first")
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
    print("MFU = (6*(P_enc*src_tokens + P_dec*tgt_tokens) + 12*D*L*(sum S^2 + sum T^2/2 + sum S*T)) "
          "/ s / peak")
    print(f"{'threads':<8}{'precision':<10}{'tgt tok/s':>12}{'model GFLOP/s':>15}{'matmul peak GFLOP/s':>22}"
          f"{'MFU':>8}{'updates':>9}{'CPU busy':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_corpus(Path(tmp) / "bin", args.vocab, pairs=20000)
        for count in threads:
            torch.set_num_threads(count)
            args.threads = count
            for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                wait_until_idle(args.wait_idle_minutes)
                before = matmul_peak(dtype)
                row = measure(data, precision, args)
                peak = max(before, matmul_peak(dtype))  # the better of before/after: others share the CPU
                print(f"{count:<8}{precision:<10}{row['tokens_per_second']:>12,.0f}"
                      f"{row['flops_per_second'] / 1e9:>15,.1f}{peak / 1e9:>22,.1f}"
                      f"{row['flops_per_second'] / peak:>8.1%}{row['updates']:>9}{row['cpu_busy']:>10.0%}",
                      flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
