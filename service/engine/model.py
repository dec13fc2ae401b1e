"""The engine of one model version: devices, runtime instances, warm-up, the batcher, and the CPU fallback. Device
choice is explicit and observable in the state and its note (README, "The engine").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from service.core.config import ModelConfig
from service.core.errors import DeviceFailure, VisionServeError
from service.core.metrics import BatchRecord
from service.core.repository import ModelVersion
from service.core.spec import ModelSpec
from service.core.status import EngineState, State
from service.engine.batcher import Batcher, BatcherConfig, InferRequest, InferResult
from service.runtime import FaultPlan, Runtime, RuntimeLike, choose_backend, make_runtime, warm_up
from service.runtime.factory import cuda_devices, resolve_precision

log = logging.getLogger(__name__)

RuntimeFactory = Callable[[str], RuntimeLike]  # device -> a loaded runtime instance


def plan_devices(config: ModelConfig, available: list[str]) -> tuple[list[str], bool, str | None]:
    """(devices, degraded, note) for ``config.device`` given the usable CUDA devices."""
    wanted = config.device
    if wanted == "cpu":
        return ["cpu"], False, None
    candidates = available if wanted in ("auto", "cuda") else [d for d in available if d == wanted]
    if candidates:
        return candidates, False, None
    if wanted == "auto":
        return ["cpu"], False, "device auto: no usable GPU, serving on CPU"
    reason = f"device {wanted} asked for, but it is not usable (usable GPUs: {available or 'none'})"
    if config.fallback == "none":
        raise DeviceFailure(f"{reason}; fallback = 'none', so the model is not served")
    return ["cpu"], True, f"{reason}: serving on CPU (fallback)"


def home_device(config: ModelConfig, gpus: list[str] | None) -> str:
    """The device a model's memory is charged to: the first it is planned on (``gpus``: this engine's usable
    GPUs, None for every usable one), the CPU where no plan can be made."""
    try:
        return plan_devices(config, gpus if gpus is not None else cuda_devices())[0][0]
    except VisionServeError:
        return "cpu"


def engine_share(config: ModelConfig, mine: list[str], machine: list[str], *, primary: bool) -> list[str] | None:
    """The GPUs this engine offers ``config``'s model, or None when another engine serves it.

    One plan for the machine, taken apart by engine: the model's devices are planned over every usable GPU, and a
    GPU engine takes the planned GPUs that are its own. A model planned on the CPU (by choice, for lack of a GPU,
    or as a fallback) lives in the primary engine alone. So a model pinned to ``cuda:1`` is served by ``cuda:1``'s
    engine only, never on the CPU by engine 0 beside it: the front ends route by catalog, and a CPU copy would
    take part of its traffic. A plan that cannot be made (``fallback = "none"``) is the primary's to report.
    """
    try:
        planned = plan_devices(config, machine)[0]
    except VisionServeError:
        planned = ["cpu"]
    if planned == ["cpu"]:
        return mine if primary else None
    return [g for g in mine if g in planned] or None


def serving_precision(
    config: ModelConfig, devices: tuple[str, ...] | list[str], version: ModelVersion | None = None
) -> str:
    """The precision served: int8 anywhere; fp16 and bf16 only on CUDA (the CPU runs those models in fp32);
    "auto" as it resolves for ``version`` on the first device, where ``version`` is given."""
    if config.precision == "auto" and version is not None and devices:
        return resolve_precision(version, config, devices[0])
    if config.precision == "int8" or any(d.startswith("cuda") for d in devices):
        return config.precision
    return "fp32"


def batcher_config(config: ModelConfig) -> BatcherConfig:
    return BatcherConfig(
        max_batch_size=config.max_batch_size,
        max_queue_delay_ms=config.max_queue_delay_ms,
        policy=config.batch_policy,
        preferred_batch_sizes=config.preferred_batch_sizes,
        max_queue_size=config.max_queue_size,
        default_timeout_ms=config.default_timeout_ms,
        stuck_after_s=config.instance_stuck_after_s,
        unhealthy_after_failed_batches=config.unhealthy_after_failed_batches,
    )


class ModelEngine:
    """One model version being served: its runtime instances behind a batcher, and its state."""

    def __init__(
        self,
        version: ModelVersion,
        config: ModelConfig,
        *,
        factory: RuntimeFactory | None = None,
        available_gpus: list[str] | None = None,
        observer: Callable[[BatchRecord], None] | None = None,
        on_fallback: Callable[[str], None] | None = None,
        on_state_change: Callable[[], None] | None = None,
    ) -> None:
        """Load and warm up every instance (blocking: call it off the event loop). ``on_state_change`` hears of
        every change of :meth:`state` the batcher makes at run time (stuck, replaced, unhealthy, healthy)."""
        self.version = version
        self.config = config
        self.backend = "custom" if factory is not None else choose_backend(version, config)
        self._factory: RuntimeFactory = factory or (lambda device: make_runtime(version, config, self.backend, device))
        gpus = cuda_devices() if available_gpus is None else available_gpus
        devices, degraded, note = plan_devices(config, gpus)
        self._state: State = "DEGRADED" if degraded else "READY"
        self._note = note
        self._fallbacks = 0
        self._on_fallback = on_fallback
        self._devices = tuple(sorted(set(devices)))
        faults = config.faults
        wanted = FaultPlan.wanted(faults) and (not faults.versions or version.version in faults.versions)
        self._faults = FaultPlan(faults) if wanted else None
        if degraded and on_fallback is not None:
            on_fallback("device_unavailable")
        instances = self._start_all(devices)
        self.batcher = Batcher(
            instances,
            batcher_config(config),
            name=f"{version.model}/{version.version}",
            observer=observer,
            on_device_lost=self._device_lost,
            on_instance_stuck=self._instance_stuck,
            on_state_change=on_state_change,
        )

    def _start_all(self, devices: list[str]) -> list[RuntimeLike]:
        """Every instance on every planned device. A GPU whose instance fails to load with a device failure is
        left out, and when none is left the model loads on the CPU, as ``fallback = "cpu"`` promises at run time:
        ``DEGRADED``, with the reason in its state and ``visionserve_fallback_total{reason="load_failed"}``.
        With ``fallback = "none"`` the failure refuses the model."""
        instances: list[RuntimeLike] = []
        failed: list[str] = []
        try:
            for device in devices:
                try:
                    instances += self._start_on(device)
                except DeviceFailure as exc:
                    if not device.startswith("cuda") or self.config.fallback == "none":
                        raise
                    log.error("model %s v%s: %s failed to load: %s", self.version.model, self.version.version,
                              device, exc)  # fmt: skip
                    failed.append(f"{device} failed to load: {exc}")
            if failed:
                if not instances:
                    instances = self._start_on("cpu")
                    failed.append("serving on CPU (fallback)")
                    self._fallbacks += 1
                self._state, self._note = "DEGRADED", "; ".join(failed)
                if self._on_fallback is not None:
                    self._on_fallback("load_failed")
        except BaseException:
            for instance in instances:
                instance.close()
            raise
        return instances

    def _start_on(self, device: str) -> list[RuntimeLike]:
        """The config's instances on ``device``; none left open if one fails."""
        started: list[RuntimeLike] = []
        try:
            for _ in range(self.config.instances):
                started.append(self._start(device))
        except BaseException:
            for instance in started:
                instance.close()
            raise
        return started

    def _start(self, device: str) -> RuntimeLike:
        """A loaded, warmed-up instance on ``device`` (blocking), with the model's injected faults armed."""
        if self._faults is not None:
            self._faults.before_load()
        instance = self._factory(device)
        try:
            if self.config.warmup:
                warm_up(instance, self.config.max_batch_size)
        except BaseException:
            instance.close()
            raise
        if self._faults is not None and isinstance(instance, Runtime):
            instance.faults = self._faults
        return instance

    @property
    def spec(self) -> ModelSpec:
        return self.version.spec

    def state(self) -> EngineState:
        batcher = self.batcher
        devices = tuple(sorted({i.device for i in batcher.instances}))
        state: State = self._state
        note = self._note
        if not devices:
            state = "REPLACING" if batcher.replacing else "FAILED"
            devices = self._devices  # what it is being served on, for labels, while nothing is
            if batcher.replacing:
                note = "a stuck runtime instance is being replaced; requests queue meanwhile"
        elif not batcher.healthy:
            state = "UNHEALTHY"
            note = f"the last {batcher.failed_streak} batches failed every image; last error: {batcher.last_failure}"
        return EngineState(
            state=state,
            backend=self.backend,
            devices=devices,
            precision=self._precision(devices),
            ungated=self.config.precision == "int8" and self.version.int8_ungated,
            note=note,
            fallbacks=self._fallbacks,
            replaced=batcher.stuck_total,
        )

    def _precision(self, devices: tuple[str, ...]) -> str:
        """What the instances really run (an fp32 ONNX graph asked to serve fp16 runs fp32), else what the config
        and devices imply."""
        ran = {p for p in (getattr(i, "precision", None) for i in self.batcher.instances) if isinstance(p, str)}
        return ran.pop() if len(ran) == 1 else serving_precision(self.config, devices, self.version)

    async def _instance_stuck(self, instance: RuntimeLike, error: Exception) -> list[RuntimeLike]:
        """A fresh instance on the stuck one's device (loaded and warmed up off the event loop)."""
        return [await asyncio.get_running_loop().run_in_executor(None, self._start, instance.device)]

    async def _device_lost(self, instance: RuntimeLike, error: Exception) -> list[RuntimeLike]:
        remaining = [i for i in self.batcher.instances if i is not instance]
        self._state = "DEGRADED"
        self._note = f"instance on {instance.device} taken out of service: {error}"
        if self._on_fallback is not None:
            self._on_fallback("device_failed")
        # Other instances (another GPU, or CPU ones) keep serving; a lost CPU instance has nothing to fall back to.
        if remaining or self.config.fallback == "none" or instance.device == "cpu":
            return []
        self._fallbacks += 1
        self._note += "; serving on CPU (fallback)"
        return await asyncio.get_running_loop().run_in_executor(None, self._start_on, "cpu")

    async def submit(self, request: InferRequest) -> InferResult:
        return await self.batcher.submit(request)

    async def close(self, timeout_s: float = 30.0) -> None:
        if self._faults is not None:
            self._faults.release()  # an injected hang ends with the model (a real one would not: see process.py)
        await self.batcher.close(timeout_s)
