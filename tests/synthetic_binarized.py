"""A stand-in for the output of `nmt binarize`, built directly for the training tests.

SYNTHETIC, NOT THE REAL PIPELINE: it writes the same files `nmt binarize` writes (dict.txt,
{split}.{lang}.bin/.idx, spm.model, manifest.json with stage "binarize") from generated text: random
words, a real sentencepiece model trained on them here, and a target that is the source's pieces
in reverse order (a task a tiny model learns in seconds). Once `nmt prepare toy | bpe | binarize`
exist, the fixtures can call them instead; the training code reads only the files.
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import sentencepiece as spm

from nmt_cli.artifacts import StageOutput
from nmt_cli.config.data import BinarizeConfig
from nmt_cli.data.dataset import Dictionary, IndexedWriter, token_dtype

SRC, TGT = "xx", "yy"


def _sentences(rng: np.random.Generator, count: int, max_words: int) -> list[str]:
    letters = list("abcdefghij")
    lexicon = ["".join(rng.choice(letters, size=rng.integers(2, 6))) for _ in range(60)]
    return [" ".join(rng.choice(lexicon, size=rng.integers(1, max_words + 1))) for _ in range(count)]


def build(out: Path, train: int = 600, valid: int = 60, max_words: int = 8, seed: int = 0,
          long_examples: int = 0) -> Path:
    """Write a binarized folder to `out`: `train`/`valid` pairs, plus `long_examples` training
    pairs of 300 pieces (for tests of skipping what does not fit)."""
    rng = np.random.default_rng(seed)
    text = {split: _sentences(rng, n, max_words) for split, n in (("train", train), ("valid", valid))}
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text["train"]), model_writer=model, vocab_size=40,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = {split: [sp.encode(s, out_type=str) for s in lines] for split, lines in text.items()}
    pieces["train"] += [pieces["train"][0] * (300 // max(len(pieces["train"][0]), 1) + 1)] * long_examples
    counts: Counter[str] = Counter(p for seqs in pieces.values() for seq in seqs for p in seq)
    dictionary = Dictionary.from_counts(counts)
    cfg = BinarizeConfig(bpe=Path("synthetic"), out=out)
    with StageOutput(out, "binarize", cfg) as stage:
        dictionary.save(out / "dict.txt")
        (out / "spm.model").write_bytes(model.getvalue())
        stage.add_output("dict.txt")
        stage.add_output("spm.model")
        splits = {}
        for split, seqs in pieces.items():
            for lang, side in ((SRC, seqs), (TGT, [list(reversed(s)) for s in seqs])):
                writer = IndexedWriter(out / f"{split}.{lang}", token_dtype(len(dictionary)))
                ids = [dictionary.encode(s) for s in side]
                writer.add_many(np.concatenate([np.array(i, np.int64) for i in ids]),
                                np.array([len(i) for i in ids]))
                writer.close()
                stage.add_output(f"{split}.{lang}.bin")
                stage.add_output(f"{split}.{lang}.idx")
            splits[split] = {"sentences": len(seqs)}
        stage.info.update(src_lang=SRC, tgt_lang=TGT, dict_size=len(dictionary), splits=splits)
    return out
