"""The candidates ``visionserve bench rollout`` derives from a served version disagree with it by what they promise,
measured with onnxruntime on the held-out digits the server's own preprocessing makes: a copy agrees on every image,
a label permutation on none, a calibrated bias on the asked fraction. The primary is the shipped digits model
(examples/model_repository/digits/1), trained, so that agreement means something (docs/FACTS: on initial weights
it is noise)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from service.bench.rollout import candidates
from service.core.repository import read_version
from service.core.spec import load_spec, write_spec

ROOT = Path(__file__).resolve().parents[2]

PRIMARY = candidates.DIGITS_VERSION


@pytest.fixture(scope="module")
def digits() -> candidates.Digits:
    return candidates.held_out_digits(359)


@pytest.fixture(scope="module")
def primary_top1(digits: candidates.Digits) -> np.ndarray:
    return candidates.top1(PRIMARY, digits.images)


def test_held_out_digits_are_the_validation_split_as_served(
    digits: candidates.Digits, primary_top1: np.ndarray
) -> None:
    from models.datasets import load_dataset

    dataset = load_dataset("digits", load_spec(PRIMARY / "spec.json"))
    assert digits.held_out == len(dataset.val_images) == 359
    # the PNGs, decoded by the server's preprocessing, give the very tensors training held out
    assert np.array_equal(digits.images, dataset.val_images.numpy())
    assert np.array_equal(digits.targets, dataset.val_targets.numpy())
    assert all(png.startswith(b"\x89PNG") for png in digits.pngs)
    # the shipped model scores on them what its training record says it scored on its validation split
    accuracy = float(np.mean(primary_top1 == digits.targets))
    training = json.loads((PRIMARY.parent / "training.json").read_text())
    assert accuracy == pytest.approx(training["val_accuracy"], abs=1e-9)


def test_held_out_digits_past_the_split_take_training_images_then_cycle() -> None:
    many = candidates.held_out_digits(2000)
    assert len(many.pngs) == len(many.images) == len(many.targets) == 2000
    assert many.held_out == 359
    assert np.array_equal(many.images[:359], candidates.held_out_digits(359).images)
    assert np.array_equal(many.images[1797:], many.images[: 2000 - 1797])  # the whole set, then again


def test_a_copy_agrees_on_every_image(tmp_path: Path, digits: candidates.Digits) -> None:
    copy = candidates.copy_version(PRIMARY, tmp_path / "2")
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in PRIMARY.iterdir())
    assert candidates.agreement(PRIMARY, copy, digits.images) == 1.0


def test_a_label_permutation_agrees_on_no_image(tmp_path: Path, digits: candidates.Digits,
                                                primary_top1: np.ndarray) -> None:  # fmt: skip
    perm = candidates.permute_labels(PRIMARY, tmp_path / "2", seed=3)
    assert sorted(perm) == list(range(10)) and all(p != j for j, p in enumerate(perm))
    assert candidates.permute_labels(PRIMARY, tmp_path / "again", seed=3) == perm  # seeded
    assert candidates.permute_labels(PRIMARY, tmp_path / "other", seed=4) != perm
    candidate_top1 = candidates.top1(tmp_path / "2", digits.images)
    assert candidates.agreement(PRIMARY, tmp_path / "2", digits.images) == 0.0
    # the candidate answers the class whose logit the primary gave its top-1: j with perm[j] = primary's top-1
    assert np.array_equal(np.asarray(perm)[candidate_top1], primary_top1)
    read_version("digits", tmp_path / "2")  # the server's own checks accept it


def test_a_bias_moves_one_class_logit_only(tmp_path: Path, digits: candidates.Digits) -> None:
    candidates.bias_logits(PRIMARY, tmp_path / "2", class_index=4, bias=2.5)
    moved = candidates.logits(tmp_path / "2", digits.images) - candidates.logits(PRIMARY, digits.images)
    assert np.allclose(moved[:, 4], 2.5, atol=1e-5)
    assert np.allclose(np.delete(moved, 4, axis=1), 0.0, atol=1e-6)
    with pytest.raises(ValueError, match="class_index"):
        candidates.bias_logits(PRIMARY, tmp_path / "3", class_index=10, bias=1.0)


@pytest.mark.parametrize("target", [0.02, 0.003, 0.1])
def test_calibrated_disagreement_is_the_fraction_asked(tmp_path: Path, digits: candidates.Digits,
                                                       target: float) -> None:  # fmt: skip
    class_index, bias, measured = candidates.calibrate_disagreement(PRIMARY, digits.images, target)
    count = len(digits.images)
    assert measured == round(target * count) / count  # as close as a whole number of images gets
    # built again from what it returned, the candidate disagrees on that fraction, in batches of any size
    candidate = candidates.bias_logits(PRIMARY, tmp_path / "2", class_index, bias)
    assert 1 - candidates.agreement(PRIMARY, candidate, digits.images) == pytest.approx(measured)
    primary = candidates.top1(PRIMARY, digits.images)
    for batch in (1, 7, 32):
        assert float(np.mean(candidates.top1(candidate, digits.images, batch) != primary)) == pytest.approx(measured)


def test_other_artifacts_are_edited_or_dropped(tmp_path: Path, digits: candidates.Digits) -> None:
    """A derived version serves the derived graph whatever precision or runtime the server picks: its INT8 ONNX file
    is edited alike, its TorchScript file and that file's spec record are dropped."""
    source = tmp_path / "source"
    shutil.copytree(PRIMARY, source)
    shutil.copy(source / "model.onnx", source / "model.int8.onnx")  # stands in for export --int8's file
    (source / "model.pt").write_bytes(b"not a TorchScript file: dropped before anyone reads it")
    spec = load_spec(source / "spec.json")
    torchscript = msgspec.structs.replace(spec.exports[0], format="torchscript", file="model.pt")
    write_spec(msgspec.structs.replace(spec, exports=(*spec.exports, torchscript)), source / "spec.json")

    candidates.permute_labels(source, tmp_path / "2", seed=0)
    derived = tmp_path / "2"
    assert sorted(p.name for p in derived.iterdir()) == ["model.int8.onnx", "model.onnx", "spec.json"]
    assert [e.file for e in load_spec(derived / "spec.json").exports] == ["model.onnx"]
    (derived / "model.onnx").rename(derived / "plain.onnx")
    (derived / "model.int8.onnx").rename(derived / "model.onnx")
    assert candidates.agreement(PRIMARY, derived, digits.images) == 0.0
