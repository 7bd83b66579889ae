"""Model FLOPs utilisation: the FLOPs of an update against the model's real weights, the peak table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nmt_cli.config.model import ARCHS, ModelConfig
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import flops

TINY = ARCHS["transformer_tiny"]
VARIANTS = {"base": ARCHS["transformer_base"], "big": ARCHS["transformer_big"],
            "narrow heads (table 3 row A)": dataclasses.replace(TINY, d_k=16, d_v=24),
            "uneven depth": dataclasses.replace(TINY, encoder_layers=3, decoder_layers=1)}


@pytest.mark.parametrize("name", VARIANTS)
def test_an_update_multiplies_each_weight_matrix_once_per_token_three_times(name: str) -> None:
    """With the weights of the real model: every encoder matrix and the decoder's encoder-side keys
    and values once per source token, every other decoder matrix and the output layer once per
    target token, forward (2 FLOPs a multiply-add) and backward (twice that)."""
    cfg, vocab = VARIANTS[name], 1000
    with torch.device("meta"):
        model = Transformer(cfg, vocab)
    d, h = cfg.d_model, cfg.heads
    d_k, d_v = cfg.d_k or d // h, cfg.d_v or d // h
    per_src = per_tgt = 0
    for key, weight in model.named_parameters():
        if weight.dim() != 2 or key.startswith(("embed", "learned_positions")):
            continue
        if key.startswith("encoder."):
            per_src += weight.numel()
        elif ".cross_attn.in_proj." in key:  # rows: queries (h * d_k), then keys and values
            per_src += weight.numel() - h * d_k * d
            per_tgt += h * d_k * d
        else:
            per_tgt += weight.numel()
    per_tgt += d * vocab  # the output layer (the embedding matrix, shared)
    src, tgt, sentences = 2000, 1000, 1000  # 2 source tokens and 1 target token a sentence
    pairs = cfg.encoder_layers * src * 2 + cfg.decoder_layers * tgt * (1 + 2)  # queries x keys
    expected = 3 * (2 * (per_src * src + per_tgt * tgt) + 2 * h * (d_k + d_v) * pairs)
    assert flops.training_flops(cfg, vocab, src, tgt, sentences) == pytest.approx(expected, rel=1e-12)
    assert flops.training_flops(cfg, vocab, 0, 0, 0) == 0


def test_longer_sentences_cost_more_at_the_same_tokens() -> None:
    cfg = ModelConfig()
    short, long = (flops.training_flops(cfg, 37000, 25000, 25000, n) for n in (1000, 250))
    assert long > short


def test_the_peak_table_matches_gpu_names_as_words() -> None:
    assert flops.table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert flops.table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert flops.table_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert flops.table_peak("NVIDIA GH200 480GB", "bf16") == 989e12
    assert flops.table_peak("NVIDIA A10G", "bf16") is None, "not the A10: measured instead"
    assert flops.table_peak("NVIDIA L40S", "bf16") == 362e12


def test_the_cpu_peak_is_measured() -> None:
    peak, source = flops.device_peak(torch.device("cpu"), "fp32")
    assert "measured" in source and 1e8 < peak < 1e14
