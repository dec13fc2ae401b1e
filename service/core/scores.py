"""Turning logits into answers: softmax scores, top-k, and Triton's "score:index:label" strings."""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) of the k best classes per row, best first."""
    k = min(k, scores.shape[1])
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    part = np.take_along_axis(scores, idx, axis=1)
    order = np.argsort(-part, axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)
    return idx, np.take_along_axis(scores, idx, axis=1)


def predictions(scores: np.ndarray, labels: tuple[str, ...], k: int) -> list[list[dict[str, object]]]:
    idx, best = top_k(scores, k)
    return [
        [{"label": labels[int(i)], "index": int(i), "score": float(s)} for i, s in zip(ri, rs, strict=True)]
        for ri, rs in zip(idx, best, strict=True)
    ]


def classification_strings(logits: np.ndarray, labels: tuple[str, ...], k: int) -> list[list[str]]:
    """Triton's classification extension: "score:index:label" for the k best raw outputs, best first."""
    idx, best = top_k(logits, k)
    return [
        [f"{float(s):f}:{int(i)}:{labels[int(i)]}" for i, s in zip(ri, rs, strict=True)]
        for ri, rs in zip(idx, best, strict=True)
    ]
