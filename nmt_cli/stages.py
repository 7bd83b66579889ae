"""The typed config of every stage: the only place a default lives.

Each `nmt` command builds one of these with `config.resolve` (defaults < YAML < command line) and
passes it to its module's `run(cfg)`. Defaults follow "Attention Is All You Need" (arXiv 1706.03762) unless
the help text says otherwise. No torch here: `nmt --help` imports this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config import opt, required
from nmt_cli.errors import NmtError

Dataset = Literal["wmt14-en-de", "wmt14-en-fr", "local", "toy"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass
class PrepareConfig:
    dataset: Dataset = required("wmt14-en-de, wmt14-en-fr, local (your own files) or toy (generated, offline)")
    out: Path = required("output folder for {train,valid,test}.{SRC,TGT} and manifest.json")
    src_lang: str | None = opt(None, "source language code (default: en; required for local)")
    tgt_lang: str | None = opt(None, "target language code (default: de or fr; required for local)")
    downloads: Path | None = opt(None, "where archives are downloaded (default: OUT/downloads)")
    from_dir: Path | None = opt(None, "folder of already-downloaded archives; the network is never used")
    mirror: str | None = opt(None, "base URL replacing http(s)://statmt.org in every download URL")
    retries: int = opt(5, "download attempts per file before giving up (with exponential backoff)", at_least=1)
    timeout_seconds: float = opt(60.0, "network timeout per connection attempt", above=0)
    retry_wait_seconds: float = opt(2.0, "wait before the second download attempt; doubles for each further one", at_least=0)
    checksums: Path | None = opt(
        None, "a file of 'md5-or-sha256  filename' lines (as sha256sum prints them); an entry replaces the "
        "built-in size and checksum of that file, e.g. for a verified mirror")
    train: str | None = opt(None, "local: training prefix; PREFIX.SRC and PREFIX.TGT must exist")
    valid: str | None = opt(None, "local: validation prefix")
    test: str | None = opt(None, "local: test prefix (optional)")
    normalize_punctuation: bool = opt(True, "Moses punctuation normalisation of the training text")
    remove_non_printing: bool = opt(True, "Moses non-printing-character removal of the training text")
    drop_empty: bool = opt(True, "drop training pairs with an empty or whitespace-only side")
    max_words: int = opt(250, "drop training pairs longer than this many words on either side (0: keep all)", at_least=0)
    max_ratio: float = opt(1.5, "drop training pairs whose word-length ratio exceeds this (0: keep all)", at_least=0)
    dedup: bool = opt(False, "drop exact duplicate training pairs (keeps a hash per pair in memory)")
    seed: int = opt(1, "toy: random seed of the generated corpus")
    toy_train: int = opt(20000, "toy: number of training pairs", at_least=1)
    toy_valid: int = opt(500, "toy: number of validation pairs", at_least=1)
    toy_test: int = opt(500, "toy: number of test pairs", at_least=0)
    invalid_utf8: Literal["auto", "error", "replace"] = opt(
        "auto", "auto: error for local files, replace (counted, reported) for downloaded corpora")
    workers: int = opt(0, "processes for cleaning (0: one per CPU core)", at_least=0)


@dataclass
class BpeConfig:
    raw: Path = required("folder written by `nmt prepare`")
    out: Path = required("output folder for spm.model, spm.vocab and {split}.{lang} pieces")
    vocab_size: int = opt(37000, "joint source+target sentencepiece vocabulary size (paper: 37000 en-de)", at_least=1)
    model: Path | None = opt(None, "reuse this sentencepiece model instead of training one")
    sample_sentences: int = opt(4_000_000, "train sentencepiece on at most this many sentences (sampled)", at_least=1)
    character_coverage: float = opt(
        1.0, "share of characters the model must cover, 0.98 to 1 (below 1 the rest become UTF-8 byte pieces)", at_least=0.98, at_most=1)
    workers: int = opt(0, "processes for encoding (0: one per CPU core)", at_least=0)
    seed: int = opt(1, "seed of the sample of training sentences")


@dataclass
class BinarizeConfig:
    bpe: Path = required("folder written by `nmt bpe`")
    out: Path = required("output folder for dict.txt, {split}.{lang}.bin/.idx and spm.model")
    dictionary: Path | None = opt(None, "reuse this dict.txt instead of building one from the training text")
    min_count: int = opt(0, "leave symbols seen fewer times out of a new dictionary (0: keep all)", at_least=0)
    workers: int = opt(0, "processes for encoding (0: one per CPU core)", at_least=0)


@dataclass
class ModelConfig:
    encoder_layers: int = opt(6, "encoder layers N", at_least=1)
    decoder_layers: int = opt(6, "decoder layers N", at_least=1)
    d_model: int = opt(512, "model width d_model", at_least=2)
    d_ff: int = opt(2048, "feed-forward inner width d_ff", at_least=1)
    heads: int = opt(8, "attention heads h (d_k = d_model / h)", at_least=1)
    dropout: float = opt(0.1, "P_drop on every sub-layer output and on embedding+position sums", at_least=0, below=1)
    attention_dropout: float = opt(0.0, "dropout on attention weights (not in the paper)", at_least=0, below=1)
    activation_dropout: float = opt(0.0, "dropout after the feed-forward ReLU (not in the paper)", at_least=0, below=1)
    max_positions: int = opt(1024, "longest source or target (in tokens, with EOS) the model accepts", at_least=2)
    norm: Literal["post", "pre"] = opt("post", "post-norm (paper) or pre-norm residual blocks")

    def __post_init__(self) -> None:
        """What the Transformer's shapes need: checked here, so that a setting from YAML or --set, or the
        config inside a model file, is refused with a message instead of failing inside torch."""
        if self.heads > 0 and (self.d_model % self.heads or self.d_model % 2):
            raise NmtError(f"model.d_model ({self.d_model}) must be even (sinusoidal positions) and divisible "
                           f"by model.heads ({self.heads})")


ARCHS: dict[str, ModelConfig] = {
    "transformer_base": ModelConfig(),
    "transformer_big": ModelConfig(d_model=1024, d_ff=4096, heads=16, dropout=0.3),
    "transformer_small": ModelConfig(encoder_layers=3, decoder_layers=3, d_model=256, d_ff=1024, heads=4),
    "transformer_tiny": ModelConfig(encoder_layers=2, decoder_layers=2, d_model=128, d_ff=512, heads=4),
}
Arch = Literal["transformer_base", "transformer_big", "transformer_small", "transformer_tiny"]


@dataclass
class TrainConfig:
    data: Path = required("folder written by `nmt binarize`")
    save_dir: Path = required("folder for checkpoints, train.jsonl and config.yaml")
    arch: Arch = opt("transformer_base", "model preset; any model.* field can still be set")
    model: ModelConfig = opt(ModelConfig(), "model settings (filled from --arch, then overridden)")
    # Batching: the paper's batch is ~25000 target tokens per update.
    max_tokens: int = opt(4096, "token budget of one micro-batch on one device, padding included", at_least=1)
    tokens_per_update: int = opt(25000, "target tokens per optimizer update, summed over devices and micro-batches", at_least=1)
    micro_batches_per_update: int = opt(
        0, "micro-batches per device per update (0: derived from tokens_per_update, max_tokens and the devices)", at_least=0)
    # Optimisation (paper section 5.3)
    label_smoothing: float = opt(0.1, "label smoothing epsilon_ls", at_least=0, below=1)
    adam_betas: tuple[float, float] = opt((0.9, 0.98), "Adam beta1,beta2", at_least=0, below=1)
    adam_eps: float = opt(1e-9, "Adam epsilon", above=0)
    weight_decay: float = opt(0.0, "decoupled weight decay (AdamW); 0 = plain Adam as in the paper", at_least=0)
    lr_schedule: Literal["paper", "inverse_sqrt"] = opt(
        "paper", "paper: d_model^-0.5*min(step^-0.5, step*warmup^-1.5); inverse_sqrt: fairseq's form")
    warmup_updates: int = opt(4000, "linear warm-up updates (0: none)", at_least=0)
    lr_scale: float = opt(1.0, "paper schedule: multiplier of the formula", above=0)
    lr: float = opt(7e-4, "inverse_sqrt schedule: peak learning rate reached after warm-up", above=0)
    warmup_init_lr: float = opt(1e-7, "inverse_sqrt schedule: learning rate at update 0", at_least=0)
    clip_norm: float = opt(0.0, "clip the gradient norm to this value (0: off, as in the paper)", at_least=0)
    # When to stop
    max_update: int = opt(100000, "stop after this many updates (0: no limit)", at_least=0)
    max_epoch: int = opt(0, "stop after this many epochs (0: no limit)", at_least=0)
    max_time_hours: float = opt(0.0, "stop after this much training time (0: no limit)", at_least=0)
    # Precision and devices
    precision: Precision = opt("auto", "auto: bf16 where the device has fast bf16, else fp32")
    device: Device = opt("auto", "auto: cuda when available, else cpu")
    threads: int = opt(0, "CPU threads per worker (0: torch's default)", at_least=0)
    seed: int = opt(1, "seed of initialisation, dropout and batch order")
    # Checkpoints, validation, logging
    save_interval_minutes: float = opt(10.0, "save a checkpoint every this many minutes (paper: 10; 0: off)", at_least=0)
    save_interval_updates: int = opt(0, "save a checkpoint every this many updates (0: off)", at_least=0)
    keep_last: int = opt(20, "keep this many numbered checkpoints (the paper averages the last 5 or 20)", at_least=1)
    validate_interval_updates: int = opt(1000, "validate every this many updates, and at every checkpoint", at_least=0)
    best_metric: Literal["loss", "bleu"] = opt("loss", "what checkpoint_best minimises/maximises")
    valid_bleu: bool = opt(False, "decode the valid split at each validation and log sacreBLEU")
    valid_bleu_sentences: int = opt(0, "decode only the first N valid sentences for BLEU (0: all)", at_least=0)
    valid_bleu_beam: int = opt(1, "beam size of validation BLEU decoding (1: greedy, fast)", at_least=1)
    log_interval: int = opt(100, "updates between log lines", at_least=0)
    tensorboard_dir: Path | None = opt(None, "also log to TensorBoard here (needs the tensorboard extra)")
    dry_run: bool = opt(False, "print the plan (parameters, batch, accumulation, learning rate) and exit")
    # Reliability
    max_bad_updates: int = opt(10, "stop after more than this many updates in a row skipped for non-finite "
                                   "loss/gradients (bf16, fp32; fp16 has min_loss_scale)")
    min_loss_scale: float = opt(1e-4, "fp16: stop when the dynamic loss scale falls below this", at_least=0)
    max_oom_fraction: float = opt(0.02, "stop when more than this share of micro-batches ran out of memory "
                                  "and were skipped (a single one never stops the run)", at_least=0, at_most=1)
    try_largest_batch: bool = opt(False, "with --dry-run: run forward, backward and an optimizer step on the "
                                  "largest batch on one device and report whether it fits in memory")
    # Launching (read by `nmt train`, which starts torchrun; ignored inside a worker)
    gpus: int = opt(0, "GPUs on this machine; >0 starts one torchrun worker per GPU (0: all if any)", at_least=0)
    nproc: int = opt(0, "CPU worker processes on gloo (for testing the distributed path; 0: one process)", at_least=0)
    nnodes: int = opt(1, "machines taking part (torchrun --nnodes)", at_least=1)
    node_rank: int = opt(0, "this machine's rank among the nodes (torchrun --node-rank)", at_least=0)
    rdzv_endpoint: str | None = opt(None, "HOST:PORT of the rendezvous for several machines")
    max_restarts: int = opt(0, "torchrun restarts of the whole worker group after a worker dies", at_least=0)


def train_base(arch: str) -> TrainConfig:
    """The defaults with the model taken from preset `arch` (YAML and CLI then override it)."""
    return TrainConfig(data=None, save_dir=None, arch=arch, model=dataclasses.replace(ARCHS[arch]))


@dataclass
class AverageConfig:
    checkpoints: tuple[Path, ...] = required("a checkpoint folder (with --last) or checkpoint files")
    out: Path = required("the averaged, weights-only model file")
    last: int = opt(5, "average the last N numbered checkpoints of the folder (paper: 5 base, 20 big)", at_least=1)


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


@dataclass
class ScoreConfig:
    hyp: Path = required("detokenized system output, one line per segment")
    ref: Path | None = opt(None, "reference file (required unless --test-set can be downloaded)")
    test_set: str | None = opt(None, "a sacreBLEU test set name, e.g. wmt14/full")
    langpair: str | None = opt(None, "language pair of --test-set, e.g. en-de")
    out_json: Path | None = opt(None, "write the scores here as JSON (default: HYP.scores.json)")
    tokenize: str = opt("13a", "sacreBLEU tokenizer (13a is its standard)")


@dataclass
class PlotConfig:
    runs: tuple[Path, ...] = required("training folders (--save-dir of `nmt train`) or their train.jsonl files")
    out: Path = required("the picture: .png or .svg")
    x: Literal["updates", "hours"] = opt("updates", "x axis: optimizer updates, or training hours (wall clock)")
    dpi: int = opt(120, "resolution of a PNG, dots per inch")


@dataclass
class AttentionConfig:
    model: Path = required("a checkpoint or an averaged model file")
    source: str = required("the source sentence, raw text")
    out: Path = required("the picture (.png or .svg), or the weights with --format json")
    target: str | None = opt(None, "the target sentence, raw text (default: the model's own translation, by beam search)")
    kind: Literal["encoder", "decoder", "cross"] = opt(
        "encoder", "encoder self-attention (the paper's figures 3-5), decoder self-attention, or "
        "encoder-decoder (cross) attention")
    layer: int = opt(0, "layer, 1-based (0: the last)")
    head: int = opt(0, "head, 1-based (0: every head of the layer, as a grid)")
    style: Literal["heatmap", "lines"] = opt(
        "heatmap", "heatmap: a grid of queries x keys per head; lines: as the paper's figures 3-5, queries above "
        "keys joined by lines as strong as the weight, one colour per head")
    query: str | None = opt(None, "lines: only the lines of this query token, as labelled (e.g. making; the first one)")
    format: Literal["picture", "json"] = opt(
        "picture", "picture: PNG or SVG by the --out suffix; json: the weights (layout in nmt_cli/attention.py)")
    beam: int = opt(4, "beam size of the translation when --target is not given")
    dpi: int = opt(120, "resolution of a PNG, dots per inch")
