"""Training from image folders: the served transform for validation, unreadable files skipped and listed, empty
classes refused, resume equal to an uninterrupted run, atomic per-epoch checkpoints with the best kept, and
``train --export`` writing the next repository version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import models
import models.folder as folder
from models.augment import STANDARD
from models.checkpoint import load_checkpoint, save_checkpoint
from models.folder import FolderImages, Split, StreamFeed, choose_mode, scan_folder
from models.registry import with_input_size
from models.train import BatchProgress, TrainConfig, best_path_for, train
from service.core.decoding import Preprocessor
from service.core.errors import DatasetError
from tests.conftest import encode_image, random_image

SMALL = models.get_architecture("smallcnn").spec


def _write_folder(root: Path, per_class: int = 10, classes: tuple[str, ...] = ("blue", "red"), size: int = 32) -> None:
    """Class-dependent images: each class a colour, with noise, alternating JPEG and PNG."""
    rng = np.random.default_rng(0)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            base = np.zeros((size, size, 3)) + np.array([60 + 140 * k, 90, 200 - 140 * k])
            image = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
            fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
            (root / name / f"{i:03d}.{ext}").write_bytes(encode_image(image, fmt))


def _config(root: Path, out: Path, **overrides: object) -> TrainConfig:
    fields: dict[str, object] = {
        "dataset": f"folder:{root}",
        "epochs": 2,
        "batch_size": 8,
        "lr": 0.05,
        "device": "cpu",
        "workers": 0,
        "loader": "stream",
        "out": str(out),
    }
    return TrainConfig(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(("height", "width", "fmt"), [(375, 500, "JPEG"), (90, 120, "PNG"), (300, 200, "JPEG")])
def test_validation_images_equal_the_served_preprocessing_pixel_for_pixel(
    tmp_path: Path, height: int, width: int, fmt: str
) -> None:
    # resnet18 at 64x64 resizes the shorter side to 73 and crops 64: the 500x375 JPEG takes PIL's draft path.
    spec = with_input_size(models.get_architecture("resnet18").spec, 64)
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(encode_image(random_image(height, width, seed=3), fmt))
    image, target, _, reason = FolderImages(Split([str(path)], np.array([0])), spec, None, seed=0)[(0, 1)]
    assert reason == "" and image is not None and target == 0
    served = Preprocessor(spec, workers=1).decode_many([path.read_bytes()])[0]
    assert isinstance(served, np.ndarray)
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
    assert np.array_equal(image.numpy(), served)


def test_augmentation_depends_on_seed_epoch_and_index_only(tmp_path: Path) -> None:
    _write_folder(tmp_path, per_class=2)
    index = scan_folder(tmp_path)
    spec = with_input_size(models.get_architecture("resnet18").spec, 16)
    images = FolderImages(index.train, spec, STANDARD, seed=5)
    first = images[(0, 1)][0]
    assert first is not None and first.shape == (3, 16, 16)
    again, other_epoch = images[(0, 1)][0], images[(0, 2)][0]
    assert again is not None and other_epoch is not None
    assert torch.equal(first, again)  # the same draw, in any process and after a resume
    assert not torch.equal(first, other_epoch)


def test_train_and_val_folders_are_used_when_present(tmp_path: Path) -> None:
    _write_folder(tmp_path / "train", per_class=4)
    _write_folder(tmp_path / "val", per_class=2)
    index = scan_folder(tmp_path)
    assert index.layout == "train/val folders" and index.labels == ("blue", "red")
    assert len(index.train.paths) == 8 and len(index.val.paths) == 4
    assert all("/val/" in p for p in index.val.paths)
    (tmp_path / "val" / "green").mkdir()
    (tmp_path / "val" / "green" / "x.png").write_bytes(encode_image(random_image(8, 8)))
    with pytest.raises(DatasetError, match=r"classes that .* lacks: green"):
        scan_folder(tmp_path)


def test_auto_holds_small_folders_in_memory_without_workers_and_streams_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_folder(tmp_path, per_class=3)
    index = scan_folder(tmp_path)
    assert choose_mode("auto", index, SMALL, workers=0) == "memory"
    assert choose_mode("auto", index, SMALL, workers=2) == "stream"
    assert choose_mode("memory", index, SMALL, workers=2) == "memory"
    monkeypatch.setattr(folder, "MEMORY_MODE_MAX_BYTES", 3 * 32 * 32 * 5)  # room for 5 of the 6 images
    assert choose_mode("auto", index, SMALL, workers=0) == "stream"


@pytest.mark.parametrize(("loader", "workers"), [("stream", 0), ("stream", 1), ("memory", 0)])
def test_unreadable_images_are_skipped_counted_and_listed(tmp_path: Path, loader: str, workers: int) -> None:
    root = tmp_path / "data"
    _write_folder(root)
    (root / "red" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    truncated = encode_image(random_image(64, 64), "JPEG")
    (root / "blue" / "half.jpg").write_bytes(truncated[: len(truncated) // 2])
    out = tmp_path / "ckpt.pt"
    result = train(_config(root, out, loader=loader, workers=workers, epochs=1))
    record = load_checkpoint(out).record
    assert record is not None and record == result.record
    assert record.loader == loader
    assert record.skipped_images == 2
    names = sorted(Path(s.path).name for s in record.skipped)
    assert names == ["broken.jpg", "half.jpg"] and all(s.reason for s in record.skipped)
    # However loaded, the split's sizes leave the unreadable files out (streaming meets them while training).
    assert record.train_size + record.val_size == 20
    assert record.history[0].images_per_s > 0 and record.history[0].compute_s > 0


def test_an_empty_class_is_refused_before_training(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _write_folder(root)
    (root / "green").mkdir()
    out = tmp_path / "ckpt.pt"
    with pytest.raises(DatasetError, match="green holds no images"):
        train(_config(root, out))
    assert not out.exists()


class _Crash(Exception):
    pass


class _CrashAfter(BatchProgress):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def end_epoch(self, record: object) -> None:
        if getattr(record, "epoch", 0) == self.epoch:
            raise _Crash


def test_resume_after_epoch_1_of_2_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _write_folder(root, per_class=12)
    whole = train(_config(root, tmp_path / "whole.pt"))

    cut = tmp_path / "cut.pt"
    with pytest.raises(_Crash):
        train(_config(root, cut), progress=_CrashAfter(1))
    interrupted = load_checkpoint(cut)
    assert interrupted.record is not None and len(interrupted.record.history) == 1
    resumed = train(_config(root, cut, resume=str(cut)))

    assert resumed.record.resumed_from_epoch == 1
    assert [h.epoch for h in resumed.record.history] == [1, 2]
    for a, b in zip(whole.record.history, resumed.record.history, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5)
        assert a.val_accuracy == b.val_accuracy
    expected, got = load_checkpoint(tmp_path / "whole.pt").state_dict, load_checkpoint(cut).state_dict
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)


def test_resume_refuses_another_run_and_a_finished_one(tmp_path: Path) -> None:
    from service.core.errors import ConfigError

    root = tmp_path / "data"
    _write_folder(root, per_class=4)
    out = tmp_path / "run.pt"
    train(_config(root, out, epochs=1))
    with pytest.raises(ConfigError, match="finished all 1 epochs"):
        train(_config(root, out, epochs=1, resume=str(out)))
    with pytest.raises(ConfigError, match="--seed 0 in the checkpoint, 1 now"):
        train(_config(root, tmp_path / "other.pt", epochs=1, seed=1, resume=str(out)))


def test_each_epoch_is_written_atomically_and_the_best_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "data"
    _write_folder(root, per_class=8)
    out = tmp_path / "run.pt"
    seen_after_epoch: list[int] = []

    class Watch(BatchProgress):
        def end_epoch(self, record: object) -> None:  # the checkpoint is on disk by the time an epoch is reported
            ckpt = load_checkpoint(out)
            assert ckpt.record is not None
            seen_after_epoch.append(len(ckpt.record.history))

    result = train(_config(root, out, epochs=3), progress=Watch())
    assert seen_after_epoch == [1, 2, 3]
    assert not list(tmp_path.glob("*.tmp"))
    record = result.record
    accuracies = [h.val_accuracy or 0.0 for h in record.history]
    assert record.best_val_accuracy == max(accuracies)
    assert record.best_epoch == accuracies.index(max(accuracies)) + 1  # the first epoch to reach it
    best = load_checkpoint(best_path_for(out))
    assert best.record is not None and best.record.history[-1].epoch == record.best_epoch

    # A write that dies half way leaves the previous checkpoint whole.
    before = out.read_bytes()

    def dying_save(payload: object, fh: object) -> None:
        fh.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(out, state_dict=best.state_dict, spec=best.spec, record=best.record)
    assert out.read_bytes() == before


def test_train_export_writes_version_1_then_2(tmp_path: Path) -> None:
    from service.cli import main
    from service.core.spec import load_spec

    root = tmp_path / "shapes"
    _write_folder(root, per_class=6)
    repo = tmp_path / "repo"
    argv = ["train", "--no-progress", "--dataset", f"folder:{root}", "--epochs", "1", "--batch-size", "8",
            "--device", "cpu", "--workers", "0", "--out", str(tmp_path / "s.pt"), "--export", "--repository",
            str(repo), "--formats", "torchscript"]  # fmt: skip
    assert main(argv) == 0
    assert main(argv) == 0
    versions = sorted(p.name for p in (repo / "shapes").iterdir() if p.is_dir())
    assert versions == ["1", "2"]
    spec = load_spec(repo / "shapes" / "2" / "spec.json")
    assert spec.labels == ("blue", "red") and spec.exports[0].format == "torchscript"
    assert "validation images of folder:" in (spec.exports[0].parity_checked_on or "")


def test_stream_feed_batches_are_uint8_and_sized(tmp_path: Path) -> None:
    _write_folder(tmp_path, per_class=5)
    feed = StreamFeed(scan_folder(tmp_path), SMALL, batch_size=4, seed=0, workers=0)
    feed.set_epoch(1)
    batches = list(feed.train_batches())
    assert feed.steps_per_epoch() == len(batches) == 2  # 8 training images
    assert all(b.images.dtype == torch.uint8 and b.images.shape[1:] == (3, 32, 32) for b in batches)
    assert sorted(torch.cat([b.targets for b in batches]).tolist()) == [0] * 4 + [1] * 4
