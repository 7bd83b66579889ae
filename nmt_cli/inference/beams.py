"""What the search asks of the model at each step: the best next tokens of every decoder row, and
where the rows sit among the sentences' beam slots when sentences keep different numbers of live
hypotheses.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.model.transformer import Cache, Encoded, Transformer


class Beams(NamedTuple):
    """Where the decoder's rows sit among the sentences' beams when the sentences keep different numbers
    of live hypotheses: each of B sentences has W slots, and only the N slots that hold one get a row.
    The model's `decode_step` reads `spread` and `slot` (its `Slots`)."""

    row: Tensor  # (B, W): the row of slot w of sentence b; N (no row) where the slot is empty
    slot: Tensor  # (N,): the flat position b * W + w of each row

    @staticmethod
    def of(live: Tensor) -> Beams:
        """The decoder's rows for the slots where `live` (B, W) is True, in order."""
        flat = live.reshape(-1)
        slot = flat.nonzero()[:, 0]
        return Beams(torch.where(flat, flat.cumsum(0) - 1, len(slot)).view(live.shape), slot)

    def spread(self, rows: Tensor, fill: float) -> Tensor:
        """rows (N, ...) -> (B, W, ...): each row in its slot, `fill` in the empty ones."""
        return torch.cat([rows, rows.new_full((1, *rows.shape[1:]), fill)])[self.row]

    def sentence(self) -> Tensor:
        """(N,): the sentence of each row."""
        return self.slot // self.row.shape[1]


class NextTokens(NamedTuple):
    """The most probable next tokens of each decoder row, best first."""

    log_probs: Tensor  # (N, k) float32
    tokens: Tensor  # (N, k)
    eos: Tensor  # (N,) float32: the log-probability of EOS


def next_tokens(model: Transformer, tokens: Tensor, step: int, enc: Encoded, cache: Cache, k: int,
                beams: Beams | None = None) -> NextTokens:
    """The model's `decode_step`, then each row's k most probable next tokens (`best_tokens`): the unit
    `search.compile_decoder` compiles."""
    scores = model.decode_step(tokens, step, enc, cache, beams)
    return best_tokens(scores, k, normalized=getattr(model, "scores_are_log_probs", False))  # an Ensemble's


def best_tokens(logits: Tensor, k: int, normalized: bool = False) -> NextTokens:
    """The k most probable tokens of each row of logits (N, V) other than PAD and BOS (which no output
    contains; the probabilities are not renormalised without them), and every row's EOS log-probability.

    Inside torch.compile on a CPU, for a vocabulary of size G * groups with G a multiple of 8 (see
    `group_size`), the top k are found in two stages: the maximum of each group of G logits (one
    fused pass over the logits), then the top k among the logits of the k groups with the largest
    maxima, which hold them (a group holding one of them has a maximum at least as large). Their
    log-probabilities are the logits minus the log-sum-exp, in float32. This reads the logits about
    twice where `log_softmax` and `topk` over whole rows read them several times. Elsewhere it is
    `log_softmax` + `topk`. Equal logits may be ranked in a different order by the two. `normalized`:
    the rows are log-probabilities already (an ensemble's), taken as they are.
    """
    N, V = logits.shape
    G = group_size(V)
    grouped = torch.compiler.is_compiling() and logits.device.type == "cpu" and G and k <= V // G
    if normalized or not grouped:
        # log_softmax accumulates in fp32 and keeps the logits' dtype
        log_probs = logits.clone() if normalized else torch.log_softmax(logits, dim=-1)
        log_probs[:, PAD] = -math.inf
        log_probs[:, BOS] = -math.inf
        top, tokens = log_probs.topk(min(k, V), dim=-1)
        return NextTokens(top.float(), tokens, log_probs[:, EOS].float())
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)  # (N, 1)
    columns = torch.arange(V, device=logits.device).view(V // G, G)
    allowed = (columns != PAD) & (columns != BOS)
    groups = torch.where(allowed, logits.view(N, V // G, G), -math.inf)  # (N, V / G, G)
    chosen = groups.amax(-1).topk(k, dim=-1).indices  # (N, k) groups
    candidates = groups.gather(1, chosen[:, :, None].expand(N, k, G)).view(N, k * G)
    top, index = candidates.topk(k, dim=-1)
    tokens = chosen.gather(1, index // G) * G + index % G
    return NextTokens(top.float() - lse, tokens, logits[:, EOS].float() - lse[:, 0])


def group_size(vocab: int) -> int:
    """For `best_tokens`: the multiple of 8 that divides `vocab` closest to its square root (0: none
    from 32 to vocab / 8)."""
    sizes = [g for g in range(32, vocab // 8 + 1, 8) if vocab % g == 0]
    return min(sizes, key=lambda g: abs(g - math.sqrt(vocab)), default=0)
