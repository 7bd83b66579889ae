"""How much faster a decoding step runs in bf16 than in fp32, by model width, on this CPU: the measure
behind `nmt translate --dtype auto` (`inference/translate.auto_cpu_dtype`: bf16 on CPUs with fast
bf16, at every width). The defaults are a batch of the size `nmt translate` searches on 2 threads
(3,200 source tokens); `--sentences 16` shows the small batches where per-operation costs weigh more.

    python benchmarks/decode_precision.py [--archs transformer_tiny,transformer_small,transformer_base]

For each preset (random weights: the speed of a step does not depend on them, and the steps are
fixed, so no output length differs between the rows): encode `--sentences` random sources of
`--length` tokens, then `--steps` incremental decoding steps of beam 4 rows each with the choice of
the best tokens, as the search runs them; one torch thread (as `nmt translate` searches on the
CPU); the best of `--repeats` after a warm-up, in fp32 and in a bf16 copy.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from machine import describe

from nmt_cli.config.model import ARCHS
from nmt_cli.data.dataset import BOS, EOS
from nmt_cli.inference.beams import best_tokens
from nmt_cli.model.transformer import Transformer


def step_seconds(model: Transformer, src: torch.Tensor, steps: int, beam: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.inference_mode():
            enc = model.encode(src)
            cache = model.start_decoding(enc)
            tokens = torch.full((src.shape[0] * beam,), BOS)
            for step in range(steps):
                best_tokens(model.decode_step(tokens, step, enc, cache), 2 * beam)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="transformer_tiny,transformer_small,transformer_base")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(describe())
    print(f"{args.sentences} sentences of {args.length} tokens, {args.steps} steps of beam 4, vocabulary "
          f"{args.vocab}, one thread; best of {args.repeats}")
    print("| arch | d_model | fp32 s | bf16 s | bf16 speed-up |")
    print("|---|---:|---:|---:|---:|")
    for arch in args.archs.split(","):
        model = Transformer(ARCHS[arch], args.vocab).eval()
        src = torch.randint(4, args.vocab, (args.sentences, args.length))
        src[:, -1] = EOS
        fp32 = step_seconds(model, src, args.steps, 4, args.repeats)
        bf16 = step_seconds(copy.deepcopy(model).to(torch.bfloat16), src, args.steps, 4, args.repeats)
        print(f"| {arch} | {model.cfg.d_model} | {fp32:.3f} | {bf16:.3f} | {fp32 / bf16:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
