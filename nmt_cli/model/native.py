"""Translation's C kernels (`native.c`): the search's choice of each row's best tokens, incremental
decoding's attention over bf16 caches, and the quantizing and scaling around int8 matrix products;
compiled for this machine on first use, loaded with ctypes.

It is built by the system's C compiler ($CC, else cc or gcc) with the machine's own instructions
(-march=native) into `$XDG_CACHE_HOME/nmt` (default ~/.cache/nmt), once: the file's name holds a
hash of the source, the flags, the compiler and this CPU's instruction flags, so a home folder shared
by different machines never loads another machine's build. Where it cannot be built (no compiler,
a failed build, a read-only cache) or `NMT_NATIVE=0` is set, `library()` is None and the callers
run the same computation in torch, slower (`why_not()` says why). ctypes releases the GIL for the
call, so the searches of several threads run it at once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from nmt_cli.model.cpu import cpu_flags

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
BUILD_SECONDS = 120  # a build that takes longer (a machine under load) is abandoned

_why_not: list[str] = []


def why_not() -> str | None:
    """Why `library()` is None (None when it is loaded, or not yet asked for)."""
    return _why_not[0] if _why_not else None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on the first call of the process (a fraction of a second) unless a
    build for this machine is cached; None where it cannot be had (see the module docstring)."""
    _why_not.clear()
    if os.environ.get("NMT_NATIVE") == "0":
        return _without("NMT_NATIVE=0")
    command = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    compiler = " ".join(command)  # $CC may hold flags too ("gcc -m64"), as make reads it
    if not shutil.which(command[0]):
        return _without(f"no C compiler on the PATH (cc, gcc, or $CC; looked for {command[0]})")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(),
                                     platform.machine().encode(),
                                     " ".join(sorted(cpu_flags())).encode()])).hexdigest()[:16]
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nmt"
    path = folder / f"native-{key}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:  # built aside, then moved in whole
                built = Path(scratch) / path.name
                subprocess.run([*command, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=BUILD_SECONDS)
                os.replace(built, path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.decode(errors="replace").strip()[-300:] if getattr(e, "stderr", None) else e
            return _without(f"building {SOURCE.name} with {compiler} failed: {detail}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return _without(f"loading {path} failed: {e}")
    lib.nmt_best_tokens.restype = ctypes.c_int
    lib.nmt_best_tokens.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 6,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.nmt_cached_attention.restype = ctypes.c_int
    lib.nmt_cached_attention.argtypes = [*[ctypes.c_void_p] * 5, ctypes.c_int, *[ctypes.c_int64] * 6,
                                         ctypes.c_float, ctypes.c_void_p]
    lib.nmt_quantize_rows.restype = None
    lib.nmt_quantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p]
    lib.nmt_int8_scale.restype = None
    lib.nmt_int8_scale.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3,
                                   ctypes.c_int, ctypes.c_void_p]
    return lib


def _without(reason: str) -> None:
    _why_not[:] = [reason]
    return None


def best_tokens(logits: Tensor, k: int, pad: int, bos: int, eos: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """`beams.best_tokens` of float32 or bf16 CPU logits (N, V) by the kernel: the k best log-probabilities
    (N, k) float32 and their tokens (N, k) other than `pad` and `bos`, best first, and EOS's log-probability
    (N,); None where the kernel is not there or does not take these logits."""
    lib = library()
    if lib is None or logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    logits = logits.contiguous()
    N, V = logits.shape
    k = min(k, V)
    top, tokens, eos_log_prob = torch.empty(N, k), torch.empty(N, k, dtype=torch.long), torch.empty(N)
    if lib.nmt_best_tokens(logits.data_ptr(), int(logits.dtype == torch.bfloat16), N, V, k, pad, bos, eos,
                           top.data_ptr(), tokens.data_ptr(), eos_log_prob.data_ptr()) != 0:
        raise MemoryError("the search's kernel could not allocate its buffers")
    return top, tokens, eos_log_prob


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                     rows: Tensor | None = None) -> Tensor | None:
    """`kernels.cached_attention` of float32 or bf16 CPU tensors by the kernel: T queries a group, q (G, H,
    T, K), over keys (G, H, L, K) and values (G, H, L, K_v), K and K_v multiples of 16 (the self-attention
    of every decoder row, one query each, and the cross-attention of a sentence's beams over its
    encoder states); `mask` None or (G, 1, 1, L), True where allowed.
    With `rows` (G, L) int64, k (P, H, K) and v (P, H, K_v) are pools and group g's key and value l are
    entry rows[g, l] (`transformer.Cache`). Returns (G, H, T, K_v) in q's dtype (a view of the heads
    side by side, (G, T, H, K_v)); None where the kernel is not there or does not take these tensors."""
    lib = library()
    G, H, T, K = q.shape
    L, Kv = (k.shape[2], v.shape[3]) if rows is None else (rows.shape[1], v.shape[2])
    if (lib is None or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16)
            or not q.dtype == k.dtype == v.dtype or K % 16 or Kv % 16
            or (rows is not None and (rows.dtype != torch.long or rows.shape[0] != G))
            or (mask is not None and (mask.dtype != torch.bool or mask.shape != (G, 1, 1, L)))):
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    allowed = None if mask is None else mask.reshape(G, L).contiguous()
    rows = None if rows is None else rows.contiguous()
    out = torch.empty(G, T, H, Kv, dtype=q.dtype)
    bf16 = int(q.dtype == torch.bfloat16)
    if lib.nmt_cached_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                None if allowed is None else allowed.data_ptr(),
                                None if rows is None else rows.data_ptr(), bf16, G, H, T, L, K, Kv,
                                K**-0.5, out.data_ptr()) != 0:
        raise MemoryError("the attention kernel could not allocate its buffers")
    return out.transpose(1, 2)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """`int8.quantize_rows` of float32 CPU rows x (N, K) by the kernel: the same int8 values (N, K) and
    scales (N, 1); None where the kernel is not there or does not take x."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        return None
    x = x.contiguous()
    N, K = x.shape
    q, scale = torch.empty(N, K, dtype=torch.int8), torch.empty(N, 1)
    lib.nmt_quantize_rows(x.data_ptr(), N, K, q.data_ptr(), scale.data_ptr())
    return q, scale


def int8_scale(acc: Tensor, wscale: Tensor, xscale: Tensor, bias: Tensor | None,
               relu: bool = False) -> Tensor | None:
    """acc (N, M) int32 * wscale (M,) * xscale (N, 1) (+ bias (M,)), then max(0, .) if `relu`, as
    float32 (N, M) by the kernel; None where it is not there or does not take these tensors."""
    lib = library()
    if lib is None or acc.device.type != "cpu" or acc.dtype != torch.int32:
        return None
    acc, wscale, xscale = acc.contiguous(), wscale.float().contiguous(), xscale.float().contiguous()
    N, M = acc.shape
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty(N, M)
    lib.nmt_int8_scale(acc.data_ptr(), N, M, wscale.data_ptr(), xscale.data_ptr(),
                       None if bias is None else bias.data_ptr(), int(relu), out.data_ptr())
    return out
