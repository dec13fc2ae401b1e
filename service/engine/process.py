"""One engine process: ``python -m service.engine.process`` with its launch record in the environment.

It loads and warms up every model for its device, and only then binds its endpoint, so a front end that can
connect can be served. SIGTERM: refuse new work, finish what is queued within the drain timeout, exit 0. SIGINT is
ignored: Ctrl-C goes to the supervisor, which stops the front ends first and this engine last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import time

import msgspec

from service.core.lifetime import die_with_parent
from service.core.settings import ServerSettings
from service.engine.server import EngineServer
from service.runtime import Runtime
from service.transport.server import EngineEndpoint

log = logging.getLogger("visionserve.engine")
LAUNCH_ENV = "VISIONSERVE_ENGINE"
LOAD_FAILED_EXIT = 3  # the engine's status when loading the repository raised (the supervisor prints it)


class EngineLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What the supervisor hands an engine."""

    settings: ServerSettings
    name: str
    endpoint: str
    gpus: list[str] | None = None  # None: every usable GPU, or the CPU
    primary: bool = True  # the engine that renders the front ends' request metrics
    log_level: str = "warning"


async def run_engine(launch: EngineLaunch) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    endpoint = EngineEndpoint(launch.endpoint, launch.name)
    server = EngineServer(launch.settings, endpoint, gpus=launch.gpus, primary=launch.primary)
    started = time.perf_counter()
    loading = loop.create_task(server.load_all())
    await asyncio.wait([loading, loop.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set() and not loading.done():
        log.warning("engine %s: stopped while loading", launch.name)
        loading.cancel()
        return
    if loading.exception() is not None:
        # Loading stopped half way (not one model failing, which is recorded per model): never serve what happened
        # to load before it. Exit non-zero; the supervisor reports it and restarts this engine with a backoff.
        log.critical("engine %s: loading the repository failed", launch.name, exc_info=loading.exception())
        raise SystemExit(LOAD_FAILED_EXIT)
    await endpoint.start(server)
    log.info("engine %s serving after %.1f s", launch.name, time.perf_counter() - started)
    await stop.wait()
    log.warning("engine %s: draining (up to %.1f s), then exiting", launch.name, launch.settings.drain_timeout_s)
    await server.drain()
    await endpoint.close()
    if Runtime.abandoned:
        # A stuck instance's worker thread may never return, and the interpreter joins every executor thread at
        # exit: leave without waiting for it (everything this process owes was answered above). Counted per
        # process, so that instances of models since unloaded or reloaded count too.
        log.warning("engine %s: exiting past %d abandoned instance(s)", launch.name, Runtime.abandoned)
        logging.shutdown()
        os._exit(0)


def main() -> None:
    launch = msgspec.json.decode(os.environ[LAUNCH_ENV], type=EngineLaunch)
    logging.basicConfig(
        level=getattr(logging, launch.log_level.upper()),
        format=f"%(asctime)s %(levelname)s %(name)s[{launch.name}]: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    if importlib.util.find_spec("uvloop"):
        import uvloop

        uvloop.run(run_engine(launch))
    else:
        asyncio.run(run_engine(launch))


if __name__ == "__main__":
    main()
