"""``train --resume`` with a larger ``--epochs``: the run is extended on its schedule rebuilt for the new total and
fast-forwarded, the record says from where, and what cannot be continued is refused with the flag and both values."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from models.checkpoint import Extension, load_checkpoint, load_resume_state
from models.resume import fast_forward
from models.train import TrainConfig, train
from service.core.errors import ConfigError
from tests.conftest import encode_image
from tests.models.test_folder_training import _Crash, _CrashAfter

STEPS = 4  # --limit-batches: optimiser steps per epoch, to keep the runs short


def _config(out: Path, **overrides: object) -> TrainConfig:
    fields: dict[str, object] = {
        "dataset": "digits",
        "epochs": 1,
        "batch_size": 32,
        "lr": 0.05,
        "device": "cpu",
        "limit_batches": STEPS,
        "out": str(out),
    }
    return TrainConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def _one_cycle(total_steps: int) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.OneCycleLR]:
    """The schedule train builds (models/train.py ``_optimiser``), on one parameter."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total_steps, pct_start=0.2)
    return optimizer, scheduler


@pytest.mark.parametrize("steps", [1, 7, 19])
def test_fast_forward_equals_stepping_the_schedule(steps: int) -> None:
    stepped_opt, stepped = _one_cycle(20)
    for _ in range(steps):
        stepped_opt.step()
        stepped.step()
    opt, scheduler = _one_cycle(20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        fast_forward(scheduler, steps)
    assert scheduler.last_epoch == stepped.last_epoch == steps
    assert opt.param_groups[0]["lr"] == stepped_opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["momentum"] == stepped_opt.param_groups[0]["momentum"]
    assert scheduler.get_last_lr() == stepped.get_last_lr()


def test_extending_1_to_2_epochs_trains_one_more_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "run.pt"
    first = train(_config(out, epochs=1))
    after_one = load_checkpoint(out).state_dict

    extended = train(_config(out, epochs=2, resume=str(out)))

    record = extended.record
    assert [h.epoch for h in record.history] == [1, 2]
    assert record.history[0] == first.record.history[0]  # epoch 1 is the checkpoint's, not trained again
    assert record.epochs == 2 and record.resumed_from_epoch == 1
    assert record.extensions == (Extension(from_epochs=1, to_epochs=2, at_epoch=1),)
    ckpt, state = load_resume_state(out)
    assert ckpt.record is not None and ckpt.record.extensions == record.extensions
    assert ckpt.record.epochs == 2 and len(ckpt.record.history) == 2
    assert state["epoch"] == 2
    assert state["scheduler"]["total_steps"] == 2 * STEPS and state["scheduler"]["last_epoch"] == 2 * STEPS
    assert any(not torch.equal(ckpt.state_dict[k], v) for k, v in after_one.items())  # epoch 2 trained


def test_an_extension_goes_on_the_longer_schedule_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    base = tmp_path / "base.pt"
    train(_config(base, epochs=1))
    whole, cut = tmp_path / "whole.pt", tmp_path / "cut.pt"
    shutil.copy(base, whole)
    shutil.copy(base, cut)
    extended = train(_config(whole, epochs=3, resume=str(whole)))

    with pytest.raises(_Crash):  # extended 1 -> 3, interrupted after epoch 2
        train(_config(cut, epochs=3, resume=str(cut)), progress=_CrashAfter(2))
    _, state = load_resume_state(cut)
    # After epoch 2 the rate is the 3-epoch cycle's after 2 epochs of steps, not the 1-epoch cycle's end.
    reference_opt, reference = _one_cycle(3 * STEPS)
    for _ in range(2 * STEPS):
        reference_opt.step()
        reference.step()
    saved = state["optimizer"]["param_groups"][0]
    assert saved["lr"] == pytest.approx(reference_opt.param_groups[0]["lr"], rel=1e-12)
    assert saved["momentum"] == pytest.approx(reference_opt.param_groups[0]["momentum"], rel=1e-12)
    assert saved["lr"] > 0.05 / 25  # well above the 1-epoch cycle's floor: the rate climbed back

    resumed = train(_config(cut, epochs=3, resume=str(cut)))  # the same --epochs: an ordinary resume
    extension = Extension(from_epochs=1, to_epochs=3, at_epoch=1)
    assert resumed.record.extensions == extended.record.extensions == (extension,)
    assert resumed.record.resumed_from_epoch == 2
    for a, b in zip(extended.record.history, resumed.record.history, strict=True):
        assert a.train_loss == b.train_loss and a.val_accuracy == b.val_accuracy
    expected, got = load_checkpoint(whole).state_dict, load_checkpoint(cut).state_dict
    assert all(torch.equal(got[k], v) for k, v in expected.items())


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "two.pt"
    train(_config(out, epochs=2))
    return out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"arch": "resnet18", "input_size": 32}, "--arch 'smallcnn' in the checkpoint, 'resnet18' now"),
        ({"input_size": 28}, "--input-size 32 in the checkpoint, 28 now"),
        ({"dataset": "synthetic:200"}, "--dataset 'digits' in the checkpoint, 'synthetic:200' now"),
        ({"seed": 3}, "--seed 0 in the checkpoint, 3 now"),
        ({"batch_size": 16}, "--batch-size 32 in the checkpoint, 16 now"),
        ({"lr": 0.1}, "--lr 0.05 in the checkpoint, 0.1 now"),
        ({"limit_batches": STEPS - 1}, f"took {STEPS} steps per epoch and would take {STEPS - 1} now"),
        ({"epochs": 1}, "--epochs 1 now, but the checkpoint has finished 2 epochs already"),
        ({"epochs": 2}, "finished all 2 epochs already; nothing to do"),
    ],
)
def test_what_cannot_be_continued_is_refused_with_the_reason(
    two_epochs: Path, tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    config = _config(tmp_path / "other.pt", **{"epochs": 3, **overrides}, resume=str(two_epochs))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        train(config)
    assert not (tmp_path / "other.pt").exists()


def test_a_run_is_not_shortened(tmp_path: Path) -> None:
    out = tmp_path / "run.pt"
    with pytest.raises(_Crash):
        train(_config(out, epochs=3), progress=_CrashAfter(1))
    with pytest.raises(ConfigError, match="--epochs 2 now, but the checkpoint's run is planned for --epochs 3"):
        train(_config(out, epochs=2, resume=str(out)))


def test_other_classes_are_refused_naming_both(tmp_path: Path) -> None:
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for name in ("blue", "red"):
        (root / name).mkdir(parents=True)
        for i in range(4):
            image = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
            (root / name / f"{i}.png").write_bytes(encode_image(image, "PNG"))
    config = _config(tmp_path / "run.pt", dataset=f"folder:{root}", batch_size=4, workers=0, loader="memory")
    train(config)
    shutil.copytree(root / "red", root / "green")
    with pytest.raises(ConfigError, match=r"the classes \[blue, red\] in the checkpoint, \[blue, green, red\] now"):
        train(msgspec.structs.replace(config, epochs=2, resume=config.out))
