"""Server-wide settings (``visionserve serve`` flags); per-model settings live in each model's config.toml."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from service.core.errors import ConfigError

MiB, KiB = 1024 * 1024, 1024


def flag(help: str, *, name: str = "", unit: int = 1, choices: tuple[str, ...] = ()) -> msgspec.Meta:
    """A setting's ``visionserve serve`` flag, declared on the field itself: its help, its name when it is not the
    field's (``--max-body-mb`` for ``max_body_bytes``), the unit the flag counts in (bytes per MiB) and its choices.
    The default is the field's own: the flag, the help and the settings cannot disagree (service/commands.py)."""
    return msgspec.Meta(description=help, extra={"flag": name, "unit": unit, "choices": choices})


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Server-wide settings; each field with its flag (:func:`flag`), in ``visionserve serve --help``'s order."""

    repository: Annotated[str, flag("model repository folder")] = "model_repository"
    host: Annotated[str, flag("address to bind")] = "127.0.0.1"
    port: Annotated[int, flag("port to bind (0: any free port)")] = 8000
    grpc_port: Annotated[int, flag("gRPC (Open Inference Protocol) port; 0: no gRPC")] = 8001
    engine_timeout_s: Annotated[float, flag("a request the engine has not answered by then is a 504")] = 120.0
    admin_token: Annotated[str | None, flag("enables /v2/repository/* for 'Authorization: Bearer TOKEN'")] = None
    max_body_bytes: Annotated[int, flag("largest request body (MiB)", name="--max-body-mb", unit=MiB)] = 64 * MiB
    max_images_per_request: Annotated[int, flag("most images in one request", name="--max-images")] = 64
    max_pixels: Annotated[int, flag("most pixels in one image")] = 40_000_000
    large_image_pixels: Annotated[
        int,
        flag(
            "images that decode to more pixels than this are decoded in a lane of their own (half the decode "
            "workers, a short bounded queue, 503 past it), so that they never hold up small ones"
        ),
    ] = 4_000_000
    decode_workers: Annotated[
        int | None, flag("decoding threads per model version in each front end; default: one per core")
    ] = None
    drain_timeout_s: Annotated[float, flag("how long SIGTERM waits for queued work")] = 10.0
    # Slow and hostile clients (service/frontend/http/connection.py): a 431 or a 408, as each flag's help says.
    max_header_bytes: Annotated[
        int, flag("largest request head (request line and headers), KiB; 431", name="--max-header-kb", unit=KiB)
    ] = 64 * KiB
    header_timeout_s: Annotated[
        float,
        flag("a request head must arrive within this of the connection opening or the request starting; else 408"),
    ] = 10.0
    stream_send_timeout_s: Annotated[
        float, flag("a stream's answer its client has not taken within this: the client is cut off (close 1008)")
    ] = 10.0
    body_timeout_s: Annotated[
        float, flag("a request body that stalls this long, or is slower than --min-body-bytes-per-s after it, is a 408")
    ] = 10.0
    min_body_bytes_per_s: Annotated[
        int, flag("slowest average a request body may arrive at once --body-timeout-s has passed (0: no minimum)")
    ] = 1024
    log_format: Annotated[
        Literal["text", "json"], flag("json: one access-log line per request", choices=("text", "json"))
    ] = "text"
    metrics: Annotated[bool, flag("turn /metrics and its recording off", name="--no-metrics")] = True
    # Many models per device (service/engine/ondemand.py).
    memory_budget: Annotated[
        str,
        flag(
            "memory for models per device: 2GB for each, or cpu=8GB,cuda:0=60GB; empty: 70% of the machine's "
            'memory, 90% of each GPU\'s (models with residency = "on_demand" are loaded and evicted within it)'
        ),
    ] = ""
    min_residency_s: Annotated[float, flag("a model loaded more recently is not evicted (churn guard)")] = 1.0
    max_parallel_loads: Annotated[int, flag("on-demand loads of different models at once")] = 2
    cold_start_limit_s: Annotated[float, flag("longest a request waits for its model's load")] = 60.0
    # Sources the server pulls (docs/sources.md): admin-only; files only under source_root.
    source_root: Annotated[
        str | None, flag("file:// sources may be read only under this folder (none: no file sources)")
    ] = None
    sources: Annotated[str | None, flag("a JSON file of sources to start with the server (a list of POST bodies)")] = (
        None
    )
    max_sources: Annotated[int, flag("most sources running at once")] = 32
    state_dir: Annotated[
        str | None,
        flag(
            "where the server keeps its state (the sources it runs, in sources.db, mode 0600: it holds their URLs); "
            "none: <repository>/.visionserve-state"
        ),
    ] = None
    source_connect_timeout_s: Annotated[float, flag("a source's connect timeout")] = 5.0
    source_read_timeout_s: Annotated[float, flag("a source that sends nothing this long has dropped")] = 5.0
    source_max_pixels: Annotated[int, flag("most pixels in a source's frame (the source fails past it)")] = 3840 * 2160
    strict_readiness: Annotated[
        bool,
        flag(
            "/v2/health/ready stays false while any model version of the repository failed to load (Triton's "
            "name); off: ready once the engines serve what did load"
        ),
    ] = False

    def __post_init__(self) -> None:
        positive = (
            "max_body_bytes max_images_per_request max_pixels max_header_bytes large_image_pixels decode_workers "
            "source_max_pixels max_parallel_loads"
        )
        for name in positive.split():
            if (value := getattr(self, name)) is not None and value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value}")
        for name in ("engine_timeout_s", "header_timeout_s", "body_timeout_s", "stream_send_timeout_s",
                     "source_connect_timeout_s", "source_read_timeout_s", "cold_start_limit_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_body_bytes_per_s", "drain_timeout_s", "max_sources", "min_residency_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name, note in (("port", ""), ("grpc_port", " (0: no gRPC)")):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be between 0 and 65535{note}, got {getattr(self, name)}")
        if self.grpc_port and self.grpc_port == self.port:
            raise ConfigError(f"grpc_port and port must differ, both are {self.port}")
        from service.core.preprocess import pil_max_pixels  # PIL only once settings are checked

        if self.max_pixels > pil_max_pixels():
            raise ConfigError(f"max_pixels must be at most {pil_max_pixels()} (PIL's own limit), got {self.max_pixels}")
        parse_budget(self.memory_budget)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?)B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``2GB``, ``512MB``, ``4096`` (decimal), ``1.5GiB`` (binary)."""
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"a memory size must look like 2GB, 512MiB or 4096 (bytes), got {text!r}")
    number, prefix, binary = float(match.group(1)), (match.group(2) or "").upper(), bool(match.group(3))
    power = "KMGT".index(prefix) + 1 if prefix else 0
    return int(number * (1024 if binary else 1000) ** power)


def parse_budget(text: str | None) -> dict[str, int]:
    """``--memory-budget``: one size for every device (``2GB``), or per device (``cpu=8GB,cuda:0=60GB``, where
    ``cuda`` alone stands for every GPU). Empty: the defaults."""
    if not text:
        return {}
    if "=" not in text:
        return {"*": parse_size(text)}
    out: dict[str, int] = {}
    for part in text.split(","):
        device, _, size = part.partition("=")
        device = device.strip()
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device) or not size:
            raise ConfigError(f"--memory-budget: expected DEVICE=SIZE (cpu=8GB, cuda:0=60GB), got {part!r}")
        out[device] = parse_size(size)
    return out
