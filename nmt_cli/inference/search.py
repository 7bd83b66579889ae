"""Beam search over the Transformer's incremental decoder, batched over sentences.

The search, for each sentence (Y counts its EOS; log-probabilities are natural logs):

- A hypothesis is ranked by score(Y) = log P(Y | X) / lp(|Y|), the GNMT length penalty
  lp(L) = ((5 + L) / 6) ** alpha (Wu et al. 2016, "Google's Neural Machine Translation System",
  eq. 14), alpha = 0.6 in "Attention Is All You Need" (section 6.1).
- The beam holds `beam` slots. Which one-token extensions of the live hypotheses (ranked by
  log-probability) are kept at each step depends on the style:
  - "paper" (the default; tensor2tensor's search, which the paper used, and fairseq's): of the best
    2 * `beam` extensions, those ending in EOS among the best `beam` become finished hypotheses,
    collected beside the beam, and the best `beam` others stay live, so the beam stays full.
  - "shrinking" (Marian's): the best `width` extensions are kept, `width` = `beam` minus the
    hypotheses already finished: an extension ending in EOS leaves the beam as a finished
    hypothesis and its slot goes with it. With beam 1 this is greedy search.
  Beam 1 is greedy search in both: tensor2tensor decodes greedily for beam size 1 (the paper's
  rule would otherwise go on past greedy's EOS, looking for a longer output the length penalty
  prefers).
- PAD and BOS are never produced. At the maximum length (`max_output_lengths`) EOS is forced.
- A sentence stops as soon as its `nbest`-th best finished score can no longer be beaten. The
  bound: a live hypothesis with log-probability s (<= 0) after t tokens can only finish with a
  length L in [t + 1, max_len + 1] and a log-probability <= s (every further token adds a
  log-probability <= 0), so its final score is at most s / lp(L) <= s / max(lp(t + 1), lp(max_len + 1))
  (s <= 0 and lp > 0; lp is monotone in L, so its maximum over the range is at an end). When the
  best live s gives a bound no higher than the nbest-th finished score, no continuation can enter
  the n-best: stopping there returns exactly what running to the maximum length would return.
  In the paper's style the same bound also takes a single live hypothesis out of the beam as soon
  as it cannot enter the n-best: its continuations score no higher than it does, so they could
  only ever take beam slots from hypotheses as hopeless (every hypothesis that outranks one of
  them is kept either way), and the n-best come out exactly as with a full beam, on fewer rows.
- That is the default, tensor2tensor's rule (`stop="bound"`). fairseq and CTranslate2 stop a
  sentence sooner, as soon as `beam` hypotheses have finished, and collect no more than `beam`
  (`stop="beam"`; no hypothesis leaves the paper's beam for being hopeless then, as none does in
  theirs): fewer steps, but a longer hypothesis that the length penalty would rank first can be
  missed. The bound still stops a sentence whose n-best it has settled (more finished hypotheses
  could not enter it), so both rules return the same n-best where the bound stops first.

Sentences that are done leave the batch, and so do empty slots: a sentence with fewer live
hypotheses than the others' gets fewer decoder rows. The beams of one sentence share its encoder states.
`reference_search` is the same search written plainly for one sentence, re-running the full
forward pass at every step; tests compare the two.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.fx.experimental import _config as fx_config  # its use_duck_shape: see `compile_decoder`

from nmt_cli.config.inference import BeamStyle, Stop, TranslateConfig
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.inference.beams import (
    Beams,
    NextTokens,
    SearchModel,
    best_tokens,
    chosen,
    extensions,
    live_first,
    next_tokens,
)
from nmt_cli.model import kernels
from nmt_cli.model.transformer import Cache, Encoded, Transformer


class Hypothesis(NamedTuple):
    tokens: list[int]  # output ids, EOS left out
    score: float  # log P(Y | X) / lp(|Y|): what the search ranks by
    log_prob: float  # log P(Y | X), EOS included


class Constraint(Protocol):
    """Which tokens each hypothesis may continue with (`trees.TreeConstraint`: well-formed trees)."""

    def allowed(self, history: Tensor, sentence: Tensor, room: Tensor) -> Tensor:
        """history (N, t): each decoder row's tokens so far; sentence (N,): the row's sentence in the
        batch; room (N,): the tokens the row may still produce after this one before EOS is forced
        -> (N, V) bool. The model's probabilities are renormalised over the allowed tokens."""
        ...

    def select(self, sentences: Sequence[int]) -> Constraint:
        """The constraint of a batch made of these sentences (indices of `translate_ids`' sources)."""
        ...


class Penalty(NamedTuple):
    """A length penalty's alpha and its form (a plain float alpha is GNMT's)."""

    alpha: float
    form: Literal["gnmt", "fairseq"] = "gnmt"


def length_penalty(length: int | Tensor, alpha: float | Penalty) -> float | Tensor:
    """GNMT length penalty lp(|Y|) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, eq. 14), or fairseq's
    |Y| ** alpha; |Y| counts EOS. Both grow with |Y| (alpha >= 0), as the search's bound needs."""
    alpha, form = alpha if isinstance(alpha, Penalty) else (alpha, "gnmt")
    match form:
        case "gnmt":
            return ((5 + length) / 6) ** alpha
        case "fairseq":
            return length**alpha


def max_output_lengths(src_lengths: Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> Tensor:
    """Most output tokens before EOS: a * source length + b (the paper: length + 50), source length
    without its EOS, capped so that the tokens and EOS fit the model's positions."""
    lengths = (max_len_a * src_lengths.double() + max_len_b).floor().long()
    return lengths.clamp(min=0, max=max_positions - 1)


# -- decoders: what the search asks the model for, with and without the incremental cache ----------


class IncrementalDecoder:
    """One position per step through `decode_step`: cached self-attention keys/values, encoder keys/values
    computed once per sentence."""

    def __init__(self, model: SearchModel, src: Tensor) -> None:
        self.model = model
        self.next_tokens = _compiled.get(model, next_tokens)
        self.enc = model.encode(src)
        self.cache = model.start_decoding(self.enc)

    def step(self, tokens: Tensor, history: Tensor, step: int | Tensor, beams: Beams | None, k: int,
             allowed: Tensor | None = None) -> NextTokens:
        return self.next_tokens(self.model, tokens, step, self.enc, self.cache, k, beams, allowed)

    def reorder(self, rows: Tensor, sentences: Tensor | None) -> None:
        self.enc, self.cache = self.model.reorder(self.enc, self.cache, rows, sentences)

    def join(self, src: Tensor) -> None:
        """Sentences src (B', S) join, one row each, after the rows there are (`Search.join`)."""
        assert isinstance(self.model, Transformer), "only a Transformer's search takes sentences as it runs"
        self.enc, self.cache = self.model.join(self.enc, self.cache, self.model.encode(src))

    def trim(self, steps: int) -> None:
        """No row is older than `steps`: the cache forgets the columns before (`Cache.trim`)."""
        self.cache.trim(steps + 1)


class FullForwardDecoder:
    """No cache at all: every step re-runs the whole model (encoder too) over the full prefix. Only
    the speed baseline of `benchmarks/translate_speed.py`; it gives the same results, slowly."""

    def __init__(self, model: Transformer, src: Tensor) -> None:
        self.model, self.src = model, src

    def step(self, tokens: Tensor, history: Tensor, step: int, beams: Beams | None, k: int,
             allowed: Tensor | None = None) -> NextTokens:
        rows, sentences = history.shape[0], self.src.shape[0]
        if beams is None:
            src = self.src.repeat_interleave(rows // sentences, dim=0)
        else:
            src = self.src[beams.sentence()]
        prev = torch.cat([torch.full((rows, 1), BOS, dtype=history.dtype, device=history.device), history], 1)
        logits = self.model(src, prev)[:, -1]
        return best_tokens(logits if allowed is None else logits.masked_fill(~allowed, -math.inf), k)

    def reorder(self, rows: Tensor, sentences: Tensor | None) -> None:
        if sentences is not None:
            self.src = self.src.index_select(0, sentences)


# -- the batched search ---------------------------------------------------------------------------


class _Finished:
    """Finished hypotheses of the sentences a search holds, in its order, and each one's nbest-th best
    score."""

    def __init__(self, batch_size: int, nbest: int, device: torch.device) -> None:
        self.nbest = nbest
        self.hypotheses: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
        self.nth_best = torch.full((batch_size,), -math.inf, device=device)

    def add(self, sentence: int, tokens: list[int], log_prob: float, alpha: float | Penalty) -> None:
        """Collect a finished hypothesis (all are kept: the n-best are taken at the end)."""
        found = self.hypotheses[sentence]
        found.append(Hypothesis(tokens, log_prob / length_penalty(len(tokens) + 1, alpha), log_prob))
        found.sort(key=lambda h: -h.score)
        if len(found) >= self.nbest:
            self.nth_best[sentence] = found[self.nbest - 1].score

    def keep(self, kept: Tensor, indices: list[int]) -> None:
        """Only the sentences `kept` (the same as the list `indices`), in that order."""
        self.hypotheses = [self.hypotheses[i] for i in indices]
        self.nth_best = self.nth_best[kept]

    def join(self, n: int) -> None:
        self.hypotheses += [[] for _ in range(n)]
        self.nth_best = torch.cat([self.nth_best, self.nth_best.new_full((n,), -math.inf)])


class Search:
    """The batched beam search of the module docstring, one step at a time: sentences join it between
    steps (`join`) and each leaves as soon as its n-best is settled (`step` returns it).
    `beam_search` joins one batch and steps until it is done. A server's search thread
    (serve/batcher.py) lets new sentences in at every step (iteration-level batching), so that no
    sentence waits for the longest one of a batch before it is answered, and the search keeps its
    rows full while sentences come and go.

    A sentence that joins late decodes at its own position: `age` (B,) counts each sentence's steps.
    `history` (N, t) holds each row's tokens right-aligned (PAD before a younger row's first token),
    and the decoder's cache masks a younger row's attention over the steps before it joined
    (`transformer.Cache.join`): its search is the one it would have alone. Joining needs the
    incremental decoder of a `Transformer` and no constraint.
    """

    def __init__(self, model: SearchModel, *, beam: int, nbest: int, lenpen: float | Penalty,
                 max_len_a: float, max_len_b: int, cached: bool = True, style: BeamStyle = "paper",
                 stop: Stop = "bound", constraint: Constraint | None = None) -> None:
        assert 1 <= nbest <= beam
        self.model, self.beam, self.nbest, self.lenpen, self.stop = model, beam, nbest, lenpen, stop
        self.max_len_a, self.max_len_b, self.cached = max_len_a, max_len_b, cached
        self.constraint = constraint
        self.style: BeamStyle = style if beam > 1 else "shrinking"  # beam 1: greedy (module docstring)
        self.width = 2 * beam if self.style == "paper" else beam  # extensions looked at per sentence
        self.decoder: IncrementalDecoder | FullForwardDecoder | None = None  # None: no sentence decoding
        self.ids: list[int] = []  # the caller's key of each sentence decoding
        self.common: int | None = 0  # the step of every sentence, while they all have the same

    def __len__(self) -> int:
        return len(self.ids)

    @torch.inference_mode()
    def join(self, src: Tensor, ids: Sequence[int]) -> None:
        """Sentences src (B', S) (right-padded source ids, each ending in EOS) start decoding at the
        next step; `ids` name them in what `step` returns."""
        B, device = src.shape[0], src.device
        max_len = max_output_lengths((src != PAD).sum(1) - 1, self.max_len_a, self.max_len_b,
                                     self.model.cfg.max_positions)
        final_lp = length_penalty(max_len.double() + 1, self.lenpen)  # the best lp still reachable
        if self.decoder is None:
            self.decoder = (IncrementalDecoder if self.cached else FullForwardDecoder)(self.model, src)
            self.ids, self.common, self.age = list(ids), 0, torch.zeros(B, dtype=torch.long, device=device)
            self.max_len, self.final_lp = max_len, final_lp
            self.scores = torch.zeros(B, 1, device=device)  # (B, W) log P of each live slot; -inf: empty
            self.tokens = torch.full((B,), BOS, device=device)  # (N,) the newest token of each decoder row
            self.history = torch.zeros(B, 0, dtype=torch.long, device=device)  # (N, t) tokens so far
            self.finished = _Finished(B, self.nbest, device)
            self.n_finished = torch.zeros(B, dtype=torch.long, device=device)
            self.beams: Beams | None = None  # the rows' slots when some are empty; None: a row per slot
            return
        assert isinstance(self.decoder, IncrementalDecoder) and self.constraint is None, \
            "only an incremental search without a constraint takes sentences while it runs"
        self.decoder.join(src)
        W = self.scores.shape[1]
        live = (torch.ones_like(self.scores, dtype=torch.bool) if self.beams is None
                else self.beams.row < len(self.tokens))
        fresh = torch.full((B, W), -math.inf, device=device)
        fresh[:, 0] = 0.0
        self.scores = torch.cat([self.scores, fresh])
        live = torch.cat([live, fresh == 0.0])
        self.beams = None if W == 1 and self.beams is None else Beams.of(live)
        self.tokens = torch.cat([self.tokens, torch.full((B,), BOS, device=device)])
        self.history = torch.cat([self.history, self.history.new_full((B, self.history.shape[1]), PAD)])
        self.ids += list(ids)
        self.common = 0 if self.common == 0 else None
        self.age = torch.cat([self.age, torch.zeros_like(max_len)])
        self.max_len, self.final_lp = torch.cat([self.max_len, max_len]), torch.cat([self.final_lp, final_lp])
        self.n_finished = torch.cat([self.n_finished, torch.zeros_like(max_len)])
        self.finished.join(B)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, list[Hypothesis]]]:
        """One decoder step of every sentence: (id, n-best) of those whose n-best it settles, which
        leave the search."""
        assert self.decoder is not None
        beams, scores, history, age, step = self.beams, self.scores, self.history, self.age, self.common
        B, W, device = scores.shape[0], scores.shape[1], scores.device
        row_sentence = (lambda: torch.arange(B, device=device).repeat_interleave(W) if beams is None  # noqa: E731
                        else beams.sentence())
        position = step if step is not None else age[row_sentence()]
        allowed = None
        if self.constraint is not None:
            row = row_sentence()
            allowed = self.constraint.allowed(history, torch.as_tensor(self.ids, device=device)[row],
                                              self.max_len[row] - age[row] - 1)
        best = self.decoder.step(self.tokens, history, position, beams, self.width, allowed)
        values, slots, new_tokens = extensions(best, scores, self.width, age >= self.max_len, beams)
        rows = torch.arange(B, device=device)[:, None] * W + slots  # (B, k)
        if beams is not None:  # the decoder row each extends (an empty slot has none: N, and is never kept)
            rows = beams.row.view(-1)[rows]
        ends, going_on = chosen(self.style, values, new_tokens, self.beam, self.n_finished)
        if self.stop == "beam":  # no more than `beam` finished a sentence, the best first (fairseq's)
            ends &= ends.cumsum(1) <= (self.beam - self.n_finished)[:, None]
        b, j = ends.nonzero().unbind(1)  # one gather and one copy to Python for all that finish
        outputs = history[rows[b, j]].tolist()
        if step is None:  # a younger row's tokens are its last `age`
            outputs = [output[len(output) - n :] for output, n in zip(outputs, age[b].tolist(), strict=True)]
        for sentence, output, log_prob in zip(b.tolist(), outputs, values[b, j].tolist(), strict=True):
            self.finished.add(sentence, output, log_prob, self.lenpen)
        self.n_finished += ends.sum(1)
        best_lp = (self.final_lp.clamp(min=length_penalty(step + 2.0, self.lenpen)) if step is not None
                   else torch.maximum(self.final_lp, _penalties(self.lenpen, self.model.cfg.max_positions
                                                                 ).to(device)[age + 2]))
        nth_best = self.finished.nth_best.double()
        if self.style == "paper" and self.stop == "bound":  # hopeless ones leave the beam (module docstring)
            going_on &= values.double() / best_lp[:, None] > nth_best[:, None]
        live, scores, rows, new_tokens = live_first(going_on, values, rows, new_tokens)
        done = ~live[:, 0] | (nth_best >= scores[:, 0].double() / best_lp)
        if self.stop == "beam":
            done |= self.n_finished >= self.beam
        if not bool(done.any()):
            keep, settled = None, []
        else:
            gone = done.nonzero()[:, 0].tolist()
            settled = [(self.ids[i], self.finished.hypotheses[i][: self.nbest]) for i in gone]
            if len(gone) == B:
                self.decoder, self.ids = None, []
                return settled
            keep = (~done).nonzero()[:, 0]
            indices = keep.tolist()
            live, rows, new_tokens, scores = live[keep], rows[keep], new_tokens[keep], scores[keep]
            self.ids = [self.ids[i] for i in indices]
            self.finished.keep(keep, indices)
            self.max_len, self.final_lp = self.max_len[keep], self.final_lp[keep]
            self.n_finished, age = self.n_finished[keep], age[keep]
        if bool(live.all()):
            self.beams, rows, self.tokens = None, rows.reshape(-1), new_tokens.reshape(-1)
        else:  # sentences with fewer live hypotheses than others: their empty slots get no row
            self.beams = Beams.of(live)
            rows, self.tokens = rows[live], new_tokens[live]
        self.scores = scores
        history = torch.cat([history.index_select(0, rows), self.tokens[:, None]], dim=1)
        self.decoder.reorder(rows, keep)
        self.age = age + 1
        if step is not None:
            self.common = step + 1
        elif keep is not None:  # the oldest may have left: drop the columns no row reads
            oldest = int(self.age.max())
            if oldest < history.shape[1]:
                history = history[:, history.shape[1] - oldest :]
                self.decoder.trim(oldest)
            if bool((self.age == oldest).all()):
                self.common = oldest
        self.history = history
        return settled


@functools.cache
def _penalties(lenpen: float | Penalty, max_positions: int) -> Tensor:
    """lp(L) for every length up to max_positions + 1, as Python computes it: the bound at the step of
    a sentence that joined late (`Search.step`), equal to the scalar one of the others."""
    return torch.tensor([length_penalty(float(n), lenpen) for n in range(max_positions + 2)],
                        dtype=torch.float64)


@torch.inference_mode()
@kernels.packed_weights()
def beam_search(model: SearchModel, src: Tensor, *, beam: int, nbest: int, lenpen: float | Penalty,
                max_len_a: float, max_len_b: int, cached: bool = True, style: BeamStyle = "paper",
                stop: Stop = "bound", constraint: Constraint | None = None) -> list[list[Hypothesis]]:
    """Translate one batch: src (B, S) source ids, right-padded, each ending in EOS.

    Returns, for each sentence in order, its best `nbest` hypotheses, best first (fewer only when the
    vocabulary and maximum length allow fewer distinct outputs). `cached=False` runs the same
    search re-running the full model at every step (for speed comparisons). `style`, `stop`: see the
    module docstring. `constraint`: the only tokens each hypothesis may continue with (see `Constraint`).
    """
    search = Search(model, beam=beam, nbest=nbest, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
                    cached=cached, style=style, stop=stop, constraint=constraint)
    search.join(src, range(src.shape[0]))
    results: list[list[Hypothesis]] = [[] for _ in range(src.shape[0])]
    while len(search):
        for i, found in search.step():
            results[i] = found
    return results


# The compiled `next_tokens` of each model `compile_decoder` was called for.
_compiled: weakref.WeakKeyDictionary[Transformer, Callable[..., NextTokens]] = weakref.WeakKeyDictionary()


def compile_decoder(model: Transformer, beam: int) -> None:
    """From now on run `next_tokens` of `model` (the decoder step and its best `beam` tokens) through
    torch.compile, and compile it here, on small batches searched with `beam`, so that a failure (no
    C++ compiler) shows before any work starts.

    Inductor fuses each layer's attention over the cache, its softmax and the elementwise work into
    a few kernels and leaves the matrix products to torch. With dynamic shapes a handful of graphs
    serve every batch: the first step and the later ones, each for several sentences and for one,
    with several rows a sentence and with one (sizes torch specialises: one row a sentence comes
    with beam 1, or once all but one of a sentence's hypotheses have finished), and with empty
    slots (`Beams`); the warm-up makes them all (7 graphs for beam 4), as a graph made later stops
    its search for seconds. Dynamo is not thread-safe: a
    compiled decoder is for one search at a time (`translate_ids` with workers=1; `replicas` for several).
    """
    compiled = torch.compile(next_tokens, dynamic=True)

    def compiled_next_tokens(model: Transformer, tokens: Tensor, step: int, enc: Encoded, cache: Cache,
                             k: int, beams: Beams | None, allowed: Tensor | None = None) -> NextTokens:
        # Always the best 2 * `beam` tokens, so that the greedy warm-up makes graphs for the beam
        # search of either style (more than k change nothing). No duck sizing: by default, sizes equal
        # when first compiled are assumed equal for good (4 slots a sentence and 4 heads), and each
        # later difference costs a recompile in the middle of a search.
        with fx_config.patch(use_duck_shape=False):
            return compiled(model, tokens, step, enc, cache, max(k, 2 * beam), beams, allowed)

    _compiled[model] = compiled_next_tokens
    device = next(model.parameters()).device
    word = min(4, model.vocab_size - 1)  # any token after the specials
    for width in sorted({beam, 1}, reverse=True):
        # sentences finish at different steps: the last one decodes alone
        for lengths in (list(range(40, 8, -1)), [5]):
            src = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
            for row, length in enumerate(lengths):
                src[row, :length] = torch.tensor([word] * (length - 1) + [EOS])
            beam_search(model, src.to(device), beam=width, nbest=1, lenpen=0.6, max_len_a=1.0, max_len_b=3)


# -- many sentences -----------------------------------------------------------------------------


class Pool(Protocol):
    """Worker processes that search batches with their own copy of the model (`replicas.Replicas`)."""

    count: int

    def submit(self, src: Tensor) -> Future[list[list[Hypothesis]]]: ...


def translate_ids(model: SearchModel, sources: Sequence[Sequence[int]], cfg: TranslateConfig,
                  on_batch: Callable[[int], None] | None = None, workers: int = 1,
                  cached: bool = True, replicas: Pool | None = None,
                  constraint: Constraint | None = None) -> list[list[Hypothesis]]:
    """Translate token-id sequences (each ending in EOS, none longer than the model's
    max_positions) in batches of similar length, longest first, of at most `cfg.max_tokens` padded
    source tokens. Returns each source's n-best list in input order; `on_batch(n)` after each batch of
    n sentences. Uses cfg's beam, nbest, lenpen, max_len_a, max_len_b and max_tokens; the model's device.

    `workers` > 1 searches that many batches at once in threads (torch releases the GIL inside its
    operations): on the CPU, with torch's own threads set to 1, this uses the cores far better than
    torch's threads inside each small operation (benchmarks/README.md); the batches
    (`_batches`) come in a multiple of `workers`, of equal tokens, each handed to the first worker
    free. `replicas`: the batches are searched
    by those worker processes instead (a compiled decoder; `workers` is then their count).
    `cached=False`: see `beam_search`. `constraint`: of all the sources, in their order (not applied
    by `replicas`).
    """
    results: list[list[Hypothesis]] = [[] for _ in sources]
    if not sources:
        return results
    device = next(model.parameters()).device
    sizes = np.array([len(s) for s in sources], dtype=np.int64)
    assert sizes.min() >= 1 and sizes.max() <= model.cfg.max_positions

    def padded_batch(batch: np.ndarray) -> Tensor:
        return padded([sources[i] for i in batch.tolist()])

    def search(batch: np.ndarray) -> list[list[Hypothesis]]:
        return beam_search(model, padded_batch(batch).to(device), **search_settings(cfg), cached=cached,
                           constraint=None if constraint is None else constraint.select(batch.tolist()))

    def record(batch: np.ndarray, hypotheses: list[list[Hypothesis]]) -> None:
        for i, found in zip(batch.tolist(), hypotheses, strict=True):
            results[i] = found
        if on_batch is not None:
            on_batch(len(batch))

    workers = replicas.count if replicas is not None else workers
    batches = iter(_batches(sizes, cfg.max_tokens, workers))
    if workers <= 1 and replicas is None:
        for batch in batches:
            record(batch, search(batch))
        return results
    with contextlib.ExitStack() as stack:
        if replicas is not None:  # they search without a constraint (the translator says so)
            submit = lambda batch: replicas.submit(padded_batch(batch))  # noqa: E731
        else:
            submit = functools.partial(stack.enter_context(ThreadPoolExecutor(workers)).submit, search)
        running = {submit(batch): batch for batch in itertools.islice(batches, workers)}
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                record(running.pop(future), future.result())
                if (batch := next(batches, None)) is not None:
                    running[submit(batch)] = batch
    return results


def padded(sources: Sequence[Sequence[int]]) -> Tensor:
    """Token-id sequences as one (B, S) batch, right-padded with PAD."""
    src = torch.full((len(sources), max(map(len, sources))), PAD, dtype=torch.long)
    for row, ids in enumerate(sources):
        src[row, : len(ids)] = torch.as_tensor(ids)
    return src


def search_settings(cfg: TranslateConfig) -> dict[str, Any]:
    """`beam_search`'s (and `Search`'s) settings from a translation's config."""
    return dict(beam=cfg.beam, nbest=cfg.nbest, lenpen=Penalty(cfg.lenpen, cfg.length_penalty),
                max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b, style=cfg.beam_style, stop=cfg.stop)


def joinable(model: SearchModel) -> bool:
    """Whether sentences can join a `Search` of `model` while it runs: a Transformer's, not compiled."""
    return isinstance(model, Transformer) and model not in _compiled


def cpu_workers(threads: int) -> int:
    """How many batches a CPU searches at once, each on one thread: `--threads` (0: one per core)."""
    return threads if threads > 0 else torch.get_num_threads()


def _batches(sizes: np.ndarray, max_tokens: int, workers: int) -> list[np.ndarray]:
    """Indices of `sizes` in batches, longest first, each of at most `max_tokens` padded tokens (a
    longer sentence alone): as many as the fewest the budget allows, rounded up to a multiple of
    `workers`, with the largest batch's share of the source tokens as small as it can be, so that
    the workers finish together.

    Few and large, because every batch pays a fixed cost at each of its steps (torch's per-operation
    cost and the tail of steps where few of its sentences are left): they beat guided
    self-scheduling's many batches, shrinking towards the end (benchmarks/README.md, "Translation")."""
    order = np.argsort(-sizes, kind="stable")
    longest_first = sizes[order]
    room = np.maximum(max_tokens // longest_first, 1)  # sentences a batch starting at each can hold
    ends = np.cumsum(longest_first)  # source tokens up to and including each sentence

    def starts(limit: int) -> list[int]:
        """Where each batch starts when each takes all it can of at most `limit` source tokens."""
        found = [0]
        while True:
            start = found[-1]
            fits = int(np.searchsorted(ends, (ends[start - 1] if start else 0) + limit, side="right"))
            end = max(min(start + int(room[start]), fits), start + 1)
            if end >= len(order):
                return found
            found.append(end)

    total = int(ends[-1])
    count = -(-len(starts(total)) // workers) * workers
    low, high = int(longest_first[0]), total  # the smallest limit that needs at most `count` batches
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(starts(middle)) <= count else (middle + 1, high)
    return np.split(order, starts(low)[1:])


# -- the reference ------------------------------------------------------------------------------


@torch.inference_mode()
@kernels.packed_weights()
def reference_search(model: Transformer, source: Sequence[int], *, beam: int, nbest: int, lenpen: float,
                     max_len_a: float, max_len_b: int, style: BeamStyle = "paper",
                     stop: Stop = "bound") -> list[Hypothesis]:
    """The search of the module docstring for one sentence, in plain Python over full forward passes
    (no cache, no batching, no shortcuts): the specification `beam_search` is tested against."""
    src = torch.tensor([list(source)])
    style = style if beam > 1 else "shrinking"
    max_len = int(max_output_lengths(torch.tensor(len(source) - 1), max_len_a, max_len_b,
                                     model.cfg.max_positions))
    live: list[tuple[float, list[int]]] = [(0.0, [])]  # (log P, tokens)
    finished: list[Hypothesis] = []
    for step in range(max_len + 1):
        candidates = []
        for log_p, tokens in live:
            logits = model(src, torch.tensor([[BOS, *tokens]]))[0, -1].float()
            log_probs = torch.log_softmax(logits, dim=-1).tolist()
            allowed = [EOS] if step == max_len else [t for t in range(len(log_probs)) if t not in (PAD, BOS)]
            candidates += [(log_p + log_probs[t], tokens, t) for t in allowed]
        candidates.sort(key=lambda c: -c[0])
        live = []
        match style:
            case "paper":  # EOS among the best `beam` finish; the best `beam` others go on
                ending = [(log_p, tokens) for log_p, tokens, t in candidates[:beam] if t == EOS]
                if stop == "beam":  # at most `beam` finished in all
                    ending = ending[: beam - len(finished)]
                live = [(log_p, [*tokens, t]) for log_p, tokens, t in candidates if t != EOS][:beam]
            case "shrinking":  # the best `beam` - finished, whether they end or not
                kept = candidates[: beam - len(finished)]
                ending = [(log_p, tokens) for log_p, tokens, t in kept if t == EOS]
                live = [(log_p, [*tokens, t]) for log_p, tokens, t in kept if t != EOS]
        finished += [Hypothesis(tokens, log_p / length_penalty(len(tokens) + 1, lenpen), log_p)
                     for log_p, tokens in ending]
        finished.sort(key=lambda h: -h.score)
        if not live or (stop == "beam" and len(finished) >= beam):
            break
        best_lp = max(length_penalty(step + 2, lenpen), length_penalty(max_len + 1, lenpen))
        if len(finished) >= nbest and finished[nbest - 1].score >= live[0][0] / best_lp:
            break
    return finished[:nbest]
