"""Label-smoothed cross-entropy and its normalisation over the whole update."""

from __future__ import annotations

import torch

from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.model.transformer import Transformer
from nmt_cli.training.loss import label_smoothed_nll
from nmt_cli.training.step import micro_batch_loss

V = 11


def _direct(logits: torch.Tensor, target: torch.Tensor, eps: float) -> tuple[float, float]:
    """-sum_v q(v) log p(v) with q = (1 - eps) * onehot(y) + eps / V, written out token by token."""
    loss = nll = 0.0
    for row, y in zip(logits.reshape(-1, V).double(), target.reshape(-1).tolist(), strict=True):
        if y == PAD:
            continue
        logp = row - torch.logsumexp(row, 0)
        q = torch.full((V,), eps / V, dtype=torch.float64)
        q[y] += 1 - eps
        loss += float(-(q * logp).sum())
        nll += float(-logp[y])
    return loss, nll


def test_label_smoothing_equals_a_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, V, generator=g) * 3
    target = torch.randint(4, V, (3, 5), generator=g)
    target[0, 3:] = PAD
    target[2, 1:] = PAD
    for eps in (0.0, 0.1, 0.3):
        loss, nll = label_smoothed_nll(logits, target, eps)
        want_loss, want_nll = _direct(logits, target, eps)
        assert abs(loss.item() - want_loss) < 1e-4 and abs(nll.item() - want_nll) < 1e-4


def test_padding_is_ignored_and_eps_zero_is_cross_entropy() -> None:
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(4, 6, V, generator=g), torch.randint(4, V, (4, 6), generator=g)
    target[1, 2:] = PAD
    loss, nll = label_smoothed_nll(logits, target, 0.0)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=PAD,
                                           reduction="sum")
    torch.testing.assert_close(loss, ce)
    torch.testing.assert_close(nll, ce)
    changed = logits.clone()
    changed[target == PAD] = 1e4  # whatever the model says at padding does not count
    torch.testing.assert_close(label_smoothed_nll(changed, target, 0.1)[0],
                               label_smoothed_nll(logits, target, 0.1)[0])


def _batch(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    S, T = max(len(s) for s, _ in rows) + 1, max(len(t) for _, t in rows) + 1
    src, prev, target = (torch.full((len(rows), n), PAD) for n in (S, T, T))
    for b, (s, t) in enumerate(rows):
        src[b, : len(s) + 1] = torch.tensor([*s, EOS])
        prev[b, : len(t) + 1] = torch.tensor([BOS, *t])
        target[b, : len(t) + 1] = torch.tensor([*t, EOS])
    return {"src": src, "prev": prev, "target": target}


def test_micro_batches_normalised_by_the_update_equal_one_big_batch() -> None:
    """Sum of per-micro-batch loss sums / all target tokens of the update = the loss of one batch."""
    g = torch.Generator().manual_seed(2)
    rows = [(torch.randint(4, V, (n,), generator=g).tolist(), torch.randint(4, V, (m,), generator=g).tolist())
            for n, m in [(3, 5), (7, 2), (4, 4), (1, 6), (6, 3)]]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, heads=2,
                                    dropout=0.0), V)
    tokens = sum(len(t) + 1 for _, t in rows)

    loss, _ = micro_batch_loss(model, _batch(rows), 0.1)
    (loss / tokens).backward()
    big = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for part in (rows[:2], rows[2:]):  # different lengths, so different padding in each micro-batch
        loss, _ = micro_batch_loss(model, _batch(part), 0.1)
        (loss / tokens).backward()
    for want, p in zip(big, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-5)


def test_gradient_is_softmax_minus_the_smoothed_target() -> None:
    """The hand-written backward equals autograd through log_softmax, in float32 and bfloat16."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(7, V, generator=g) * 2
    target = torch.randint(4, V, (7,), generator=g)
    target[5] = PAD
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = base.clone().to(dtype).requires_grad_()
        loss, _ = label_smoothed_nll(logits, target, 0.1)
        (3.0 * loss).backward()
        ref = base.clone().to(dtype).float().requires_grad_()
        lprobs = torch.log_softmax(ref[target != PAD], dim=-1)
        q = torch.full_like(lprobs, 0.1 / V).scatter_add_(
            1, target[target != PAD][:, None], torch.full((6, 1), 0.9))
        (3.0 * -(q * lprobs).sum()).backward()
        assert logits.grad.dtype == dtype
        torch.testing.assert_close(logits.grad.float(), ref.grad, atol=tol, rtol=tol)
