"""Training: beats chance on real digits, repeats with a seed, round-trips through a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.checkpoint import apply_weights, load_checkpoint, load_weights, save_checkpoint
from models.normalize import Uint8Classifier
from models.registry import get_architecture
from models.train import BatchProgress, TrainConfig, evaluate, resolve_device, train
from service.core.errors import CheckpointError, ConfigError
from service.launcher import free_port


def test_a_short_run_on_digits_clearly_beats_chance(digits_checkpoint: Path) -> None:
    ckpt = load_checkpoint(digits_checkpoint)
    assert ckpt.record is not None
    assert ckpt.record.val_accuracy is not None and ckpt.record.val_accuracy > 0.7  # chance is 0.1
    assert ckpt.record.epochs == len(ckpt.record.history) == 4
    assert ckpt.record.dataset == "digits" and ckpt.record.device == "cpu"
    assert ckpt.spec.labels == tuple(str(d) for d in range(10))
    assert ckpt.record.versions["torch"] == torch.__version__


def test_checkpoint_round_trip_gives_the_same_predictions(digits_checkpoint: Path, tmp_path: Path) -> None:
    from models.datasets import load_dataset

    ckpt = load_checkpoint(digits_checkpoint)
    network = get_architecture("smallcnn").build(num_classes=10)
    apply_weights(network, ckpt.state_dict, source=str(digits_checkpoint))
    model = Uint8Classifier(network, ckpt.spec.mean, ckpt.spec.std).eval()
    data = load_dataset("digits", ckpt.spec)
    accuracy = evaluate(model, data.val_images, data.val_targets, torch.device("cpu"))
    assert accuracy == pytest.approx(ckpt.record.val_accuracy if ckpt.record else -1)

    copy = tmp_path / "copy.pt"
    save_checkpoint(copy, state_dict=ckpt.state_dict, spec=ckpt.spec, record=ckpt.record)
    again = load_checkpoint(copy)
    assert again.spec == ckpt.spec and again.record == ckpt.record
    assert all(torch.equal(again.state_dict[k], v) for k, v in ckpt.state_dict.items())
    assert load_weights(copy).keys() == ckpt.state_dict.keys()


def test_same_seed_repeats_the_run() -> None:
    config = TrainConfig(dataset="synthetic:60", epochs=1, batch_size=16, out="")
    a = train(config)
    b = train(config)
    assert a.record.history[0].train_loss == b.record.history[0].train_loss


def test_progress_hooks_are_called_per_batch_and_epoch() -> None:
    calls: list[str] = []

    class Recorder(BatchProgress):
        def start_epoch(self, epoch: int, batches: int) -> None:
            calls.append(f"start {epoch} {batches}")

        def advance(self, loss: float, accuracy: float) -> None:
            calls.append("step")

        def end_epoch(self, record: object) -> None:
            calls.append("end")

    train(TrainConfig(dataset="synthetic:40", epochs=2, batch_size=16, out=""), progress=Recorder())
    # 40 images, 20% validation -> 32 training images -> 2 batches of 16 per epoch
    assert calls == ["start 1 2", "step", "step", "end", "start 2 2", "step", "step", "end"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("epochs", 0, "--epochs"), ("batch_size", 0, "--batch-size"), ("lr", -1.0, "--lr")],
)
def test_bad_settings_are_refused(field: str, value: object, message: str) -> None:
    config = TrainConfig(out="", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        train(config)


def test_device_names_are_checked() -> None:
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ConfigError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no usable CUDA"):
            resolve_device("cuda")


def test_a_zoo_model_without_a_training_loop_is_refused_with_where_to_go() -> None:
    import argparse

    from models.commands import train_from_args

    with pytest.raises(ConfigError, match=r"lraspp_mobilenet_v3_large \(semantic\) has no training loop.*export"):
        train_from_args(argparse.Namespace(arch="lraspp_mobilenet_v3_large", dataset="digits"))


def test_checkpoints_that_are_not_ours_are_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, evil)
    with pytest.raises(CheckpointError, match="refused rather than unpickled"):
        load_checkpoint(evil)
    assert not marker.exists()

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"definitely not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or not a PyTorch file"):
        load_checkpoint(garbage)

    bare = tmp_path / "bare.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), bare)
    with pytest.raises(CheckpointError, match="bare state dict"):
        load_checkpoint(bare)

    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_truncated_checkpoint_is_refused(digits_checkpoint: Path, tmp_path: Path) -> None:
    data = digits_checkpoint.read_bytes()
    broken = tmp_path / "half.pt"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(broken)


def test_weights_of_another_architecture_are_refused(digits_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match="do not fit"):
        apply_weights(get_architecture("resnet18").build(), load_weights(digits_checkpoint), source="x")


@pytest.mark.slow
def test_torchrun_trains_with_ddp_and_only_rank_0_writes(tmp_path: Path) -> None:
    out = tmp_path / "ddp.pt"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        "-m", "service.cli", "train", "--dataset", "synthetic:80", "--epochs", "1", "--batch-size", "8",
        "--device", "cpu", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("checkpoint written") == 1
    ckpt = load_checkpoint(out)
    assert ckpt.record is not None and ckpt.record.world_size == 2
