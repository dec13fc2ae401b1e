"""The Python client of the image API, synchronous and asynchronous, over httpx: ``classify`` for classifiers,
``detect`` for detectors, one path under both (:class:`~service.client.kinds.Kind`: the route and the result type
are all they differ in).

Images go as ``multipart/form-data`` files, several per request, in order; every image gets its own result
(:class:`ImageResult`, :class:`DetectedImage`). A list larger than the server's ``--max-images`` is split: the
client starts from ``max_images_per_request`` and, when the server refuses a request as holding too many images
(413 "... over the limit of N"), it learns N and splits again, so nothing needs configuring to match a server.
Overload answers and dropped connections are retried under a :class:`RetryPolicy`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from service.client.errors import ClientError, error_text
from service.client.images import ImageInput, encode
from service.client.kinds import CLASSIFY, DETECT, SEGMENT, DetectedImage, Kind, R, SegmentedImage, answer_of
from service.client.retry import Attempts, RetryPolicy
from service.core.answers import ImageResult

File = tuple[str, bytes, str]  # (filename, data, media type)
Images = ImageInput | Sequence[ImageInput]  # a list or tuple of images, or one image

# A safe start under any server (its --max-images defaults to 64); a server with a lower limit says so in a 413,
# and the client learns it.
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
_LIMIT_MESSAGE = re.compile(r"images in one request, over the limit of (\d+)")
_Http = TypeVar("_Http", httpx.Client, httpx.AsyncClient)


@dataclass(frozen=True, slots=True)
class _Call(Generic[R]):
    """One ``classify`` or ``detect`` call: what it asks and where (its requests differ only in their images)."""

    kind: Kind[R]
    route: str
    query: dict[str, Any]


class _Base(Generic[_Http]):
    """What the sync and async clients share: building the requests, splitting, and reading answers."""

    _http: _Http

    def __init__(
        self, url: str, model: str | None, version: int | None, retry: RetryPolicy | None, max_images_per_request: int
    ) -> None:
        if max_images_per_request < 1:
            raise ValueError(f"max_images_per_request must be >= 1, got {max_images_per_request}")
        self.url = url.rstrip("/")
        self.model = model
        self.version = version
        self.retry = retry or RetryPolicy()
        self.max_images_per_request = max_images_per_request
        self.requests_sent = 0  # counting every attempt, retries included
        self.retries = 0

    def _call(self, kind: Kind[R], options: dict[str, Any], model: str | None, version: int | None) -> _Call[R]:
        query = kind.query(options)
        model = model or self.model
        if not model:
            raise ValueError(f"no model named: pass model= to the client or to {kind.action}()")
        version = version if version is not None else self.version
        where = f"/v1/models/{quote(model, safe='')}"
        route = where + (f"/versions/{int(version)}" if version is not None else "") + f"/{kind.action}"
        return _Call(kind, route, query)

    def _request(self, call: _Call[Any], files: list[File]) -> httpx.Request:
        """One attempt's request, counted (built again for each attempt: a multipart body is read as it is sent)."""
        self.requests_sent += 1
        return self._http.build_request("POST", call.route, params=call.query, files=[("file", f) for f in files])

    @staticmethod
    def _files(images: Images) -> list[File]:
        many = images if isinstance(images, list | tuple) else [images]
        return [encode(image, i) for i, image in enumerate(many)]

    def _chunks(self, files: list[File]) -> list[list[File]]:
        n = self.max_images_per_request
        return [files[i : i + n] for i in range(0, len(files), n)]

    def _retry_or_raise(self, attempts: Attempts, response: httpx.Response | None, exc: Exception | None) -> float:
        """The wait before trying again, or raise :class:`ClientError` when the policy is spent."""
        retry_after = response.headers.get("retry-after") if response is not None else None
        delay = attempts.next_delay_s(retry_after)
        if delay is not None:
            self.retries += 1
            return delay
        tries = f"{attempts.tried} attempt{'s' if attempts.tried > 1 else ''}"
        if response is not None:
            message = error_text(response.content, response.reason_phrase)
            raise ClientError(
                f"{self.url} answered {response.status_code} ({message}) to each of {tries}",
                status=response.status_code,
                retries=attempts.retries,
            )
        raise ClientError(f"cannot reach {self.url}: {exc} (after {tries})", retries=attempts.retries) from exc

    def _read(self, response: httpx.Response, files: list[File], kind: Kind[R]) -> tuple[list[R], list[list[File]]]:
        """(results, []) from a request's answer, or ([], the smaller requests to send instead of a refused one)."""
        status = response.status_code
        if status == 200:
            try:
                answer = answer_of(response.content, kind)
            except msgspec.DecodeError as exc:
                raise ClientError(f"{self.url} answered 200 with an unexpected body: {exc}", status=200) from exc
            if len(answer.results) != len(files):
                raise ClientError(f"sent {len(files)} images, got {len(answer.results)} results", status=200)
            for result in answer.results:
                result.model, result.version = answer.model, answer.version
            return answer.results, []
        message = error_text(response.content, response.reason_phrase)
        if status == 413 and len(files) > 1:
            found = _LIMIT_MESSAGE.search(message)
            limit = int(found.group(1)) if found else len(files) // 2  # a body too large: halve
            limit = min(limit, len(files) - 1)  # every split makes progress, whatever the message said
            self.max_images_per_request = max(1, min(self.max_images_per_request, limit))
            return [], self._chunks(files)
        if status in (400, 413, 415) and len(files) == 1:  # the one image is the whole request: its own failure
            return [kind.result(error=message, filename=files[0][0])], []
        raise ClientError(f"{self.url} answered {status}: {message}", status=status)


class Client(_Base[httpx.Client]):
    """A blocking client of the image API (README, "Python client")."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        version: int | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
        headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, model, version, retry, max_images_per_request)
        # ``transport`` as httpx takes it: e.g. ``httpx.MockTransport(handler)`` to script a server in a test.
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers, transport=transport)

    def classify(
        self, images: Images, *, model: str | None = None, version: int | None = None, **options: Any
    ) -> list[ImageResult]:
        """One :class:`ImageResult` per image, in order; ``options``: :class:`~service.core.tasks.ClassifyOptions`'s
        (``top_k``). ``images``: paths, bytes of encoded files, PIL images or uint8 numpy arrays (HxW or HxWxC).
        Raises :class:`ClientError` when a request is refused as a whole (an unknown model: 404) or the server
        cannot be reached within the retry policy; an image the server cannot use gets its own ``error``."""
        return self._ask(self._call(CLASSIFY, options, model, version), images)

    def detect(
        self, images: Images, *, model: str | None = None, version: int | None = None, **options: Any
    ) -> list[DetectedImage]:
        """One :class:`DetectedImage` per image, in order, from a detector's ``/detect`` route (README, "Detect
        objects in a folder, or from Python"); ``options``: :class:`~service.core.tasks.DetectOptions`'s, each sent
        only when given. ``images`` and the errors raised as :meth:`classify`'s."""
        return self._ask(self._call(DETECT, options, model, version), images)

    def segment(
        self, images: Images, *, model: str | None = None, version: int | None = None, **options: Any
    ) -> list[SegmentedImage]:
        """One :class:`SegmentedImage` per image, in order, from a segmenter's ``/segment`` route: its ``instances``
        (a detection's fields, ``area`` and ``mask``: COCO's compressed RLE of the full image, or a base64 PNG with
        ``mask_format="png"``). ``options``: :class:`~service.core.tasks.SegmentOptions`'s, as :meth:`detect`'s."""
        return self._ask(self._call(SEGMENT, options, model, version), images)

    def _ask(self, call: _Call[R], images: Images) -> list[R]:
        return [r for chunk in self._chunks(self._files(images)) for r in self._send(call, chunk)]

    def _send(self, call: _Call[R], files: list[File]) -> list[R]:
        results, resend = self._read(self._post(call, files), files, call.kind)
        return results + [r for chunk in resend for r in self._send(call, chunk)]

    def _post(self, call: _Call[Any], files: list[File]) -> httpx.Response:
        attempts = self.retry.start()
        while True:
            try:
                response = self._http.send(self._request(call, files))
            except httpx.TransportError as exc:
                time.sleep(self._retry_or_raise(attempts, None, exc))
                continue
            if response.status_code not in self.retry.statuses:
                return response
            time.sleep(self._retry_or_raise(attempts, response, None))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base[httpx.AsyncClient]):
    """The asyncio client of the image API: the same calls as :class:`Client`, awaited. The requests of one
    :meth:`classify` call go out ``max_concurrency`` at a time."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        version: int | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
        max_concurrency: int = 4,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, model, version, retry, max_images_per_request)
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=max(max_concurrency, 10), max_keepalive_connections=max_concurrency),
            transport=transport,
        )

    async def classify(
        self, images: Images, *, model: str | None = None, version: int | None = None, **options: Any
    ) -> list[ImageResult]:
        """As :meth:`Client.classify`."""
        return await self._ask(self._call(CLASSIFY, options, model, version), images)

    async def detect(
        self, images: Images, *, model: str | None = None, version: int | None = None, **options: Any
    ) -> list[DetectedImage]:
        """As :meth:`Client.detect`."""
        return await self._ask(self._call(DETECT, options, model, version), images)

    async def segment(
        self, images: Images, *, model: str | None = None, version: int | None = None, **options: Any
    ) -> list[SegmentedImage]:
        """As :meth:`Client.segment`."""
        return await self._ask(self._call(SEGMENT, options, model, version), images)

    async def ask(self, kind: Kind[R], images: Images, options: dict[str, Any], **where: Any) -> list[R]:
        """Any task's route (``kind``), with the task's ``options`` (``where``: ``model``, ``version``)."""
        return await self._ask(self._call(kind, options, where.get("model"), where.get("version")), images)

    async def _ask(self, call: _Call[R], images: Images) -> list[R]:
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(chunk: list[File]) -> list[R]:
            async with gate:
                return await self._send(call, chunk)

        done = await asyncio.gather(*(one(chunk) for chunk in self._chunks(self._files(images))))
        return [r for results in done for r in results]

    async def _send(self, call: _Call[R], files: list[File]) -> list[R]:
        results, resend = self._read(await self._post(call, files), files, call.kind)
        return results + [r for chunk in resend for r in await self._send(call, chunk)]

    async def _post(self, call: _Call[Any], files: list[File]) -> httpx.Response:
        attempts = self.retry.start()
        while True:
            try:
                response = await self._http.send(self._request(call, files))
            except httpx.TransportError as exc:
                await asyncio.sleep(self._retry_or_raise(attempts, None, exc))
                continue
            if response.status_code not in self.retry.statuses:
                return response
            await asyncio.sleep(self._retry_or_raise(attempts, response, None))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
