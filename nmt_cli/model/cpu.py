"""What this CPU multiplies fast, for the choice of precision: bf16 natively (AVX512-BF16 or AMX
instructions), or only through torch's reference kernel, which on a CPU with AVX2 alone runs bf16
matrix products 4-50x slower than fp32 (depending on their layout; benchmarks/README.md). The
detection is a value (`Cpu`) that callers may be given, so that tests can ask what happens on a CPU
they do not run on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of bf16 matrix instructions
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class Cpu:
    capability: str  # torch.backends.cpu.get_cpu_capability(): the kernels torch picked (AVX2, AVX512, ...)
    flags: frozenset[str]  # of /proc/cpuinfo (empty where there is none)

    @property
    def native_bf16(self) -> bool:
        return any(flag in self.flags for flag in NATIVE_BF16_FLAGS)

    def describe(self) -> str:
        shown = ", ".join(f for f in SHOWN_FLAGS if f in self.flags) or f"none of {', '.join(SHOWN_FLAGS)}"
        return f"torch CPU capability {self.capability}, CPU flags: {shown}"


def this_cpu() -> Cpu:
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f.read(1 << 20).decode(errors="replace").splitlines():  # a few kB a core
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:  # not Linux
        pass
    return Cpu(torch.backends.cpu.get_cpu_capability(), flags)


def slow_bf16_warning(asked: str, fix: str, cpu: Cpu | None = None) -> str | None:
    """What to tell a user who asked for bf16 (`asked`, the option as typed) on the CPU `cpu` (default:
    this one) if it has no native bf16, naming `fix`; None where bf16 is fast."""
    cpu = cpu or this_cpu()
    if cpu.native_bf16:
        return None
    return (f"{asked} on a CPU without native bf16 ({cpu.describe()}; no {' or '.join(NATIVE_BF16_FLAGS)}): "
            "torch runs bf16 matrix products here through a reference kernel, 4-50x slower than fp32; "
            f"use {fix}, which picks fp32 on this CPU")

