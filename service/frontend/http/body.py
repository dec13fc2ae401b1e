"""Compressed HTTP bodies: requests sent with ``Content-Encoding: gzip`` or ``deflate`` (as tritonclient's
``request_compression_algorithm`` sends them), and answers compressed when the client's ``Accept-Encoding`` asks.

The size limit holds after decompression: a body is inflated in bounded steps and refused (413) as soon as it
would pass ``max_body_bytes``, so a small compressed body that inflates to gigabytes (a compression bomb) costs at
most the limit in memory, never the whole expansion.
"""

from __future__ import annotations

import zlib
from typing import Any

from litestar import Request

from service.core.errors import BadInputError, PayloadTooLargeError, UnsupportedMediaError

# Below this, compressing an answer costs more time than the bytes it saves (a v2 answer of a few logits).
MIN_COMPRESS_BYTES = 1024
_CHUNK = 1 << 20
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decoded per ``Content-Encoding`` (gzip, deflate or identity), refused past ``limit`` bytes."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in _WBITS:
        raise UnsupportedMediaError(f"Content-Encoding {encoding!r} is not taken: send gzip, deflate or identity")
    # "deflate" is the zlib format (RFC 9110), which tritonclient sends; a raw deflate stream is taken too.
    wbits = _WBITS[encoding]
    if encoding == "deflate" and body[:1] and (body[0] & 0x0F) != 8:
        wbits = -zlib.MAX_WBITS
    parts: list[bytes] = []
    size = 0
    rest = body
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            data = inflater.decompress(rest, _CHUNK)
            while True:
                size += len(data)
                if size > limit:
                    raise _too_large(limit, encoding)
                parts.append(data)
                if not inflater.unconsumed_tail:
                    break
                data = inflater.decompress(inflater.unconsumed_tail, _CHUNK)
            tail = inflater.flush()
            size += len(tail)
            if size > limit:
                raise _too_large(limit, encoding)
            if not inflater.eof:
                raise BadInputError(f"request body is not valid {encoding} data: the stream is truncated")
            parts.append(tail)
            rest = inflater.unused_data
            if not rest:
                return b"".join(parts)
            # Whatever follows the end of the stream is never dropped unseen: gzip bodies may be several members
            # (RFC 1952, as `cat a.gz b.gz` or pigz writes them); after a deflate stream it is an error.
            if wbits != _WBITS["gzip"]:
                raise BadInputError(
                    f"request body is not valid {encoding} data: {len(rest)} bytes follow the end of the stream"
                )
    except zlib.error as exc:
        raise BadInputError(f"request body is not valid {encoding} data: {exc}") from exc


def _too_large(limit: int, encoding: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body too large: over {limit} bytes once decompressed ({encoding})")


async def read_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    """The request body, decompressed per its ``Content-Encoding`` within ``limit`` bytes."""
    return inflate(await request.body(), request.headers.get("content-encoding", ""), limit)


def accepted_encoding(request: Request[Any, Any, Any]) -> str | None:
    """gzip or deflate when the client's ``Accept-Encoding`` takes one (gzip first), else None."""
    offered: dict[str, float] = {}
    for part in request.headers.get("accept-encoding", "").lower().split(","):
        name, _, params = part.strip().partition(";")
        q = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                q = float(params[2:])
            except ValueError:
                q = 0.0
        offered[name.strip()] = q
    for name in ("gzip", "deflate"):
        if offered.get(name, offered.get("*", 0.0)) > 0:
            return name
    return None


def compress(data: bytes, encoding: str) -> bytes:
    """``data`` as gzip or deflate (the zlib format, which is what HTTP's "deflate" means)."""
    # Level 1: the answers are mostly float32 logits, which compress little at any level; speed matters more.
    if encoding == "gzip":
        obj = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return obj.compress(data) + obj.flush()
    return zlib.compress(data, 1)
