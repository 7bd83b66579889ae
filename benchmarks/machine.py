"""The line every benchmark table starts with: what the numbers were measured on.

CPU speeds depend on the instruction set far more than on the clock: with AVX512-BF16 or AMX, bf16
matrix products run several times faster than fp32; with AVX2 only, torch falls back to a reference
kernel and bf16 runs many times slower. Read the table with this line.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def describe() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    has = ", ".join(f for f in FLAGS if f in flags) or "none of " + ", ".join(FLAGS)
    return (f"{model}; {os.cpu_count()} cores; torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}; flags: {has}; "
            f"load average {os.getloadavg()[0]:.1f}")
