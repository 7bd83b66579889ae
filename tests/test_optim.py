"""The learning-rate schedules and the optimiser, at chosen steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nmt_cli.config.train import train_base
from nmt_cli.training.optim import (
    build_optimizer,
    inverse_sqrt_lr,
    learning_rate,
    paper_lr,
    peak_learning_rate,
)


@pytest.mark.parametrize("step", [1, 10, 1000, 3999, 4000, 4001, 16000, 100000])
def test_paper_schedule_is_the_formula(step: int) -> None:
    want = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)  # lrate of section 5.3
    assert paper_lr(step, 512, 4000) == pytest.approx(want, rel=1e-12)
    assert paper_lr(step, 512, 4000, scale=2.0) == pytest.approx(2 * want, rel=1e-12)


def test_paper_schedule_shape() -> None:
    peak = paper_lr(4000, 512, 4000)
    assert peak == pytest.approx(512**-0.5 * 4000**-0.5)  # ~7.0e-4
    assert paper_lr(2000, 512, 4000) == pytest.approx(peak / 2)  # linear warm-up
    assert paper_lr(16000, 512, 4000) == pytest.approx(peak / 2)  # inverse square root decay
    assert max(paper_lr(s, 512, 4000) for s in range(1, 20000, 7)) <= peak


def test_paper_schedule_without_warmup_is_the_decay_alone() -> None:
    for step in (1, 10, 4000):
        assert paper_lr(step, 512, 0) == pytest.approx(512**-0.5 * step**-0.5, rel=1e-12)


def test_inverse_sqrt_schedule() -> None:
    assert inverse_sqrt_lr(0, 7e-4, 4000, 1e-7) == pytest.approx(1e-7)
    assert inverse_sqrt_lr(2000, 7e-4, 4000, 1e-7) == pytest.approx((1e-7 + 7e-4) / 2)
    assert inverse_sqrt_lr(4000, 7e-4, 4000, 1e-7) == pytest.approx(7e-4)
    assert inverse_sqrt_lr(16000, 7e-4, 4000, 1e-7) == pytest.approx(7e-4 / 2)


def test_config_picks_the_schedule_and_adam_follows_the_paper() -> None:
    cfg = train_base("transformer_big")
    assert learning_rate(cfg.optim, cfg.model.d_model, 100) == paper_lr(100, 1024, 4000)
    assert peak_learning_rate(cfg.optim, cfg.model.d_model) == pytest.approx(1024**-0.5 * 4000**-0.5)
    fairseq = dataclasses.replace(cfg.optim, lr_schedule="inverse_sqrt", lr=5e-4)
    assert learning_rate(fairseq, cfg.model.d_model, 16000) == pytest.approx(2.5e-4)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg.optim)
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.defaults["betas"] == (0.9, 0.98) and optimizer.defaults["eps"] == 1e-9
    assert optimizer.defaults["weight_decay"] == 0
