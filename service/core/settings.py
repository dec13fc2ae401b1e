"""Server-wide settings (``visionserve serve`` flags); per-model settings live in each model's config.toml."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from service.core.errors import ConfigError


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True):
    repository: str = "model_repository"
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001  # the Open Inference Protocol over gRPC; 0: off
    max_body_bytes: int = 64 * 1024 * 1024
    max_images_per_request: int = 64
    max_pixels: int = 40_000_000
    admin_token: str | None = None
    drain_timeout_s: float = 10.0
    log_format: Literal["text", "json"] = "text"
    decode_workers: int | None = None
    large_image_pixels: int = 4_000_000  # decoded pixels past which an image takes the large-image lane
    metrics: bool = True
    strict_readiness: bool = False  # ready only while every model version of the repository is loaded
    engine_timeout_s: float = 120.0  # a request the engine has not answered by then is a 504 (a wedged engine)
    # Slow and hostile clients (service/frontend/http/connection.py): a request head over max_header_bytes is a 431;
    # a head not complete header_timeout_s after the connection opened or the request began is a 408; a body that
    # stalls for body_timeout_s, or averages under min_body_bytes_per_s after it, is a 408.
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    min_body_bytes_per_s: int = 1024
    stream_send_timeout_s: float = 10.0  # a stream's answer not taken by its client this long: the client is cut off
    # Many models per device (service/engine/ondemand.py): the memory budget per device ("" = 70% of the machine's
    # memory, 90% of each GPU's; "2GB" for every device; "cpu=8GB,cuda:0=60GB"), the youngest a model may be
    # evicted at (the guard against churn), how many loads run at once, and how long a request waits for a load.
    memory_budget: str = ""
    min_residency_s: float = 1.0
    max_parallel_loads: int = 2
    cold_start_limit_s: float = 60.0

    def __post_init__(self) -> None:
        positive = ("max_body_bytes", "max_images_per_request", "max_pixels", "max_header_bytes", "large_image_pixels")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be between 0 and 65535, got {self.port}")
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port must be between 0 and 65535 (0: no gRPC), got {self.grpc_port}")
        if self.grpc_port and self.grpc_port == self.port:
            raise ConfigError(f"grpc_port and port must differ, both are {self.port}")
        if self.engine_timeout_s <= 0:
            raise ConfigError(f"engine_timeout_s must be > 0, got {self.engine_timeout_s}")
        from service.core.preprocess import pil_max_pixels  # PIL only once settings are checked

        if self.max_pixels > pil_max_pixels():
            raise ConfigError(f"max_pixels must be at most {pil_max_pixels()} (PIL's own limit), got {self.max_pixels}")
        for name in ("header_timeout_s", "body_timeout_s", "stream_send_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_body_bytes_per_s < 0:
            raise ConfigError(f"min_body_bytes_per_s must be >= 0, got {self.min_body_bytes_per_s}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        parse_budget(self.memory_budget)
        if self.min_residency_s < 0 or self.cold_start_limit_s <= 0 or self.max_parallel_loads < 1:
            raise ConfigError(
                "min_residency_s must be >= 0, cold_start_limit_s > 0 and max_parallel_loads >= 1, got "
                f"{self.min_residency_s}, {self.cold_start_limit_s} and {self.max_parallel_loads}"
            )


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
