"""The batcher's input as bytes: an :class:`InferRequest` round-trips through MessagePack, uint8 array included.

This is what lets the HTTP/decode side move to other processes later (shared memory for the pixels, these bytes
for the control) without changing the batcher.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from service.batching.batcher import InferRequest


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"dtype": str(obj.dtype), "shape": list(obj.shape), "data": obj.tobytes()}
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray:
        return np.frombuffer(obj["data"], dtype=obj["dtype"]).reshape(obj["shape"])
    raise NotImplementedError(f"cannot decode {type_}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(InferRequest, dec_hook=_dec_hook)


def encode_request(request: InferRequest) -> bytes:
    return _encoder.encode(request)


def decode_request(data: bytes) -> InferRequest:
    return _decoder.decode(data)
