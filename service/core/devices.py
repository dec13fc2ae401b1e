"""Whether this machine has NVIDIA GPUs, told without importing torch.

Importing torch to ask costs ~2 s and ~650 MB per process; a machine without an NVIDIA device file has no usable
GPU whatever torch would say, so the CPU-only path (CI, most laptops, every CPU replica) never pays it. Where the
device files exist, the runtimes still check that each GPU really works before using it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def gpu_count() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` where set, else the ``/dev/nvidiaN`` device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])


def may_have_gpu() -> bool:
    """False when this machine surely has no usable NVIDIA GPU (no device file, or none made visible)."""
    return gpu_count() > 0
