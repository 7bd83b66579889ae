"""Beam search, in both styles (the paper's, which keeps `beam` live hypotheses, and the shrinking
one): the batched, cached search equals a plain reference, beam 1 is greedy, a beam wide enough
finds the exhaustive optimum, and batching does not change a sentence's translation."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from conftest import why_torch_compile_cannot_run
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.inference.beams import CHUNK_ROWS, Beams, best_tokens, group_size, top_k
from nmt_cli.inference.search import (
    IncrementalDecoder,
    Search,
    _batches,
    beam_search,
    compile_decoder,
    length_penalty,
    max_output_lengths,
    reference_search,
    translate_ids,
)
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer

TINY = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, dropout=0.0,
                   max_positions=64)


def random_model(vocab: int, seed: int, sharpness: float = 8.0, cfg: ModelConfig = TINY) -> Transformer:
    """Random weights; a larger embedding scale makes the output distributions peaked enough that
    hypotheses end at different lengths."""
    torch.manual_seed(seed)
    model = Transformer(cfg, vocab).eval()
    with torch.no_grad():
        model.embed.weight.mul_(sharpness)
    return model


def padded(sources: list[list[int]]) -> torch.Tensor:
    src = torch.full((len(sources), max(map(len, sources))), PAD)
    for i, ids in enumerate(sources):
        src[i, : len(ids)] = torch.tensor(ids)
    return src


def random_sources(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[*torch.randint(4, vocab, (n,), generator=g).tolist(), EOS] for n in lengths]


def test_length_penalty_is_gnmt() -> None:
    assert length_penalty(1, 0.6) == pytest.approx(1.0)  # (5 + 1) / 6 = 1
    assert length_penalty(7, 1.0) == pytest.approx(2.0)
    assert length_penalty(25, 0.6) == pytest.approx(5.0**0.6)
    assert length_penalty(40, 0.0) == 1.0


def test_max_output_length_is_a_times_source_plus_b_capped_by_positions() -> None:
    lengths = max_output_lengths(torch.tensor([0, 10, 1000]), 1.0, 50, max_positions=256)
    assert lengths.tolist() == [50, 60, 255]  # 255 tokens + EOS fill the 256 positions
    assert max_output_lengths(torch.tensor([10]), 1.5, 0, 1024).tolist() == [15]


def test_live_slots_are_numbered_in_order() -> None:
    beams = Beams.of(torch.tensor([[True, True, False], [True, False, False], [True, True, True]]))
    assert beams.slot.tolist() == [0, 1, 3, 6, 7, 8]
    assert beams.row.tolist() == [[0, 1, 6], [2, 6, 6], [3, 4, 5]]  # 6: no row


@pytest.mark.parametrize(("live", "order"), [
    ([[True] * 3] * 2, [2, 0, 0, 4, 5, 3]),  # rows b * 3 ... b * 3 + 2 are sentence b's
    ([[True, True, False], [True, False, False], [True, True, True]],
     [1, 0, 2, 5, 3, 3]),  # empty slots: `Beams`
])
def test_decode_step_equals_full_forward(live: list[list[bool]], order: list[int]) -> None:
    """Rows grouped by sentence, reordered between steps (each row from a row of its own sentence),
    attend to their own sentence's encoder states, also when sentences keep different numbers of
    live hypotheses and only the live slots get rows."""
    slots = torch.tensor(live)
    beams = None if slots.all() else Beams.of(slots)
    sentence = slots.reshape(-1).nonzero()[:, 0] // slots.shape[1]  # of each row
    rows, steps = len(sentence), 5
    model = random_model(24, seed=0)
    src = padded(random_sources(24, [3, 6, 4][: len(slots)], seed=1))
    g = torch.Generator().manual_seed(2)
    prefixes = torch.randint(4, 24, (rows, steps), generator=g)
    enc = model.encode(src)
    cache = model.start_decoding(enc)
    tokens = torch.full((rows,), BOS)
    history = torch.zeros(rows, 0, dtype=torch.long)
    with torch.no_grad():
        for step in range(steps):
            logits = model.decode_step(tokens, step, enc, cache, beams)
            full = model(src[sentence], torch.cat([torch.full((rows, 1), BOS), history], 1))[:, -1]
            torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
            enc, cache = model.reorder(enc, cache, torch.tensor(order))
            history = torch.cat([history[order], prefixes[order, step : step + 1]], 1)
            tokens = history[:, -1]


def whole_row_best(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """What `best_tokens` must give, the plain way: (log-probabilities, tokens, EOS log-probability)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    eos = log_probs[:, EOS].clone()
    log_probs[:, [PAD, BOS]] = -math.inf
    top = log_probs.topk(k, dim=-1)
    return top.values, top.indices, eos


def hard_logits(vocab: int) -> Tensor:
    torch.manual_seed(0)
    logits = torch.randn(50, vocab) * 3
    logits[0, PAD] = logits[1, BOS] = 100.0  # the most probable, and never produced
    logits[2, 5000:5004] = 50.0 + torch.arange(4.0)  # the whole top 4 in one group of the compiled path
    logits[3, 100 + vocab // 8 * torch.arange(4)] = 50.0 + torch.arange(4.0)  # ... in one class of `top_k`
    logits[4, -3:] = 50.0 + torch.arange(3.0)  # in the columns left over by `top_k`'s classes
    return logits


@pytest.mark.parametrize("vocab", [7968, 7795])
def test_best_tokens_equal_log_softmax_and_topk(vocab: int) -> None:
    """The eager path (the in-place log_softmax, and `top_k`'s classes with leftover columns when the
    vocabulary is not a multiple of 8) gives the tokens and log-probabilities of `topk` over
    `log_softmax`."""
    logits = hard_logits(vocab)
    for k in (8, 4, 1):
        values, tokens, eos = whole_row_best(logits, k)
        found = best_tokens(logits.clone(), k)
        assert torch.equal(found.tokens, tokens)
        torch.testing.assert_close(found.log_probs, values)
        torch.testing.assert_close(found.eos, eos)
    top4 = best_tokens(logits.clone(), 4).tokens
    assert not torch.isin(top4, torch.tensor([PAD, BOS])).any()
    assert top4[2].tolist() == [5003, 5002, 5001, 5000]
    assert top4[3].tolist() == (100 + vocab // 8 * torch.arange(3, -1, -1)).tolist()
    assert top4[4, :3].tolist() == [vocab - 1, vocab - 2, vocab - 3]
    rows = torch.randn(30, 1003)
    for k in (1, 5, 125):  # 125 classes of 8 columns: every class is a candidate
        assert torch.equal(top_k(rows, k)[1], rows.topk(k, dim=-1).indices)


def test_best_tokens_in_two_stages_when_compiled_equal_topk() -> None:
    """The compiled CPU path's group maxima, then the top k within the best k groups, gives the
    tokens and log-probabilities `topk` over `log_softmax` gives, never PAD or BOS."""
    if (reason := why_torch_compile_cannot_run()) is not None:
        pytest.skip(reason)
    assert group_size(7968) == 96 and group_size(32000) == 160 and group_size(64) == 0
    logits = hard_logits(7968)
    compiled = torch.compile(best_tokens, dynamic=True)
    for k in (4, 1):
        values, tokens, eos = whole_row_best(logits, k)
        found = compiled(logits.clone(), k)
        assert torch.equal(found.tokens, tokens)
        torch.testing.assert_close(found.log_probs, values)
        torch.testing.assert_close(found.eos, eos)


def test_compiled_search_equals_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled decoder (`compile_decoder`) in a search that has empty slots, with a vocabulary
    large enough for the two-stage choice of the best tokens: the reference search's n-best lists."""
    if (reason := why_torch_compile_cannot_run()) is not None:
        pytest.skip(reason)
    model = random_model(256, seed=0)
    with torch.no_grad():
        model.embed.weight[EOS] *= 2  # EOS likely enough that hypotheses end at different steps
    assert group_size(256) == 32
    compile_decoder(model, beam=5)
    layouts = []
    spread_rows = Beams.of
    monkeypatch.setattr(Beams, "of", staticmethod(lambda live: layouts.append(live) or spread_rows(live)))
    sources = random_sources(256, [3, 7, 1, 5, 9, 2, 6, 4], seed=0)
    lengths = set()
    for style in ("paper", "shrinking"):  # one compiled graph set serves both
        settings = dict(beam=5, nbest=2, lenpen=0.6, max_len_a=1.0, max_len_b=4, style=style)
        found = beam_search(model, padded(sources), **settings)
        for source, hyps in zip(sources, found, strict=True):
            expected = reference_search(model, source, **settings)
            assert [h.tokens for h in hyps] == [h.tokens for h in expected]
            assert [h.score for h in hyps] == pytest.approx([h.score for h in expected], abs=1e-4)
            lengths.update(len(h.tokens) for h in hyps)
    assert len(lengths) > 1  # hypotheses ended at different steps
    assert layouts  # and slots were left empty: some steps decoded fewer rows than slots
    # More rows than the eager step's chunk of the projection (`beams.CHUNK_ROWS`) are searched by
    # the graphs above: a guard on the rows' count made each graph compile again for them, past
    # dynamo's limit on recompiles, and a compiled search ran several times slower than an eager one.
    graphs = counters["stats"]["unique_graphs"]
    many = random_sources(256, [5, 3, 7, 4] * 20, seed=1)  # 80 sentences, up to 400 rows
    assert len(many) * 5 > CHUNK_ROWS
    beam_search(model, padded(many), beam=5, nbest=1, lenpen=0.6, max_len_a=1.0, max_len_b=4)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_batches_hold_every_sentence_once_longest_first_within_the_budget(workers: int) -> None:
    sizes = np.random.default_rng(workers).integers(1, 120, size=3000)
    batches = list(_batches(sizes, max_tokens=12000, workers=workers))
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(sizes)))
    lengths = np.concatenate([sizes[b] for b in batches])
    assert (np.diff(lengths) <= 0).all()  # longest first, and each batch's first sentence is its longest
    assert all(len(b) * sizes[b].max() <= 12000 for b in batches)
    # about as few as the budget allows (padding makes some a little under it), a multiple of the workers
    assert len(batches) % workers == 0 and len(batches) <= 1.25 * sizes.sum() / 12000 + 2 * workers
    # where the budget leaves room, of equal source tokens (to a sentence)
    batches = _batches(sizes, max_tokens=10**6, workers=workers)
    tokens = [int(sizes[b].sum()) for b in batches]
    assert len(batches) == workers and max(tokens) - min(tokens) <= sizes.max()


@pytest.mark.parametrize("workers", [1, 2])
def test_batches_of_a_small_input_are_one_a_worker_and_of_long_sentences_alone(workers: int) -> None:
    sizes = np.array([30, 12, 11, 9, 9, 8, 5, 3])
    batches = [b.tolist() for b in _batches(sizes, max_tokens=1000, workers=workers)]
    assert batches == ([[0, 1, 2, 3, 4, 5, 6, 7]] if workers == 1 else [[0, 1], [2, 3, 4, 5, 6, 7]])
    # sentences longer than the budget, each alone; the others within it
    batches = list(_batches(np.array([50, 40, 6, 5, 5, 2]), max_tokens=30, workers=2))
    assert [b.tolist() for b in batches[:2]] == [[0], [1]]
    assert all(len(b) * np.array([50, 40, 6, 5, 5, 2])[b].max() <= 30 for b in batches[2:])
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))


@pytest.mark.parametrize("beam,nbest,alpha", [(1, 1, 0.6), (4, 1, 0.6), (4, 4, 1.0), (5, 2, 0.0),
                                              (3, 1, -0.5)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("style,stop", [("paper", "bound"), ("shrinking", "bound"), ("paper", "beam")])
def test_batched_search_equals_reference(beam: int, nbest: int, alpha: float, seed: int, style: str,
                                         stop: str) -> None:
    model = random_model(24, seed)
    sources = random_sources(24, [3, 7, 1, 5, 9, 2], seed)
    settings = dict(beam=beam, nbest=nbest, lenpen=alpha, max_len_a=1.0, max_len_b=4, style=style, stop=stop)
    found = beam_search(model, padded(sources), **settings)
    uncached = beam_search(model, padded(sources), **settings, cached=False)
    lengths = set()
    for source, hyps, slow in zip(sources, found, uncached, strict=True):
        expected = reference_search(model, source, **settings)
        assert [h.tokens for h in hyps] == [h.tokens for h in expected]
        assert [h.tokens for h in slow] == [h.tokens for h in expected]
        for h, e in zip(hyps, expected, strict=True):
            assert h.score == pytest.approx(e.score, abs=1e-4)
            assert h.log_prob == pytest.approx(e.log_prob, abs=1e-4)
        assert len(hyps) == nbest and [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        lengths.update(len(h.tokens) for h in hyps)
    assert len(lengths) > 1  # the sentences did end at different lengths: EOS handling was exercised


@pytest.mark.parametrize("beam,nbest", [(1, 1), (4, 2)])
@pytest.mark.parametrize("style,stop", [("paper", "bound"), ("shrinking", "bound"), ("paper", "beam")])
@pytest.mark.parametrize("d_model", [32, 64], ids=["torch-attention", "kernel-attention"])
def test_sentences_that_join_a_running_search_get_the_reference_search(beam: int, nbest: int, style: str,
                                                                      stop: str, d_model: int) -> None:
    """Iteration-level batching (`Search.join`, the server's): sentences join at different steps, one
    or several at a time, while others decode and leave, and one joins a search that had emptied;
    each gets the plain reference's n-best, and the cache keeps no column older than its oldest row.
    Heads 16 wide (d_model 64) take the C attention kernel where it is built, 8 wide torch's."""
    model = random_model(24, seed=2, cfg=dataclasses.replace(TINY, d_model=d_model, d_ff=2 * d_model))
    sources = random_sources(24, [3, 7, 1, 5, 9, 2, 11, 4, 6, 8, 3], seed=2)
    settings = dict(beam=beam, nbest=nbest, lenpen=0.6, max_len_a=1.0, max_len_b=4, style=style, stop=stop)
    search = Search(model, **settings)
    arrivals = {0: [0, 1], 1: [2], 3: [3, 4, 5], 4: [6], 7: [7, 8], 9: [9], 40: [10]}  # step -> joining
    found: dict[int, list] = {}
    ages_differed, emptied = False, False
    for step in range(60):
        if step in arrivals:
            emptied |= step > 0 and not len(search)
            search.join(padded([sources[i] for i in arrivals[step]]), arrivals[step])
        if len(search):
            ages_differed |= search.common is None
            found.update(search.step())
        if len(search) and search.decoder.cache.rows is not None:
            assert search.decoder.cache.rows.shape[1] == int(search.age.max()) + 1
    assert ages_differed and emptied and sorted(found) == list(range(len(sources)))
    for i, source in enumerate(sources):
        expected = reference_search(model, source, **settings)
        assert [h.tokens for h in found[i]] == [h.tokens for h in expected], i
        assert [h.score for h in found[i]] == pytest.approx([h.score for h in expected], abs=1e-4)


@pytest.mark.parametrize("changes", [dict(d_k=4, d_v=12), dict(positions="learned")],
                         ids=["d_k,d_v", "learned"])
def test_search_equals_reference_for_table3_settings(changes: dict) -> None:
    """The batched, cached search with empty slots, for the model settings of table 3 rows A, B and E."""
    model = random_model(24, seed=0, cfg=dataclasses.replace(TINY, **changes))
    sources = random_sources(24, [3, 7, 1, 5, 9, 2], seed=0)
    settings = dict(beam=4, nbest=2, lenpen=0.6, max_len_a=1.0, max_len_b=4)  # the paper's style
    for source, hyps in zip(sources, beam_search(model, padded(sources), **settings), strict=True):
        expected = reference_search(model, source, **settings)
        assert [h.tokens for h in hyps] == [h.tokens for h in expected]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in expected], abs=1e-4)


@pytest.mark.parametrize("style", ["paper", "shrinking"])
def test_search_equals_reference_on_a_trained_model(tiny_trained_model: Path, style: str) -> None:
    model, _, _ = model_file.load_model(tiny_trained_model)
    sources = random_sources(len(model.embed.weight), [4, 9, 2, 12, 6], seed=3)
    settings = dict(beam=4, nbest=2, lenpen=0.6, max_len_a=1.0, max_len_b=10, style=style)
    for source, hyps in zip(sources, beam_search(model, padded(sources), **settings), strict=True):
        assert [h.tokens for h in hyps] == [h.tokens for h in reference_search(model, source, **settings)]


@contextlib.contextmanager
def rows_decoded() -> Iterator[list[int]]:
    """The decoder rows of each step of the incremental searches run inside, in order."""
    rows: list[int] = []
    step = IncrementalDecoder.step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(IncrementalDecoder, "step", lambda self, tokens, *rest: rows.append(len(tokens))
                      or step(self, tokens, *rest))
        yield rows


def test_the_two_styles_differ_and_the_paper_keeps_its_beam_full() -> None:
    """Where hypotheses finish early, the shrinking beam is left with fewer live ones and the two
    styles return different n-best lists; the paper's keeps `beam` live hypotheses at every step
    (here until the search stops: with nbest 4, none is hopeless before it stops)."""
    model = random_model(24, seed=0)
    with torch.no_grad():
        model.embed.weight[EOS] *= 2  # hypotheses end early and often
    sources = random_sources(24, [3, 7, 1, 5, 9, 2, 6, 4], seed=0)
    settings = dict(beam=4, nbest=4, lenpen=1.0, max_len_a=1.0, max_len_b=6)
    paper = beam_search(model, padded(sources), **settings, style="paper")
    shrinking = beam_search(model, padded(sources), **settings, style="shrinking")
    assert any([h.tokens for h in a] != [h.tokens for h in b] for a, b in zip(paper, shrinking, strict=True))
    with rows_decoded() as rows:
        beam_search(model, padded(sources[:1]), **settings, style="paper")
    assert rows[0] == 1 and set(rows[1:]) == {4}  # BOS, then a full beam until the search stops


def test_the_paper_beam_drops_only_hypotheses_that_cannot_enter_the_nbest() -> None:
    """Once a sentence has its n-best finished, live hypotheses whose bound cannot beat them leave the
    beam (fewer decoder rows), and the n-best lists are still the full beam's (the reference search
    keeps every slot filled)."""
    model = random_model(24, seed=2)
    with torch.no_grad():
        model.embed.weight[EOS] *= 2  # hypotheses end early and often
    sources = random_sources(24, [3, 7, 1, 5, 9, 2, 6, 4], seed=0)
    settings = dict(beam=4, nbest=1, lenpen=0.6, max_len_a=1.0, max_len_b=6, style="paper")
    with rows_decoded() as rows:
        found = beam_search(model, padded(sources), **settings)
    assert any(n % 4 for n in rows[1:])  # some sentence's beam held fewer than 4 live hypotheses
    for source, hyps in zip(sources, found, strict=True):
        expected = reference_search(model, source, **settings)
        assert [h.tokens for h in hyps] == [h.tokens for h in expected]
        # as the tests above: the cached and the full passes round differently
        assert [h.score for h in hyps] == pytest.approx([h.score for h in expected], abs=1e-4)


def test_stopping_once_beam_hypotheses_finished_is_sooner_and_never_scores_higher() -> None:
    """fairseq's and CTranslate2's rule (`stop="beam"`) ends a sentence once `beam` hypotheses have
    finished: here on fewer decoder rows, with another best hypothesis for some sentences, never a
    better-scored one than the bound's (which returns what a search to the maximum length would)."""
    model = random_model(24, seed=2)
    with torch.no_grad():
        model.embed.weight[EOS] *= 2  # hypotheses end early and often
    sources = random_sources(24, [3, 7, 1, 5, 9, 2, 6, 4], seed=0)
    settings = dict(beam=4, nbest=1, lenpen=1.0, max_len_a=1.0, max_len_b=6)
    found, rows = {}, {}
    for stop in ("bound", "beam"):
        with rows_decoded() as counted:
            found[stop] = [hyps[0] for hyps in beam_search(model, padded(sources), **settings, stop=stop)]
        rows[stop] = sum(counted)
    assert rows["beam"] < rows["bound"]
    differ = [a.tokens != b.tokens for a, b in zip(found["bound"], found["beam"], strict=True)]
    assert any(differ)
    for exact, sooner, different in zip(found["bound"], found["beam"], differ, strict=True):
        assert exact.score > sooner.score if different else exact.score == pytest.approx(sooner.score)


def greedy(model: Transformer, source: list[int], max_len: int) -> list[int]:
    """Most probable next token (never PAD or BOS) until EOS or the maximum length."""
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_len:
            logits = model(torch.tensor([source]), torch.tensor([[BOS, *tokens]]))[0, -1]
            logits[[PAD, BOS]] = -math.inf
            best = int(logits.argmax())
            if best == EOS:
                break
            tokens.append(best)
    return tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("style", ["paper", "shrinking"])
def test_beam_one_is_greedy(seed: int, style: str) -> None:
    model = random_model(24, seed)
    sources = random_sources(24, [3, 7, 1, 5, 9, 2], seed)
    found = beam_search(model, padded(sources), beam=1, nbest=1, lenpen=0.6, max_len_a=1.0, max_len_b=4,
                        style=style)
    for source, hyps in zip(sources, found, strict=True):
        assert hyps[0].tokens == greedy(model, source, len(source) - 1 + 4)


def exhaustive_ranking(model: Transformer, source: list[int], max_len: int,
                       alpha: float) -> list[tuple[float, list[int]]]:
    """Every output of up to `max_len` tokens (then EOS) with its length-normalised score, best first."""
    allowed = [t for t in range(model.vocab_size) if t not in (PAD, BOS, EOS)]
    ranked = []
    with torch.no_grad():
        for length in range(max_len + 1):
            for tokens in itertools.product(allowed, repeat=length):
                prev = torch.tensor([[BOS, *tokens]])
                log_probs = torch.log_softmax(model(torch.tensor([source]), prev)[0].double(), -1)
                log_p = float(log_probs[torch.arange(length + 1), torch.tensor([*tokens, EOS])].sum())
                ranked.append((log_p / length_penalty(length + 1, alpha), list(tokens)))
    return sorted(ranked, key=lambda r: -r[0])


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("style", ["paper", "shrinking"])
def test_wide_beam_finds_the_exhaustive_optimum(alpha: float, seed: int, style: str) -> None:
    """Symbols: pad bos eos unk a b -> 3 producible non-EOS tokens; outputs of at most 3 tokens: 40
    sequences. A beam of 40 never prunes, so the search (with its early stop) must return the true
    best ones; this checks the scores, the length penalty and that the stopping bound is safe."""
    model = random_model(6, seed, sharpness=3.0)
    source = [4, 5, 4, EOS]
    ranking = exhaustive_ranking(model, source, max_len=3, alpha=alpha)
    found = beam_search(model, padded([source]), beam=40, nbest=5, lenpen=alpha, max_len_a=0.0,
                        max_len_b=3, style=style)[0]
    assert [h.tokens for h in found] == [tokens for _, tokens in ranking[:5]]
    assert [h.score for h in found] == pytest.approx([score for score, _ in ranking[:5]], abs=1e-5)


def test_translation_alone_equals_translation_in_a_mixed_batch(tiny_trained_model: Path) -> None:
    model, _, _ = model_file.load_model(tiny_trained_model)
    sources = random_sources(model.vocab_size, [12, 1, 7, 3, 20, 5, 9], seed=4)
    together = translate_ids(model, sources, TranslateConfig(model=None, max_tokens=10_000))
    for source, hyps in zip(sources, together, strict=True):
        alone = beam_search(model, padded([source]), beam=4, nbest=1, lenpen=0.6, max_len_a=1.0, max_len_b=50)
        assert hyps[0].tokens == alone[0][0].tokens
        assert hyps[0].score == pytest.approx(alone[0][0].score, abs=1e-4)


@pytest.mark.parametrize("workers", [1, 3])
def test_translate_ids_keeps_input_order_across_batches(tiny_trained_model: Path, workers: int) -> None:
    model, _, _ = model_file.load_model(tiny_trained_model)
    sources = random_sources(model.vocab_size, [9, 2, 14, 1, 6, 11, 3, 8, 5, 12], seed=5)
    batches: list[int] = []
    small = translate_ids(model, sources, TranslateConfig(model=None, max_tokens=16), on_batch=batches.append,
                          workers=workers)
    assert len(batches) > 2 and sum(batches) == len(sources)  # several batches, every sentence once
    for source, hyps in zip(sources, small, strict=True):
        alone = translate_ids(model, [source], TranslateConfig(model=None))[0]
        assert hyps[0].tokens == alone[0].tokens
