"""The config of `nmt translate` (and of the beam search that validation BLEU runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config.core import Device, Precision, opt, required

# How the beam search keeps hypotheses (inference/search.py): the paper's (tensor2tensor's, fairseq's)
# keeps `beam` live ones at every step; the shrinking one (Marian's) gives a finished one's slot up.
BeamStyle = Literal["paper", "shrinking"]
# When a sentence's search ends (inference/search.py): once no live hypothesis can still enter the
# n-best (tensor2tensor's rule, the paper's), or once `beam` hypotheses have finished (fairseq's and
# CTranslate2's).
Stop = Literal["bound", "beam"]


@dataclass
class TranslateConfig:
    model: tuple[Path, ...] = required("a checkpoint or an averaged model file; several: an ensemble, whose "
                                       "models' log-probabilities are averaged at every step", argument=True)
    input: Path | None = opt(None, "text to translate, one sentence per line (default: stdin)",
                             flag="--input", short="-i")
    output: Path | None = opt(None, "where translations go, one line per input line (default: stdout)",
                              flag="--output", short="-o")
    beam: int = opt(4, "beam size (1: greedy search)", flag="--beam", at_least=1)
    beam_style: BeamStyle = opt(
        "paper", "paper: `beam` live hypotheses at every step, finished ones collected beside them "
        "(tensor2tensor, fairseq); shrinking: a finished hypothesis takes its slot with it (Marian)",
        flag="--beam-style")
    stop: Stop = opt(
        "bound", "when a sentence's search ends. bound: once no live hypothesis can still enter the n-best "
        "(tensor2tensor's rule, the paper's: the n-best of a search run to the maximum length); beam: once "
        "`beam` hypotheses have finished (fairseq's and CTranslate2's rule: fewer steps, but a longer "
        "hypothesis the length penalty prefers may be missed)", flag="--stop")
    nbest: int = opt(1, "print this many hypotheses per sentence: K lines LINE<TAB>SCORE<TAB>TEXT per input "
                     "line", flag="--nbest", at_least=1)
    lenpen: float = opt(0.6, "GNMT length penalty alpha: score / ((5+|Y|)/6)^alpha", flag="--lenpen")
    length_penalty: Literal["gnmt", "fairseq"] = opt(
        "gnmt", "the length penalty's form: GNMT's ((5+|Y|)/6)^alpha, or fairseq's |Y|^alpha (|Y| counts "
        "EOS)",
        flag="--length-penalty")
    max_len_a: float = opt(1.0, "maximum output length = a * source length + b", at_least=0)
    max_len_b: int = opt(50, "maximum output length = a * source length + b", at_least=0)
    max_tokens: int = opt(12000, "source-token budget of one batch, padding included", flag="--max-tokens",
                          at_least=1)
    chunk_lines: int = opt(20000, "lines read, sorted and translated at a time (memory stays flat)",
                           at_least=1)
    input_format: Literal["raw", "pieces"] = opt(
        "raw", "raw text, or text already split into sentencepiece pieces", flag="--input-format")
    output_format: Literal["raw", "pieces", "tree"] = opt(
        "raw", "detokenized text, space-separated sentencepiece pieces, or (a parsing model of `nmt prepare "
        "ptb`) the output as a bracketed tree over the input's words, ill-formed ones repaired and counted",
        flag="--output-format")
    constrain: bool = opt(True, "with --output-format tree: search only well-formed trees over the input's "
                          "words (a word token for each input word, brackets opened and closed in pairs); "
                          "not with --compile or an exported folder, whose outputs are repaired instead",
                          flag="--constrain/--no-constrain")
    device: Device = opt("auto", "auto: cuda when available, else cpu", flag="--device")
    dtype: Literal[Precision, "int8"] = opt(
        "auto", "auto: bf16 on cuda; on a CPU bf16 where its bf16 matrix products measure fast (but fp32 "
        "for greedy search with d_model < 256), else fp32; int8 (a CPU only): the linear layers as int8 "
        "matrix products, faster, with a small loss of BLEU", flag="--dtype")
    threads: int = opt(0, "CPU threads (0: one per core); on the CPU each searches its own batch",
                       flag="--threads", at_least=0)
    compile: bool = opt(False, "run the decoder step through torch.compile (on the CPU in one process per "
                        "thread, each with a copy of the model): faster in bf16, after a minute or more of "
                        "compiling (less once cached); needs a C++ compiler (g++, or $CXX)",
                        flag="--compile/--no-compile")
    normalize: Literal["model", "none"] = opt(
        "model", "model: normalise the source text as the model's training text was (the settings of "
        "`nmt prepare` in the model file; models from before nmt recorded them: none); none: feed it as it "
        "is", flag="--normalize")

    def __post_init__(self) -> None:
        if isinstance(self.model, (str, Path)):  # one model file, as callers in code name it
            self.model = (Path(self.model),)
