"""Turning logits into answers: softmax scores, top-k, and Triton's "score:index:label" strings."""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_k(scores: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k best classes, best first: (index, score)."""
    k = min(k, scores.shape[1])
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    part = np.take_along_axis(scores, idx, axis=1)
    idx = np.take_along_axis(idx, np.argsort(-part, axis=1, kind="stable"), axis=1)
    best = np.take_along_axis(scores, idx, axis=1)
    return [list(zip(ri, rs, strict=True)) for ri, rs in zip(idx.tolist(), best.tolist(), strict=True)]


def predictions(scores: np.ndarray, labels: tuple[str, ...], k: int) -> list[list[dict[str, object]]]:
    return [[{"label": labels[i], "index": i, "score": s} for i, s in row] for row in top_k(scores, k)]


def classification_strings(logits: np.ndarray, labels: tuple[str, ...], k: int) -> list[list[str]]:
    """Triton's classification extension: "score:index:label" for the k best raw outputs, best first."""
    return [[f"{s:f}:{i}:{labels[i]}" for i, s in row] for row in top_k(logits, k)]
