"""Server-wide settings (``visionserve serve`` flags); per-model settings live in each model's config.toml."""

from __future__ import annotations

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
        for name in ("header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_body_bytes_per_s < 0:
            raise ConfigError(f"min_body_bytes_per_s must be >= 0, got {self.min_body_bytes_per_s}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
