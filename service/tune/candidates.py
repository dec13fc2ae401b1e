"""What ``tune`` chooses between: one serving configuration (a :class:`Candidate`: runtime, batcher, instances and
threads, and the front-end processes, the one setting on ``serve``'s command line, not in the file), the settings'
ranges on a device, and the ``config.toml`` text of a chosen one.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.core.config import ModelConfig, default_config_text, parse_config, toml_value
from service.core.repository import ModelVersion
from service.runtime import choose_backend

Say = Callable[[str], None]  # how tune's phases tell what they do


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One serving configuration of a model on one device."""

    backend: str
    precision: str = "fp32"
    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    preferred_batch_sizes: tuple[int, ...] = ()
    batch_policy: str = "delay"
    instances: int = 1
    threads: int = 0  # 0: the runtime's default (one per core)
    workers: int = 1  # front-end processes (serve --workers)

    @property
    def label(self) -> str:
        """A short, unique, human-readable name."""
        pref = f" pref={','.join(map(str, self.preferred_batch_sizes))}" if self.preferred_batch_sizes else ""
        policy = " adaptive" if self.batch_policy == "adaptive" else ""
        precision = "" if self.precision == "fp32" else f"/{self.precision}"
        return (
            f"{self.backend}{precision} b{self.max_batch_size} d{self.max_queue_delay_ms:g}ms{pref}{policy} "
            f"i{self.instances}x{self.threads or 'auto'}t w{self.workers}"
        )

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


# What a candidate sets of a model's config (besides ``backend``, which a config may leave to "auto").
SETTINGS = ("precision", "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes", "batch_policy", "instances",
            "threads")  # fmt: skip


def candidate_from(config: ModelConfig, version: ModelVersion, device: str, workers: int) -> Candidate:
    """The candidate a model's config (its backend resolved for ``version`` on ``device``) and ``workers`` front
    ends make."""
    backend = choose_backend(version, config, device)
    return Candidate(backend=backend, workers=workers, **{name: getattr(config, name) for name in SETTINGS})


def export_default_config(max_batch_size: int = 32) -> ModelConfig:
    """What ``visionserve export`` writes (the defaults of every setting)."""
    return parse_config(tomllib.loads(default_config_text(max_batch_size)), source="export's default config.toml")


def apply(config: ModelConfig, candidate: Candidate) -> ModelConfig:
    """``config`` with the candidate's settings (device, queue size, timeouts, faults and the rest kept)."""
    return msgspec.structs.replace(config, **{name: getattr(candidate, name) for name in ("backend", *SETTINGS)})


@dataclass(frozen=True)
class Space:
    """The values each setting may take. The first value of each is tried first."""

    max_batch_size: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    max_queue_delay_ms: tuple[float, ...] = (0.0, 1.0, 2.0, 5.0, 10.0)
    preferred: tuple[str, ...] = ("none", "half")  # half: dispatch at once at half the maximum
    batch_policy: tuple[str, ...] = ("delay", "adaptive")
    instances: tuple[int, ...] = (1, 2)
    threads: tuple[int, ...] = (0, 1)
    workers: tuple[int, ...] = (1, 2)
    runtimes: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (backend, precision) measured


def space_for(cores: int, cuda: bool, runtimes: tuple[tuple[str, str], ...], largest_batch: int) -> Space:
    """The settings' ranges on a machine with ``cores`` CPU cores (and a GPU when ``cuda``)."""
    batches = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= largest_batch)
    instances = tuple(sorted({1, 2, *([4] if cuda or cores >= 8 else [])}))
    # Threads per instance matter on the CPU only: the runtime's default (one per core), one, and powers of two
    # between. On CUDA the kernels run on the GPU and one host thread feeds them.
    threads = (0,) if cuda else tuple(sorted({0, *(t for t in (1, 2, 4, 8) if t < cores)}))
    workers = tuple(sorted({1, *(w for w in (2, 4, 8) if w <= max(1, cores))}))
    return Space(max_batch_size=batches or (1,), instances=instances, threads=threads, workers=workers,
                 runtimes=runtimes)  # fmt: skip


def preferred_sizes(kind: str, max_batch_size: int) -> tuple[int, ...]:
    return (max_batch_size // 2,) if kind == "half" and max_batch_size >= 4 else ()


# ---- config.toml text ------------------------------------------------------------------------------------------
_LINE = re.compile(r"^(?P<key>[a-z_]+)(?P<eq>\s*=\s*)(?P<value>\S.*?)(?P<comment>\s+#.*)?$")


def config_text(config: ModelConfig, header: str = "") -> str:
    """``config`` as a complete, commented ``config.toml`` (export's file with each value replaced)."""
    values = msgspec.to_builtins(config)
    tables = {name: values.pop(name) for name in ("faults", "rollout")}  # the [faults] and [rollout] sections
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for line in default_config_text(config.max_batch_size).splitlines():
        match = _LINE.match(line)
        if match and match["key"] in values:
            new = f"{match['key']}{match['eq']}{toml_value(values.pop(match['key']))}"
            line = f"{new:<29} {match['comment'].lstrip()}" if match["comment"] else new
        lines.append(line)
    lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]  # settings export's file does not name
    defaults = msgspec.to_builtins(ModelConfig())
    for name, table in tables.items():
        if table != defaults[name]:
            lines += ["", f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items())]
    text = "\n".join(lines) + "\n"
    if parse_config(tomllib.loads(text), source="tuned config.toml") != config:  # never write what would not load
        raise ValueError("the tuned config.toml does not read back as the configuration it was made from")
    return text
