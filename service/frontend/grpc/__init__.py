"""The Open Inference Protocol over gRPC, served beside HTTP by each front-end process."""

from __future__ import annotations

from service.frontend.grpc.servicer import InferenceServicer, code_of, start_grpc

__all__ = ["InferenceServicer", "code_of", "start_grpc"]
