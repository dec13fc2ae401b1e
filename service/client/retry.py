"""When to try a request again, and how long to wait: one policy for the Python client and ``visionserve classify``.

A request is tried again when the server says it is overloaded (503 or 429: its ``Retry-After`` is honoured, up to
a cap) or when the connection failed or dropped. Waits grow exponentially with jitter, so that many clients turned
away at once do not come back at once. Attempts and total time are both bounded, so a dead server fails a run
in bounded time instead of hanging it. Classifying is a pure function of the image, so sending it twice is safe.
"""

from __future__ import annotations

import random
import time
from email.utils import parsedate_to_datetime

import msgspec

from service.core.errors import ConfigError


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Bounded retries with exponential backoff and jitter.

    ``max_attempts`` counts the first try; ``max_total_s`` bounds the time from the first try to the last retry's
    start. The n-th wait is ``backoff_s * 2**(n-1)`` capped at ``max_backoff_s``, times a random factor in
    [0.5, 1]; a ``Retry-After`` the server sends (seconds or an HTTP date) replaces it, capped at
    ``max_retry_after_s``, plus up to ``backoff_s`` of jitter.
    """

    max_attempts: int = 6
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 30.0
    max_total_s: float = 120.0
    statuses: tuple[int, ...] = (429, 503)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be an integer >= 1, got {self.max_attempts}")
        for name in ("backoff_s", "max_backoff_s", "max_retry_after_s", "max_total_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def delay_s(self, retry: int, retry_after: str | None = None, rng: random.Random | None = None) -> float:
        """The wait before retry number ``retry`` (1 for the first), given the server's ``Retry-After``, if any."""
        uniform = (rng or random).uniform
        asked = parse_retry_after(retry_after)
        if asked is not None:
            return min(asked, self.max_retry_after_s) + uniform(0.0, self.backoff_s)
        return min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1)) * uniform(0.5, 1.0)

    def start(self) -> Attempts:
        """A fresh count of attempts for one request."""
        return Attempts(self)


class Attempts:
    """One request's attempts under a policy: :meth:`next_delay_s` says how long to wait, or None to give up."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.started = time.monotonic()
        self.tried = 1  # the first try is under way
        self.retries = 0

    def next_delay_s(self, retry_after: str | None = None) -> float | None:
        """The wait before the next try, or None when the attempts or the time are spent."""
        if self.tried >= self.policy.max_attempts:
            return None
        delay = self.policy.delay_s(self.tried, retry_after)
        if time.monotonic() - self.started + delay > self.policy.max_total_s:
            return None
        self.tried += 1
        self.retries += 1
        return delay


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date (RFC 9110); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return None if when.tzinfo is None else max(0.0, when.timestamp() - time.time())
