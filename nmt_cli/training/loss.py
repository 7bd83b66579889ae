"""The training loss: label-smoothed cross-entropy (paper section 5.4, epsilon_ls = 0.1).

The smoothed target distribution of a token with reference y is
``q(v) = (1 - eps) * [v == y] + eps / V`` (Szegedy et al. 2016, "Rethinking the Inception
Architecture", section 7; the same form as ``torch.nn.functional.cross_entropy(label_smoothing=eps)``),
so the loss of one token is

    -sum_v q(v) log p(v) = (1 - eps) * (-log p(y)) + eps * mean_v(-log p(v))

and its gradient with respect to the logits is ``softmax(x) - q``. `label_smoothed_nll` computes both
in a few passes over the (tokens x vocabulary) logits, without keeping a float32 copy of them for the
backward pass: on a CPU the loss over the big output layer otherwise costs a fifth of a training step.

Losses are *sums* over real (non-pad) target tokens. The trainer divides them by the number of
real target tokens of the whole update (every micro-batch on every rank), so an update's gradient
does not depend on how its examples were split into micro-batches or devices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt_cli.data.dataset import PAD


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float,
                       pad: int = PAD) -> tuple[Tensor, Tensor]:
    """(smoothed loss, nll), each summed over the positions where ``target != pad``.

    logits (..., V) unnormalised scores in any float dtype (the arithmetic is float32); target (...) ids.
    The nll carries no gradient: it is for the log.
    """
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    # padding weighs 0 (a mask that selected the real rows would make the host wait for the device)
    real = (target != pad).to(torch.float32)
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, real, epsilon)
    return loss, nll


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Sums of the smoothed loss and of the nll of logits (N, V) against target (N,), each row
    weighted by `real` (N,): 1 for a real token, 0 for padding.

    On a CPU the rows go through in chunks of about 4 MB of float32, so each chunk's temporaries
    stay in cache (against whole-tensor passes: benchmarks/model_kernels.py). bf16 logits are read
    as they are by (log_)softmax with a float32 result, never copied whole.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, real: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        nll = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # (N,) -log p(y)
        uniform = torch.empty_like(nll)  # (N,) -mean_v log p(v)
        for rows in _chunks(logits):
            lprobs = torch.log_softmax(logits[rows], dim=-1, dtype=torch.float32)  # (n, V)
            nll[rows] = -lprobs.gather(1, target[rows, None]).squeeze(1)
            uniform[rows] = -lprobs.mean(dim=-1)
        ctx.save_for_backward(logits, target, real)
        ctx.epsilon = epsilon
        nll.mul_(real)
        loss = ((1.0 - epsilon) * nll + epsilon * (uniform * real)).sum()
        nll = nll.sum()
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        logits, target, real = ctx.saved_tensors
        eps, V = ctx.epsilon, logits.shape[-1]
        grad = torch.empty_like(logits)
        weight = real * grad_loss  # (N,)
        for rows in _chunks(logits):
            p = torch.softmax(logits[rows], dim=-1, dtype=torch.float32)  # (n, V)
            p.sub_(eps / V)  # minus q: eps / V everywhere ...
            p.scatter_add_(1, target[rows, None],
                           torch.full_like(p[:, :1], eps - 1.0))  # ... 1 - eps more at y
            grad[rows] = p.mul_(weight[rows, None])
        return grad, None, None, None


def _chunks(logits: Tensor) -> list[slice]:
    N, V = logits.shape
    step = N if logits.device.type != "cpu" else max(1, (1 << 20) // V)
    return [slice(start, start + step) for start in range(0, N, step)]


def per_token(total: float, tokens: int) -> float:
    """A summed loss divided by its token count (0 for no tokens, so empty logs stay finite)."""
    return total / tokens if tokens else 0.0
