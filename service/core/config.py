"""A model's serving settings: ``<repository>/<model>/config.toml``. Every field is optional.

Bad values are refused at startup with a message that names the file, the field and the value, e.g.
``max_batch_size must be an integer >= 1, got 0 (model_repository/digits/config.toml)``.
"""

from __future__ import annotations

import re
import tomllib
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


class RolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A candidate version on trial beside the serving one (``[rollout]``, docs/rollouts.md)."""

    candidate: int = 0
    mode: Literal["shadow", "canary"] = "shadow"
    fraction: float = 0.1  # of the requests that do not name a version
    sticky_header: str = ""  # canary: route by a hash of this request header's value ("": at random)
    auto: bool = True  # promote and abort on the evidence; false: only report what the evidence says
    min_samples: int = 1000  # compared images before a promotion
    min_agreement: float = 0.99  # promote when the interval's lower bound reaches it; abort when its upper one is below
    confidence: float = 0.95  # of the top-1 agreement interval (Wilson)
    abort_min_samples: int = 50  # compared (or attempted) images before an abort
    max_latency_ratio: float = 1.5  # candidate / primary compute per image, at most, to promote
    max_error_rate: float = 0.01  # candidate errors per attempted image, at most
    shadow_timeout_ms: float = 1000.0  # a shadow computation still queued this long is shed


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Serving settings of one model (all versions)."""

    backend: Literal["auto", "onnxruntime", "torchscript", "aoti", "noop"] = "auto"
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


# field -> (check, what is allowed); checked after msgspec has checked the types.
_RULES: dict[str, tuple[Any, str]] = {
    "instances": (lambda v: v >= 1, "an integer >= 1"),
    "threads": (lambda v: v >= 0, "an integer >= 0 (0: the runtime's default)"),
    "max_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "max_queue_delay_ms": (lambda v: v >= 0, "a number >= 0"),
    "max_queue_size": (lambda v: v >= 1, "an integer >= 1"),
    "default_timeout_ms": (lambda v: v >= 0, "a number >= 0 (0: no timeout)"),
    "device": (lambda v: bool(_DEVICE.match(v)), "auto, cpu, cuda or cuda:N"),
    "instance_stuck_after_s": (lambda v: v >= 0, "a number >= 0 (0: never declared stuck)"),
    "unhealthy_after_failed_batches": (lambda v: v >= 1, "an integer >= 1"),
}
_FAULT_RULES: dict[str, tuple[Any, str]] = {
    "delay_ms": (lambda v: v >= 0, "a number >= 0"),
    "image_delay_ms": (lambda v: v >= 0, "a number >= 0"),
    "hang_at_batch": (lambda v: v >= -1, "an integer >= 0 (-1: never)"),
    "fail_after_batches": (lambda v: v >= -1, "an integer >= 0 (-1: never)"),
    "load_delay_ms": (lambda v: v >= 0, "a number >= 0"),
    "load_error": (lambda v: isinstance(v, str), "a message (empty: none)"),
    "resident_bytes": (lambda v: v >= 0, "an integer >= 0 (0: the measured size)"),
    "versions": (lambda v: all(x >= 1 for x in v), "a list of version numbers >= 1 (empty: every version)"),
}
ROLLOUT_RULES: dict[str, tuple[Any, str]] = {
    "candidate": (lambda v: v >= 0, "a version number >= 1 (0: no rollout)"),
    "fraction": (lambda v: 0 <= v <= 1, "a number between 0 and 1"),
    "min_samples": (lambda v: v >= 1, "an integer >= 1"),
    "min_agreement": (lambda v: 0 <= v <= 1, "a number between 0 and 1"),
    "confidence": (lambda v: 0.5 <= v < 1, "a number in [0.5, 1)"),
    "abort_min_samples": (lambda v: v >= 1, "an integer >= 1"),
    "max_latency_ratio": (lambda v: v > 0, "a number > 0"),
    "max_error_rate": (lambda v: 0 <= v <= 1, "a number between 0 and 1"),
    "shadow_timeout_ms": (lambda v: v > 0, "a number > 0"),
}

_ALLOWED_TEXT = {
    "backend": "auto, onnxruntime, torchscript, aoti or noop",
    "fallback": "cpu or none",
    "precision": "fp32, fp16, bf16 (GPU only), int8 (model.int8.onnx, from `export --int8`) or auto (the fastest "
    "gated artifact for the device)",
    "queue_full_status": "503 or 429",
    "batch_policy": "delay or adaptive",
    "conv_algo_search": "heuristic, exhaustive or default",
    "residency": "pinned or on_demand",
    "warmup": "true or false",
    "preferred_batch_sizes": "a list of integers",
    "faults": "a table with delay_ms, image_delay_ms, hang_at_batch, fail_after_batches, load_delay_ms, load_error, "
    "resident_bytes, versions",
    "rollout": "a table with candidate, mode, fraction, sticky_header, auto, min_samples, min_agreement, confidence, "
    "abort_min_samples, max_latency_ratio, max_error_rate, shadow_timeout_ms",
    **{k: v[1] for k, v in _RULES.items()},
}


def _check_rules(settings: Any, rules: dict[str, tuple[Any, str]], source: str, prefix: str = "") -> None:
    for field, (check, allowed) in rules.items():
        value = getattr(settings, field)
        if isinstance(value, bool) or not check(value):
            raise ConfigError(f"{prefix}{field} must be {allowed}, got {value!r} ({source})")


def _fail(field: str, value: Any, source: str) -> ConfigError:
    return ConfigError(f"{field} must be {_ALLOWED_TEXT.get(field, 'valid')}, got {value!r} ({source})")


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
        raise _fail(field, raw.get(field), source) from exc
    _check_rules(config, _RULES, source)
    _check_rules(config.faults, _FAULT_RULES, source, prefix="faults.")
    _check_rules(config.rollout, ROLLOUT_RULES, source, prefix="rollout.")
    for size in config.preferred_batch_sizes:
        if not 1 <= size <= config.max_batch_size:
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


DEFAULT_CONFIG_TOML = """\
# Serving settings for this model (all optional; these are the defaults).
backend = "auto"              # auto (the fastest measured runtime for the device among the files present:
                              # service/runtime/factory.py) | onnxruntime | torchscript | aoti (AOTInductor)
                              # | noop (no model work, nonsense answers: measures the server's own capacity)
device = "auto"               # auto (cuda when a usable GPU exists, else cpu) | cpu | cuda | cuda:N
fallback = "cpu"              # cpu: keep serving from CPU when the GPU fails | none: fail instead
precision = "fp32"            # fp32 | fp16 | bf16 (GPU only) | int8 (model.int8.onnx from `export --int8`,
                              # onnxruntime; on CUDA only with its TensorRT or CUDA execution provider) | auto
                              # (int8 where it passed export's accuracy and speed gates on this device type, else
                              # fp16 on CUDA where the runtime has it, else fp32; metadata says which is served)
instances = 1                 # runtime instances per device
threads = 0                   # intra-op threads per instance (CPU); 0: the runtime's default (onnxruntime and
                              # torch: one per core). instances x threads above the cores oversubscribes them
intra_op_spinning = true      # onnxruntime: intra-op threads spin-wait for work between parallel sections (true:
                              # lower tails under load, measured) or sleep (false: CPU left to other work, a
                              # wake-up per section)
conv_algo_search = "heuristic"  # onnxruntime on CUDA: how cuDNN picks convolution algorithms. exhaustive (its
                              # own default) times every one on each new input shape: each batch size not seen in
                              # warm-up pays it while serving; heuristic asks cuDNN's heuristics, no timing
max_batch_size = {max_batch_size}
max_queue_delay_ms = 2.0      # how long the oldest queued image may wait for a fuller batch
batch_policy = "adaptive"     # adaptive: with an instance idle, wait (never past max_queue_delay_ms) only while
                              # the measured batch costs and arrival rate say that waiting for the next image costs
                              # the queued ones less than it saves it; on a CPU that is at once (docs/performance.md,
                              # "Where each request waits"); from a backlog, batches stop at the knee of the
                              # measured costs (README, "The engine") | delay: wait for a preferred or full batch
                              # up to max_queue_delay_ms even with an instance idle, as Triton does
preferred_batch_sizes = []    # dispatch at once when one of these sizes is reached
max_queue_size = 1024         # images queued before requests are refused
queue_full_status = 503       # 503 or 429, with Retry-After
default_timeout_ms = 0        # 0: no deadline unless the request sets one
warmup = true                 # run every batch-size bucket once before reporting ready
instance_stuck_after_s = 60   # a batch unanswered this long: its instance is abandoned and replaced (0: never)
unhealthy_after_failed_batches = 3  # this many batches in a row failing every image: the model reports not ready
residency = "pinned"          # pinned: loaded at start and kept | on_demand: loaded by its first request, evicted
                              # (least recently used, never while it has work) when a load needs room within
                              # serve's --memory-budget
# [faults]                    # fault drills only (README, "Reliability"): delay_ms, hang_at_batch,
                              # fail_after_batches, load_delay_ms, load_error, resident_bytes, versions
# [rollout]                   # a candidate version beside the serving one (docs/rollouts.md): candidate = N,
                              # mode = "shadow" | "canary", fraction = 0.1, sticky_header, auto, min_samples,
                              # min_agreement, confidence, abort_min_samples, max_latency_ratio, max_error_rate
"""


def default_config_text(max_batch_size: int = 32) -> str:
    return DEFAULT_CONFIG_TOML.format(max_batch_size=max_batch_size)
