"""How the model's attention, dropout, ReLU and output projection run on each device: the paper's
operations, with CPU paths that compute the same thing faster than torch's defaults do for
translation's short sentences (and, for the ReLU, faster than inductor compiles torch's).

`transformer.py` calls these and nothing device-specific itself. GPUs take torch's own kernels
(`scaled_dot_product_attention`, `nn.Dropout`, `F.linear`). Speeds of each path against torch's:
`benchmarks/model_kernels.py`, figures in benchmarks/README.md ("Model kernels").
"""

from __future__ import annotations

import contextlib
import platform
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt_cli.model import native


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout: float) -> Tensor:
    """softmax(Q K^T / sqrt(K)) V (section 3.2.1): (B, H, T, K) queries over (B, H, L, K) keys and
    values -> (B, H, T, K). `mask` (broadcast to (B, H, T, L)) is True where attending is allowed;
    `causal` lets query t see keys <= t.

    GPUs take `scaled_dot_product_attention` and its fused kernels. A CPU takes two batched matrix
    products around a float32 softmax (`attention_weights`): for short sentences, faster than torch's
    fused CPU kernels and its math path.
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    weights = attention_weights(q, k, mask, causal).to(v.dtype)
    if dropout > 0:
        weights = F.dropout(weights, dropout)
    return weights @ v


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                     rows: Tensor | None = None) -> Tensor:
    """`attention` of incremental decoding: a few queries (the beams of a sentence, or one row's newest
    position) over cached keys and values; with `rows` (B, L), keys (P, H, K) and values (P, H, K_v)
    are pools and query b's key and value l are entry rows[b, l] (`transformer.Cache`). Inside
    torch.compile on a CPU it is written as products and sums, which inductor fuses into one kernel
    that reads each cached key and value once, where it would leave two batched matrix products to
    torch. Eager on a CPU outside autograd it is the C kernel of `native.py` where there is one and it
    takes the shapes (fp32 or bf16): one pass over each head's cache, where torch runs two batched
    products of tiny matrices (and in bf16 sets up a new primitive for every cache length). Elsewhere
    it is `attention` (of the pools' entries gathered). Measured: benchmarks/README.md, "Translation"."""
    if not torch.compiler.is_compiling():
        found = (None if q.device.type != "cpu" or q.requires_grad
                 else native.cached_attention(q, k, v, mask, rows))
        if found is not None:
            return found
    if rows is not None:
        k, v = gathered(k, rows), gathered(v, rows)
    if not torch.compiler.is_compiling():
        return attention(q, k, v, mask, causal=False, dropout=0.0)
    scores = (q.float()[:, :, :, None] * q.shape[-1] ** -0.5 * k.float()[:, :, None]).sum(-1)  # (B, H, T, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = softmax(scores)
    return (weights[..., None] * v.float()[:, :, None]).sum(-2).to(v.dtype)  # (B, H, T, K)


def gathered(pool: Tensor, rows: Tensor) -> Tensor:
    """Entries rows (B, L) of a pool (P, H, K) of cached keys or values, as (B, H, L, K)."""
    B, L = rows.shape
    return pool.index_select(0, rows.reshape(-1)).view(B, L, *pool.shape[1:]).transpose(1, 2)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """The softmax rows softmax(Q K^T / sqrt(K)) of `attention`, (B, H, T, L) in float32, masked
    positions exactly 0: on a CPU, the rows it multiplies V by; a GPU's fused kernel matches them to
    rounding (`nmt attention` calls it there to look at them)."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, H, T, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        T, L = scores.shape[-2:]
        future = torch.ones(T, L, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return softmax(scores.float())


def output_projection(hidden: Tensor, weight: Tensor, rows: int) -> Tensor:
    """hidden (..., D) @ weight[:rows]^T: the output projection onto the vocabulary (section 3.4).

    Inside `packed_weights` (a search), in float32 on an x86 CPU, it takes oneDNN's matrix product
    with the weight packed once into its blocked layout: the projection's matrix is wide (rows = the
    vocabulary) and the search's batches are short (a few to 256 rows), where torch's default (MKL)
    product runs well below the CPU's peak (benchmarks/README.md, "Translation"). The result
    equals torch's to rounding (another order of the same sums). Elsewhere (training and its
    validation loss, a GPU, bf16, inside torch.compile, or where this torch lacks the operation):
    `F.linear`."""
    weight = weight[:rows]
    packed = getattr(_scope, "packed", None)
    if (packed is None or hidden.dtype != torch.float32 or weight.dtype != torch.float32
            or hidden.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling()):
        return F.linear(hidden, weight)
    key = (weight.data_ptr(), tuple(weight.shape))
    if key not in packed:
        try:
            packed[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                                  PACKED_FOR_ROWS)
        except RuntimeError:  # oneDNN refused it: torch's product, for the rest of the search
            packed[key] = None
    if packed[key] is None:
        return F.linear(hidden, weight)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    logits = torch.ops.mkldnn._linear_pointwise(flat, packed[key], None, "none", [], "")
    return logits.view(*hidden.shape[:-1], rows)


@contextlib.contextmanager
def packed_weights() -> Iterator[None]:
    """Within it, on this thread, `output_projection` packs each weight on first use and reuses it:
    for a search, whose weights cannot change. Packs never outlive it, because a weight can change
    in place unseen: torch's fused Adam step, for one, leaves the tensor's version counter as it was
    (a pack kept across a training run's validations was the first update's weights). A pack is made
    once a batch of sentences, a small cost beside the batch's search."""
    if not _PACKING or hasattr(_scope, "packed"):
        yield
        return
    _scope.packed = {}
    try:
        yield
    finally:
        del _scope.packed


# oneDNN's packed product: on x86 CPUs only (where it was measured), in a torch that has it.
_PACKING = (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
_scope = threading.local()  # .packed inside `packed_weights`: (data pointer, shape) -> packed weight
PACKED_FOR_ROWS = 256  # the batch size oneDNN is told to pack for: the search's chunks (beams.CHUNK_ROWS)


SHORT_ROW = 16  # torch's CPU softmax over fewer entries than this is slower than over 16


def softmax(scores: Tensor) -> Tensor:
    """softmax over the last dimension. Rows shorter than `SHORT_ROW` on a CPU, outside autograd, take
    four elementwise operations instead of torch's kernel, which handles them element by element
    (benchmarks/README.md, "Translation")."""
    if (torch.compiler.is_compiling() or scores.device.type != "cpu" or scores.requires_grad
            or scores.shape[-1] >= SHORT_ROW):  # in this order: no guard on a compiled graph's sizes
        return torch.softmax(scores, dim=-1)
    weights = (scores - scores.amax(-1, keepdim=True)).exp_()
    return weights.div_(weights.sum(-1, keepdim=True))


def relu(x: Tensor) -> Tensor:
    """max(0, x) (section 3.3). Compiled for training on a CPU, its backward multiplies by the sign of
    its output, which the next layer keeps anyway: with torch's relu, inductor saves a boolean mask
    for the backward, and its CPU kernels store and load booleans slowly (benchmarks/README.md,
    "Training speed: eager and compiled")."""
    if torch.compiler.is_compiling() and x.device.type == "cpu" and x.requires_grad:
        return _ReluBySign.apply(x)
    return F.relu(x)


class _ReluBySign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        y = x.clamp_min(0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * torch.sign(y)  # y >= 0: 1 where x > 0, else 0 (torch's relu backward at 0 too)


class Dropout(nn.Dropout):
    """Dropout that draws its mask faster on a CPU: four 16-bit random numbers from each 64-bit draw,
    instead of one draw per element. The drop probability is rounded to a multiple of 1/65536 (0.1
    becomes 0.100006); kept values are scaled by 1 / (1 - that probability). GPUs keep torch's.
    Compiled (`nmt train --compile`) the same: `training.step.compile_model` leaves the draw to torch
    (inductor's `fallback_random`) and inductor fuses the rest, which beat inductor's own dropout
    (benchmarks/README.md, "Training speed: eager and compiled")."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        drop_below = round(self.p * 65536)  # draws in [0, drop_below) of [0, 65536) are dropped
        n = x.numel()
        bits = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=x.device)
        keep = bits.view(torch.int16)[:n].view(x.shape) >= drop_below - 32768
        return x * keep * (65536 / (65536 - drop_below))  # scaled in float32 then rounded, as torch does
