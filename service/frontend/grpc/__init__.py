"""The Open Inference Protocol over gRPC, served beside HTTP by each front-end process."""

from __future__ import annotations

from service.frontend.grpc.server import GrpcHandle, start_grpc
from service.frontend.grpc.servicer import InferenceServicer, code_of

__all__ = ["GrpcHandle", "InferenceServicer", "code_of", "start_grpc"]
