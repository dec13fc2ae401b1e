"""The command line as a user meets it: its exit status and what it prints. A real process where the process is
the point (a whole training run); the refusals run ``main`` in this process, the same code a process would run, in
a fraction of the time (each process imported torch again: 3-9 s apiece here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main


def visionserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=timeout)


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``visionserve ARGS`` through ``service.cli.main`` here: its exit status and output, as a process gives."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's refusals
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_models_lists_every_architecture_with_size_and_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    proc = in_process(capsys, "models")
    assert proc.returncode == 0, proc.stderr
    for name, params in [("smallcnn", "0.09 M"), ("resnet18", "11.69 M"), ("convnext_tiny", "28.59 M")]:
        line = next(line for line in proc.stdout.splitlines() if name in line)
        assert params in line
    assert "3x224x224" in proc.stdout and "3x32x32" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arch", "vgg99"], "unknown architecture 'vgg99'; choose one of: convnext_tiny"),
        (["--dataset", "cifar"], "unknown dataset 'cifar'; choose one of: digits, folder:PATH"),
        (["--dataset", "folder:/nonexistent/x"], "does not exist"),
        (["--epochs", "0"], "--epochs must be an integer >= 1"),
    ],
)
def test_bad_train_arguments_get_a_clear_error_not_a_traceback(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = in_process(capsys, "train", "--out", "", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_train_with_a_corrupt_weights_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "w.pt"
    bad.write_bytes(b"\x00" * 100)
    proc = in_process(capsys, "train", "--out", "", "--weights", str(bad), "--dataset", "synthetic:40")
    assert proc.returncode == 2
    assert "corrupt or not a PyTorch file" in proc.stderr and "Traceback" not in proc.stderr


def test_train_writes_a_checkpoint_and_reports_accuracy(tmp_path: Path) -> None:
    out = tmp_path / "c.pt"
    proc = visionserve("train", "--dataset", "synthetic:60", "--epochs", "2", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "validation accuracy" in proc.stdout and out.is_file()
    assert "epoch   2/2" in proc.stderr
