"""``tune``'s prediction forms the adaptive policy's batches: from a backlog, no bigger than the knee of the
measured batch times (``CostModel.knee``), so a user sees the trade-off for their model before serving it."""

from __future__ import annotations

from service.tune.candidates import Candidate
from service.tune.measure import RuntimeFigures
from service.tune.model import ServiceCurve, Simulator, Workload


def candidate(policy: str) -> Candidate:
    return Candidate(backend="onnxruntime", precision="fp32", max_batch_size=16, max_queue_delay_ms=2.0,
                     preferred_batch_sizes=(), batch_policy=policy, instances=1, threads=0, workers=1)  # fmt: skip


def curve(batch_ms: dict[int, float]) -> ServiceCurve:
    figures = RuntimeFigures("onnxruntime", "fp32", 0, {b: [ms] * 5 for b, ms in batch_ms.items()})
    return ServiceCurve(figures, largest=16)


def test_near_saturation_the_predicted_adaptive_batches_stop_at_the_knee_and_the_delay_ones_do_not() -> None:
    cpu = curve({1: 12.0, 8: 82.0, 16: 162.0})  # 2 ms a batch + 10 ms an image: 2 / 4 within 5% of 10 + 2 / 16
    assert cpu.knee(16) == 4
    workload = Workload(cores=64, decode_ms=0.0, frontend_ms=0.0, client_ms=0.0, duration_s=20.0)
    rate = 92.0  # 95% of one instance's best, 1000 / 10.3 ms an image at 16
    adaptive = Simulator(candidate("adaptive"), cpu, workload).step(rate)
    delay = Simulator(candidate("delay"), cpu, workload).step(rate)
    assert adaptive.mean_batch <= 4.0 < delay.mean_batch
    gpu = curve({1: 5.0, 8: 5.2, 16: 5.4})  # batching nearly free: the knee is the maximum
    assert gpu.knee(16) == 16
