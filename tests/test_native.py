"""The search's C kernel (`model/native.py`): it gives what torch's path gives, and where it
cannot be built the search runs torch's path and says why."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from test_search import TINY, hard_logits, padded, random_model, random_sources, whole_row_best

from conftest import nmt, toy_sentences
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.inference import beams
from nmt_cli.inference.beams import best_tokens
from nmt_cli.inference.search import beam_search
from nmt_cli.model import kernels, native


@pytest.fixture
def kernel() -> None:
    if native.library() is None:
        pytest.skip(f"the search's C kernel is not available here: {native.why_not()}")


def torch_path(logits: torch.Tensor, k: int):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        return best_tokens(logits.clone(), k)


@pytest.mark.parametrize("vocab", [7968, 7795, 70])
def test_kernel_equals_log_softmax_and_topk(kernel, vocab: int) -> None:
    """float32 logits: the tokens `topk` over `log_softmax` gives (PAD and BOS never, even when the most
    probable; the best k in one block or at the end of the row), their log-probabilities and EOS's
    to float32 rounding, as the torch path gives them."""
    logits = hard_logits(vocab) if vocab > 5004 else torch.randn(50, vocab) * 3
    for k in (8, 4, 1):
        values, tokens, eos = whole_row_best(logits, k)
        found = best_tokens(logits.clone(), k)
        assert torch.equal(found.tokens, tokens)
        torch.testing.assert_close(found.log_probs, values, atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(found.eos, eos, atol=2e-6, rtol=1e-6)
        assert torch.equal(torch_path(logits, k).tokens, tokens)


def test_kernel_on_bf16_and_masked_rows(kernel) -> None:
    """bf16 logits (many equal values: any of equal logits may be chosen, best first) give the
    log-probabilities of their float32 values; rows with fewer allowed tokens than k (a constraint's
    -inf) give those tokens, then -inf."""
    torch.manual_seed(1)
    logits = (torch.randn(40, 4000) * 3).bfloat16()
    found = best_tokens(logits.clone(), 8)
    values, _, eos = whole_row_best(logits.float(), 8)
    torch.testing.assert_close(found.log_probs, values, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(found.eos, eos, atol=2e-6, rtol=1e-6)
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    chosen = logits.float().gather(1, found.tokens) - lse
    torch.testing.assert_close(chosen, found.log_probs, atol=2e-6, rtol=1e-6)
    masked = torch.full((3, 300), -math.inf)
    masked[:, [EOS, 17, 200]] = torch.tensor([-1.0, 2.0, 0.5])
    masked[:, [PAD, BOS]] = 5.0
    got, want = best_tokens(masked.clone(), 5), whole_row_best(masked, 5)
    assert got.tokens[:, :3].tolist() == [[17, 200, EOS]] * 3
    assert torch.equal(got.log_probs.isinf(), want[0].isinf())
    torch.testing.assert_close(got.log_probs[:, :3], want[0][:, :3])


def test_without_a_compiler_the_search_runs_torchs_path(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler (or NMT_NATIVE=0): `library()` is None with the reason, and `best_tokens` still
    gives `topk` over `log_softmax`; with one, a fresh cache folder gets a build for this machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert native.library() is None and "no C compiler" in native.why_not()
        logits = hard_logits(7795)
        values, tokens, _ = whole_row_best(logits, 4)
        found = best_tokens(logits.clone(), 4)
        assert torch.equal(found.tokens, tokens) and torch.equal(found.log_probs, values)
        native.library.cache_clear()
        monkeypatch.setenv("NMT_NATIVE", "0")
        monkeypatch.delenv("CC")
        assert native.library() is None and native.why_not() == "NMT_NATIVE=0"
        native.library.cache_clear()
        monkeypatch.delenv("NMT_NATIVE")
        if native.library() is not None:  # a machine with a compiler: built into the fresh cache
            built = list((tmp_path / "nmt").iterdir())
            assert len(built) == 1 and built[0].name.startswith("native-") and built[0].suffix == ".so"
    finally:
        native.library.cache_clear()


def test_translate_without_the_kernel_says_so_and_translates_the_same(tiny_trained_model: Path,
                                                                      tmp_path: Path) -> None:
    """`nmt translate` where the kernel cannot be built warns once, naming why, and its translations
    are those of the kernel (fp32: the same tokens); NMT_NATIVE=0 chooses torch without a word."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(toy_sentences(12, seed=3, max_words=10)) + "\n", encoding="utf-8")
    settings = ("--dtype", "fp32", "--beam", 4)
    with_kernel = nmt("translate", tiny_trained_model, "-i", src, *settings)
    without = nmt("translate", tiny_trained_model, "-i", src, *settings,
                  env={"CC": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    chosen = nmt("translate", tiny_trained_model, "-i", src, *settings, env={"NMT_NATIVE": "0"})
    assert without.stdout == with_kernel.stdout == chosen.stdout
    assert len(with_kernel.stdout.splitlines()) == 12
    warned = [line for line in without.stderr.splitlines() if "C kernel is not available" in line]
    assert len(warned) == 1 and "no C compiler" in warned[0]
    assert "C kernel" not in chosen.stderr and "C kernel" not in with_kernel.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_of_many_rows_project_in_chunks_and_find_the_same(kernel, monkeypatch: pytest.MonkeyPatch,
                                                                dtype: torch.dtype) -> None:
    """A step of more rows than `CHUNK_ROWS` takes the output projection and best tokens a chunk of rows
    at a time: the same hypotheses and scores as one projection of all rows (120 sentences, beam 4:
    480 rows at first, fewer as sentences finish, through both sides of the limit)."""
    model = random_model(300, seed=3).to(dtype)
    src = padded(random_sources(300, [3 + i % 9 for i in range(120)], seed=4))
    settings = dict(beam=4, nbest=2, lenpen=0.6, max_len_a=1.0, max_len_b=5)
    calls = []
    projection = model.logits
    monkeypatch.setattr(model, "logits", lambda hidden: calls.append(len(hidden)) or projection(hidden))
    chunked = beam_search(model, src, **settings)
    assert max(calls) == beams.CHUNK_ROWS and 480 % beams.CHUNK_ROWS in calls
    calls.clear()
    monkeypatch.setattr(beams, "CHUNK_ROWS", 10**6)
    whole = beam_search(model, src, **settings)
    assert max(calls) == 480
    assert [[h.tokens for h in n] for n in chunked] == [[h.tokens for h in n] for n in whole]
    assert [[h.score for h in n] for n in chunked] == [[h.score for h in n] for n in whole]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernel_equals_attention_in_float64(kernel, dtype: torch.dtype) -> None:
    """The attention kernel over a cache: softmax(q k^T / sqrt(K)) v as float64 computes it, within
    float32's rounding, and in bf16 no further from it than torch's bf16 attention; keys left out by
    the mask get no weight (their values are huge) and are not read at all (NaN there changes nothing:
    a row that joined a search late costs only its own keys); shapes it does not take are left to
    torch (None)."""
    torch.manual_seed(0)
    G, H, L, K = 37, 4, 23, 32
    q, k, v = (torch.randn(G, H, n, K).to(dtype) for n in (1, L, L))
    mask = torch.rand(G, 1, 1, L) > 0.3
    mask[:, :, :, 0] = True
    v = v.masked_fill(~mask.transpose(-1, -2), 1e4)
    want = torch.softmax((q.double() @ k.double().transpose(-1, -2) * K**-0.5).masked_fill(~mask, -math.inf),
                         -1) @ v.double()
    found = native.cached_attention(q, k, v, mask)
    assert found.dtype == dtype and found.shape == (G, H, 1, K)
    error = (found.double() - want).abs().max().item()
    by_torch = kernels.attention(q, k, v, mask, causal=False, dropout=0.0)
    torch_error = (by_torch.double() - want).abs().max().item()
    assert error < (1e-5 if dtype == torch.float32 else torch_error + 1e-3), (error, torch_error)
    unmasked = native.cached_attention(q, k, v, None).double()
    assert (unmasked - want).abs().max() > 1  # the mask mattered
    unread = native.cached_attention(q, k.masked_fill(~mask.transpose(-1, -2), math.nan),
                                     v.masked_fill(~mask.transpose(-1, -2), math.nan), mask)
    assert torch.equal(unread, found)  # keys and values left out are not read (NaN there changes nothing)
    assert native.cached_attention(q[..., :24], k[..., :24], v, mask) is None  # K not a multiple of 16
    assert native.cached_attention(q.half(), k.half(), v.half(), mask) is None


def test_attention_kernel_takes_several_queries_a_group_and_pooled_keys(kernel) -> None:
    """A sentence's beams over its encoder states (several queries a group), and rows whose keys and
    values are entries of a pool (`transformer.Cache`): the same as torch's attention of them, within
    float32's rounding."""
    torch.manual_seed(1)
    G, H, T, L, K, P = 9, 4, 3, 11, 16, 50
    q, k, v = torch.randn(G, H, T, K), torch.randn(G, H, L, K), torch.randn(G, H, L, 32)
    mask = torch.rand(G, 1, 1, L) > 0.3
    mask[:, :, :, 0] = True
    found = native.cached_attention(q, k, v, mask)
    torch.testing.assert_close(found, kernels.attention(q, k, v, mask, causal=False, dropout=0.0),
                               atol=1e-5, rtol=1e-5)
    pool_k, pool_v = torch.randn(P, H, K), torch.randn(P, H, 32)
    rows = torch.randint(0, P, (G, L))
    pooled = native.cached_attention(q[:, :, :1], pool_k, pool_v, None, rows)
    keys, values = kernels.gathered(pool_k, rows), kernels.gathered(pool_v, rows)
    want = kernels.attention(q[:, :, :1], keys, values, None, causal=False, dropout=0.0)
    torch.testing.assert_close(pooled, want, atol=1e-5, rtol=1e-5)


def test_search_with_the_attention_kernel_finds_what_torch_finds(kernel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 beam search with the attention kernel (kernels.cached_attention) and without it: the same
    hypotheses, scores within float32 rounding."""
    model = random_model(300, seed=5, cfg=dataclasses.replace(TINY, d_model=64))  # heads of 16
    src = padded(random_sources(300, [3 + i % 9 for i in range(40)], seed=6))
    settings = dict(beam=4, nbest=2, lenpen=0.6, max_len_a=1.0, max_len_b=5)
    answers = []
    kernel_attention = native.cached_attention
    monkeypatch.setattr(native, "cached_attention",
                        lambda *a: answers.append(kernel_attention(*a)) or answers[-1])
    with_kernel = beam_search(model, src, **settings)
    assert any(found is not None for found in answers)  # the self-attention (one query a row)
    monkeypatch.setattr(native, "cached_attention", lambda *a: None)
    with_torch = beam_search(model, src, **settings)
    assert [[h.tokens for h in n] for n in with_kernel] == [[h.tokens for h in n] for n in with_torch]
    scores = [[h.score for h in n] for n in with_kernel], [[h.score for h in n] for n in with_torch]
    torch.testing.assert_close(torch.tensor(scores[0]), torch.tensor(scores[1]), atol=1e-4, rtol=1e-5)


def test_int8_kernels_equal_torchs_quantizing_and_scaling(kernel) -> None:
    from nmt_cli.model import int8

    torch.manual_seed(5)
    x = torch.randn(7, 96) * 4
    x[2] = 0  # a row of zeros stays zeros
    x[3, :10] = torch.tensor([127.0, 63.5, -0.5, 0.5, 1.5, -1.5, 2.5, 62.5, -63.5, 0.0])  # ties: to even
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        q_torch, s_torch = int8.quantize_rows(x)
    q, s = int8.quantize_rows(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_torch) and torch.equal(s, s_torch)
    assert q[3, :10].tolist() == [127, 64, 0, 0, 2, -2, 2, 62, -64, 0]
    layer = int8.Int8Linear(torch.randn(40, 96), torch.randn(40))
    for rows in (slice(None), slice(8, None)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(native, "library", lambda: None)
            expected = layer(x, rows)
        assert torch.allclose(layer(x, rows), expected, rtol=1e-6, atol=1e-5)
    fused = copy.deepcopy(layer)  # the feed-forward's first layer: its relu applied as it scales
    fused.relu = True
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        expected = fused(x)
    assert torch.equal(fused(x), layer(x).clamp_min(0))
    assert torch.allclose(fused(x), expected, rtol=1e-6, atol=1e-5) and bool((expected >= 0).all())
    without_bias = int8.Int8Linear(torch.randn(40, 96), None)
    acc = torch._int_mm(q, without_bias.qweight.t())
    assert torch.allclose(without_bias(x), acc.float() * without_bias.scale * s, rtol=1e-6, atol=1e-5)
