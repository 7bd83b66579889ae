"""int8 translation on a CPU (`nmt translate --dtype int8`): every linear layer of the Transformer
(the attention projections W^Q, W^K, W^V and W^O, the feed-forward W1 and W2, the output projection)
runs as an int8 matrix product, as CTranslate2's int8 does.

Each weight row (an output channel) is quantized once with its own scale, max |w| / 127; each input
row (one token's vector) is quantized when it arrives with its own scale, max |x| / 127. The product
of the int8 matrices is exact in int32 (`torch._int_mm`, torch's int8 kernel: oneDNN on x86, with
AVX-512 VNNI or AVX2), then scaled back to float32 by the two scales, and the float32 bias added.
The quantizing of each input row, and the scaling after the product (with the feed-forward's relu),
run in the C kernel (`native.c`, one pass each) where it is built, in torch otherwise.
Because every input row has its own scale, a sentence's translation does not depend on what it is
batched with, as in float32. Everything else (layer norms, softmax, attention over the cache,
embeddings) stays float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt_cli.errors import NmtError
from nmt_cli.model import native
from nmt_cli.model.transformer import Attention, FeedForward, Transformer


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (N, K) float -> (int8 (N, K), float32 scales (N, 1)): each row scaled so that its largest
    magnitude is 127, rounded to the nearest integer (a row of zeros stays zeros). By the C kernel
    where it is there (the same values in one pass), else in torch."""
    if (found := native.quantize_rows(x)) is not None:
        return found
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(127)
    return (x / scale).round_().to(torch.int8), scale  # |x / scale| <= 127 by the scale's choice


class Int8Linear(nn.Module):
    """x W^T + b with W quantized per output row; `rows` selects a block of W's rows (the queries of
    W^Q, W^K, W^V stacked), exactly as slicing the float weight would."""

    def __init__(self, weight: Tensor, bias: Tensor | None, relu: bool = False) -> None:
        super().__init__()
        self.relu = relu  # max(0, .) of the output too: the feed-forward's first layer (`quantize`)
        qweight, scale = quantize_rows(weight.detach())
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scale", scale[:, 0])  # (N,) float32
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: Tensor, rows: slice = slice(None)) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        qweight, scale = self.qweight[rows], self.scale[rows]
        if flat.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], qweight.shape[0])
        qx, x_scale = quantize_rows(flat)
        acc = torch._int_mm(qx, qweight.t())
        bias = None if self.bias is None else self.bias[rows]
        y = native.int8_scale(acc, scale, x_scale, bias, self.relu)
        if y is None:
            y = acc.float().mul_(scale)
            y = y.mul_(x_scale) if bias is None else torch.addcmul(bias, y, x_scale)
            y = y.clamp_min_(0) if self.relu else y
        return y.view(*x.shape[:-1], qweight.shape[0])

    def dequantized(self) -> Tensor:
        """The float32 weight the int8 one stands for (what a reference computation multiplies by)."""
        return self.qweight.float() * self.scale[:, None]


def missing() -> str | None:
    """What this torch lacks for int8 products on this CPU (None: nothing): the kernel itself, or
    one that fails on a tiny product."""
    if not hasattr(torch, "_int_mm"):
        return f"torch {torch.__version__} has no int8 matrix product (torch._int_mm)"
    a = torch.ones(2, 16, dtype=torch.int8)
    try:
        result = torch._int_mm(a, a.t().contiguous())
    except RuntimeError as e:
        return f"torch's int8 matrix product does not run on this CPU ({str(e).splitlines()[0]})"
    return None if bool((result == 16).all()) else "torch's int8 matrix product gives wrong results here"


def quantize(model: Transformer) -> Transformer:
    """`model` (float32, on the CPU, for inference) with its linear layers in int8, in place."""
    if (why := missing()) is not None:
        raise NmtError(f"--dtype int8: {why}; use --dtype fp32 (or auto)")
    model.float().eval()
    for module in model.modules():
        if isinstance(module, Attention):
            module.in_proj = Int8Linear(module.in_proj.weight, module.in_proj.bias)
            module.out_proj = Int8Linear(module.out_proj.weight, module.out_proj.bias)
        elif isinstance(module, FeedForward):
            fused = module.activation == "relu"  # applied by fc1 as it scales its output: one pass fewer
            module.fc1 = Int8Linear(module.fc1.weight, module.fc1.bias, relu=fused)
            module.fc2 = Int8Linear(module.fc2.weight, module.fc2.bias)
            module.activation = None if fused else module.activation
    model.int8_output = Int8Linear(model.output_weight()[: model.output_vocab], None)
    return model
