"""What CPU this is, in the words figures need: its model name and the instruction sets INT8 speed depends on
(onnxruntime's int8 kernels: 3.1-3.3x fp32 on a CPU with AVX-512 VNNI, 1.9-2.1x with AVX2 only, resnet18)."""

from __future__ import annotations

import platform
from pathlib import Path

INT8_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def _cpuinfo(key: str) -> str | None:
    """The first ``key`` line's value in ``/proc/cpuinfo`` (None where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def int8_flags() -> tuple[str, ...]:
    """Which of :data:`INT8_FLAGS` the CPU has, in that order."""
    flags = set((_cpuinfo("flags") or "").split())
    return tuple(f for f in INT8_FLAGS if f in flags)


def describe_cpu() -> str:
    """``model name (flag, flag, ...)``: a speed figure's machine in one line."""
    flags = int8_flags()
    return f"{cpu_name()} ({', '.join(flags) if flags else 'none of ' + '/'.join(INT8_FLAGS)})"
