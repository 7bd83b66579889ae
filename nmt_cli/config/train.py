"""The configs of `nmt train` (arXiv 1706.03762, section 5) and `nmt average`.

`TrainConfig` holds what the whole run shares (data, model, seed, precision, device) and one section
per component, each handed alone to the code that reads it: `batch` to the batch plan, `optim` to
the optimiser and schedule, `stop`, `checkpoint`, `valid` and `log` to the loop, `guard` to the
checks of non-finite values and memory, `launch` to torchrun. In YAML a section is a mapping; on the
command line its fields keep their flags (--max-tokens) and are set as ``--set optim.lr=5e-4``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from nmt_cli.config.core import Device, Precision, opt, required, resolve
from nmt_cli.config.model import ARCHS, Arch, ModelConfig


@dataclass
class BatchConfig:
    """Batching: the paper's batch holds about 25000 target tokens per update (section 5.1)."""

    max_tokens: int = opt(4096, "token budget of one micro-batch on one device, padding included",
                          flag="--max-tokens", at_least=1)
    tokens_per_update: int = opt(
        25000, "target tokens per optimizer update, summed over devices and micro-batches",
        flag="--tokens-per-update", at_least=1)
    micro_batches_per_update: int = opt(
        0, "micro-batches per device per update (0: derived from tokens_per_update, max_tokens and the "
        "devices)", at_least=0)


@dataclass
class OptimConfig:
    """The loss, optimiser and learning-rate schedule (sections 5.3 and 5.4)."""

    label_smoothing: float = opt(0.1, "label smoothing epsilon_ls", at_least=0, below=1)
    adam_betas: tuple[float, float] = opt((0.9, 0.98), "Adam beta1,beta2", at_least=0, below=1)
    adam_eps: float = opt(1e-9, "Adam epsilon", above=0)
    weight_decay: float = opt(0.0, "decoupled weight decay (AdamW); 0 = plain Adam as in the paper",
                              at_least=0)
    lr_schedule: Literal["paper", "inverse_sqrt"] = opt(
        "paper", "paper: d_model^-0.5*min(step^-0.5, step*warmup^-1.5); inverse_sqrt: fairseq's form")
    warmup_updates: int = opt(4000, "linear warm-up updates (0: none)", at_least=0)
    lr_scale: float = opt(1.0, "paper schedule: multiplier of the formula", above=0)
    lr: float = opt(7e-4, "inverse_sqrt schedule: peak learning rate reached after warm-up", above=0)
    warmup_init_lr: float = opt(1e-7, "inverse_sqrt schedule: learning rate at update 0", at_least=0)
    clip_norm: float = opt(0.0, "clip the gradient norm to this value (0: off, as in the paper)", at_least=0)


@dataclass
class StopConfig:
    """When to stop: at the first limit reached."""

    max_update: int = opt(100000, "stop after this many updates (0: no limit)", flag="--max-update",
                          at_least=0)
    max_epoch: int = opt(0, "stop after this many epochs (0: no limit)", flag="--max-epoch", at_least=0)
    max_time_hours: float = opt(0.0, "stop after this much training time (0: no limit)",
                                flag="--max-time-hours", at_least=0)


@dataclass
class CheckpointConfig:
    save_interval_minutes: float = opt(
        10.0, "save every this many minutes (paper: 10; 0: off); with save_interval_updates set, these saves "
        "write checkpoint_last.pt only, for crash safety, and never enter `nmt average --last`",
        flag="--save-interval-minutes", at_least=0)
    save_interval_updates: int = opt(
        0, "write a numbered checkpoint (what `nmt average --last` reads) every this many updates (0: off; "
        "the recipes: 1400 base / 600 big, the paper's 10 minutes on P100s)",
        flag="--save-interval-updates", at_least=0)
    keep_last: int = opt(20, "keep this many numbered checkpoints (the paper averages the last 5 or 20)",
                         flag="--keep-last", at_least=1)
    best_metric: Literal["loss", "bleu"] = opt("loss", "what checkpoint_best minimises/maximises")


@dataclass
class ValidConfig:
    interval_updates: int = opt(1000, "validate every this many updates, and at every checkpoint", at_least=0)
    max_batches: int = opt(0, "validation loss on the first N batches of the valid split only (0: all of "
                           "it): a quick check, not the dev perplexity", at_least=0)
    bleu: bool = opt(False, "decode the valid split at each validation and log sacreBLEU",
                     flag="--valid-bleu/--no-valid-bleu")
    bleu_sentences: int = opt(0, "decode only the first N valid sentences for BLEU (0: all)", at_least=0)
    bleu_beam: int = opt(1, "beam size of validation BLEU decoding (1: greedy, fast)", at_least=1)


@dataclass
class LogConfig:
    interval: int = opt(100, "updates between log lines; also how often (at most) the host waits for the "
                        "device to read the statistics, so the clock's saves and time limit act at the "
                        "next line",
                        at_least=0)
    tensorboard_dir: Path | None = opt(None, "also log to TensorBoard here (needs the tensorboard extra)",
                                       flag="--tensorboard-dir")


@dataclass
class GuardConfig:
    """Limits on the updates skipped for non-finite values and the micro-batches that ran out of memory."""

    max_bad_updates: int = opt(10, "stop after more than this many updates in a row skipped for non-finite "
                                   "loss/gradients (bf16, fp32; fp16 has min_loss_scale)")
    min_loss_scale: float = opt(1e-4, "fp16: stop when the dynamic loss scale falls below this", at_least=0)
    max_oom_fraction: float = opt(0.02, "stop when more than this share of micro-batches ran out of memory "
                                  "and were skipped (a single one never stops the run)",
                                  at_least=0, at_most=1)


@dataclass
class LaunchConfig:
    """How `nmt train` starts torchrun; a worker it started ignores this section."""

    gpus: int = opt(0, "GPUs on this machine; >0 starts one torchrun worker per GPU (0: all if any)",
                    flag="--gpus", at_least=0)
    nproc: int = opt(0, "CPU worker processes on gloo (for testing the distributed path; 0: one process)",
                     flag="--nproc", at_least=0)
    nnodes: int = opt(1, "machines taking part (torchrun --nnodes)", flag="--nnodes", at_least=1)
    node_rank: int = opt(0, "this machine's rank among the nodes (torchrun --node-rank)", flag="--node-rank",
                         at_least=0)
    rdzv_endpoint: str | None = opt(None, "HOST:PORT of the rendezvous for several machines",
                                    flag="--rdzv-endpoint")
    max_restarts: int = opt(0, "torchrun restarts of the whole worker group after a worker dies",
                            flag="--max-restarts", at_least=0)


@dataclass
class TrainConfig:
    data: Path = required("folder written by `nmt binarize`", argument=True)
    save_dir: Path = required("folder for checkpoints, train.jsonl and config.yaml", flag="--save-dir")
    arch: Arch = opt("transformer_base", "model preset; any model.* field can still be set", flag="--arch")
    seed: int = opt(1, "seed of initialisation, dropout and batch order", flag="--seed")
    precision: Precision = opt("auto", "auto: bf16 where the device has fast bf16, else fp32",
                               flag="--precision")
    device: Device = opt("auto", "auto: cuda when available, else cpu", flag="--device")
    threads: int = opt(0, "CPU threads per worker (0: torch's default)", at_least=0)
    compile: bool = opt(False, "run the model's forward and backward through torch.compile, each batch "
                        "padded to a multiple of 8 positions so that a few graphs serve the whole run "
                        "(compiling takes a minute or more first; on a CPU it needs a C++ compiler: g++, or "
                        "$CXX)",
                        flag="--compile/--no-compile")
    dry_run: bool = opt(False, "print the plan (parameters, batch, accumulation, learning rate) and exit",
                        flag="--dry-run")
    try_largest_batch: bool = opt(False, "with --dry-run: run forward, backward and an optimizer step on the "
                                  "largest batch on one device and report whether it fits in memory",
                                  flag="--try-largest-batch")
    model: ModelConfig = opt(ModelConfig(), "model settings (filled from --arch, then overridden)")
    init: Path | None = opt(None, "start from this model file's weights (fine-tuning; an imported model "
                            "too): its model settings replace model.*, and the data must be binarized with "
                            "its dictionary", flag="--init")
    batch: BatchConfig = opt(BatchConfig(), "batching")
    optim: OptimConfig = opt(OptimConfig(), "loss, optimiser and learning rate")
    stop: StopConfig = opt(StopConfig(), "when to stop")
    checkpoint: CheckpointConfig = opt(CheckpointConfig(), "when to save checkpoints and which to keep")
    valid: ValidConfig = opt(ValidConfig(), "validation")
    log: LogConfig = opt(LogConfig(), "logging")
    guard: GuardConfig = opt(GuardConfig(), "limits on skipped updates")
    launch: LaunchConfig = opt(LaunchConfig(), "starting torchrun")

    # Where each key of the flat TrainConfig went, for old YAML files, --set keys and checkpoints.
    RENAMED: ClassVar[dict[str, str]] = {
        **{k: f"batch.{k}" for k in ("max_tokens", "tokens_per_update", "micro_batches_per_update")},
        **{k: f"optim.{k}" for k in ("label_smoothing", "adam_betas", "adam_eps", "weight_decay",
                                     "lr_schedule", "warmup_updates", "lr_scale", "lr", "warmup_init_lr",
                                     "clip_norm")},
        **{k: f"stop.{k}" for k in ("max_update", "max_epoch", "max_time_hours")},
        **{k: f"checkpoint.{k}" for k in ("save_interval_minutes", "save_interval_updates", "keep_last",
                                          "best_metric")},
        "validate_interval_updates": "valid.interval_updates", "valid_bleu": "valid.bleu",
        "valid_bleu_sentences": "valid.bleu_sentences", "valid_bleu_beam": "valid.bleu_beam",
        "log_interval": "log.interval", "tensorboard_dir": "log.tensorboard_dir",
        **{k: f"guard.{k}" for k in ("max_bad_updates", "min_loss_scale", "max_oom_fraction")},
        **{k: f"launch.{k}" for k in ("gpus", "nproc", "nnodes", "node_rank", "rdzv_endpoint",
                                      "max_restarts")},
    }


def train_base(arch: str) -> TrainConfig:
    """The defaults with the model taken from preset `arch` (YAML and CLI then override it)."""
    return TrainConfig(data=None, save_dir=None, arch=arch, model=dataclasses.replace(ARCHS[arch]))


@dataclass
class AverageConfig:
    checkpoints: tuple[Path, ...] = required("a checkpoint folder (with --last) or checkpoint files",
                                             argument=True)
    out: Path = required("the averaged, weights-only model file", flag="--out", short="-o")
    last: int = opt(5, "average the last N numbered checkpoints of the folder (paper: 5 base, 20 big)",
                    flag="--last", at_least=1)


def resolve_train(yaml_file: Path | None, values: dict[str, Any],
                  sets: list[str] | None = None) -> TrainConfig:
    """`nmt train`'s config: the arch preset fills `model` first (the arch itself may come from the YAML
    or the command line); the YAML file and the command line then override it."""
    arch = resolve(TrainConfig, yaml_file, values, sets).arch
    return resolve(TrainConfig, yaml_file, values, sets, base=train_base(arch))
