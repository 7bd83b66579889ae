"""Optimiser and learning-rate schedules (paper section 5.3), as pure functions of the update number.

Update numbers count from 1: `learning_rate(optim, d_model, u)` is the rate used by the u-th optimiser
step.
The schedule has no state of its own; a resumed run recomputes it from the saved update count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from nmt_cli.config.train import OptimConfig


def paper_lr(update: int, d_model: int, warmup_updates: int, scale: float = 1.0) -> float:
    """``scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (Vaswani et al. 2017, eq. 3):
    linear warm-up for `warmup_updates` steps, then decay with the inverse square root of the step.
    No warm-up (0) is the limit warmup -> 0 of the formula: the decay alone."""
    step = max(update, 1)
    warm = step * warmup_updates**-1.5 if warmup_updates > 0 else math.inf
    return scale * d_model**-0.5 * min(step**-0.5, warm)


def inverse_sqrt_lr(update: int, peak_lr: float, warmup_updates: int, warmup_init_lr: float) -> float:
    """fairseq's ``inverse_sqrt``: linear from `warmup_init_lr` (update 0) to `peak_lr` (update =
    warmup), then ``peak_lr * sqrt(warmup / update)``."""
    if warmup_updates > 0 and update < warmup_updates:
        return warmup_init_lr + (peak_lr - warmup_init_lr) * update / warmup_updates
    return peak_lr * math.sqrt(max(warmup_updates, 1) / max(update, 1))


def learning_rate(optim: OptimConfig, d_model: int, update: int) -> float:
    """The rate of update `update` by `optim.lr_schedule`, for a model of width `d_model`."""
    match optim.lr_schedule:
        case "paper":
            return paper_lr(update, d_model, optim.warmup_updates, optim.lr_scale)
        case "inverse_sqrt":
            return inverse_sqrt_lr(update, optim.lr, optim.warmup_updates, optim.warmup_init_lr)


def peak_learning_rate(optim: OptimConfig, d_model: int) -> float:
    """The largest rate of the schedule, reached at the end of the warm-up."""
    return learning_rate(optim, d_model, max(optim.warmup_updates, 1))


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    """Adam(beta1, beta2, eps) as in the paper; AdamW (decoupled weight decay) when weight_decay > 0."""
    params = list(params)
    # fused: one kernel per parameter for the whole update (benchmarks/model_kernels.py)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    if optim.weight_decay > 0:
        return torch.optim.AdamW(params, lr=0.0, betas=optim.adam_betas, eps=optim.adam_eps,
                                 weight_decay=optim.weight_decay, fused=fused)
    return torch.optim.Adam(params, lr=0.0, betas=optim.adam_betas, eps=optim.adam_eps, fused=fused)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
