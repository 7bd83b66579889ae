"""Speed of the CPU paths of the model, its loss, optimizer and search (`nmt_cli/model/kernels.py`,
`training/loss.py`, `training/optim.py`, `inference/beams.py`) against torch's own operations, on
shapes of translation's short sentences.

    python benchmarks/model_kernels.py [--threads 2] [--repeats 50] [--groups attention,search,...]

Rows, each against what torch would do without it:
- attention, forward + backward, bf16, (B, H, T, K) = (80, 4, 32, 64): the two batched products
  around a float32 softmax (`kernels.attention`) against `scaled_dot_product_attention` with its
  flash kernel and with its math kernel;
- Dropout, forward + backward of an (80, 32, 256) tensor: `kernels.Dropout` against `nn.Dropout`;
- the label-smoothed loss, forward + backward of 2560 x 8000 float32 logits: `loss.label_smoothed_nll`
  (chunks of about 4 MB) against `F.cross_entropy(label_smoothing=0.1)` over the whole tensor;
- one Adam update of 20M float32 parameters in 100 tensors: fused (`optim.build_optimizer`) against
  torch's foreach implementation;
- incremental decoding's self-attention compiled, bf16, 240 rows (8 heads of 64) of one query
  over 8 and 80 cached positions: `kernels.cached_attention` (products and sums, fused by
  inductor) against the compiled `attention` (batched products left to torch), in us a row;
- the best 8 of 7792 logits of 1200 rows, eager, fp32 and bf16 (a beam of 4 over 300 sentences of
  the Multi30k model), each call on a fresh copy (`best_tokens` overwrites its input):
  `beams.best_tokens` by the search's C kernel (`model/native.py`, where it can be built) and by
  torch (`top_k`'s classes and a `log_softmax` written over the logits) against `log_softmax` +
  `topk` over whole rows, and `beams.top_k` alone against `topk`;
- incremental decoding's self-attention, eager, fp32 and bf16, 1400 rows (4 heads of 32) of one query
  over 8 and 30 cached positions: `kernels.cached_attention` by the C kernel (`model/native.py`)
  against torch's two batched products around a softmax;
- the softmax of cached self-attention's rows of 12 positions: `kernels.softmax` against torch's;
- the output projection of 4, 64 and 256 decoder rows of 128 onto 7792 words, fp32, outside
  autograd (a step of the search, or one of its chunks, on the Multi30k model):
  `kernels.output_projection` in a search's `packed_weights` (oneDNN, the weight packed once)
  against `F.linear` (MKL);
- the best 4 of 7968 logits of 1200 rows compiled, bf16: `beams.best_tokens`' two stages against
  `log_softmax` + `topk` over whole rows.
The compiled rows need a C++ compiler; they are left out where torch.compile cannot run. `--groups`
picks some of the groups of rows: attention, dropout, training (loss and Adam), search, compiled.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from machine import describe
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmt_cli.config.train import OptimConfig
from nmt_cli.inference import beams
from nmt_cli.model import kernels, native
from nmt_cli.training import loss, optim


def timed(fn: Callable[..., object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median seconds of one call, after three untimed calls; with `setup`, of `fn(setup())`, setup's
    time not counted (a fresh input for a function that overwrites its input)."""
    times = []
    for i in range(repeats + 3):
        args = () if setup is None else (setup(),)
        start = time.perf_counter()
        fn(*args)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def forward_backward(op: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    leaves = [x.detach().requires_grad_() for x in inputs]

    def run() -> None:
        op(*leaves).float().sum().backward()

    return run


def attention_rows(repeats: int) -> list[tuple[str, str, float]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(80, 4, 32, 64, generator=g).bfloat16() for _ in range(3))
    ours = timed(forward_backward(lambda *x: kernels.attention(*x, None, False, 0.0), q, k, v), repeats)
    rows = [("attention fwd+bwd (80, 4, 32, 64) bf16", "kernels.attention", ours)]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
        with sdpa_kernel(backend):
            theirs = timed(forward_backward(F.scaled_dot_product_attention, q, k, v), repeats)
        rows.append(("", f"sdpa, {name} kernel", theirs))
    return rows


def dropout_rows(repeats: int) -> list[tuple[str, str, float]]:
    x = torch.randn(80, 32, 256)
    ours = timed(forward_backward(kernels.Dropout(0.1), x), repeats)
    theirs = timed(forward_backward(torch.nn.Dropout(0.1), x), repeats)
    return [("dropout fwd+bwd (80, 32, 256) fp32", "kernels.Dropout", ours), ("", "nn.Dropout", theirs)]


def training_rows(repeats: int) -> list[tuple[str, str, float]]:
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(2560, 8000, generator=g), torch.randint(4, 8000, (2560,), generator=g)
    ours = timed(forward_backward(lambda x: loss.label_smoothed_nll(x, target, 0.1)[0], logits), repeats)
    whole = timed(forward_backward(
        lambda x: F.cross_entropy(x, target, label_smoothing=0.1, reduction="sum"), logits), repeats)
    rows = [("label-smoothed loss fwd+bwd, 2560 x 8000 fp32", "loss.label_smoothed_nll", ours),
            ("", "F.cross_entropy, whole tensor", whole)]
    params = [torch.nn.Parameter(torch.randn(200_000, generator=g)) for _ in range(100)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = optim.build_optimizer(params, OptimConfig())
    foreach = torch.optim.Adam(params, lr=1e-4, foreach=True)
    rows.append(("Adam update, 20M fp32 parameters in 100 tensors", "optim.build_optimizer (fused)",
                 timed(fused.step, repeats)))
    rows.append(("", "torch.optim.Adam(foreach=True)", timed(foreach.step, repeats)))
    return rows


def search_rows(repeats: int) -> list[tuple[str, str, float]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        logits = (torch.randn(1200, 7792, generator=g) * 3).to(dtype)
        what = f"best 8 of 7792 logits, 1200 rows, {name}"
        if native.library() is not None:
            rows.append((what, "beams.best_tokens (C kernel)",
                         timed(lambda x: beams.best_tokens(x, 8), repeats, setup=logits.clone)))
            what = ""
        else:
            print(f"the C kernel's rows left out: {native.why_not()}")
        with mock.patch.object(native, "library", lambda: None):
            rows.append((what, "beams.best_tokens (torch)",
                         timed(lambda x: beams.best_tokens(x, 8), repeats, setup=logits.clone)))
        rows.append(("", "log_softmax + topk",
                     timed(lambda x=logits: torch.log_softmax(x.float(), -1).topk(8, -1), repeats)))
        if dtype == torch.float32:
            rows.append(("", "beams.top_k", timed(lambda x=logits: beams.top_k(x, 8), repeats)))
            rows.append(("", "topk", timed(lambda x=logits: x.topk(8, -1), repeats)))
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for length in (8, 30):  # one query a row, 4 heads of 32 (the Multi30k model), a step of a beam of 4
            q, k, v = (torch.randn(1400, 4, n, 32, generator=g).to(dtype) for n in (1, length, length))
            step = functools.partial(kernels.cached_attention, q, k, v,
                                     torch.ones(1400, 1, 1, length, dtype=torch.bool))
            what = f"cached self-attention, 1400 rows over {length}, {name}"
            if native.library() is not None:
                rows.append((what, "kernels.cached_attention (C kernel)",
                             timed(step, repeats)))
                what = ""
            with mock.patch.object(native, "cached_attention", lambda *_: None):
                rows.append((what, "kernels.cached_attention (torch)",
                             timed(step, repeats)))
    weight = torch.randn(7792, 128, generator=g)
    for n in (4, 64, 256):
        hidden = torch.randn(n, 128, generator=g)
        with torch.inference_mode(), kernels.packed_weights():  # as in a search
            rows.append((f"output projection, {n} rows of 128 onto 7792, fp32", "kernels.output_projection",
                         timed(lambda h=hidden: kernels.output_projection(h, weight, 7792), repeats)))
            rows.append(("", "F.linear", timed(lambda h=hidden: F.linear(h, weight), repeats)))
    scores = torch.randn(800, 4, 1, 12, generator=g)  # one query of 4 heads over 12 cached positions
    rows.append(("softmax of 3200 rows of 12 (cached self-attention)", "kernels.softmax",
                 timed(lambda: kernels.softmax(scores), repeats)))
    rows.append(("", "torch.softmax", timed(lambda: torch.softmax(scores, -1), repeats)))
    return rows


def compiled_rows(repeats: int) -> list[tuple[str, str, float]]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for length in (8, 80):
        q = torch.randn(240, 8, 1, 64, generator=g).bfloat16()  # self-attention: each row's newest position
        k, v = (torch.randn(240, 8, length, 64, generator=g).bfloat16() for _ in range(2))
        fused = torch.compile(lambda q, k, v: kernels.cached_attention(q, k, v, None), dynamic=False)
        plain = torch.compile(lambda q, k, v: kernels.attention(q, k, v, None, False, 0.0), dynamic=False)
        with torch.no_grad():
            rows.append((f"cached attention, {length} positions, per row (us)", "kernels.cached_attention",
                         timed(functools.partial(fused, q, k, v), repeats) / 240 * 1e6))
            rows.append(("", "compiled attention",
                         timed(functools.partial(plain, q, k, v), repeats) / 240 * 1e6))
    logits = torch.randn(1200, 7968, generator=g).bfloat16()
    two_stage = torch.compile(beams.best_tokens, dynamic=False)

    def whole_rows(x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1).topk(k, dim=-1).values

    plain_topk = torch.compile(whole_rows, dynamic=False)
    with torch.no_grad():
        rows.append(("best 4 of 7968 logits, 1200 rows, bf16", "beams.best_tokens",
                     timed(lambda: two_stage(logits, 4), repeats)))
        rows.append(("", "log_softmax + topk", timed(lambda: plain_topk(logits, 4), repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--groups", default="attention,dropout,training,search,compiled",
                        help="the groups of rows to measure, comma-separated")
    args = parser.parse_args()
    groups = {"attention": attention_rows, "dropout": dropout_rows, "training": training_rows,
              "search": search_rows, "compiled": compiled_rows}
    chosen = args.groups.split(",")
    if unknown := sorted(set(chosen) - set(groups)):
        parser.error(f"unknown group(s) {', '.join(unknown)}; choose among {', '.join(groups)}")
    torch.set_num_threads(args.threads)
    print(describe())
    print(f"{args.threads} threads; median of {args.repeats} calls; ms unless the row says otherwise")
    rows = []
    for name in chosen:
        try:
            rows += groups[name](args.repeats)
        except Exception as error:  # compiled: no C++ compiler, or inductor unsupported here; keep the rest
            if name != "compiled":
                raise
            print(f"compiled rows left out: torch.compile failed ({type(error).__name__}: {error})")
    print(f"| {'what':<52} | {'implementation':<30} | {'time':>9} |")
    print(f"|{'-' * 54}|{'-' * 32}|{'-' * 11}:|")
    in_us = False
    for what, name, seconds in rows:
        in_us = "(us)" in what if what else in_us  # a row without `what` is measured as the one above
        print(f"| {what:<52} | {name:<30} | {seconds * (1 if in_us else 1e3):>9.3f} |")


if __name__ == "__main__":
    main()
