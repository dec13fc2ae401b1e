"""The dynamic batcher: semantics by example, and its invariants by property-based testing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.core.errors import CancelledError, DeadlineExceededError, OverloadedError, RuntimeFailure
from service.core.spec import InputSpec, ModelSpec
from service.engine import Batcher, BatcherConfig, InferRequest
from service.engine.policy import (
    EXPLORE_EVERY,
    KNEE_SLACK,
    SMOOTHING,
    AdaptivePolicy,
    CostModel,
    DelayPolicy,
    make_policy,
)
from service.runtime import FakeRuntime

SPEC = ModelSpec(
    name="fake",
    architecture="fake",
    input=InputSpec(height=4, width=4),
    resize_size=4,
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
    labels=tuple("abcdefghij"),
)


def images(ids: list[int], priority: int = 0, poison: set[int] | None = None) -> np.ndarray:
    """Images whose pixels name them: [id low, id high, priority, poison flag, ...]."""
    out = np.zeros((len(ids), 3, 4, 4), dtype=np.uint8)
    flat = out.reshape(len(ids), -1)
    for row, ident in enumerate(ids):
        flat[row, 0], flat[row, 1], flat[row, 2] = ident % 256, ident // 256, priority
        flat[row, 3] = 1 if poison and ident in poison else 0
        flat[row, 4:] = np.arange(4, 48) % 251
    return out


def ident(row: np.ndarray) -> int:
    return int(row[0]) + 256 * int(row[1])


def poison_fault(batch: np.ndarray) -> Exception | None:
    if (batch.reshape(len(batch), -1)[:, 3] == 1).any():
        return RuntimeFailure("poison image")
    return None


class LoggingFake(FakeRuntime):
    """Records the ids of each batch it runs, and when."""

    def __init__(self, **kw: Any) -> None:
        self.log: list[list[int]] = []
        self.spans: list[tuple[float, float]] = []
        super().__init__(SPEC, **kw)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        started = time.monotonic()
        self.log.append([ident(r) for r in batch.reshape(len(batch), -1)])
        try:
            return super()._forward(batch)
        finally:
            self.spans.append((started, time.monotonic()))


class GatedFake(LoggingFake):
    """Holds every batch inside forward until the test opens ``gate``: a busy instance by construction, so no test
    depends on how long a sleep takes on this machine. ``entered`` tells that a batch reached forward."""

    def __init__(self, **kw: Any) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        super().__init__(**kw)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        self.entered.set()
        if not self.gate.wait(10):
            raise RuntimeError("the gate was never opened")
        return super()._forward(batch)


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``check()`` holds: a state the test can observe, not a guess at how long it takes."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.001)


def request(ids: list[int], **kw: Any) -> InferRequest:
    priority = kw.pop("priority", 0)
    return InferRequest(
        request_id=str(ids[0]), model="fake", images=images(ids, priority, kw.pop("poison", None)), priority=priority,
        **kw,
    )  # fmt: skip


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_request_larger_than_the_maximum_is_split_and_reassembled_in_order() -> None:
    async def scenario() -> None:
        rt = LoggingFake()
        batcher = Batcher([rt], BatcherConfig(max_batch_size=8, max_queue_delay_ms=0))
        ids = list(range(100, 120))
        result = await batcher.submit(request(ids))
        assert [len(b) for b in rt.log] == [8, 8, 4]
        assert [ident(row.astype(np.uint8)) for row in result.logits] == ids
        assert result.errors == [None] * 20
        await batcher.close()

    run(scenario())


def test_the_delay_counts_from_the_oldest_item() -> None:
    async def scenario() -> None:
        rt = LoggingFake()
        batcher = Batcher([rt], BatcherConfig(max_batch_size=8, max_queue_delay_ms=1000))
        before_first = time.monotonic()
        first = batcher.enqueue(request([1]))
        await asyncio.sleep(0.5)
        second = batcher.enqueue(request([2]))
        after_second = time.monotonic()
        await asyncio.gather(first, second)
        # One batch of both, dispatched when the first item's delay ran out, not 1 s after the second: the margin
        # is the gap between them (0.5 s or more), so only a stall of that size could make this fail.
        assert rt.log == [[1, 2]]
        dispatched = rt.spans[0][0]
        assert before_first + 1.0 <= dispatched < after_second + 1.0
        await batcher.close()

    run(scenario())


def test_a_preferred_size_dispatches_at_once() -> None:
    async def scenario() -> None:
        rt = LoggingFake()
        batcher = Batcher([rt], BatcherConfig(max_batch_size=8, max_queue_delay_ms=5000, preferred_batch_sizes=(4,)))
        started = time.monotonic()
        await asyncio.gather(*(batcher.submit(request([i])) for i in range(4)))
        assert rt.log == [[0, 1, 2, 3]] and time.monotonic() - started < 2.5  # not the 5 s delay
        await batcher.close()

    run(scenario())


def test_priority_levels_are_served_first_and_fifo_within_a_level() -> None:
    async def scenario() -> None:
        rt = LoggingFake(delay_s=0.1)
        batcher = Batcher([rt], BatcherConfig(max_batch_size=2, max_queue_delay_ms=0))
        busy = asyncio.create_task(batcher.submit(request([0])))  # occupies the only instance
        await asyncio.sleep(0.02)
        tasks = [asyncio.create_task(batcher.submit(request([i], priority=p))) for i, p in
                 [(1, 5), (2, 5), (3, 1), (4, 5), (5, 1)]]  # fmt: skip
        await asyncio.gather(busy, *tasks)
        assert rt.log == [[0], [3, 5], [1, 2], [4]]
        await batcher.close()

    run(scenario())


def test_a_full_queue_refuses_at_once() -> None:
    async def scenario() -> None:
        rt = GatedFake()
        batcher = Batcher([rt], BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=3))
        running = asyncio.create_task(batcher.submit(request([0])))
        await until(rt.entered.is_set)
        queued = asyncio.create_task(batcher.submit(request([1, 2, 3])))
        await until(lambda: batcher.queue_depth == 3)
        refused = batcher.submit(request([4]))
        with pytest.raises(OverloadedError, match="queue full"):
            refused.send(None)  # at once: on submit's first step, before it awaits anything
        rt.gate.set()
        await asyncio.gather(running, queued)
        await batcher.close()

    run(scenario())


def test_an_expired_request_fails_with_a_deadline_error_and_is_never_computed() -> None:
    async def scenario() -> None:
        rt = GatedFake()
        batcher = Batcher([rt], BatcherConfig(max_batch_size=4, max_queue_delay_ms=0))
        busy = asyncio.create_task(batcher.submit(request([0])))
        try:
            await until(lambda: rt.entered.is_set() and batcher.inflight_batches == 1)
            with pytest.raises(DeadlineExceededError):
                async with asyncio.timeout(10):
                    await batcher.submit(request([7], timeout_ms=50))
            assert not busy.done()  # answered at its deadline, while the busy batch still holds the instance
        finally:
            rt.gate.set()
        await busy
        await batcher.close()
        assert all(7 not in b for b in rt.log)

    run(scenario())


def test_a_caller_that_goes_away_is_not_computed() -> None:
    async def scenario() -> None:
        rt = GatedFake()
        batcher = Batcher([rt], BatcherConfig(max_batch_size=4, max_queue_delay_ms=0))
        busy = asyncio.create_task(batcher.submit(request([0])))
        await until(rt.entered.is_set)
        gone = asyncio.create_task(batcher.submit(request([9])))
        await until(lambda: batcher.queue_depth == 1)  # queued behind the busy batch
        gone.cancel()
        after = asyncio.create_task(batcher.submit(request([10])))
        await until(lambda: batcher.queue_depth == 2)
        rt.gate.set()
        await asyncio.gather(busy, after)
        await batcher.close()
        assert gone.cancelled()
        assert all(9 not in b for b in rt.log) and any(10 in b for b in rt.log)

    run(scenario())


def test_one_poison_image_fails_alone() -> None:
    async def scenario() -> None:
        rt = LoggingFake(fault=poison_fault)
        batcher = Batcher([rt], BatcherConfig(max_batch_size=4, max_queue_delay_ms=50))
        results = await asyncio.gather(
            batcher.submit(request([1, 2])), batcher.submit(request([3], poison={3})), batcher.submit(request([4]))
        )
        assert rt.log[0] == [1, 2, 3, 4]  # the batch, then each image on its own
        assert sorted(rt.log[1:]) == [[1], [2], [3], [4]]
        assert results[0].errors == [None, None] and results[2].errors == [None]
        assert isinstance(results[1].errors[0], RuntimeFailure)
        assert ident(results[2].logits[0].astype(np.uint8)) == 4
        await batcher.close()

    run(scenario())


def test_instances_overlap() -> None:
    async def scenario() -> None:
        # Each forward waits at the barrier until the other instance is inside forward too: unless the two batches
        # run at the same time, the barrier breaks (after 10 s) and the batches fail.
        both_inside = threading.Barrier(2, timeout=10)

        class MeetingFake(LoggingFake):
            def _forward(self, batch: np.ndarray) -> np.ndarray:
                both_inside.wait()
                return super()._forward(batch)

        rts = [MeetingFake(), MeetingFake()]
        batcher = Batcher(rts, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0))
        results = await asyncio.gather(*(batcher.submit(request([i])) for i in range(2)))
        assert [r.errors for r in results] == [[None], [None]] and not both_inside.broken
        assert [len(rt.log) for rt in rts] == [1, 1]
        await batcher.close()

    run(scenario())


def test_close_drains_what_is_queued_then_refuses() -> None:
    async def scenario() -> None:
        rt = LoggingFake(delay_s=0.01)
        batcher = Batcher([rt], BatcherConfig(max_batch_size=4, max_queue_delay_ms=1))
        tasks = [asyncio.create_task(batcher.submit(request([i]))) for i in range(20)]
        await asyncio.sleep(0)
        await batcher.close(timeout_s=10)
        results = await asyncio.gather(*tasks)
        assert all(r.errors == [None] for r in results)
        with pytest.raises(OverloadedError, match="shutting down"):
            await batcher.submit(request([99]))
        assert batcher.queue_depth == 0 and batcher.inflight_batches == 0

    run(scenario())


def test_close_fails_what_cannot_drain_in_time() -> None:
    async def scenario() -> None:
        rt = LoggingFake(delay_s=0.3)
        batcher = Batcher([rt], BatcherConfig(max_batch_size=1, max_queue_delay_ms=0))
        tasks = [asyncio.create_task(batcher.submit(request([i]))) for i in range(5)]
        await asyncio.sleep(0.01)
        await batcher.close(timeout_s=0.1)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert any(isinstance(o, OverloadedError) for o in outcomes)  # resolved, not left hanging

    run(scenario())


# ---- properties ----------------------------------------------------------------------------------------------

REQUESTS = st.lists(
    st.fixed_dictionaries(
        {
            "size": st.integers(1, 10),
            "priority": st.integers(0, 2),
            "gap_ms": st.sampled_from([0.0, 0.0, 0.2, 1.0]),
            "timeout_ms": st.one_of(st.none(), st.floats(1.0, 15.0)),
            "cancel_ms": st.one_of(st.none(), st.none(), st.floats(0.0, 5.0)),
            "poison": st.booleans(),
        }
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_batch=st.integers(1, 8),
    delay_ms=st.sampled_from([0.0, 0.5, 3.0]),
    preferred=st.lists(st.integers(1, 8), max_size=2, unique=True),
    instances=st.integers(1, 3),
    queue_size=st.integers(4, 80),
    work_s=st.sampled_from([0.0, 0.0005, 0.002]),
    requests=REQUESTS,
)
def test_batcher_invariants(
    max_batch: int,
    delay_ms: float,
    preferred: list[int],
    instances: int,
    queue_size: int,
    work_s: float,
    requests: list[dict[str, Any]],
) -> None:
    """No request lost or answered twice; no batch over the maximum; every answer is the caller's own, in order;
    one poison image fails alone; FIFO within a priority level."""
    loop_errors: list[Any] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        rts = [LoggingFake(delay_s=work_s, fault=poison_fault) for _ in range(instances)]
        config = BatcherConfig(
            max_batch_size=max_batch,
            max_queue_delay_ms=delay_ms,
            preferred_batch_sizes=tuple(p for p in preferred if p <= max_batch),
            max_queue_size=queue_size,
        )
        batcher = Batcher(rts, config)
        next_id = 0
        tasks: list[tuple[dict[str, Any], list[int], asyncio.Task[Any]]] = []
        resolutions: dict[int, int] = {}
        for spec in requests:
            ids = list(range(next_id, next_id + spec["size"]))
            next_id += spec["size"]
            poison = {ids[len(ids) // 2]} if spec["poison"] else set()
            req = request(ids, priority=spec["priority"], timeout_ms=spec["timeout_ms"], poison=poison)
            task = asyncio.create_task(batcher.submit(req))
            key = ids[0]
            task.add_done_callback(lambda _t, k=key: resolutions.__setitem__(k, resolutions.get(k, 0) + 1))
            tasks.append(({**spec, "poison_ids": poison}, ids, task))
            if spec["cancel_ms"] is not None:
                asyncio.get_running_loop().call_later(spec["cancel_ms"] / 1000, task.cancel)
            if spec["gap_ms"]:
                await asyncio.sleep(spec["gap_ms"] / 1000)
        outcomes = await asyncio.wait_for(asyncio.gather(*(t for _, _, t in tasks), return_exceptions=True), 30)
        await batcher.close(timeout_s=5)

        for (spec, ids, _task), outcome in zip(tasks, outcomes, strict=True):
            assert resolutions[ids[0]] == 1  # resolved exactly once
            if isinstance(outcome, BaseException):
                allowed = (OverloadedError, DeadlineExceededError, CancelledError, asyncio.CancelledError)
                assert isinstance(outcome, allowed), repr(outcome)
                if isinstance(outcome, DeadlineExceededError):
                    assert spec["timeout_ms"] is not None
                if isinstance(outcome, asyncio.CancelledError):
                    assert spec["cancel_ms"] is not None
                continue
            for row, image_id in enumerate(ids):
                if image_id in spec["poison_ids"]:
                    assert isinstance(outcome.errors[row], RuntimeFailure)
                else:
                    assert outcome.errors[row] is None
                    assert ident(outcome.logits[row].astype(np.uint8)) == image_id  # the caller's own, in order
        sizes = [len(b) for rt in rts for b in rt.log]
        assert max(sizes, default=0) <= max_batch
        if instances == 1:  # execution order is formation order: FIFO within each priority level
            first_seen: list[int] = []
            for b in rts[0].log:
                first_seen += [i for i in b if i not in first_seen]
            priority_of = {i: spec["priority"] for spec, ids, _ in tasks for i in ids}
            for level in {0, 1, 2}:
                seq = [i for i in first_seen if priority_of[i] == level]
                assert seq == sorted(seq)
        assert batcher.queue_depth == 0 and batcher.inflight_batches == 0

    asyncio.run(scenario())
    assert not loop_errors, loop_errors


def test_runtime_calls_stay_on_one_worker_thread() -> None:
    threads: set[int] = set()

    class ThreadFake(FakeRuntime):
        def _forward(self, batch: np.ndarray) -> np.ndarray:
            threads.add(threading.get_ident())
            return super()._forward(batch)

    async def scenario() -> None:
        batcher = Batcher([ThreadFake(SPEC)], BatcherConfig(max_batch_size=4, max_queue_delay_ms=0))
        await asyncio.gather(*(batcher.submit(request([i])) for i in range(30)))
        await batcher.close()

    run(scenario())
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_stuck_instance_is_abandoned_its_batch_fails_and_queued_work_waits_for_the_replacement() -> None:
    from service.core.config import Faults
    from service.core.errors import InstanceStuckError
    from service.runtime import FaultPlan

    async def scenario() -> None:
        plan = FaultPlan(Faults(hang_at_batch=0))
        wedged = LoggingFake()
        wedged.faults = plan
        spare = LoggingFake()
        changes: list[tuple[int, int]] = []
        replaced: list[Any] = []

        async def replace(instance: Any, error: Exception) -> list[Any]:
            replaced.append(instance)
            await asyncio.sleep(0.2)  # a replacement takes a while to load
            return [spare]

        def changed() -> None:
            changes.append((len(batcher.instances), batcher.replacing))

        config = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0, stuck_after_s=0.3)
        batcher = Batcher([wedged], config, on_instance_stuck=replace, on_state_change=changed)
        first = asyncio.create_task(batcher.submit(request([1])))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(batcher.submit(request([2])))  # queued behind the hung batch
        stuck = (await first).errors[0]
        assert isinstance(stuck, InstanceStuckError) and "gave no answer in 0.3 s" in str(stuck)
        assert replaced == [wedged] and batcher.replacing == 1 and batcher.instances == []
        third = asyncio.create_task(batcher.submit(request([3])))  # accepted while the replacement loads
        results = await asyncio.gather(second, third)
        assert [ident(r.logits[0].astype(np.uint8)) for r in results] == [2, 3]
        assert changes == [(0, 1), (1, 0)]  # not ready while replacing, then ready
        assert batcher.stuck_total == 1 and batcher.instances == [spare]
        plan.release()
        await batcher.close()

    run(scenario())


def test_batches_that_all_fail_make_the_model_unhealthy_until_one_succeeds() -> None:
    async def scenario() -> None:
        failing = {"on": True}
        rt = LoggingFake(fault=lambda batch: RuntimeFailure("broken") if failing["on"] else None)
        changes: list[bool] = []
        batcher = Batcher(
            [rt], BatcherConfig(max_batch_size=4, max_queue_delay_ms=0, unhealthy_after_failed_batches=2),
            on_state_change=lambda: changes.append(batcher.healthy),
        )  # fmt: skip
        for i in range(2):
            result = await batcher.submit(request([i]))
            assert isinstance(result.errors[0], RuntimeFailure)
        assert not batcher.healthy and batcher.last_failure is not None and "broken" in batcher.last_failure
        failing["on"] = False
        result = await batcher.submit(request([9]))
        assert result.errors == [None] and batcher.healthy
        assert changes == [False, True]
        await batcher.close()

    run(scenario())


def test_a_replacement_that_never_loads_fails_the_model_instead_of_waiting_for_ever() -> None:
    from service.core.config import Faults
    from service.core.errors import DeviceFailure
    from service.runtime import FaultPlan

    async def scenario() -> None:
        plan = FaultPlan(Faults(hang_at_batch=0))
        wedged = LoggingFake()
        wedged.faults = plan

        async def never(instance: Any, error: Exception) -> list[Any]:
            await asyncio.sleep(30)  # the device is wedged too
            return []

        config = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0, stuck_after_s=0.2, replace_timeout_s=0.3)
        batcher = Batcher([wedged], config, on_instance_stuck=never)
        first = asyncio.create_task(batcher.submit(request([1])))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(DeviceFailure, match="no working instance left"):
            await batcher.submit(request([2]))  # queued behind the hang, then failed with the model
        assert time.monotonic() - started < 2
        assert (await first).errors[0] is not None
        assert batcher.instances == [] and batcher.replacing == 0
        with pytest.raises(DeviceFailure):
            await batcher.submit(request([3]))  # refused at once now
        plan.release()
        await batcher.close()

    run(scenario())


# ---- the batch policies: pure decisions, driven with numbers (no event loop) ----------------------------------


def adaptive(costs: dict[int, float], gap_s: float | None, delay_ms: float = 2.0) -> AdaptivePolicy:
    return AdaptivePolicy(max_batch_size=8, max_queue_delay_ms=delay_ms, costs=CostModel(costs, gap_s))


def test_adaptive_never_waits_where_a_batch_costs_the_same_per_image() -> None:
    cpu = adaptive({1: 0.010, 4: 0.040}, gap_s=0.001)  # a CPU: 10 ms an image at any batch size
    assert all(cpu.dispatch_now(n) for n in range(1, 8))
    assert cpu.wait_s(1, oldest_wait_s=0.0) == 0.0


def test_adaptive_waits_where_batching_is_nearly_free_and_images_come_fast() -> None:
    gpu = {1: 0.020, 8: 0.021}  # a GPU: eight images cost about what one does
    assert not adaptive(gpu, gap_s=0.001).dispatch_now(1)  # the next image is due in 1 ms: worth it
    assert adaptive(gpu, gap_s=0.050).dispatch_now(1)  # due in 50 ms, after the batch would be done: go now


def test_adaptive_waits_never_past_the_delay() -> None:
    gpu = adaptive({1: 0.020, 8: 0.021}, gap_s=0.001, delay_ms=10.0)
    assert gpu.wait_s(1, oldest_wait_s=0.004) == pytest.approx(0.006)  # what is left of the oldest image's delay
    assert gpu.wait_s(1, oldest_wait_s=0.010) == 0.0
    assert gpu.wait_s(8, oldest_wait_s=0.0) == 0.0  # a full batch goes at once


def test_adaptive_dispatches_until_it_has_figures() -> None:
    assert adaptive({}, gap_s=0.001).dispatch_now(1)
    assert adaptive({1: 0.02}, gap_s=None).dispatch_now(1)


def test_adaptive_costs_between_and_beyond_measured_sizes() -> None:
    costs = CostModel({1: 0.010, 4: 0.016, 8: 0.024})
    assert costs.cost(2) == pytest.approx(0.012) and costs.cost(16) == pytest.approx(0.040)
    assert CostModel({2: 0.010}).cost(4) == pytest.approx(0.020)  # one size seen: per image
    assert CostModel().cost(1) is None


def test_the_cost_model_learns_moving_averages_from_what_it_observes() -> None:
    costs = CostModel()
    costs.observe_arrival(0.0)
    assert costs.gap_s is None  # one arrival is no gap yet
    costs.observe_arrival(0.010)
    costs.observe_arrival(0.030)
    assert costs.gap_s == pytest.approx(0.010 + SMOOTHING * (0.020 - 0.010))
    costs.observe_batch(4, 0.010)
    costs.observe_batch(4, 0.020)
    assert costs.costs == {4: pytest.approx(0.010 + SMOOTHING * 0.010)}


def test_the_adaptive_policy_learns_to_wait_from_the_batches_it_sees() -> None:
    """Fed a GPU's costs and fast arrivals, it holds a lone image; fed a CPU's, it lets it go."""
    for costs, waits in (({1: 0.020, 8: 0.021}, True), ({1: 0.010, 8: 0.080}, False)):
        policy = make_policy("adaptive", max_batch_size=8, max_queue_delay_ms=10.0)
        assert policy.wait_s(1, oldest_wait_s=0.0) == 0.0  # no figures yet: go
        for t in (0.0, 0.001, 0.002):
            policy.observe_arrival(t)
        for size, seconds in costs.items():
            policy.observe_batch(size, seconds)
        assert (policy.wait_s(1, oldest_wait_s=0.0) > 0) is waits


def test_with_a_backlog_the_adaptive_batch_stops_at_the_knee_of_the_measured_costs() -> None:
    """The batch it forms from a backlog of 30, given measured costs: where each image costs the same (a CPU) the
    batch is the smallest whose cost per image is within KNEE_SLACK of the best; where images come nearly free (a
    GPU), the maximum; the delay policy takes the maximum either way."""
    cpu = {1: 0.012, 8: 0.082, 32: 0.322}  # 2 ms a batch + 10 ms an image
    policy = AdaptivePolicy(max_batch_size=32, max_queue_delay_ms=10.0, costs=CostModel(cpu, 0.001))
    knee = next(n for n in range(1, 33) if (0.002 / n + 0.010) <= (0.002 / 32 + 0.010) * (1 + KNEE_SLACK))
    assert knee == 4 and policy.costs.knee(32) == knee
    assert policy.batch_size(30) == knee
    gpu = {1: 0.005, 8: 0.006, 32: 0.010}
    on_gpu = AdaptivePolicy(max_batch_size=32, max_queue_delay_ms=10.0, costs=CostModel(gpu, 0.001))
    assert on_gpu.costs.knee(32) == 29 and on_gpu.batch_size(40) == 29  # (6 + 4 * 21/24) / 29 within 5% of 10 / 32
    assert DelayPolicy(max_batch_size=32, max_queue_delay_ms=10.0).batch_size(30) == 32


def test_the_knee_waits_for_two_measured_sizes() -> None:
    """One size alone says nothing of how the cost grows: the batch is the delay policy's until a second size is
    measured (else a first lone image, read as a per-image cost, would keep every batch at one)."""
    policy = make_policy("adaptive", max_batch_size=8, max_queue_delay_ms=10.0)
    assert policy.batch_size(20) == 8  # no figures
    policy.observe_batch(1, 0.060)
    assert policy.batch_size(20) == 8  # one size: a GPU's 60 ms at 1 or a CPU's 60 ms an image, unknown yet
    policy.observe_batch(8, 0.061)  # a GPU: the maximum stays the batch
    assert policy.batch_size(20) == 8
    cpu = make_policy("adaptive", max_batch_size=8, max_queue_delay_ms=10.0)
    cpu.observe_batch(1, 0.060)
    cpu.observe_batch(8, 0.480)  # 60 ms an image: one at a time loses nothing
    assert cpu.batch_size(20) == 1


def test_one_slow_batch_above_the_knee_does_not_hold_the_knee_down_for_ever() -> None:
    """A batch of 2 measured once at 3.4x the cost per image (a preempted forward) puts the knee at 1; one in
    EXPLORE_EVERY of the batches cut to it still takes 2, and once 2 is measured at its true cost the knee is 2."""
    policy = AdaptivePolicy(max_batch_size=8, max_queue_delay_ms=2.0, costs=CostModel({1: 0.0154, 2: 0.1038}))
    assert policy.costs.knee(8) == 1
    sizes = [policy.batch_size(10) for _ in range(2 * EXPLORE_EVERY)]
    assert sizes.count(2) == 2 and sizes.count(1) == 2 * EXPLORE_EVERY - 2
    assert policy.batch_size(1) == 8  # nothing to cut with one image queued (the batch takes what there is)
    for _ in range(40):  # explored batches of 2, at 14 ms an image
        policy.observe_batch(2, 0.028)
    knee = policy.costs.knee(8)
    assert knee is not None and knee >= 2 and policy.batch_size(10) == knee


def test_the_delay_policy_counts_from_the_oldest_image_and_prefers_preferred_sizes() -> None:
    policy = DelayPolicy(max_batch_size=8, max_queue_delay_ms=10.0, preferred_batch_sizes=(4, 6, 16))
    assert policy.wait_s(1, oldest_wait_s=0.003) == pytest.approx(0.007)
    assert policy.wait_s(3, oldest_wait_s=0.012) == 0.0  # the delay ran out
    assert policy.wait_s(4, oldest_wait_s=0.0) == 0.0  # a preferred size goes at once
    assert [policy.batch_size(n) for n in (3, 5, 7, 9)] == [8, 4, 6, 8]  # 16 is over the maximum: ignored
    # only the first image (it starts the delay) and reaching a dispatching size wake the dispatcher
    assert (policy.wakes(0, 1), policy.wakes(1, 2), policy.wakes(3, 4)) == (True, False, True)


def test_an_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="delay, adaptive, got 'eager'"):
        make_policy("eager", max_batch_size=8, max_queue_delay_ms=2.0)


@pytest.mark.parametrize("policy", ["delay", "adaptive"])
def test_a_lone_image_waits_out_the_delay_only_under_the_delay_policy(policy: str) -> None:
    """The setting is not ignored: a lone image with an idle instance waits the whole max_queue_delay_ms under
    Triton's policy; under the adaptive one, with a CPU-like runtime measured, it goes at once."""
    delay_ms = 2000.0

    async def scenario() -> float:
        fake = LoggingFake()
        config = BatcherConfig(policy=policy, max_batch_size=8, max_queue_delay_ms=delay_ms)
        measured = adaptive({1: 0.010, 8: 0.080}, gap_s=0.001, delay_ms=delay_ms) if policy == "adaptive" else None
        batcher = Batcher([fake], config, policy=measured)
        sent = time.monotonic()
        await batcher.submit(request([1]))
        await batcher.close()
        return fake.spans[0][0] - sent

    started_after_s = asyncio.run(scenario())
    if policy == "delay":
        assert started_after_s >= delay_ms / 1000 * 0.99
    else:
        assert started_after_s < delay_ms / 1000 / 2
