"""The configs of `nmt train` (arXiv 1706.03762, section 5) and `nmt average`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config.core import Device, Precision, opt, required
from nmt_cli.config.model import ARCHS, Arch, ModelConfig


@dataclass
class TrainConfig:
    data: Path = required("folder written by `nmt binarize`", argument=True)
    save_dir: Path = required("folder for checkpoints, train.jsonl and config.yaml", flag="--save-dir")
    arch: Arch = opt("transformer_base", "model preset; any model.* field can still be set", flag="--arch")
    model: ModelConfig = opt(ModelConfig(), "model settings (filled from --arch, then overridden)")
    # Batching: the paper's batch is ~25000 target tokens per update.
    max_tokens: int = opt(4096, "token budget of one micro-batch on one device, padding included", at_least=1, flag="--max-tokens")
    tokens_per_update: int = opt(25000, "target tokens per optimizer update, summed over devices and micro-batches", at_least=1, flag="--tokens-per-update")
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
    max_update: int = opt(100000, "stop after this many updates (0: no limit)", at_least=0, flag="--max-update")
    max_epoch: int = opt(0, "stop after this many epochs (0: no limit)", at_least=0, flag="--max-epoch")
    max_time_hours: float = opt(0.0, "stop after this much training time (0: no limit)", at_least=0, flag="--max-time-hours")
    # Precision and devices
    precision: Precision = opt("auto", "auto: bf16 where the device has fast bf16, else fp32", flag="--precision")
    device: Device = opt("auto", "auto: cuda when available, else cpu", flag="--device")
    threads: int = opt(0, "CPU threads per worker (0: torch's default)", at_least=0)
    seed: int = opt(1, "seed of initialisation, dropout and batch order", flag="--seed")
    # Checkpoints, validation, logging
    save_interval_minutes: float = opt(10.0, "save a checkpoint every this many minutes (paper: 10; 0: off)", at_least=0, flag="--save-interval-minutes")
    save_interval_updates: int = opt(0, "save a checkpoint every this many updates (0: off)", at_least=0, flag="--save-interval-updates")
    keep_last: int = opt(20, "keep this many numbered checkpoints (the paper averages the last 5 or 20)", at_least=1, flag="--keep-last")
    validate_interval_updates: int = opt(1000, "validate every this many updates, and at every checkpoint", at_least=0)
    best_metric: Literal["loss", "bleu"] = opt("loss", "what checkpoint_best minimises/maximises")
    valid_bleu: bool = opt(False, "decode the valid split at each validation and log sacreBLEU", flag="--valid-bleu/--no-valid-bleu")
    valid_bleu_sentences: int = opt(0, "decode only the first N valid sentences for BLEU (0: all)", at_least=0)
    valid_bleu_beam: int = opt(1, "beam size of validation BLEU decoding (1: greedy, fast)", at_least=1)
    log_interval: int = opt(100, "updates between log lines", at_least=0)
    tensorboard_dir: Path | None = opt(None, "also log to TensorBoard here (needs the tensorboard extra)", flag="--tensorboard-dir")
    dry_run: bool = opt(False, "print the plan (parameters, batch, accumulation, learning rate) and exit", flag="--dry-run")
    # Reliability
    max_bad_updates: int = opt(10, "stop after more than this many updates in a row skipped for non-finite "
                                   "loss/gradients (bf16, fp32; fp16 has min_loss_scale)")
    min_loss_scale: float = opt(1e-4, "fp16: stop when the dynamic loss scale falls below this", at_least=0)
    max_oom_fraction: float = opt(0.02, "stop when more than this share of micro-batches ran out of memory "
                                  "and were skipped (a single one never stops the run)", at_least=0, at_most=1)
    try_largest_batch: bool = opt(False, "with --dry-run: run forward, backward and an optimizer step on the "
                                  "largest batch on one device and report whether it fits in memory", flag="--try-largest-batch")
    # Launching (read by `nmt train`, which starts torchrun; ignored inside a worker)
    gpus: int = opt(0, "GPUs on this machine; >0 starts one torchrun worker per GPU (0: all if any)", at_least=0, flag="--gpus")
    nproc: int = opt(0, "CPU worker processes on gloo (for testing the distributed path; 0: one process)", at_least=0, flag="--nproc")
    nnodes: int = opt(1, "machines taking part (torchrun --nnodes)", at_least=1, flag="--nnodes")
    node_rank: int = opt(0, "this machine's rank among the nodes (torchrun --node-rank)", at_least=0, flag="--node-rank")
    rdzv_endpoint: str | None = opt(None, "HOST:PORT of the rendezvous for several machines", flag="--rdzv-endpoint")
    max_restarts: int = opt(0, "torchrun restarts of the whole worker group after a worker dies", at_least=0, flag="--max-restarts")


def train_base(arch: str) -> TrainConfig:
    """The defaults with the model taken from preset `arch` (YAML and CLI then override it)."""
    return TrainConfig(data=None, save_dir=None, arch=arch, model=dataclasses.replace(ARCHS[arch]))


@dataclass
class AverageConfig:
    checkpoints: tuple[Path, ...] = required("a checkpoint folder (with --last) or checkpoint files", argument=True)
    out: Path = required("the averaged, weights-only model file", flag="--out", short="-o")
    last: int = opt(5, "average the last N numbered checkpoints of the folder (paper: 5 base, 20 big)", at_least=1, flag="--last")
