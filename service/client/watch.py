"""``visionserve watch``: a running source's answers as they come (docs/sources.md), printed one line a frame or
saved as JSON Lines.

A client of the Server-Sent Events route ``GET /v1/sources/{id}/results`` (admin): every message the server sends
for a frame (``result``, ``expired`` or ``error``) is one answer; the stream's last message says how the source
ended (``ended``, with its state and reason) or that this subscriber was cut off for not reading (``cut_off``).

Exit status: 0 when the source ended or ``--count`` answers were taken; 1 when the stream stopped otherwise (cut off,
the connection lost, nothing heard for ``--read-timeout`` seconds, the server not reached); 2 when the server
refused the subscription (403: no or a wrong token; 404: no such source) or a flag is wrong; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import msgspec

from service.client.errors import ClientError
from service.client.rollout import TOKEN_ENV, error_text
from service.core.arguments import add_option_flags, integer_in, number_in, option_flags
from service.core.errors import ConfigError
from service.core.tasks import TASKS

__all__ = ["add_watch_arguments", "answer_line", "end_line", "event_data", "run_watch"]

MAX_SECONDS = 86400  # a day
MAX_COUNT = 2**63 - 1
SHOWN = 5  # labels or boxes a text line shows; the rest are counted ("+3 more"), --out keeps them all
FRAME_STATUSES = ("result", "expired", "error")  # a frame's answer; anything else ends the stream
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "A running source's answers as they come, over the server's /v1/sources/{id}/results event stream: one "
        "line a frame (frame index, pts, age, the top labels or the boxes), or every answer as it came to a JSON "
        "Lines file. Stops when the source ends (exit 0), after --count answers (exit 0), when the server refuses "
        "(exit 2: 403 no or a wrong token, 404 no such source) or on Ctrl-C (exit 130)."
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--source", required=True, metavar="ID", help="the source's id (POST /v1/sources answered it)")
    p.add_argument("--token", default=None, help=f"the server's admin token; default: ${TOKEN_ENV}")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="save the answers to this file (JSON Lines unless --format text); default: print them",
    )
    p.add_argument("--append", action="store_true", help="add to an existing --out (without it one is refused)")
    p.add_argument("--events", action="store_true", help="also each line crossing, zone entry and exit (tracking)")
    p.add_argument(
        "--format",
        choices=("text", "jsonl"),
        default=None,
        help="text: one line a frame; jsonl: each answer as the server sent it; default: text on stdout, jsonl to "
        "--out",
    )
    p.add_argument(
        "--count",
        type=integer_in(1, MAX_COUNT),
        default=None,
        metavar="N",
        help="stop after N answers (results, expired and errors alike); default: until the source ends",
    )
    p.add_argument(
        "--connect-timeout",
        type=number_in(0, MAX_SECONDS, above=True),
        default=10.0,
        metavar="S",
        help="seconds to wait for the server to accept the connection",
    )
    p.add_argument(
        "--read-timeout",
        type=number_in(0, MAX_SECONDS, above=True),
        default=60.0,
        metavar="S",
        help="seconds without a message before giving up (a camera that reconnects sends none meanwhile)",
    )
    add_option_flags(
        p.add_argument_group(
            "the source's options", "given, the source is changed first (PATCH /v1/sources/ID, for every subscriber)"
        ),
        *_options(),
    )


def _options() -> list[Any]:
    return [task.Options for task in TASKS.values()]


def run_watch(args: argparse.Namespace) -> int:
    """``visionserve watch``: subscribe to the source, write each answer as it comes, stop at its end, at
    ``--count``, on a refusal or on Ctrl-C; the exit status (module docstring)."""
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ConfigError(f"watch needs the server's admin token: --token or {TOKEN_ENV}")
    text = (args.format or ("jsonl" if args.out else "text")) == "text"
    out: IO[str] | None = None
    try:
        if args.out is not None:
            out = _open_out(Path(args.out), append=args.append)
        return _watch(args, token, out or sys.stdout, text=text)
    except KeyboardInterrupt:  # the user stopped watching: nothing went wrong, and nothing to say
        return INTERRUPTED
    except BrokenPipeError:  # stdout's reader went away (`watch ... | head`): it took what it wanted
        # Python flushes stdout again at exit, and would print a second BrokenPipeError: point it at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        if out is not None:
            out.close()


def _open_out(path: Path, *, append: bool) -> IO[str]:
    if path.exists() and path.stat().st_size > 0 and not append:
        raise ConfigError(f"{path} exists: pass --append to add to it, or name another file")
    try:
        return path.open("a" if append else "w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write --out {path}: {exc.strerror or exc}") from exc


def _watch(args: argparse.Namespace, token: str, out: IO[str], *, text: bool) -> int:
    import httpx

    base = args.url.rstrip("/")
    target = f"{base}/v1/sources/{quote(args.source, safe='')}/results"
    timeout = httpx.Timeout(args.connect_timeout, connect=args.connect_timeout, read=args.read_timeout)
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    # The end is said where a reader looks: after the text lines, or beside the file; never inside JSON Lines on
    # stdout, which a pipe reads as data.
    report = sys.stderr if out is sys.stdout and not text else sys.stdout
    taken = 0
    try:
        with httpx.Client(timeout=timeout) as client:
            if not _change(client, base, args, headers["Authorization"]):
                return 2
            with client.stream("GET", target, headers=headers) as response:
                if response.status_code != 200:
                    refusal = f"{base} answered {response.status_code}: {error_text(response.read())}"
                    if 400 <= response.status_code < 500:  # the request is wrong (token, source): asking again won't do
                        print(f"visionserve watch: error: {refusal}", file=sys.stderr)
                        return 2
                    raise ClientError(refusal, status=response.status_code)
                kind = response.headers.get("content-type", "")
                if not kind.startswith("text/event-stream"):
                    raise ClientError(f"{target} answered {kind or 'no content type'}, not an event stream")
                for data in event_data(response.iter_lines()):
                    message = _decode(data)
                    status = message.get("status")
                    if message.get("type") == "event":  # a track crossed a line, or entered or left a zone
                        if args.events:
                            out.write((event_line(message) if text else data) + "\n")
                            out.flush()
                        continue
                    if status in FRAME_STATUSES:
                        if not text and "\n" in data:  # an event of several data lines: one line of JSON all the same
                            data = msgspec.json.encode(message).decode()
                        out.write((answer_line(message) if text else data) + "\n")
                        out.flush()  # each answer visible as it comes (a tail -f, a Ctrl-C keeps what was taken)
                        taken += 1
                        if args.count is not None and taken >= args.count:
                            _say(report, f"took {_answers(taken)} from source {args.source}{_saved(args)}")
                            return 0
                        continue
                    _say(report, f"{end_line(message)} ({_answers(taken)}{_saved(args)})")
                    return 0 if status == "ended" else 1
    except httpx.TimeoutException as exc:
        waited = args.connect_timeout if isinstance(exc, httpx.ConnectTimeout) else args.read_timeout
        what = "accepted the connection" if isinstance(exc, httpx.ConnectTimeout) else "sent a message"
        raise ClientError(
            f"{base} has not {what} in {waited:g} s, after {_answers(taken)} (--connect-timeout, --read-timeout)"
        ) from exc
    except httpx.HTTPError as exc:
        raise ClientError(f"{base}: the stream was lost after {_answers(taken)} ({exc})") from exc
    raise ClientError(f"{base} closed the stream before source {args.source} ended, after {_answers(taken)}")


def _change(client: Any, base: str, args: argparse.Namespace, authorization: str) -> bool:
    """The source's options the flags give, sent as a PATCH before watching; False (and why, on stderr) when the
    server refused them."""
    options = option_flags(args, *_options())
    if not options:
        return True
    url = f"{base}/v1/sources/{quote(args.source, safe='')}"
    response = client.patch(url, json=options, headers={"Authorization": authorization})
    if response.status_code == 200:
        return True
    print(f"visionserve watch: error: {base} answered {response.status_code}: {error_text(response.content)}",
          file=sys.stderr)  # fmt: skip
    return False


def event_data(lines: Iterable[str]) -> Iterator[str]:
    """The data of each Server-Sent Event in ``lines`` (the text of the stream, a line at a time, without line
    ends): an event's ``data:`` lines joined with newlines, dispatched at the blank line that ends it, as
    EventSource does. Comments, other fields and events without data are passed over."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":  # "data" alone is a data line with an empty value
            data.append(value[1:] if value.startswith(" ") else value)
    if data:  # the stream ended without the blank line after its last event: it was whole all the same
        yield "\n".join(data)


def answer_line(message: dict[str, Any]) -> str:
    """One frame's answer as a compact line: its index, pts, age, then the top labels with their scores, the boxes
    (``2 boxes: 3 0.91, 7 0.40``), or what became of it (expired, error)."""
    pts = message.get("pts")
    head = f"frame {message.get('frame')}  pts {'-' if pts is None else f'{pts:.3f}'}"
    age = message.get("age_ms")
    head += f"  age {'-' if age is None else f'{age:.1f}'} ms"
    status = message.get("status")
    if status == "expired":
        stage = message.get("stage")
        return f"{head}  expired" + (f" ({stage})" if stage else "")
    if status == "error":
        return f"{head}  error: {message.get('error', '')}"
    if "classes" in message:  # a semantic model's: the classes present, each with its pixel count
        return f"{head}  " + (", ".join(f"{_label(c)} {c.get('area')} px" for c in message["classes"]) or "none")
    if "detections" in message or "instances" in message:
        boxes = message.get("detections", message.get("instances")) or []
        shown = ", ".join(f"{_label(d)} {_score(d)}" for d in boxes[:SHOWN])
        more = f", +{len(boxes) - SHOWN} more" if len(boxes) > SHOWN else ""
        return f"{head}  {len(boxes)} box{'' if len(boxes) == 1 else 'es'}" + (f": {shown}{more}" if boxes else "")
    if "predictions" in message:
        predictions = message["predictions"] or []
        return f"{head}  " + (", ".join(f"{_label(p)} {_score(p)}" for p in predictions[:SHOWN]) or "no labels")
    if "outputs" in message:
        return f"{head}  outputs: {', '.join(message['outputs'] or {}) or 'none'}"
    return head


def event_line(message: dict[str, Any]) -> str:
    """One event as a line: ``event cross gate in  track 4 (7)  t 3.200``."""
    where = message.get("line") or message.get("zone")
    direction = f" {message['direction']}" if "direction" in message else ""
    return (f"event {message.get('event')} {where}{direction}  track {message.get('track_id')} "
            f"({message.get('label')})  t {message.get('time', 0):.3f}")  # fmt: skip


def end_line(message: dict[str, Any]) -> str:
    """How the stream ended, from its last message: ``source clip ended: file ended``; or that this watcher was cut
    off, and why."""
    source = message.get("source", "?")
    reason = message.get("reason") or ""
    if message.get("status") == "ended":
        return f"source {source} {message.get('state') or 'ended'}" + (f": {reason}" if reason else "")
    if message.get("status") == "cut_off":
        return f"cut off from source {source} by the server" + (f": {reason}" if reason else "")
    return f"source {source}: unexpected message {msgspec.json.encode(message).decode()[:300]}"


def _decode(data: str) -> dict[str, Any]:
    try:
        message = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ClientError(f"the server sent an event that is not JSON: {data[:300]!r}") from exc
    if not isinstance(message, dict):
        raise ClientError(f"the server sent an event that is not a JSON object: {data[:300]!r}")
    return message


def _label(item: dict[str, Any]) -> str:
    return str(item.get("label", item.get("index", "?")))


def _score(item: dict[str, Any]) -> str:
    score = item.get("score")
    return f"{score:.2f}" if isinstance(score, int | float) else "?"


def _answers(n: int) -> str:
    return f"{n} answer{'' if n == 1 else 's'}"


def _saved(args: argparse.Namespace) -> str:
    return f", saved to {args.out}" if args.out else ""


def _say(stream: IO[str], line: str) -> None:
    print(line, file=stream, flush=True)
