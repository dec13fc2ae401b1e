"""GPUs told without torch: the device files (or CUDA_VISIBLE_DEVICES) say whether there are any, and NVML gives the
gauges. The NVML here is a stand-in module: this machine has no GPU, and the device is all that is missing."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from service.core import devices, metrics


class FakeNvml:
    """pynvml's calls the gauges make, for a machine of three GPUs of 80 GB."""

    def __init__(self) -> None:
        self.initialised = 0

    def nvmlInit(self) -> None:  # pynvml's names
        self.initialised += 1

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(used=(handle + 1) * 10**9, total=80 * 10**9)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        if handle == 2:
            raise RuntimeError("not supported (a MIG slice)")
        return SimpleNamespace(gpu=25 * (handle + 1))


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(devices, "_nvml_state", [])

    def no_torch() -> list[devices.GpuSample]:
        raise AssertionError("the gauges asked torch though NVML answered")

    monkeypatch.setattr(metrics, "_torch_samples", no_torch)
    return fake


def test_no_device_file_means_no_gpu_and_no_gauges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "Path", lambda _: SimpleNamespace(glob=lambda pattern: []))
    assert devices.gpu_count() == 0 and not devices.may_have_gpu()
    assert list(metrics._gpu_metrics()) == []


def test_the_gpu_gauges_come_from_nvml(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")  # this process's cuda:0 is the machine's GPU 2
    samples = devices.nvml_samples()
    assert samples == [devices.GpuSample("cuda:0", 3 * 10**9, 80 * 10**9, None),
                       devices.GpuSample("cuda:1", 1 * 10**9, 80 * 10**9, 0.25)]  # fmt: skip
    families = {f.name: {s.labels["device"]: s.value for s in f.samples} for f in metrics._gpu_metrics()}
    used, total, util = metrics.GPU_METRIC_NAMES
    assert families[used] == {"cuda:0": 3e9, "cuda:1": 1e9} and families[total] == {"cuda:0": 8e10, "cuda:1": 8e10}
    assert families[util] == {"cuda:1": 0.25}  # cuda:0 has no utilisation to report; its memory is still there
    devices.nvml_samples()
    assert nvml.initialised == 1  # initialised once per process, not per scrape


def test_gpus_named_by_uuid_are_left_to_torch(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3c2d1e")
    assert devices.nvml_samples() is None
