"""A model's serving settings: ``<repository>/<model>/config.toml``. Every field is optional.

Bad values are refused at startup with a message that names the file, the field and the value, e.g.
``max_batch_size must be an integer >= 1, got 0 (model_repository/digits/config.toml)``.
"""

from __future__ import annotations

import json
import re
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from service.core.errors import ConfigError

CONFIG_FILE = "config.toml"
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class Faults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Faults injected into a model's runtime, for drills and the reliability tests (``[faults]``; all off by
    default). Batches are counted per model version from the end of warm-up, across its instances."""

    delay_ms: float = 0.0  # added to every batch, on the runtime's worker thread (fixes a model's capacity)
    image_delay_ms: float = 0.0  # added per image of every batch (a cost that grows with the batch, as on a CPU)
    hang_at_batch: int = -1  # that batch (0 = the first) never returns: a wedged forward
    fail_after_batches: int = -1  # every batch from that one on raises
    load_delay_ms: float = 0.0  # added to loading each instance (a slow load, or a slow replacement)
    load_error: str = ""  # loading each instance raises a RuntimeError with this message (a runtime's own exception)
    resident_bytes: int = 0  # charged to the memory budget in place of the measured size (a model this big); 0: off
    versions: tuple[int, ...] = ()  # the versions faulted (a failing candidate beside a sound one); (): all
    noop: bool = False  # served by a runtime that does no model work (nonsense answers): the server's own capacity


class RolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A candidate version on trial beside the serving one (``[rollout]``, docs/rollouts.md)."""

    candidate: int = 0
    mode: Literal["shadow", "canary"] = "shadow"
    fraction: float = 0.1  # of the requests that do not name a version
    sticky_header: str = ""  # canary: route by a hash of this request header's value ("": at random)
    auto: bool = True  # promote and abort on the evidence; false: only report what the evidence says
    min_samples: int = 1000  # compared images before a promotion
    min_agreement: float = 0.99  # promote when the interval's lower bound reaches it; abort when its upper one is below
    min_box_f1: float = 0.9  # a detector's image agrees when its boxes' F1 against the primary's reaches this
    confidence: float = 0.95  # of the top-1 agreement interval (Wilson)
    abort_min_samples: int = 50  # compared (or attempted) images before an abort
    max_latency_ratio: float = 1.5  # candidate / primary compute per image, at most, to promote
    max_error_rate: float = 0.01  # candidate errors per attempted image, at most
    shadow_timeout_ms: float = 1000.0  # a shadow computation still queued this long is shed


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Serving settings of one model (all versions)."""

    backend: Literal["auto", "onnxruntime", "torchscript", "aoti"] = "auto"
    device: str = "auto"
    fallback: Literal["cpu", "none"] = "cpu"
    precision: Literal["fp32", "fp16", "bf16", "int8", "auto"] = "fp32"
    instances: int = 1
    threads: int = 0  # intra-op threads per runtime instance; 0: the runtime's own default
    intra_op_spinning: bool = True  # onnxruntime's intra-op threads spin-wait between parallel sections
    conv_algo_search: Literal["heuristic", "exhaustive", "default"] = "heuristic"  # onnxruntime's CUDA provider
    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    batch_policy: Literal["delay", "adaptive"] = "adaptive"
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    queue_full_status: Literal[503, 429] = 503
    default_timeout_ms: float = 0.0
    warmup: bool = True
    instance_stuck_after_s: float = 60.0
    unhealthy_after_failed_batches: int = 3
    residency: Literal["pinned", "on_demand"] = "pinned"
    faults: Faults = msgspec.field(default_factory=Faults)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)


@dataclass(frozen=True)
class Setting:
    """What one config.toml field allows, said once: the check (after msgspec has checked the type), the words that
    name what is allowed in a refusal, and its comment in the written template ("" for a table's fields, which the
    template lists by name)."""

    allowed: str
    doc: str = ""
    check: Callable[[Any], bool] | None = None


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low


# One entry per field of each struct, in the template's order; the import-time check below keeps them in step.
SETTINGS: dict[str, Setting] = {
    "backend": Setting(
        "auto, onnxruntime, torchscript or aoti",
        "auto (the fastest measured runtime for the "
        "device among the files present: service/runtime/factory.py) | onnxruntime | torchscript | aoti "
        "(AOTInductor); a runtime that does no work is a drill: [faults] noop",
    ),
    "device": Setting(
        "auto, cpu, cuda or cuda:N",
        "auto (cuda when a usable GPU exists, else cpu) | cpu | cuda | cuda:N",
        lambda v: bool(_DEVICE.match(v)),
    ),
    "fallback": Setting("cpu or none", "cpu: keep serving from CPU when the GPU fails | none: fail instead"),
    "precision": Setting(
        "fp32, fp16, bf16 (GPU only), int8 (model.int8.onnx, from `export --int8`) or auto (the "
        "fastest gated artifact for the device)",
        "fp32 | fp16 | bf16 (GPU only) | int8 (model.int8.onnx from "
        "`export --int8`, onnxruntime; on CUDA only with its TensorRT or CUDA execution provider) | auto (int8 where "
        "it passed export's accuracy and speed gates on this device type, else fp16 on CUDA where the runtime has "
        "it, else fp32; metadata says which is served)",
    ),
    "instances": Setting("an integer >= 1", "runtime instances per device", _at_least(1)),
    "threads": Setting(
        "an integer >= 0 (0: the runtime's default)",
        "intra-op threads per instance (CPU); 0: the "
        "runtime's default (onnxruntime and torch: one per core). instances x threads above the cores "
        "oversubscribes them",
        _at_least(0),
    ),
    "intra_op_spinning": Setting(
        "true or false",
        "onnxruntime: intra-op threads spin-wait for work between "
        "parallel sections (true: lower tails under load, measured) or sleep (false: CPU left to other work, a "
        "wake-up per section)",
    ),
    "conv_algo_search": Setting(
        "heuristic, exhaustive or default",
        "onnxruntime on CUDA: how cuDNN picks "
        "convolution algorithms. exhaustive (its own default) times every one on each new input shape: each batch "
        "size not seen in warm-up pays it while serving; heuristic asks cuDNN's heuristics, no timing",
    ),
    "max_batch_size": Setting("an integer >= 1", "images in one batch at most", _at_least(1)),
    "max_queue_delay_ms": Setting(
        "a number >= 0", "how long the oldest queued image may wait for a fuller batch", _at_least(0)
    ),
    "batch_policy": Setting(
        "delay or adaptive",
        "adaptive: with an instance idle, wait (never past "
        "max_queue_delay_ms) only while the measured batch costs and arrival rate say that waiting for the next "
        'image costs the queued ones less than it saves it; on a CPU that is at once (docs/performance.md, "Where '
        'each request waits"); from a backlog, batches stop at the knee of the measured costs (README, "The '
        'engine") | delay: wait for a preferred or full batch up to max_queue_delay_ms even with an instance '
        "idle, as Triton does",
    ),
    "preferred_batch_sizes": Setting("a list of integers", "dispatch at once when one of these sizes is reached"),
    "max_queue_size": Setting("an integer >= 1", "images queued before requests are refused", _at_least(1)),
    "queue_full_status": Setting("503 or 429", "503 or 429, with Retry-After"),
    "default_timeout_ms": Setting(
        "a number >= 0 (0: no timeout)", "0: no deadline unless the request sets one", _at_least(0)
    ),
    "warmup": Setting("true or false", "run every batch-size bucket once before reporting ready"),
    "instance_stuck_after_s": Setting(
        "a number >= 0 (0: never declared stuck)",
        "a batch unanswered this long: its instance is abandoned and replaced (0: never)",
        _at_least(0),
    ),
    "unhealthy_after_failed_batches": Setting(
        "an integer >= 1", "this many batches in a row failing every image: the model reports not ready", _at_least(1)
    ),
    "residency": Setting(
        "pinned or on_demand",
        "pinned: loaded at start and kept | on_demand: loaded by its first "
        "request, evicted (least recently used, never while it has work) when a load needs room within serve's "
        "--memory-budget",
    ),
    "faults": Setting(
        "a table of " + ", ".join(Faults.__struct_fields__),
        'fault drills only (docs/testing.md, "Drills"; README, "Reliability")',
    ),
    "rollout": Setting(
        "a table of " + ", ".join(RolloutConfig.__struct_fields__),
        "a candidate version beside the serving one (docs/rollouts.md)",
    ),
}
FAULT_SETTINGS: dict[str, Setting] = {
    "delay_ms": Setting("a number >= 0", check=_at_least(0)),
    "image_delay_ms": Setting("a number >= 0", check=_at_least(0)),
    "hang_at_batch": Setting("an integer >= 0 (-1: never)", check=_at_least(-1)),
    "fail_after_batches": Setting("an integer >= 0 (-1: never)", check=_at_least(-1)),
    "load_delay_ms": Setting("a number >= 0", check=_at_least(0)),
    "load_error": Setting("a message (empty: none)", check=lambda v: isinstance(v, str)),
    "resident_bytes": Setting("an integer >= 0 (0: the measured size)", check=_at_least(0)),
    "versions": Setting(
        "a list of version numbers >= 1 (empty: every version)", check=lambda v: min(v, default=1) >= 1
    ),
    "noop": Setting("true or false"),
}
ROLLOUT_SETTINGS: dict[str, Setting] = {
    "candidate": Setting("a version number >= 1 (0: no rollout)", check=_at_least(0)),
    "mode": Setting("shadow or canary"),
    "fraction": Setting("a number between 0 and 1", check=lambda v: 0 <= v <= 1),
    "sticky_header": Setting("a header name (empty: at random)"),
    "auto": Setting("true or false"),
    "min_samples": Setting("an integer >= 1", check=_at_least(1)),
    "min_agreement": Setting("a number between 0 and 1", check=lambda v: 0 <= v <= 1),
    "min_box_f1": Setting("a number between 0 and 1", check=lambda v: 0 <= v <= 1),
    "confidence": Setting("a number in [0.5, 1)", check=lambda v: 0.5 <= v < 1),
    "abort_min_samples": Setting("an integer >= 1", check=_at_least(1)),
    "max_latency_ratio": Setting("a number > 0", check=lambda v: v > 0),
    "max_error_rate": Setting("a number between 0 and 1", check=lambda v: 0 <= v <= 1),
    "shadow_timeout_ms": Setting("a number > 0", check=lambda v: v > 0),
}

# Each struct's settings, by the ModelConfig field that holds it ("": ModelConfig's own).
TABLES = {"": (ModelConfig, SETTINGS), "faults": (Faults, FAULT_SETTINGS), "rollout": (RolloutConfig, ROLLOUT_SETTINGS)}
for _struct, _declared in TABLES.values():
    if tuple(_declared) != _struct.__struct_fields__:  # a field added to one and not the other fails at import
        raise AssertionError(f"{_struct.__name__}'s fields and their settings differ: {_struct.__struct_fields__}")


def parse_config(raw: dict[str, Any], *, source: str) -> ModelConfig:
    """Validate a config mapping; ``source`` names the file in every message."""
    known = set(ModelConfig.__struct_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"unknown setting {unknown[0]!r} = {raw[unknown[0]]!r} ({source}); "
            f"known settings: {', '.join(sorted(known))}"
        )
    try:
        config = msgspec.convert(raw, type=ModelConfig, strict=False)
    except msgspec.ValidationError as exc:
        match = re.search(r"at `\$\.(\w+)", str(exc))
        field = match.group(1) if match else "?"
        allowed = SETTINGS[field].allowed if field in SETTINGS else "valid"
        raise ConfigError(f"{field} must be {allowed}, got {raw.get(field)!r} ({source})") from exc
    for table, (_, declared) in TABLES.items():
        settings, prefix = (getattr(config, table), f"{table}.") if table else (config, "")
        for field, setting in declared.items():
            value = getattr(settings, field)
            if setting.check is not None and (isinstance(value, bool) or not setting.check(value)):
                raise ConfigError(f"{prefix}{field} must be {setting.allowed}, got {value!r} ({source})")
    if not all(1 <= size <= config.max_batch_size for size in config.preferred_batch_sizes):
        raise ConfigError(
            f"preferred_batch_sizes entries must be between 1 and max_batch_size ({config.max_batch_size}), "
            f"got {list(config.preferred_batch_sizes)} ({source})"
        )
    if config.precision in ("fp16", "bf16") and config.device == "cpu":
        raise ConfigError(f"precision {config.precision} needs a GPU, but device is 'cpu' ({source})")
    return config


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.toml``; a missing file gives the defaults."""
    path = Path(path)
    if not path.exists():
        return ModelConfig()
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse_config(raw, source=str(path))


def toml_value(value: Any) -> str:
    """A value as TOML writes it: the one writer of config.toml's values (strings escaped as JSON's, which TOML's
    basic strings read the same)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}" if value != int(value) else f"{value:.1f}"
    return str(value)


_COMMENT_AT = 30  # the column where a template line's comment starts
_WIDTH = 118


def _commented(assignment: str, doc: str) -> list[str]:
    """``assignment`` with ``doc`` as its comment, wrapped into lines aligned at ``_COMMENT_AT``."""
    width = _WIDTH - _COMMENT_AT - 2
    shorter = max(_COMMENT_AT, len(assignment) + 2) - _COMMENT_AT  # the first line starts further right
    wrapped = textwrap.wrap(doc, width, initial_indent="\0" * shorter, break_long_words=False, break_on_hyphens=False)
    lines = [line.replace("\0", " ").strip() for line in wrapped]
    head = f"{assignment:<{_COMMENT_AT - 1}} #" if len(assignment) < _COMMENT_AT - 1 else f"{assignment}  #"
    return [f"{head} {lines[0]}"] + [f"{'':<{_COMMENT_AT}}# {rest}" for rest in lines[1:]]


def default_config_text(max_batch_size: int = 32) -> str:
    """Export's config.toml: every setting at its default (``max_batch_size`` as export measured it), each with its
    comment, and the two tables named; derived from :data:`SETTINGS`, so it lists every field."""
    defaults = msgspec.to_builtins(ModelConfig(max_batch_size=max_batch_size))
    lines = ["# Serving settings for this model (all optional; these are the defaults)."]
    for field, setting in SETTINGS.items():
        if field in TABLES:
            # "\0" holds each "name = value" on one line when the comment wraps.
            names = ", ".join(f"{k}\0=\0{toml_value(v)}" for k, v in defaults[field].items() if k in TABLES[field][1])
            lines += _commented(f"# [{field}]", f"{setting.doc}: {names}")
        else:
            lines += _commented(f"{field} = {toml_value(defaults[field])}", setting.doc)
    return "\n".join(lines) + "\n"
