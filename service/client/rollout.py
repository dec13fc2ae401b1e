"""``visionserve rollout``: start, watch, promote or abort a running server's rollout (docs/rollouts.md).

A thin client of the admin routes ``/v2/models/{m}/rollout[/promote|/abort]``: the server decides and compares;
this command sends what the flags say and prints what the server answers. An answer ``{"error": ...}`` with a
status becomes a :class:`ClientError` (``visionserve`` prints it and exits 1).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

import msgspec

from service.client.errors import ClientError, error_text
from service.core.arguments import integer_in, number_in
from service.core.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

ACTIONS = ("status", "start", "promote", "abort")
TOKEN_ENV = "VISIONSERVE_ADMIN_TOKEN"
MAX_VERSION = 2**63 - 1
LOWEST_CLASSES = 5  # the lowest-agreement classes shown: where a candidate went wrong, not a full confusion matrix
# start's own flags (each absent unless given), refused with the other actions: a --fraction on `promote` would be
# ignored silently, and the user would believe the fraction changed.
START_OPTIONS: dict[str, dict[str, Any]] = {
    "--candidate": {
        "type": integer_in(1, MAX_VERSION),
        "metavar": "N",
        "help": "the version on trial (it must be in the server's repository); start needs it",
    },
    "--mode": {
        "choices": ("shadow", "canary"),
        "help": "shadow: the candidate computes a copy and is never returned; canary: it answers; default: shadow",
    },
    "--fraction": {
        "type": number_in(0, 1),
        "metavar": "F",
        "help": "of the requests that name no version; default: 0.1",
    },
    "--sticky-header": {
        "metavar": "HEADER",
        "help": "canary: route by a hash of this request header's value; default: at random",
    },
    "--no-auto": {"action": "store_true", "help": "only say what the evidence calls for; never act on it"},
    "--min-samples": {
        "type": integer_in(1, MAX_VERSION),
        "metavar": "N",
        "help": "compared requests before a promotion; default: the server's (1000)",
    },
    "--min-agreement": {
        "type": number_in(0, 1),
        "metavar": "X",
        "help": "top-1 agreement the interval's lower bound must reach to promote; default: the server's (0.99)",
    },
}
START_FLAGS = tuple(flag[2:].replace("-", "_") for flag in START_OPTIONS)


class Latency(msgspec.Struct, frozen=True, kw_only=True):
    mean: float | None = None  # per image, ms (p50 and p99 are left to --json)


class ClassAgreement(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    label: str = ""
    samples: int = 0
    agreed: int = 0
    agreement: float | None = None
    moved_to: dict[str, int] = {}


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    samples: int = 0
    agreed: int = 0
    agreement: float | None = None
    agreement_low: float | None = None
    agreement_high: float | None = None
    topk: int = 0
    topk_overlap: float | None = None
    primary_ms: Latency = Latency()
    candidate_ms: Latency = Latency()
    latency_ratio: float | None = None
    attempts: int = 0
    errors: int = 0
    error_rate: float | None = None
    last_error: str = ""
    shed: int = 0
    classes: list[ClassAgreement] = []


class RolloutStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of ``GET /v2/models/{m}/rollout`` this command prints; the others are left to ``--json``."""

    model: str = ""
    state: str = "none"
    mode: str = ""
    primary: int | None = None
    candidate: int | None = None
    fraction: float | None = None
    effective_fraction: float | None = None
    sticky_header: str = ""
    auto: bool = True
    reason: str = ""
    verdict: str = ""
    verdict_reason: str = ""
    policy: dict[str, float] = {}
    comparison: Comparison | None = None


def add_rollout_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "A running server's rollout of a candidate version beside the serving one (docs/rollouts.md): status prints "
        "the comparison so far; start, promote and abort need the server's admin token."
    )
    p.add_argument("action", choices=ACTIONS, metavar="ACTION", help="status, start, promote or abort")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--admin-token", metavar="TOKEN", help=f"the server's admin token; default: ${TOKEN_ENV}")
    timeout = number_in(0, 600, above=True)
    p.add_argument("--timeout", type=timeout, default=60.0, metavar="S", help="seconds to wait for the server's answer")
    p.add_argument("--json", action="store_true", help="print the server's answer as JSON, as it came")
    g = p.add_argument_group("start")
    for flag, options in START_OPTIONS.items():
        g.add_argument(flag, **options)
    p.add_argument("--reason", default=None, help="promote and abort: why, kept with the decision")


def start_body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of ``start``: what the flags give (the server's defaults fill the rest)."""
    fraction = 0.1 if args.fraction is None else args.fraction
    given = {"sticky_header": args.sticky_header, "auto": False if args.no_auto else None,
             "min_samples": args.min_samples, "min_agreement": args.min_agreement}  # fmt: skip
    return {"candidate": args.candidate, "mode": args.mode or "shadow", "fraction": fraction} | {
        k: v for k, v in given.items() if v is not None
    }


def check_rollout_args(args: argparse.Namespace) -> str | None:
    """Refuse flags the action would ignore (``ConfigError``, exit status 2); the admin token (None for status)."""
    if args.action == "start":
        if args.candidate is None:
            raise ConfigError("rollout start needs --candidate N: the version to put on trial")
        if args.sticky_header and args.mode != "canary":
            raise ConfigError("--sticky-header routes a canary's requests: add --mode canary")
    else:
        # Identity, not equality: --fraction 0 is given (and 0 == False).
        values = vars(args)
        given = ["--" + d.replace("_", "-") for d in START_FLAGS if values[d] is not None and values[d] is not False]
        if given:
            raise ConfigError(f"{', '.join(given)} only go with rollout start, not rollout {args.action}")
    if args.reason is not None and args.action not in ("promote", "abort"):
        raise ConfigError(f"--reason goes with rollout promote or abort, not rollout {args.action}")
    if args.action == "status":
        return None
    token = args.admin_token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ConfigError(f"rollout {args.action} needs the server's admin token: --admin-token or {TOKEN_ENV}")
    return token


def run_rollout(args: argparse.Namespace) -> int:
    """``visionserve rollout``: one request to the server, its answer printed."""
    import httpx

    token = check_rollout_args(args)
    target = f"{args.url.rstrip('/')}/v2/models/{args.model}/rollout"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        if args.action == "status":
            response = httpx.get(target, timeout=args.timeout)
        else:
            body = start_body(args) if args.action == "start" else ({"reason": args.reason} if args.reason else {})
            path = "" if args.action == "start" else f"/{args.action}"
            response = httpx.post(target + path, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise ClientError(f"{args.url}: the server could not be reached ({exc})") from exc
    if response.status_code != 200:
        raise ClientError(
            f"{args.url} answered {response.status_code}: {error_text(response.content)}", status=response.status_code
        )
    if args.json:
        print(response.text)
        return 0
    try:
        answer = msgspec.json.decode(response.content)
        is_status = isinstance(answer, dict) and "state" in answer
        status = msgspec.convert(_without_nulls(answer), RolloutStatus) if is_status else None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ClientError(f"{args.url} answered {args.action} with what is no rollout status: {exc}") from exc
    if args.action != "status":
        done = {"start": "started", "promote": "promoted", "abort": "aborted"}[args.action]
        print(f"{args.model}: rollout {done} on {args.url}")
    if status is not None:
        print_status(msgspec.structs.replace(status, model=status.model or args.model))
    elif args.action == "status":
        raise ClientError(f"{args.url} answered status with what is no rollout status: {response.text[:300]}")
    return 0


def _without_nulls(value: Any) -> Any:
    """``value`` with the nulls of its objects left out, so the fields take their defaults: a server leaves a
    statistic null until it has a sample (``last_error``, ``primary_ms.mean``), and that is no reason to fail."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


def _pct(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def _limit(policy: dict[str, float], name: str, fmt: str) -> str:
    return f"; at most {fmt.format(policy[name])}" if name in policy else ""


def print_status(status: RolloutStatus, console: Console | None = None) -> None:
    """A readable summary of a rollout status: what runs, the evidence so far, the verdict and the classes that
    agree least."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(soft_wrap=True)
    name = status.model or "model"
    if status.state == "none":
        console.print(f"{name}: no rollout")
        return
    share = f"{_pct(status.fraction, 0)} of the requests that name no version"
    if status.state == "running" and status.effective_fraction not in (None, status.fraction):
        share += f" (effectively {_pct(status.effective_fraction, 1)})"
    sticky = f", sticky on {status.sticky_header}" if status.sticky_header else ""
    console.print(f"[bold]{name}[/]: rollout {status.state}, {status.mode} of {share}{sticky}", highlight=False)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("versions", f"primary {status.primary} -> candidate {status.candidate}")
    c, policy = status.comparison, status.policy
    if c is not None:
        interval = f"{_pct(c.agreement_low)} to {_pct(c.agreement_high)}"
        confidence = f"{policy['confidence']:.0%} " if "confidence" in policy else ""
        target = f"; promote at >= {policy['min_agreement']:.2%}" if "min_agreement" in policy else ""
        grid.add_row("samples", f"{c.samples} compared, {c.agreed} agreed on top-1")
        grid.add_row("agreement", f"{_pct(c.agreement)} ({confidence}interval {interval}{target})")
        if c.topk:
            grid.add_row(f"top-{c.topk} overlap", _pct(c.topk_overlap, 1))
        latency = "n/a" if c.latency_ratio is None else f"{c.latency_ratio:.2f}x"
        if c.primary_ms.mean is not None and c.candidate_ms.mean is not None:
            latency += f" (mean {c.candidate_ms.mean:.2f} ms vs {c.primary_ms.mean:.2f} ms per image)"
        grid.add_row("latency ratio", latency + _limit(policy, "max_latency_ratio", "{:.2f}x"))
        rate, last = _pct(c.error_rate) + _limit(policy, "max_error_rate", "{:.2%}"), c.errors and c.last_error
        grid.add_row("errors", f"{c.errors} of {c.attempts} attempts ({rate})" + (f": {last}" if last else ""))
        grid.add_row("shed", f"{c.shed} sampled requests not compared (live work went first)")
    verdict = f"{status.verdict}: {status.verdict_reason}" if status.verdict_reason else status.verdict
    manual = not status.auto and status.state == "running"
    grid.add_row("verdict", (verdict or "n/a") + (" (auto off: not acted on)" if manual else ""))
    if status.reason:
        grid.add_row("reason", status.reason)
    console.print(grid)
    if c is not None and c.classes:
        table = Table(title=f"lowest agreement, {min(LOWEST_CLASSES, len(c.classes))} of {len(c.classes)} classes")
        for column in ("class", "samples", "agreed", "agreement", "candidate said instead"):
            table.add_column(column)
        for row in c.classes[:LOWEST_CLASSES]:
            moved = ", ".join(f"{label} x{n}" for label, n in sorted(row.moved_to.items(), key=lambda kv: -kv[1]))
            label = f"{row.label} ({row.index})" if row.label and row.label != str(row.index) else str(row.index)
            table.add_row(label, str(row.samples), str(row.agreed), _pct(row.agreement), moved or "-")
        console.print(table)
