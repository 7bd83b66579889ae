"""The Transformer: the paper's sizes, causality, padding invariance, incremental decoding, pre-norm."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from nmt_cli.config.model import ARCHS, ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.model.transformer import Transformer, count_parameters

VOCAB = 50
SMALL = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, dropout=0.1)
# fp32 on the CPU; different batch shapes take different kernel paths, so results agree to rounding only
ATOL = 1e-5


def _model(cfg: ModelConfig = SMALL, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg, VOCAB).eval()


def _tokens(rows: list[int], seed: int, first: int | None = None) -> torch.Tensor:
    """Right-padded rows of random real tokens ending in EOS (or starting with `first`)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(rows), max(rows)), PAD)
    for b, n in enumerate(rows):
        out[b, :n] = torch.randint(4, VOCAB, (n,), generator=g)
        if first is None:
            out[b, n - 1] = EOS
        else:
            out[b, 0] = first
    return out


@pytest.mark.parametrize("arch, paper_params", [("transformer_base", 65e6), ("transformer_big", 213e6)])
def test_parameter_count_matches_the_paper(arch: str, paper_params: float) -> None:
    with torch.device("meta"):  # no memory for 213M parameters
        model = Transformer(ARCHS[arch], 37000)  # the paper's joint en-de vocabulary
    assert abs(count_parameters(model) - paper_params) / paper_params < 0.05


def test_decoder_is_causal() -> None:
    model = _model()
    src, prev = _tokens([7, 5], seed=1), _tokens([9, 9], seed=2, first=BOS)
    logits = model(src, prev)
    for t in range(1, prev.shape[1]):
        changed = prev.clone()
        changed[:, t] = (changed[:, t] + 1 - 4) % (VOCAB - 4) + 4
        again = model(src, changed)
        torch.testing.assert_close(again[:, :t], logits[:, :t], atol=ATOL, rtol=0)
        assert not torch.allclose(again[:, t:], logits[:, t:]), \
            "a later token must matter to its own position"


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_never_changes_real_positions(norm: str) -> None:
    model = _model(dataclasses.replace(SMALL, norm=norm))
    src, prev = _tokens([6, 3], seed=3), _tokens([5, 2], seed=4, first=BOS)
    alone = [model(src[b : b + 1, :n], prev[b : b + 1, :m]) for b, (n, m) in enumerate([(6, 5), (3, 2)])]
    extra_pad = torch.nn.functional.pad  # more padding on both sides than the batch needs
    batched = model(extra_pad(src, (0, 4), value=PAD), extra_pad(prev, (0, 3), value=PAD))
    for b, (m, out) in enumerate(zip([5, 2], alone, strict=True)):
        torch.testing.assert_close(batched[b, :m], out[0], atol=ATOL, rtol=0)
    enc_alone = model.encode(src[1:, :3]).memory
    enc_batched = model.encode(extra_pad(src, (0, 4), value=PAD)).memory
    torch.testing.assert_close(enc_batched[1, :3], enc_alone[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_incremental_decoding_equals_full_forward(norm: str) -> None:
    model = _model(dataclasses.replace(SMALL, norm=norm))
    src, prev = _tokens([6, 4, 2], seed=5), _tokens([8, 8, 8], seed=6, first=BOS)
    full = model(src, prev)  # (B, T, V)
    enc = model.encode(src)
    cache = model.start_decoding(enc)
    steps = torch.stack([model.decode_step(prev[:, t], t, enc, cache) for t in range(prev.shape[1])], dim=1)
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


def test_keep_selects_the_same_logits_as_the_full_output() -> None:
    model = _model()
    src, prev = _tokens([6, 3], seed=7), _tokens([5, 2], seed=8, first=BOS)
    keep = prev != PAD
    torch.testing.assert_close(model(src, prev, keep), model(src, prev)[keep], atol=ATOL, rtol=0)


def test_pre_norm_trains() -> None:
    """Pre-norm has its own final LayerNorms and learns: a few steps on one batch lower its loss."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(SMALL, norm="pre", dropout=0.0), VOCAB)
    assert (isinstance(model.encoder_norm, torch.nn.LayerNorm)
            and isinstance(model.decoder_norm, torch.nn.LayerNorm))
    src, prev = _tokens([6, 5], seed=9), _tokens([6, 5], seed=10, first=BOS)
    target = torch.roll(prev, -1, dims=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(src, prev).flatten(0, 1), target.flatten(),
                                                 ignore_index=PAD)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.7 * losses[0]


def test_tied_embeddings_and_scaled_sinusoids() -> None:
    model = _model()
    vocab_sized = [name for name, p in model.named_parameters() if VOCAB in p.shape]
    assert vocab_sized == ["embed.weight"]  # one matrix for source, target and output
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model.logits(hidden), hidden @ model.embed.weight.T)
    pos, i = 3, 2  # PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...)
    assert model.positions[pos, 2 * i].item() == pytest.approx(
        torch.sin(torch.tensor(pos / 10000 ** (2 * i / 32))).item())
    assert model.positions[pos, 2 * i + 1].item() == pytest.approx(
        torch.cos(torch.tensor(pos / 10000 ** (2 * i / 32))).item())


@pytest.mark.parametrize("module", ["model/transformer", "data/dataset", "training/loss", "training/optim",
                                    "training/corpus"])
def test_library_modules_know_nothing_of_distribution(module: str) -> None:
    source = (Path(__file__).resolve().parents[1] / "nmt_cli" / f"{module}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not any(name.startswith("torch.distributed") or name == "torch.nn.parallel" for name in imported)
    assert "DistributedDataParallel" not in source


def test_cpu_dropout_drops_at_its_rate_and_keeps_the_expectation() -> None:
    from nmt_cli.model.kernels import Dropout

    torch.manual_seed(0)
    layer, x = Dropout(0.1), torch.ones(200, 500)
    y = layer(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.005  # 100000 draws: 5 standard deviations
    assert torch.allclose(y[kept], torch.tensor(65536 / (65536 - 6554)))  # 1 / (1 - p) with p = 6554/65536
    assert abs(y.mean().item() - 1.0) < 0.01
    assert not torch.equal(layer(x), y), "a new mask for each call"
    half_in = (torch.rand(200, 500) + 1).bfloat16()
    half = layer(half_in)  # bf16: the scale is applied in float32 and rounded once, so no systematic bias
    ratio = (half.float() / half_in.float())[half != 0]
    assert half.dtype == torch.bfloat16 and abs(ratio.mean().item() - 65536 / (65536 - 6554)) < 3e-4
    assert torch.equal(layer.eval()(x), x)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attention_equals_torch_sdpa(causal: bool) -> None:
    """The CPU's explicit softmax(QK^T/sqrt(K))V gives what scaled_dot_product_attention gives."""
    from nmt_cli.model.kernels import attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(3, 2, 5, 8, generator=g) for _ in range(3))
    mask = None if causal else torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]],
                                            dtype=torch.bool)[:, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(attention(q, k, v, mask, causal, 0.0), want, atol=1e-6, rtol=1e-5)
