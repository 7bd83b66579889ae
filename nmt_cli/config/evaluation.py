"""The configs of `nmt score`, `nmt plot` and `nmt attention`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config.core import opt, required


@dataclass
class ScoreConfig:
    hyp: Path = required("detokenized system output, one line per segment", flag="--hyp")
    ref: Path | None = opt(None, "reference file (required unless --test-set can be downloaded)",
                           flag="--ref")
    test_set: str | None = opt(None, "a sacreBLEU test set name, e.g. wmt14/full", flag="--test-set")
    langpair: str | None = opt(None, "language pair of --test-set, e.g. en-de", flag="--langpair", short="-l")
    out_json: Path | None = opt(None, "write the scores here as JSON (default: HYP.scores.json)",
                                flag="--json")
    tokenize: str = opt("13a", "sacreBLEU tokenizer (13a is its standard)")
    task: Literal["translation", "parse"] = opt(
        "translation", "translation: BLEU and chrF of text; parse: EVALB's labelled bracketing F1 of trees "
        "(one per line; COLLINS.prm, as parsers report)", flag="--task")
    cutoff_len: int = opt(40, "parse: the short-sentence subset holds sentences of at most this many words "
                          "(EVALB's CUTOFF_LEN)", at_least=1)


@dataclass
class PlotConfig:
    runs: tuple[Path, ...] = required(
        "training folders (--save-dir of `nmt train`) or their train.jsonl files", argument=True)
    out: Path = required("the picture: .png or .svg", flag="--out", short="-o")
    x: Literal["updates", "hours"] = opt(
        "updates", "x axis: optimizer updates, or training hours (wall clock)", flag="--x")
    dpi: int = opt(120, "resolution of a PNG, dots per inch", flag="--dpi")


@dataclass
class AttentionConfig:
    model: Path = required("a checkpoint or an averaged model file", argument=True)
    source: str = required("the source sentence, raw text", flag="--source")
    target: str | None = opt(
        None, "the target sentence, raw text (default: the model's own translation, by beam search)",
        flag="--target")
    out: Path = required("the picture (.png or .svg), or the weights with --format json",
                         flag="--out", short="-o")
    kind: Literal["encoder", "decoder", "cross"] = opt(
        "encoder", "encoder self-attention (the paper's figures 3-5), decoder self-attention, or "
        "encoder-decoder (cross) attention", flag="--kind")
    layer: int = opt(0, "layer, 1-based (0: the last)", flag="--layer")
    head: int = opt(0, "head, 1-based (0: every head of the layer, as a grid)", flag="--head")
    style: Literal["heatmap", "lines"] = opt(
        "heatmap", "heatmap: a grid of queries x keys per head; lines: as the paper's figures 3-5, queries "
        "above keys joined by lines as strong as the weight, one colour per head", flag="--style")
    query: str | None = opt(
        None, "lines: only the lines of this query token, as labelled (e.g. making; the first one)",
        flag="--query")
    format: Literal["picture", "json"] = opt(
        "picture", "picture: PNG or SVG by the --out suffix; json: the weights (layout in "
        "nmt_cli/evaluation/attention_maps.py)", flag="--format")
    beam: int = opt(4, "beam size of the translation when --target is not given", flag="--beam")
    dpi: int = opt(120, "resolution of a PNG, dots per inch", flag="--dpi")
