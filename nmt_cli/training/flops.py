"""Model FLOPs utilisation (MFU): the arithmetic the model needs per second of training, as a share of
what the devices can do at their peak, as nanoGPT reports it (after the PaLM paper, appendix B).

The FLOPs count only the model's matrix products, for the real (unpadded) tokens: 2 per
multiply-add in the forward pass, and twice the forward's for the backward (3 x forward in all).
Per source token: the encoder's projections and feed-forward, and in every decoder layer the keys and
values of the encoder-decoder attention. Per target token: the decoder's projections and
feed-forward and the output layer over the vocabulary (the embedding lookups cost none). Attention
scores and their weighted sums cost 2 * h * (d_k + d_v) per query and key, with each sentence's keys
taken at the update's mean sentence length (the decoder's causal mask counted in full, as nanoGPT
does). Padding, dropout, softmax and the optimiser are not counted: MFU says how much of the peak
the model's own arithmetic uses.

The peak: a table of the dense bf16/fp16 tensor-core and fp32 rates of known GPUs (vendor data
sheets); a GPU not in it, and the CPU, get a matrix product timed here at the training precision.
"""

from __future__ import annotations

import re
import time

import torch

from nmt_cli.config.model import ModelConfig

# (name as in torch.cuda.get_device_name, dense bf16/fp16 TFLOP/s, fp32 TFLOP/s), searched in order:
# the first found as a word of the device's name wins ("H100 PCIe" before "H100").
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 67.0),
    ("GH200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A6000", 154.8, 38.7),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),  # fp16 only: its bf16 runs without tensor cores
    ("T4", 65.0, 8.1),
    ("P100", 21.2, 10.6),
)


def training_flops(model: ModelConfig, vocab: int, src_tokens: float, tgt_tokens: float,
                   sentences: float) -> float:
    """Model FLOPs of one training update over `sentences` pairs holding these real tokens."""
    if sentences <= 0:
        return 0.0
    d, h = model.d_model, model.heads
    d_k, d_v = model.d_k or d // h, model.d_v or d // h
    query_out = d * h * d_k + h * d_v * d  # the query projection and the output projection
    key_value = d * h * (d_k + d_v)
    ffn = 2 * d * model.d_ff
    per_src = model.encoder_layers * (query_out + key_value + ffn) + model.decoder_layers * key_value
    per_tgt = model.decoder_layers * (2 * query_out + key_value + ffn) + d * vocab
    src_len, tgt_len = src_tokens / sentences, tgt_tokens / sentences
    scores = 2 * h * (d_k + d_v)
    attention = scores * (model.encoder_layers * src_tokens * src_len
                          + model.decoder_layers * tgt_tokens * (tgt_len + src_len))
    forward = 2 * (per_src * src_tokens + per_tgt * tgt_tokens) + attention
    return 3.0 * forward


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one device at `precision`, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if (peak := table_peak(name, precision)) is not None:
            return peak, f"{name}, data sheet"
        return measured_peak(device, precision), f"{name}, measured matrix product"
    return measured_peak(device, precision), "CPU, measured matrix product"


def table_peak(name: str, precision: str) -> float | None:
    """The data-sheet peak FLOP/s of the GPU called `name` at `precision`, or None for one not in
    GPU_PEAKS. Names match as whole words: "A10" is not "A10G", whose figures differ."""
    for key, half, single in GPU_PEAKS:
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", name):
            return (single if precision == "fp32" else half) * 1e12
    return None


def measured_peak(device: torch.device, precision: str, size: int = 0) -> float:
    """The best FLOP/s of a few square matrix products at `precision` on `device` (about a tenth of
    a second on a CPU: 512 or 1024 wide there, 8192 on a GPU)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if not size:
        size = 8192 if device.type == "cuda" else (1024 if precision == "fp32" else 512)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(4):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
