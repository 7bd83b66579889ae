"""The config of `nmt translate` (and of the beam search that validation BLEU runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config.core import Device, Precision, opt, required


@dataclass
class TranslateConfig:
    model: Path = required("a checkpoint or an averaged model file")
    input: Path | None = opt(None, "text to translate, one sentence per line (default: stdin)")
    output: Path | None = opt(None, "where translations go, one line per input line (default: stdout)")
    input_format: Literal["raw", "pieces"] = opt("raw", "raw text, or text already split into sentencepiece pieces")
    output_format: Literal["raw", "pieces"] = opt("raw", "detokenized text, or space-separated sentencepiece pieces")
    beam: int = opt(4, "beam size (1: greedy search)", at_least=1)
    nbest: int = opt(1, "print this many hypotheses per sentence: K lines LINE<TAB>SCORE<TAB>TEXT per input line", at_least=1)
    lenpen: float = opt(0.6, "GNMT length penalty alpha: score / ((5+|Y|)/6)^alpha")
    max_len_a: float = opt(1.0, "maximum output length = a * source length + b", at_least=0)
    max_len_b: int = opt(50, "maximum output length = a * source length + b", at_least=0)
    max_tokens: int = opt(12000, "source-token budget of one batch, padding included", at_least=1)
    chunk_lines: int = opt(20000, "lines read, sorted and translated at a time (memory stays flat)", at_least=1)
    device: Device = opt("auto", "auto: cuda when available, else cpu")
    dtype: Precision = opt("auto", "auto: bf16 on cuda, fp32 on cpu")
    threads: int = opt(0, "CPU threads (0: one per core); on the CPU each searches its own batch", at_least=0)
    compile: bool = opt(False, "run the decoder step through torch.compile (on the CPU in one process per thread, "
                        "each with a copy of the model): faster in bf16, after a minute or more of compiling "
                        "(less once cached); needs a C++ compiler (g++, or $CXX)")
