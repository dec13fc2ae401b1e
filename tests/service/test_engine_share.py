"""One device plan for a model across a machine's engines (one engine per GPU): a model pinned to one GPU is served
by that GPU's engine only, and a model on the CPU by the primary engine only. The machine's second GPU is the one
thing missing here, so the list of usable GPUs is given; the engines, the repository and the models are real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import pytest

from service.core.config import ModelConfig
from service.core.settings import ServerSettings
from service.engine import server as engine_server
from service.engine.server import EngineServer, engine_share
from tests.conftest import copy_model

MACHINE = ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(
    ("device", "fallback", "shares"),
    [
        ("cuda:1", "cpu", [None, ["cuda:1"]]),  # pinned: engine 1 alone, never a CPU copy in engine 0
        ("cuda", "cpu", [["cuda:0"], ["cuda:1"]]),  # any GPU: each engine its own
        ("auto", "cpu", [["cuda:0"], ["cuda:1"]]),
        ("cpu", "cpu", [["cuda:0"], None]),  # the CPU: the primary engine alone (its plan says cpu)
        ("cuda:7", "cpu", [["cuda:0"], None]),  # not on this machine: the primary serves it on the CPU, degraded
        ("cuda:7", "none", [["cuda:0"], None]),  # ... or reports why it is not served
    ],
)
def test_each_engine_takes_its_share_of_one_plan(device: str, fallback: str, shares: list[Any]) -> None:
    config = ModelConfig(device=device, fallback=fallback)  # type: ignore[arg-type]
    got = [engine_share(config, [gpu], MACHINE, primary=i == 0) for i, gpu in enumerate(MACHINE)]
    assert got == shares


def test_a_model_pinned_to_the_second_gpu_is_not_served_on_the_cpu_by_the_first_engine(
    digits_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = copy_model(digits_export, tmp_path)
    copy_model(digits_export, repo, as_name="pinned")
    (repo / "pinned" / "config.toml").write_text('device = "cuda:1"\nfallback = "cpu"\n')
    (repo / "digits" / "config.toml").write_text('device = "cpu"\n')
    monkeypatch.setattr(engine_server, "cuda_devices", lambda: list(MACHINE))
    settings = ServerSettings(repository=str(repo), metrics=False)

    class Endpoint:
        name = "engine"
        snapshots: ClassVar[dict[bytes, Any]] = {}

        def send(self, peer: bytes, message: Any) -> None: ...
        def announce(self) -> None: ...
        def live_peer(self, peer: bytes) -> bool: ...
        async def flush(self, timeout_s: float = 0.5) -> None: ...

    first = EngineServer(settings, Endpoint(), gpus=["cuda:0"], primary=True)
    asyncio.run(first.load_all())
    # Before one plan for the machine, engine 0 loaded "pinned" on its CPU, degraded, and took part of its traffic.
    assert set(first.table.models) == {"digits"} and first.table.errors == {}
    assert first.table.models["digits"][1].state().devices == ("cpu",)

    asked: list[tuple[str, list[str] | None]] = []

    def model_engine(version: Any, config: Any, *, available_gpus: list[str] | None = None, **_: Any) -> Any:
        asked.append((version.model, available_gpus))  # the GPU itself cannot load here: record what was asked
        raise engine_server.VisionServeError("no GPU on this machine")

    monkeypatch.setattr(engine_server, "ModelEngine", model_engine)
    second = EngineServer(settings, Endpoint(), gpus=["cuda:1"], primary=False)
    asyncio.run(second.load_all())
    assert asked == [("pinned", ["cuda:1"])]  # the CPU model stays in the primary; the pinned one is asked of cuda:1
    asyncio.run(first.table.models["digits"][1].close())
