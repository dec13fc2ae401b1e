"""The prediction refuses CPU candidates with more intra-op threads than cores (measured far below what the
proportional-sharing simulation predicts for them), and only those."""

from __future__ import annotations

import pytest

from service.tune.candidates import Candidate
from service.tune.model import Workload
from service.tune.rank import oversubscribed


def candidate(instances: int, threads: int) -> Candidate:
    return Candidate(backend="onnxruntime", precision="fp32", max_batch_size=8, max_queue_delay_ms=2.0,
                     preferred_batch_sizes=(), batch_policy="adaptive", instances=instances, threads=threads,
                     workers=1)  # fmt: skip


@pytest.mark.parametrize(
    ("instances", "threads", "cores", "expected"),
    [(1, 0, 2, False), (2, 1, 2, False), (2, 0, 2, True), (2, 2, 2, True), (1, 4, 2, True), (2, 2, 4, False)],
)
def test_threads_beyond_the_cores_are_oversubscribed_on_the_cpu(
    instances: int, threads: int, cores: int, expected: bool
) -> None:
    assert oversubscribed(candidate(instances, threads), Workload(cores=cores, decode_ms=1.0)) is expected


def test_a_gpu_runs_its_instances_on_the_device() -> None:
    assert not oversubscribed(candidate(4, 0), Workload(cores=2, decode_ms=1.0, cuda=True))
