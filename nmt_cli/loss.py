"""The training loss: label-smoothed cross-entropy (paper section 5.4, epsilon_ls = 0.1).

The smoothed target distribution of a token with reference y is
``q(v) = (1 - eps) * [v == y] + eps / V`` (Szegedy et al. 2016, "Rethinking the Inception
Architecture", section 7; the same form as ``torch.nn.functional.cross_entropy(label_smoothing=eps)``),
so the loss of one token is ``-sum_v q(v) log p(v) = (1 - eps) * nll + eps * mean_v(-log p(v))``.

Losses are *sums* over real (non-pad) target tokens. The trainer divides them by the number of
real target tokens of the whole update (every micro-batch on every rank), so an update's gradient
does not depend on how its examples were split into micro-batches or devices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt_cli.data import PAD


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad: int = PAD) -> tuple[Tensor, Tensor]:
    """(smoothed loss, nll), each summed over the positions where ``target != pad``.

    logits (..., V) unnormalised scores, any float dtype (computed in fp32); target (...) ids.
    """
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    real = target != pad
    if not bool(real.all()):  # the trainer passes real rows only; this keeps the function total
        logits, target = logits[real], target[real]
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)  # (N,)
    uniform = -lprobs.mean(dim=-1)  # (N,) cross-entropy against the uniform distribution
    loss = (1.0 - epsilon) * nll + epsilon * uniform
    return loss.sum(), nll.detach().sum()


def per_token(total: float, tokens: int) -> float:
    """A summed loss divided by its token count (0 for no tokens, so empty logs stay finite)."""
    return total / tokens if tokens else 0.0
