"""What this CPU multiplies fast, for the choice of precision: bf16 natively (AVX512-BF16 or AMX
instructions), or only through torch's reference kernel, which on a CPU with AVX2 alone runs bf16
matrix products many times slower than fp32 (benchmarks/README.md, "Translation"). The instruction
flags are not enough: a machine may list AVX512-BF16 and still multiply bf16 slower than fp32 (a CI
machine did). So where the flags are there, one matrix product
of a Transformer layer's shape is timed in both precisions (tens of milliseconds), and bf16 counts
as fast only if it measured at least `MIN_BF16_SPEEDUP` times fp32's speed. The detection is a value
(`Cpu`) that callers may be given, so that tests can ask what happens on a CPU they do not run on.
Also `keep_freed_memory`, which training and translation on a CPU call.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of bf16 matrix instructions
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
MIN_BF16_SPEEDUP = 1.2  # bf16's measured speed over fp32's below which auto keeps fp32


@dataclass(frozen=True)
class Cpu:
    capability: str  # torch.backends.cpu.get_cpu_capability(): the kernels torch picked (AVX2, AVX512, ...)
    flags: frozenset[str]  # of /proc/cpuinfo (empty where there is none)
    bf16_speedup: float = 0.0  # bf16's measured matrix-product speed over fp32's (0: not measured)

    @property
    def native_bf16(self) -> bool:
        return any(flag in self.flags for flag in NATIVE_BF16_FLAGS)

    @property
    def fast_bf16(self) -> bool:
        """Native bf16 instructions, and bf16 measured faster than fp32 (`MIN_BF16_SPEEDUP`)."""
        return self.native_bf16 and self.bf16_speedup >= MIN_BF16_SPEEDUP

    def describe(self) -> str:
        shown = ", ".join(f for f in SHOWN_FLAGS if f in self.flags) or f"none of {', '.join(SHOWN_FLAGS)}"
        measured = f", bf16 measured {self.bf16_speedup:.2f}x fp32" if self.bf16_speedup else ""
        return f"torch CPU capability {self.capability}, CPU flags: {shown}{measured}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f.read(1 << 20).decode(errors="replace").splitlines():  # a few kB a core
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:  # not Linux
        pass
    return frozenset()


@functools.cache
def this_cpu() -> Cpu:
    """This CPU (measured once per process, and only where it has native bf16 instructions)."""
    cpu = Cpu(torch.backends.cpu.get_cpu_capability(), cpu_flags())
    if cpu.native_bf16:
        cpu = Cpu(cpu.capability, cpu.flags, bf16_speedup())
    return cpu


def bf16_speedup(rows: int = 512, inner: int = 256, cols: int = 1024) -> float:
    """fp32's best time over bf16's for (rows x inner) @ (inner x cols), a feed-forward layer's
    product for a batch of `rows` tokens, on torch's current threads (after one warm-up each)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
        a @ b
        best[dtype] = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def slow_bf16_warning(asked: str, fix: str, cpu: Cpu | None = None) -> str | None:
    """What to tell a user who asked for bf16 (`asked`, the option as typed) on the CPU `cpu` (default:
    this one) if bf16 is slow there, naming `fix`; None where bf16 is fast."""
    cpu = cpu or this_cpu()
    if cpu.fast_bf16:
        return None
    if cpu.native_bf16:
        return (f"{asked} on a CPU whose bf16 matrix products measured no faster than fp32 "
                f"({cpu.describe()}); use {fix}, which picks fp32 on this CPU")
    return (f"{asked} on a CPU without native bf16 ({cpu.describe()}; no {' or '.join(NATIVE_BF16_FLAGS)}): "
            "torch runs bf16 matrix products here through a reference kernel, 4-50x slower than fp32; "
            f"use {fix}, which picks fp32 on this CPU")


def missing_compiler() -> str | None:
    """The C++ compiler torch.compile builds its CPU kernels with ($CXX, else g++; clang++ on macOS),
    when it is not on the PATH, so that `--compile` can say so before any work starts (torch itself
    says it minutes in, after tracing); None when it is there (or on Windows, left to torch)."""
    if sys.platform == "win32":
        return None
    compiler = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    return None if shutil.which(compiler) else compiler


def no_compiler_message(compiler: str, verb: str) -> str:
    return (f"--compile on a CPU needs a C++ compiler ({compiler}), and none is on the PATH: install "
            f"g++ (or name yours in $CXX), or {verb} without --compile")


def keep_freed_memory() -> None:
    """Make glibc's malloc keep and reuse freed memory instead of handing every large block back to
    the system: a decoding step allocates and frees tensors of many MB, and so does a training step
    (its output layer's logits and their gradient alone are 80 MB in bf16 for transformer_small's
    batches of 6,144 tokens); each fresh page from the system costs a page fault, which slowed the
    search's cache reorders and training updates (benchmarks/README.md, "Training speed: eager and
    compiled"). Memory still peaks where use peaks. Linux/glibc only;
    elsewhere nothing changes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # mallopt parameters of glibc's malloc.h
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 1 << 30)
