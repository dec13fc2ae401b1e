"""One model's rollout as a record (:class:`Rollout`: its versions, settings, comparison and decision), what the
rollout route shows of it, and its state file, ``<model>/rollout.json``, which lets a decision outlive a restart.
The engine's side of rollouts (routing, comparing, deciding) is :mod:`service.engine.rollout`."""

from __future__ import annotations

import json
import logging
import os
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from service.core.comparison import Comparison
from service.core.config import RolloutConfig, parse_config
from service.core.errors import BadInputError, ConfigError

log = logging.getLogger("visionserve.rollout")

STATE_FILE = "rollout.json"
_EFFECTIVE_SMOOTHING = 0.05  # weight of the newest sample in the effective fraction's moving average


@dataclass(eq=False)
class Rollout:
    """One model's rollout: its versions, settings, comparison and decision."""

    model: str
    primary: int
    candidate: int
    config: RolloutConfig
    comparison: Comparison
    state: str = "running"
    reason: str = ""
    started_unix: float = field(default_factory=time.time)
    decided_unix: float | None = None
    verdict: str = "wait"
    verdict_reason: str = "no samples yet"
    done_share: float = 1.0  # moving average of sampled requests whose comparison was not shed

    @property
    def running(self) -> bool:
        return self.state == "running"

    def arms(self, route: str) -> tuple[int, int | None]:
        """(the version that answers, the version computed beside it for the comparison, or None)."""
        cfg = self.config
        if cfg.mode == "canary":
            draw = zlib.crc32(route.encode()) / 2**32 if route and cfg.sticky_header else random.random()
            return (self.candidate, self.primary) if draw < cfg.fraction else (self.primary, None)
        return (self.primary, self.candidate) if random.random() < cfg.fraction else (self.primary, None)

    def sampled(self, done: bool) -> None:
        self.done_share += _EFFECTIVE_SMOOTHING * ((1.0 if done else 0.0) - self.done_share)

    def document(self) -> dict[str, Any]:
        """What ``GET /v2/models/{m}/rollout`` answers (docs/rollouts.md)."""
        cfg = self.config
        policy = {k: getattr(cfg, k) for k in ("min_samples", "min_agreement", "min_box_f1", "confidence",
                                               "abort_min_samples", "max_latency_ratio", "max_error_rate",
                                               "shadow_timeout_ms")}  # fmt: skip
        return {
            "model": self.model, "state": self.state, "mode": cfg.mode, "primary": self.primary,
            "serving": self.candidate if self.state == "promoted" else self.primary,
            "candidate": self.candidate, "fraction": cfg.fraction,
            "effective_fraction": cfg.fraction * self.done_share if self.running else 0.0,
            "sticky_header": cfg.sticky_header, "auto": cfg.auto, "reason": self.reason,
            "started_unix": self.started_unix, "decided_unix": self.decided_unix,
            "verdict": self.verdict, "verdict_reason": self.verdict_reason, "policy": policy,
            "comparison": self.comparison.summary(),
        }  # fmt: skip


def write_state(rollout: Rollout, model_dir: Path) -> None:
    """Write ``rollout``'s record into its model's folder (atomically); a read-only repository is logged."""
    record = {
        "model": rollout.model, "state": rollout.state, "primary": rollout.primary,
        "candidate": rollout.candidate, "config": msgspec.to_builtins(rollout.config),
        "reason": rollout.reason, "started_unix": rollout.started_unix, "decided_unix": rollout.decided_unix,
        "comparison": rollout.comparison.summary() if not rollout.running else None,
    }  # fmt: skip
    path = model_dir / STATE_FILE
    try:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only repository still rolls out; the decision lasts until a restart
        log.error("model %s: could not write %s (%s): the rollout will not survive a restart", rollout.model,
                  path, exc)  # fmt: skip


def read_state(model_dir: Path) -> dict[str, Any] | None:
    """A model's rollout record (``rollout.json`` in its folder), or None where there is none or it is unreadable."""
    path = model_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        int(record["candidate"]), int(record["primary"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("ignoring %s: %s", path, exc)
        return None
    return record if isinstance(record, dict) else None


def rollout_config(raw: Any, source: str) -> RolloutConfig:
    """A rollout's settings (``[rollout]`` fields) from ``source``, checked; 400 when they are not valid."""
    if not isinstance(raw, dict):
        raise BadInputError(f"a rollout's settings must be a JSON object of [rollout] fields, got {raw!r}")
    try:
        return parse_config({"rollout": raw}, source=source).rollout
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
