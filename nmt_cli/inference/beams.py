"""What the search asks of the model at each step: the best next tokens of every decoder row, and
where the rows sit among the sentences' beam slots when sentences keep different numbers of live
hypotheses; and what it does with the answer: each sentence's best extensions, which of them finish
and which stay live (search.py's module docstring says how).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from nmt_cli.config.inference import BeamStyle
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.model import native
from nmt_cli.model.transformer import Cache, Encoded, Slots, Transformer


@runtime_checkable
class SearchModel(Protocol):
    """What the search decodes: a `Transformer` (trained here or imported), or an `ensemble.Ensemble`
    of them. The encoder states and the cache are the model's own; the search only hands them back.
    A model whose `decode_step` gives log-probabilities rather than logits says so with a true
    `scores_are_log_probs` (an ensemble's mean); without the attribute they are logits."""

    cfg: ModelConfig  # the search reads max_positions
    vocab_size: int

    def encode(self, src: Tensor) -> Any:
        """src (B, S) token ids, right-padded with PAD, each ending in EOS -> the encoder's states."""
        ...

    def start_decoding(self, enc: Any) -> Any:
        """A fresh cache for decoding the sentences of `enc`."""
        ...

    def decode_step(self, tokens: Tensor, step: int | Tensor, enc: Any, cache: Any, beams: Slots | None = None
                    ) -> Tensor:
        """tokens (N,) at target position `step` -> scores (N, V) of the next token, extending `cache`."""
        ...

    def reorder(self, enc: Any, cache: Any, order: Tensor, sentences: Tensor | None = None
                ) -> tuple[Any, Any]:
        """Keep decoder rows `order` (N'), and of the sentences only `sentences` (B'; None: all)."""
        ...


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


def next_tokens(model: SearchModel, tokens: Tensor, step: int | Tensor, enc: Encoded, cache: Cache, k: int,
                beams: Beams | None = None, allowed: Tensor | None = None) -> NextTokens:
    """The model's `decode_step`, then each row's k most probable next tokens (`best_tokens`), among the
    `allowed` ones (N, V) if given: the unit `search.compile_decoder` compiles.

    With the C kernel on a CPU, a step of more than `CHUNK_ROWS` rows takes its output projection and
    best tokens `CHUNK_ROWS` rows at a time, each chunk's logits read while still in the cache, which
    beats one projection of all rows (benchmarks/README.md, "Translation")."""
    # is_compiling first: a compiled graph must not test the rows (a guard on them would make every
    # graph of up to CHUNK_ROWS rows compile again for more, past dynamo's limit on recompiles)
    if (not torch.compiler.is_compiling() and isinstance(model, Transformer) and tokens.shape[0] > CHUNK_ROWS
            and tokens.device.type == "cpu" and native.library() is not None):
        hidden = model.decode_hidden(tokens, step, enc, cache, beams)
        return NextTokens(*map(torch.cat, zip(*(
            _best_allowed(model.logits(hidden[i : i + CHUNK_ROWS]), k,
                          None if allowed is None else allowed[i : i + CHUNK_ROWS])
            for i in range(0, len(hidden), CHUNK_ROWS)), strict=True)))
    scores = model.decode_step(tokens, step, enc, cache, beams)
    if getattr(model, "scores_are_log_probs", False):  # an Ensemble's
        return best_tokens(scores if allowed is None else scores.masked_fill(~allowed, -math.inf), k, True)
    return _best_allowed(scores, k, allowed)


CHUNK_ROWS = 256  # decoder rows whose logits are made and read at once (see `next_tokens`)


def _best_allowed(logits: Tensor, k: int, allowed: Tensor | None) -> NextTokens:
    return best_tokens(logits if allowed is None else logits.masked_fill(~allowed, -math.inf), k)


def best_tokens(logits: Tensor, k: int, normalized: bool = False) -> NextTokens:
    """The k most probable tokens of each row of logits (N, V) other than PAD and BOS (which no output
    contains; the probabilities are not renormalised without them), and every row's EOS log-probability.

    On a CPU where the search's C kernel could be built (`native.py`), the kernel does it all in one
    call that reads each row while it is in the cache (faster than the torch path below:
    benchmarks/README.md, "Translation"); its log-sum-exp may differ from torch's in the last bits.
    Elsewhere, their log-probabilities are the logits' log_softmax in float32, written over float32
    logits on a CPU (one fused pass, which beat a log-sum-exp in three passes over the rows: the same
    section), and the top k are found by
    `top_k` (torch's `topk` over long rows is slow on a CPU). Inside torch.compile on a CPU, for a
    vocabulary of size G * groups with G a multiple of 8 (see `group_size`), the top k are found in
    two stages: the maximum of each group of G logits (one fused pass over the logits), then the top
    k among the logits of the k groups with the largest maxima, which hold them (a group holding one
    of them has a maximum at least as large). Equal logits may be ranked in a different order than
    by `topk`. `normalized`: the rows are log-probabilities already (an ensemble's), taken as they
    are. The logits are overwritten (the decoder's output, used once).
    """
    N, V = logits.shape
    if normalized:
        log_probs = logits.clone()
        log_probs[:, PAD] = -math.inf
        log_probs[:, BOS] = -math.inf
        top, tokens = log_probs.topk(min(k, V), dim=-1)
        return NextTokens(top.float(), tokens, log_probs[:, EOS].float())
    G = group_size(V)
    if torch.compiler.is_compiling() and logits.device.type == "cpu" and G and k <= V // G:
        lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)  # (N, 1)
        columns = torch.arange(V, device=logits.device).view(V // G, G)
        allowed = (columns != PAD) & (columns != BOS)
        groups = torch.where(allowed, logits.view(N, V // G, G), -math.inf)  # (N, V / G, G)
        chosen = groups.amax(-1).topk(k, dim=-1).indices  # (N, k) groups
        candidates = groups.gather(1, chosen[:, :, None].expand(N, k, G)).view(N, k * G)
        top, index = candidates.topk(k, dim=-1)
        tokens = chosen.gather(1, index // G) * G + index % G
        return NextTokens(top.float() - lse, tokens, logits[:, EOS].float() - lse[:, 0])
    found = None if torch.compiler.is_compiling() else native.best_tokens(logits, k, PAD, BOS, EOS)
    if found is not None:
        return NextTokens(*found)
    log_probs = logits.float()  # float32 logits themselves, which the CPU overwrites with their log_softmax
    if log_probs.device.type == "cpu":  # in place: bit for bit as out of place, without a second (N, V)
        log_probs = torch.log_softmax(log_probs, dim=-1, out=log_probs)
    else:
        log_probs = torch.log_softmax(log_probs, dim=-1)
    eos = log_probs[:, EOS].clone()
    log_probs[:, [PAD, BOS]] = -math.inf
    top, tokens = top_k(log_probs, min(k, V))
    return NextTokens(top, tokens, eos)


def top_k(rows: Tensor, k: int, classes: int = 8) -> tuple[Tensor, Tensor]:
    """`rows.topk(k, dim=-1)`, best first, in two cheaper passes on a CPU: the columns of each row fall
    into V // `classes` classes (column c + i * (V // classes), i < `classes`; the last V % classes columns
    on their own), the classes' maxima are one elementwise maximum of `classes` slices of the row, and
    the top k lie in the k classes with the largest maxima (a class holding one of them has a maximum
    at least as large) and the leftover columns: faster than `topk` on a vocabulary's rows
    (benchmarks/model_kernels.py). Equal values may be ranked in a different order."""
    N, V = rows.shape
    n = V // classes
    if rows.device.type != "cpu" or n < k:
        return rows.topk(k, dim=-1)
    main = rows[:, : n * classes].view(N, classes, n)  # main[:, i, c]: column i * n + c
    best = main.amax(1).topk(k, dim=-1).indices  # (N, k): the classes c with the largest maxima
    candidates = torch.cat([main.gather(2, best[:, None, :].expand(N, classes, k)).flatten(1),
                            rows[:, n * classes :]], dim=1)  # (N, classes * k + V % classes)
    top, index = candidates.topk(k, dim=-1)
    in_main = index < classes * k
    i = index.clamp(max=classes * k - 1)
    tokens = torch.where(in_main, (i // k) * n + best.gather(1, i % k), index - classes * k + n * classes)
    return top, tokens


def group_size(vocab: int) -> int:
    """For `best_tokens`: the multiple of 8 that divides `vocab` closest to its square root (0: none
    from 32 to vocab / 8)."""
    sizes = [g for g in range(32, vocab // 8 + 1, 8) if vocab % g == 0]
    return min(sizes, key=lambda g: abs(g - math.sqrt(vocab)), default=0)


# -- choosing among the extensions ----------------------------------------------------------------


def extensions(best: NextTokens, scores: Tensor, k: int, force_eos: Tensor,
                beams: Beams | None) -> tuple[Tensor, Tensor, Tensor]:
    """The best k one-token extensions of each sentence's live hypotheses.

    best: the decoder's best next tokens of each row (k of them; more change nothing, fewer come only
    from a tiny vocabulary), one row per live slot (all B * W slots without `beams`); scores (B, W)
    log-probabilities so far (-inf: empty slot); force_eos (B,) sentences at their maximum length.
    Returns log-probabilities (B, k) best first, the slot each extends (B, k) and its token (B, k). A
    sentence's best k extensions lie among the best k of each of its slots, so only those are
    combined with the slots' scores.
    """
    B, W = scores.shape
    top_log_probs, top_tokens = best.log_probs, best.tokens  # (N, k), or fewer columns for a tiny vocabulary
    per_slot = top_log_probs.shape[1]
    if bool(force_eos.any()):
        forced = (force_eos.repeat_interleave(W)[:, None] if beams is None
                  else force_eos[beams.sentence(), None])
        eos_only = torch.full_like(top_log_probs, -math.inf)
        eos_only[:, 0] = best.eos
        top_log_probs = torch.where(forced, eos_only, top_log_probs)
        top_tokens = torch.where(forced, torch.full_like(top_tokens, EOS), top_tokens)
    if beams is not None:  # back to all B * W slots; the empty ones (score -inf) extend to nothing
        top_log_probs = beams.spread(top_log_probs, -math.inf).flatten(0, 1)
        top_tokens = beams.spread(top_tokens, PAD).flatten(0, 1)
    candidates = (scores.reshape(-1, 1) + top_log_probs).view(B, W * per_slot)
    values, index = candidates.topk(min(k, W * per_slot), dim=1)
    return values, index // per_slot, top_tokens.view(B, W * per_slot).gather(1, index)


def live_first(live: Tensor, values: Tensor, rows: Tensor,
                tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each sentence's live extensions moved to its first slots, best first, and the slots no sentence
    uses dropped: (live, scores (-inf where not live), source rows, tokens), each (B, W')."""
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, : max(int(live.sum(1).max()), 1)]
    live = live.gather(1, order)
    return (live, torch.where(live, values.gather(1, order), -math.inf), rows.gather(1, order),
            tokens.gather(1, order))


def chosen(style: BeamStyle, values: Tensor, tokens: Tensor, beam: int,
            n_finished: Tensor) -> tuple[Tensor, Tensor]:
    """Which of each sentence's extensions (B, k), best first, finish (end in EOS) and which stay live,
    as two (B, k) masks, by the `style` of the module docstring."""
    valid, eos = values > -math.inf, tokens == EOS
    rank = torch.arange(values.shape[1], device=values.device)
    match style:
        case "paper":
            going_on = valid & ~eos
            return valid & eos & (rank < beam), going_on & (going_on.cumsum(1) <= beam)
        case "shrinking":
            kept = valid & (rank < (beam - n_finished)[:, None])
            return kept & eos, kept & ~eos
