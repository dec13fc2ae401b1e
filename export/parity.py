"""The parity gate: eager PyTorch against an artifact, on real images and random uint8 batches.

Relative logit error of one image is ``max_j |a_j - e_j| / max_j |e_j|``: the largest deviation measured against
the size of that image's logits (an element-wise ratio would blow up on logits near zero). The gate takes the
maximum over every image, and top-1 agreement over every image.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from torch import nn

MIN_RANDOM_IMAGES = 16


class Tolerance(msgspec.Struct, frozen=True):
    max_rel_error: float
    min_top1_agreement: float


FP32 = Tolerance(max_rel_error=1e-4, min_top1_agreement=1.0)
FP16 = Tolerance(max_rel_error=2e-2, min_top1_agreement=0.99)


@dataclass(frozen=True)
class ParityResult:
    images: int
    max_rel_error: float
    top1_agreement: float
    tolerance: Tolerance
    checked: bool = True
    note: str = ""
    error: str = ""  # the candidate could not be produced or run: failed, with this reason

    @property
    def passed(self) -> bool:
        if self.error:
            return False
        if not self.checked:
            return True
        return (
            self.max_rel_error <= self.tolerance.max_rel_error
            and self.top1_agreement >= self.tolerance.min_top1_agreement
        )

    def record_fields(self) -> dict[str, Any]:
        """What spec.json's export record holds of this check."""
        if not self.checked:
            return {}
        return {"parity_max_rel_error": self.max_rel_error, "parity_top1_agreement": self.top1_agreement}

    def describe(self) -> str:
        if self.error:
            return f"FAIL: {self.error}"
        if not self.checked:
            return f"not checked ({self.note})"
        verdict = "pass" if self.passed else "FAIL"
        return (
            f"{verdict}: max relative logit error {self.max_rel_error:.2e} (limit {self.tolerance.max_rel_error:.0e}), "
            f"top-1 agreement {self.top1_agreement:.2%} (limit {self.tolerance.min_top1_agreement:.0%}) "
            f"on {self.images} images"
        )


def parity_batches(
    real: np.ndarray | None, shape: tuple[int, int, int], max_batch_size: int, *, seed: int = 0
) -> list[np.ndarray]:
    """Real images in chunks of ``max_batch_size``, then random uint8 batches of 1, 7 and ``max_batch_size``."""
    batches: list[np.ndarray] = []
    if real is not None and len(real):
        batches += [real[i : i + max_batch_size] for i in range(0, len(real), max_batch_size)]
    rng = np.random.default_rng(seed)
    sizes = sorted(n for n in {1, 7, max_batch_size} if n <= max_batch_size)
    while sum(sizes) < MIN_RANDOM_IMAGES:  # small maximum batches (a graph fixed at 1): more batches, not fewer images
        sizes.append(max_batch_size)
    for n in sizes:
        batches.append(rng.integers(0, 256, size=(n, *shape), dtype=np.uint8))
    return batches


def eager_outputs(model: nn.Module, batches: Sequence[np.ndarray]) -> list[Any]:
    """The model's output on each batch: an array, or for a model of several outputs (a segmenter's) a dict of them
    named as the TorchScript runtime names them (``output_0``, ``output_1``, ...)."""
    model.eval()
    with torch.inference_mode():
        outs = [model(torch.from_numpy(b)) for b in batches]
    return [
        {f"output_{i}": o.float().numpy() for i, o in enumerate(out)} if isinstance(out, tuple) else out.float().numpy()
        for out in outs
    ]


def compare(
    reference: Sequence[np.ndarray],
    run: Callable[[np.ndarray], np.ndarray],
    batches: Sequence[np.ndarray],
    tolerance: Tolerance,
) -> ParityResult:
    """Run ``run`` on each batch and measure it against ``reference`` (outputs for the same batches)."""
    worst = 0.0
    agree = total = 0
    for batch, expected in zip(batches, reference, strict=True):
        got = np.asarray(run(batch), dtype=np.float32)
        if got.shape != expected.shape:
            return ParityResult(len(batch), float("inf"), 0.0, tolerance, note=f"shape {got.shape} != {expected.shape}")
        scale = np.maximum(np.abs(expected).max(axis=1), 1e-12)
        worst = max(worst, float((np.abs(got - expected).max(axis=1) / scale).max()))
        agree += int((got.argmax(1) == expected.argmax(1)).sum())
        total += len(batch)
    return ParityResult(total, worst, agree / total, tolerance)


@contextlib.contextmanager
def exact_fp32(device: str) -> Iterator[None]:
    """TF32 off while an fp32 artifact's parity is checked on CUDA: cuDNN and cuBLAS run fp32 convolutions and
    matrix products in TF32 by default on Ampere and later (about 1e-3 relative error, PyTorch's numerical accuracy
    note), which would fail the 1e-4 fp32 gate for a faithful export. Restored after."""
    if not device.startswith("cuda"):
        yield
        return
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
