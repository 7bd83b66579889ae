"""The two beam searches on the same model and sentences: the paper's (`--beam-style paper`, the
default: `beam` live hypotheses every step, finished ones collected beside them) against the
shrinking one (`--beam-style shrinking`: a finished hypothesis takes its slot with it).

    python benchmarks/beam_styles.py --model MODEL.pt --source SRC --reference REF [--sentences N]
        [--threads 2] [--beam 4] [--rounds 2]

Each round translates the sentences with each style in turn (so that a change in the machine's load
falls on both), as `nmt translate` does by default: the model file's source normalisation, fp32,
`--threads` batches searched at once on one torch thread each. Per row: sentences/s and target
tokens/s (search and sentencepiece, not model loading), the mean length and mean model score
(log P / lp, what the search maximises) of the best hypotheses, and sacreBLEU against the raw
reference.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `nmt translate` does; must precede `import torch`

import sacrebleu
import torch
from machine import describe

from nmt_cli.config.inference import TranslateConfig
from nmt_cli.inference.search import translate_ids
from nmt_cli.inference.translate import Translator, load_translator


def measure(translator: Translator, lines: list[str]) -> tuple[float, int, float, list[str]]:
    """(wall seconds, target tokens with EOS, summed best scores, detokenized outputs)."""
    start = time.perf_counter()
    sources = [translator.encode(line, i + 1) for i, line in enumerate(lines)]
    found = translate_ids(translator.model, sources, translator.cfg, workers=translator.workers)
    outputs = [translator.decode(h[0].tokens) for h in found]
    seconds = time.perf_counter() - start
    return seconds, sum(len(h[0].tokens) + 1 for h in found), sum(h[0].score for h in found), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lines = args.source.read_text(encoding="utf-8").splitlines()[: args.sentences]
    refs = args.reference.read_text(encoding="utf-8").splitlines()[: args.sentences]
    translators = {style: load_translator(TranslateConfig(model=args.model, beam=args.beam, beam_style=style,
                                                          dtype="fp32", device="cpu", threads=args.threads),
                                          lambda _: None)
                   for style in ("paper", "shrinking")}
    model = translators["paper"].model
    print(describe())
    print(f"model {args.model}: {model.cfg.encoder_layers}+{model.cfg.decoder_layers} layers, d_model "
          f"{model.cfg.d_model}; {len(lines)} sentences of {args.source}, beam {args.beam}, lenpen "
          f"{translators['paper'].cfg.lenpen}, fp32, {args.threads} threads, torch {torch.__version__}")
    print(f"{'style':<10} {'round':>5} {'seconds':>8} {'sent/s':>7} {'tok/s':>7} {'out len':>7} {'score':>7} "
          f"{'BLEU':>6}")
    measure(translators["paper"], lines[:20])  # warm-up: thread pools, kernel selection
    for round_ in range(1, args.rounds + 1):
        for style, translator in translators.items():
            seconds, tokens, score, outputs = measure(translator, lines)
            bleu = sacrebleu.corpus_bleu(outputs, [refs]).score
            print(f"{style:<10} {round_:>5} {seconds:>8.1f} {len(lines) / seconds:>7.1f} "
                  f"{tokens / seconds:>7.0f} {tokens / len(lines):>7.2f} {score / len(lines):>7.4f} "
                  f"{bleu:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
