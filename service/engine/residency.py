"""Which models are resident on each device, what each really costs there, and which to evict for a load (README,
"Many models on one device"): the least recently used that may go, never a pinned model, a busy one (work queued,
in flight or waiting for its load) or one resident for under ``min_residency_s``; when nothing may go,
:class:`NoRoom`. This module only keeps the accounts and decides; :mod:`service.engine.ondemand` loads and evicts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.transport.messages import VersionKey

UNLIMITED = 2**62


def budget_for(budgets: dict[str, int], device: str) -> int:
    """The budget of ``device``: its own, else its kind's (``cuda``), else the one for all, else the default."""
    key = next((k for k in (device, device.partition(":")[0], "*") if k in budgets), None)
    return budgets[key] if key is not None else default_budget(device)


def default_budget(device: str) -> int:
    """70% of the machine's memory for the CPU (the rest is the server's own, the decoders' and the OS's); 90% of
    a GPU's memory (CUDA's context and the allocators' slack take the rest)."""
    if device.startswith("cuda"):
        try:
            import torch

            _free, total = torch.cuda.mem_get_info(device)
        except Exception:  # a device torch cannot query: no budget rather than no model (the load says why)
            return UNLIMITED
        return int(total * 0.9)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.7)


def used_bytes(device: str) -> int:
    """Memory in use that a load shows up in: this process's resident set on the CPU, the device's memory in use
    on CUDA (every allocator's, not only torch's)."""
    if device.startswith("cuda"):
        try:
            import torch

            free, total = torch.cuda.mem_get_info(device)
        except Exception:  # as above: the load itself will report the device
            return 0
        return int(total - free)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settled_used_bytes(device: str) -> int:
    """:func:`used_bytes` once freed heap went back to the OS. A load's peak (the model file parsed, the graph
    optimised) is freed by its end but kept by the allocator; measured without this, a resnet18 copy at 64x64 was
    charged 138-167 MB for the 61 MB it held (scripts/many_models_bench.py), and the budget held twice what it said."""
    if not device.startswith("cuda"):
        give_back_memory()
    return used_bytes(device)


def give_back_memory() -> None:
    """Return freed heap to the OS after an unload (glibc keeps it otherwise, and the resident set would not fall)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class Charge:
    """One resident model on its device; or one version of it (a rollout's candidate), by its key."""

    model: str | VersionKey
    device: str
    bytes: int
    pinned: bool
    loaded_at: float
    last_used: float


class NoRoom(Exception):
    """Nothing may be evicted for a load now; ``wait_s`` says when a young model may go (None: waiting won't do)."""

    def __init__(self, message: str, wait_s: float | None = None) -> None:
        super().__init__(message)
        self.wait_s = wait_s


class Accounts:
    """The charges per device, and the least-recently-used choice of what to evict."""

    def __init__(self, budgets: dict[str, int], *, min_residency_s: float = 1.0) -> None:
        self.budgets = budgets
        self.min_residency_s = min_residency_s
        self.charges: dict[str | VersionKey, Charge] = {}
        self.leaving: list[Charge] = []  # evicted or replaced, still closing: their memory is not free yet
        # the last measured size of each model, resident or not (for estimates)
        self.sizes: dict[str | VersionKey, int] = {}

    def budget(self, device: str) -> int:
        return budget_for(self.budgets, device)

    def used(self, device: str) -> int:
        return sum(c.bytes for c in [*self.charges.values(), *self.leaving] if c.device == device)

    def charge(self, model: str | VersionKey, device: str, size: int, *, pinned: bool) -> None:
        now = time.monotonic()
        self.charges[model] = Charge(model, device, size, pinned, now, now)
        self.sizes[model] = size

    def release(self, model: str | VersionKey) -> Charge | None:
        return self.charges.pop(model, None)

    def touch(self, model: str) -> None:
        charge = self.charges.get(model)
        if charge is not None:
            charge.last_used = time.monotonic()

    def victims(self, device: str, need: int, busy: Callable[[str], bool]) -> list[str]:
        """The least recently used models to evict from ``device`` so that ``need`` more bytes fit, or
        :class:`NoRoom`. An empty list: it fits already."""
        budget = self.budget(device)
        if need > budget:
            raise NoRoom(f"it needs {_mb(need)}, more than the whole {device} memory budget of {_mb(budget)}")
        free = budget - self.used(device)
        if need <= free:
            return []
        now = time.monotonic()
        chosen: list[str] = []
        young: list[float] = []
        for charge in sorted(self.charges.values(), key=lambda c: c.last_used):
            if charge.device != device or charge.pinned or not isinstance(charge.model, str) or busy(charge.model):
                continue  # a version's own charge (a rollout's candidate) is pinned too
            age = now - charge.loaded_at
            if age < self.min_residency_s:
                young.append(self.min_residency_s - age)
                continue
            chosen.append(charge.model)
            free += charge.bytes
            if need <= free:
                return chosen
        pinned = sum(1 for c in self.charges.values() if c.device == device and c.pinned)
        resident = sum(1 for c in self.charges.values() if c.device == device)
        message = (
            f"the {device} memory budget of {_mb(budget)} is full ({_mb(self.used(device))} in {resident} resident "
            f"models, {pinned} pinned) and no model may be evicted now (the others are busy"
            + (f" or loaded under {self.min_residency_s:g} s ago" if young else "")
            + f"): {_mb(need)} more are needed"
        )
        raise NoRoom(message, wait_s=min(young) if young else None)


def _mb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
