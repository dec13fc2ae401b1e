"""Whether this machine has NVIDIA GPUs, told without importing torch.

Importing torch to ask costs ~2 s and ~650 MB per process; a machine without an NVIDIA device file has no usable
GPU whatever torch would say, so the CPU-only path (CI, most laptops, every CPU replica) never pays it. Where the
device files exist, the runtimes still check that each GPU really works before using it.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any, NamedTuple


def gpu_count() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` where set, else the ``/dev/nvidiaN`` device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])


def may_have_gpu() -> bool:
    """False when this machine surely has no usable NVIDIA GPU (no device file, or none made visible)."""
    return gpu_count() > 0


class GpuSample(NamedTuple):
    """One GPU's memory and utilisation, as the metrics report them."""

    device: str  # "cuda:N", N as this process numbers its GPUs (after CUDA_VISIBLE_DEVICES)
    used_bytes: int
    total_bytes: int
    utilization: float | None  # busy fraction over NVML's last sample period


_nvml_lock = threading.Lock()
_nvml_state: list[Any] = []  # [the pynvml module] once initialised, [None] once found missing or failing


def _nvml() -> Any:
    with _nvml_lock:
        if not _nvml_state:
            try:
                import pynvml  # nvidia-ml-py, in the `gpu` extra

                pynvml.nvmlInit()
                _nvml_state.append(pynvml)
            except Exception:  # not installed, or no driver: the caller falls back to torch
                _nvml_state.append(None)
        return _nvml_state[0]


def _physical_indices(count: int) -> list[int] | None:
    """NVML counts every GPU of the machine; CUDA_VISIBLE_DEVICES renumbers them for this process (by index; a
    UUID list is left to torch: None)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    wanted = [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    return [int(d) for d in wanted] if all(d.isdigit() for d in wanted) else None


def nvml_samples() -> list[GpuSample] | None:
    """Every visible GPU's memory and utilisation from NVML, without torch; None where NVML cannot say (not
    installed, no driver, GPUs named by UUID)."""
    nvml = _nvml() if may_have_gpu() else None
    if nvml is None:
        return None
    try:
        indices = _physical_indices(nvml.nvmlDeviceGetCount())
        if indices is None:
            return None
        samples = []
        for logical, physical in enumerate(indices):
            handle = nvml.nvmlDeviceGetHandleByIndex(physical)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except Exception:  # not every GPU reports it (MIG slices): memory is still reported
                utilization = None
            samples.append(GpuSample(f"cuda:{logical}", int(memory.used), int(memory.total), utilization))
        return samples
    except Exception:
        return None
