"""Datasets: digits (real, offline, deterministic split), folder:PATH on generated images, synthetic, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import models
from models.datasets import load_dataset
from service.core.errors import DatasetError, UnknownNameError
from tests.conftest import encode_image, random_image

SPEC = models.get_architecture("smallcnn").spec


def test_digits_is_real_split_deterministically_and_sized_for_the_model() -> None:
    a = load_dataset("digits", SPEC)
    b = load_dataset("digits", SPEC)
    assert len(a.train_images) + len(a.val_images) == 1797
    assert 0.18 < len(a.val_images) / 1797 < 0.22
    assert a.train_images.shape[1:] == (3, 32, 32) and a.train_images.dtype == torch.uint8
    assert torch.equal(a.val_targets, b.val_targets) and torch.equal(a.val_images, b.val_images)
    assert set(a.val_targets.tolist()) == set(range(10))  # stratified: every class validated
    assert a.labels == tuple(str(d) for d in range(10))
    # Real digits have both dark ground and bright ink.
    assert a.train_images.float().mean() < 128 and a.train_images.max() == 255


def _write_folder(root: Path, counts: dict[str, int]) -> None:
    for cls_index, (name, count) in enumerate(counts.items()):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(count):
            image = random_image(40 + i, 50, seed=cls_index * 100 + i)
            fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
            (folder / f"img{i}.{ext}").write_bytes(encode_image(image, fmt))


def test_folder_dataset_reads_an_image_folder_tree(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"cat": 5, "dog": 6})
    (tmp_path / "cat" / "notes.txt").write_text("not an image, and not looked at")
    seen: list[tuple[int, int]] = []
    data = load_dataset(f"folder:{tmp_path}", SPEC, progress=lambda i, n: seen.append((i, n)))
    assert data.labels == ("cat", "dog")
    assert len(data.train_images) + len(data.val_images) == 11
    assert len(data.val_images) == 2 and set(data.val_targets.tolist()) == {0, 1}
    assert data.train_images.shape[1:] == (3, 32, 32)
    assert seen[-1] == (11, 11)


def test_folder_without_class_folders_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no class folders"):
        load_dataset(f"folder:{tmp_path}", SPEC)


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(f"folder:{tmp_path / 'nope'}", SPEC)


def test_class_folder_with_no_images_is_named(tmp_path: Path) -> None:
    _write_folder(tmp_path, {"cat": 2})
    (tmp_path / "empty_class").mkdir()
    (tmp_path / "empty_class" / "readme.md").write_text("x")
    with pytest.raises(DatasetError, match=r"class folder .*empty_class holds no images"):
        load_dataset(f"folder:{tmp_path}", SPEC)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"this is not a picture", "not a recognised image"),
        (b"", "empty image"),
        ("truncated", "truncated"),
    ],
)
def test_unreadable_image_is_named_with_the_reason(tmp_path: Path, content: bytes | str, reason: str) -> None:
    _write_folder(tmp_path, {"cat": 2, "dog": 2})
    if content == "truncated":
        full = encode_image(random_image(64, 64), "JPEG")
        content = full[: len(full) // 2]
    assert isinstance(content, bytes)
    (tmp_path / "dog" / "broken.jpg").write_bytes(content)
    with pytest.raises(DatasetError) as info:
        load_dataset(f"folder:{tmp_path}", SPEC)
    assert "broken.jpg" in str(info.value) and reason in str(info.value)


def test_synthetic_is_deterministic_and_sized() -> None:
    a = load_dataset("synthetic:100", SPEC)
    b = load_dataset("synthetic:100", SPEC)
    assert len(a.train_images) + len(a.val_images) == 100
    assert torch.equal(a.train_images, b.train_images)
    assert a.num_classes == 10


@pytest.mark.parametrize("name", ["synthetic:abc", "synthetic:3"])
def test_synthetic_with_a_bad_count_is_refused(name: str) -> None:
    with pytest.raises(DatasetError, match="synthetic:N"):
        load_dataset(name, SPEC)


def test_unknown_dataset_names_the_choices() -> None:
    with pytest.raises(UnknownNameError, match=r"digits, folder:PATH, synthetic"):
        load_dataset("imagenet", SPEC)


def test_digits_pixels_survive_the_serving_transform() -> None:
    """Each 8x8 digit is scaled up by exactly 4: block means of the 32x32 image recover the original ordering."""
    from sklearn.datasets import load_digits

    data = load_dataset("digits", SPEC)
    raw = load_digits().images
    first = data.train_images[0, 0].numpy().astype(float)
    blocks = first.reshape(8, 4, 8, 4).mean(axis=(1, 3))
    candidates = [np.corrcoef(blocks.ravel(), r.ravel())[0, 1] for r in raw[:20]]
    assert max(candidates) > 0.95
