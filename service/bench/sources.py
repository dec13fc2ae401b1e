"""Cameras the server pulls: RTSP sources into one model, against their targets (docs/performance.md, "Cameras the
server pulls").

The cameras are loadtest/cameras.py's RTSP server (GStreamer, run by Debian's Python): ``--sources`` live H.264
streams of ``--width`` x ``--height`` at ``--fps`` with a keyframe every ``--keyint`` frames, either one shared mount
that every source reads (``--mounts shared``: one encode for all, the frames of every source arriving together) or
a mount of its own per source (``--mounts each``: an encode each, their phases spread). Their CPU competes with the
server's on the same machine, so it is measured and printed beside the server's.

First the capacity of the model here, in the same run: ``visionserve bench``'s in-process pipeline at batch 8 (JPEG
decode, letterbox, forward, suppression and mapping; no HTTP) on JPEGs of the cameras' own frames, in a process of
its own while no source runs (a JPEG decode stands in for the H.264 decode). Then the model is served alone
(service/launcher.py, ``--admin-token``), every camera is added with ``POST /v1/sources`` and, after ``--warmup-s``,
measured for ``--minutes``. Targets, each printed PASS or FAIL:

- throughput: answered fps over all sources / min(offered, capacity) >= 0.8, where offered is sources x fps (what
  the cameras send) and capacity the pipeline figure: when capacity exceeds the offered rate, the offered rate binds;
- fairness: the lowest source's answered fps over the mean >= 0.8;
- flat age: the answered frames' age p99 of each ``--window-s`` (from the deltas of the server's
  ``visionserve_source_age_seconds`` histogram, summed over the sources; interpolated in its buckets, which are 1.5x
  apart), the last window's within 10% of the first's;
- memory: the engine's and the front ends' RSS (service/launcher.py's roles) at the end grow at most 5% over their
  RSS once the sources have warmed up.

Beside them: each source's frames (decoded, skipped, answered, expired, error), the decode cost per frame (the
sources' ``decode_ms_per_frame``, mean over sources) and the CPU of the RTSP server, the server and this process.
Exit code 0 when every target is met, 1 when one is missed, 2 when it cannot run here::

    visionserve bench sources --out results/sources.json          # 16 cameras for 5 minutes, about 6.5 minutes
    visionserve bench sources --sources 2 --minutes 0.3 --warmup-s 5 --window-s 5   # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.cameras import RtspServer, rtsp_available
from loadtest.scrape import bucket_quantile, parse
from service import launcher
from service.bench.detect_served import PIPELINE_BATCH, in_process
from service.bench.kit import COUNT, POSITIVE, SHARE, Flag, conclude, header, repository

FLATNESS = 0.10  # the last window's age p99 within this share of the first's, either way
RSS_GROWTH = 0.05  # the engine's and the front ends' RSS at the end over theirs after the warm-up, at most
FRAMES_GRABBED = 32  # the cameras' frames saved as JPEGs for the capacity figure
AGE = "visionserve_source_age_seconds"
Say = Callable[[str], None]
ANSWERED = "visionserve_source_frames_total|answered"  # summed over the model's sources (loadtest.scrape.parse)
FLAGS: list[Flag] = [
    ("--repository", "examples/model_repository", "model repository holding the model"),
    ("--model", "digits-detect", "model every source is answered by"),
    ("--sources", 16, "cameras pulled at once", COUNT),
    ("--fps", 15, "frames per second each camera sends", COUNT),
    ("--width", 640, "frame width in pixels", COUNT),
    ("--height", 480, "frame height in pixels", COUNT),
    ("--keyint", 15, "a keyframe at least every this many frames", COUNT),
    ("--bitrate-kbps", 500, "H.264 bitrate of each camera", COUNT),
    (
        "--mounts",
        "shared",
        "shared: one encode read by every source; each: a mount (an encode) per source",
        ("shared", "each"),
    ),
    ("--minutes", 5.0, "measured minutes, after the warm-up", POSITIVE),
    ("--warmup-s", 30.0, "seconds the sources run before the measurement starts", POSITIVE),
    ("--window-s", 60.0, "seconds per age p99 window (the first and last are compared)", POSITIVE),
    ("--max-fps", 0.0, "each source's max_fps (0: every frame)"),
    ("--track", False, "each source tracks its boxes and counts them in two zones (docs/tracking.md)"),
    ("--max-age-ms", None, "each source's max_age_ms (default: the server's)", float),
    ("--capacity-seconds", 5.0, "in-process pipeline: measuring seconds", POSITIVE),
    ("--min-share", 0.8, "throughput and fairness targets", SHARE),
    ("--workers", None, "front ends (default: the server's choice)", int),
    ("--work", None, "folder for the repository, the frames and the logs (default: a new temporary one)"),
    ("--json", False, "print one JSON object on stdout, the figures as they come on stderr"),
    ("--out", None, "write every figure as JSON to this file (default: none)"),
]


def grab_frames(url: str, folder: Path, count: int) -> None:
    """``count`` decoded frames of the camera at ``url``, saved as JPEGs (quality 90) in ``folder``."""
    import av

    folder.mkdir(parents=True, exist_ok=True)
    with av.open(url, options={"rtsp_transport": "tcp"}, timeout=30) as container:
        for i, frame in enumerate(itertools.islice(container.decode(video=0), count)):
            frame.to_image().save(folder / f"frame-{i:03d}.jpg", quality=90)


class Server:
    """The running server as the benchmark drives and reads it: its sources (``/v1/sources``, with the admin
    token), its ``/metrics`` for the model, and its engine's and front ends' RSS."""

    def __init__(self, running: launcher.RunningServer, token: str, model: str) -> None:
        self.running, self.model = running, model
        self.client = httpx.Client(base_url=running.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def add(self, body: dict[str, Any]) -> None:
        answer = self.client.post("/v1/sources", json=body)
        if answer.status_code != 201:
            raise RuntimeError(f"POST /v1/sources {body} answered {answer.status_code}: {answer.text}")

    def sources(self) -> dict[str, dict[str, Any]]:
        return {doc["id"]: doc for doc in self.client.get("/v1/sources").raise_for_status().json()["sources"]}

    def metrics(self) -> dict[str, float]:
        return parse(self.client.get("/metrics").raise_for_status().text, self.model)

    def rss_mb(self) -> dict[str, float]:
        """The RSS of the engines and of the front ends, each role summed, in MiB."""
        return {role: sum(map(launcher.tree_rss_mb, pids)) for role, pids in self.running.roles().items()}

    def delete(self, id: str) -> None:
        answer = self.client.delete(f"/v1/sources/{id}")
        if answer.status_code not in (200, 404):
            raise RuntimeError(f"DELETE /v1/sources/{id} answered {answer.status_code}: {answer.text}")

    def wait_running(self, ids: list[str], timeout_s: float) -> dict[str, str]:
        """Once every source in ``ids`` runs and has answered a frame, or has finished: the finished ones with
        their reasons (none: all run). Raises if ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            docs = self.sources()
            finished = {i: docs[i]["reason"] for i in ids if docs.get(i, {}).get("state") in ("failed", "ended")}
            running = [i for i in ids if docs.get(i, {}).get("state") == "running" and docs[i]["frames"]["answered"]]
            if len(finished) + len(running) == len(ids):
                return finished
            if time.monotonic() > deadline:
                states = {i: docs.get(i, {}).get("state") for i in ids}
                raise RuntimeError(f"sources not all running and answered in {timeout_s:g} s: {states}")
            time.sleep(0.2)

    def start_sources(self, bodies: list[dict[str, Any]], timeout_s: float, attempts: int = 3) -> int:
        """Adds every source, the first alone, then the rest together; one that fails to open is deleted and added
        again, up to ``attempts`` times. Returns how many retries it took.

        Why: 16 clients opening a shared mount of GStreamer's RTSP server soon after its last client left sometimes
        all fail (FFmpeg: "Invalid data found when processing input", or EPERM) while the server re-prepares the
        shared media (seen here in 1 of 3 tries); once the first client runs, the rest join its media. A source
        whose first open fails is failed for good (docs of service/frontend/sources/reader.py)."""
        retries = 0
        for group in (bodies[:1], bodies[1:]):
            for attempt in range(attempts):
                for body in group:
                    self.add(body)
                failed = self.wait_running([b["id"] for b in group], timeout_s)
                if not failed:
                    break
                if attempt == attempts - 1:
                    raise RuntimeError(f"sources failed to start {attempts} times: {failed}")
                retries += len(failed)
                for id in failed:
                    self.delete(id)
                group = [b for b in group if b["id"] in failed]
        return retries


def snapshot(server: Server, cameras: RtspServer) -> dict[str, Any]:
    """Everything read at one instant: the sources, the model's metrics, RSS by role and CPU seconds."""
    return {
        "at_s": time.perf_counter(),
        "sources": server.sources(),
        "metrics": server.metrics(),
        "rss_mb": server.rss_mb(),
        "cpu_s": {
            "cameras": launcher.tree_cpu_s(cameras.pid),
            "server": launcher.tree_cpu_s(server.running.process.pid),
            "bench": time.process_time(),
        },
    }


def age_p99_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """The age p99 (ms) of the frames answered between two scrapes, from the histogram's buckets."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(AGE)}
    return 1000 * bucket_quantile(delta, AGE, 0.99)


def measure(args: argparse.Namespace, server: Server, cameras: RtspServer, say: Say) -> dict[str, Any]:
    """The sources after the warm-up for ``--minutes``: snapshots at the start, each window's end and the end."""
    first = snapshot(server, cameras)
    seconds = args.minutes * 60
    ends = [w * args.window_s for w in range(1, int(seconds // args.window_s) + 1)]
    ends = ends if ends and ends[-1] >= seconds - 1e-6 else [*ends, seconds]
    windows: list[dict[str, Any]] = []
    last = first
    for end in ends:
        time.sleep(max(0.0, first["at_s"] + end - time.perf_counter()))
        now = snapshot(server, cameras)
        span = now["at_s"] - last["at_s"]
        answered = now["metrics"].get(ANSWERED, 0.0) - last["metrics"].get(ANSWERED, 0.0)
        window = {
            "end_s": now["at_s"] - first["at_s"],
            "seconds": span,
            "age_p99_ms": age_p99_ms(last["metrics"], now["metrics"]),
            "answered_fps": answered / span,
            "rss_mb": now["rss_mb"],
        }
        windows.append(window)
        rss = ", ".join(f"{role} {mb:.0f} MiB" for role, mb in window["rss_mb"].items())
        say(f"  {window['end_s']:6.0f} s: answered {window['answered_fps']:6.1f} fps, age p99 "
            f"{window['age_p99_ms']:7.1f} ms; RSS {rss}")  # fmt: skip
        last = now
    return {"first": first, "last": last, "windows": windows}


def per_source(first: dict[str, Any], last: dict[str, Any], seconds: float) -> dict[str, dict[str, Any]]:
    """Each source's frames counted over the measurement, its answered fps and its decode cost per frame."""
    out: dict[str, dict[str, Any]] = {}
    for id, doc in sorted(last["sources"].items()):
        before = first["sources"].get(id, {}).get("frames", {})
        frames = {k: v - before.get(k, 0) for k, v in doc["frames"].items()}
        out[id] = {
            "state": doc["state"],
            "frames": frames,
            "answered_fps": frames["answered"] / seconds,
            "decoded_fps": frames["decoded"] / seconds,
            **{k: doc[k] for k in ("age_ms", "decode_ms_per_frame", "reconnects")},
        }
    return out


def judge(args: argparse.Namespace, run: dict[str, Any], pipeline: dict[str, Any]) -> dict[str, Any]:
    """Every figure and each target's verdict."""
    first, last, windows = run["first"], run["last"], run["windows"]
    seconds = last["at_s"] - first["at_s"]
    sources = per_source(first, last, seconds)
    answered = sum(s["answered_fps"] for s in sources.values())
    offered = float(args.sources * args.fps)
    capacity_fps = float(pipeline["pipeline_images_per_s"])
    ratio = answered / min(offered, capacity_fps)
    rates = [s["answered_fps"] for s in sources.values()]
    mean = sum(rates) / len(rates) if rates else 0.0
    fairness = min(rates) / mean if mean > 0 else 0.0
    p99_first, p99_last = windows[0]["age_p99_ms"], windows[-1]["age_p99_ms"]
    flat = abs(p99_last / p99_first - 1) if p99_first > 0 else float("nan")
    decode = [s["decode_ms_per_frame"] for s in sources.values() if s["decode_ms_per_frame"] is not None]
    rss = {
        role: {"start_mb": first["rss_mb"][role], "end_mb": last["rss_mb"][role],
               "growth": last["rss_mb"][role] / first["rss_mb"][role] - 1 if first["rss_mb"][role] else float("nan")}
        for role in first["rss_mb"]
    }  # fmt: skip
    cpu = {k: (last["cpu_s"][k] - first["cpu_s"][k]) / seconds for k in first["cpu_s"]}
    frames = {k: sum(s["frames"][k] for s in sources.values()) for k in next(iter(sources.values()))["frames"]}
    targets = {
        "throughput": {"value": ratio, "limit": args.min_share, "passed": ratio >= args.min_share},
        "fairness": {"value": fairness, "limit": args.min_share, "passed": fairness >= args.min_share},
        "flatness": {"value": flat, "limit": FLATNESS, "passed": flat <= FLATNESS},
        **{
            f"rss_growth_{role}": {"value": r["growth"], "limit": RSS_GROWTH,
                                   "passed": r["growth"] <= RSS_GROWTH}
            for role, r in rss.items() if r["start_mb"]
        },
    }  # fmt: skip
    return {
        "measured_s": seconds,
        "offered_fps": offered,
        "answered_fps": answered,
        "decoded_fps": sum(s["decoded_fps"] for s in sources.values()),
        "frames": frames,
        "capacity": {
            "images_per_s": capacity_fps,
            "how": "in-process pipeline, batch 8, JPEGs of the cameras' frames",
            "pipeline": pipeline,
        },
        "denominator": "offered" if offered <= capacity_fps else "capacity",
        "throughput_ratio": ratio,
        "fairness": fairness,
        "age_p99_ms_per_window": [w["age_p99_ms"] for w in windows],
        "flatness": flat,
        "decode_ms_per_frame": sum(decode) / len(decode) if decode else None,
        "rss": rss,
        "cpu_cores": cpu,
        "cores": os.cpu_count(),
        "sources": sources,
        "windows": windows,
        "targets": targets,
        "passed": all(t["passed"] for t in targets.values()),
    }


def report(args: argparse.Namespace, r: dict[str, Any], say: Say) -> None:
    verdict = {True: "PASS", False: "FAIL"}
    t, cpu = r["targets"], r["cpu_cores"]
    say(f"{args.sources} sources, {args.width}x{args.height} H.264 at {args.fps} fps (keyframe every {args.keyint}), "
        f"{'one shared mount' if args.mounts == 'shared' else 'a mount each'}, into {args.model}, "
        f"{r['measured_s']:.0f} s measured")  # fmt: skip
    for id, s in r["sources"].items():
        f = s["frames"]
        say(f"  {id:<8} answered {s['answered_fps']:6.2f} fps (decoded {f['decoded']}, skipped {f['skipped']}, "
            f"answered {f['answered']}, expired {f['expired']}, error {f['error']}), decode "
            f"{s['decode_ms_per_frame'] or 0:.2f} ms/frame, {s['reconnects']} reconnects, {s['state']}")  # fmt: skip
    bound = "the offered rate binds" if r["denominator"] == "offered" else "the capacity binds"
    say(f"{verdict[t['throughput']['passed']]} answered {r['answered_fps']:.1f} fps in all (decoded "
        f"{r['decoded_fps']:.1f}); offered {r['offered_fps']:.0f} fps ({args.sources} x {args.fps}); capacity "
        f"{r['capacity']['images_per_s']:.1f} images/s ({r['capacity']['how']}); answered / min(offered, capacity) "
        f"= {r['throughput_ratio']:.3f} ({bound}; target >= {args.min_share:g})")  # fmt: skip
    rates = [s["answered_fps"] for s in r["sources"].values()]
    say(f"{verdict[t['fairness']['passed']]} fairness: lowest {min(rates):.2f} fps / mean "
        f"{sum(rates) / len(rates):.2f} fps = {r['fairness']:.3f} (target >= {args.min_share:g})")  # fmt: skip
    p99 = ", ".join(f"{v:.1f}" for v in r["age_p99_ms_per_window"])
    first, last = r["age_p99_ms_per_window"][0], r["age_p99_ms_per_window"][-1]
    side = "above" if last > first else "below"
    say(f"{verdict[t['flatness']['passed']]} age p99 per {args.window_s:g} s (ms): {p99}; the last "
        f"{100 * r['flatness']:.1f}% {side} the first (target within 10% either way; the histogram's buckets are "
        f"1.5x apart); decode {r['decode_ms_per_frame'] or 0:.2f} "
        "ms/frame (mean over sources)")  # fmt: skip
    for role, m in r["rss"].items():
        target = t.get(f"rss_growth_{role}")
        say(f"{verdict[target['passed']] if target else '----'} {role} RSS {m['start_mb']:.1f} MiB after the "
            f"warm-up, {m['end_mb']:.1f} MiB at the end: {100 * m['growth']:+.1f}% (target <= +5%)")  # fmt: skip
    say(f"CPU, cores busy on average: RTSP server {cpu['cameras']:.2f}, visionserve {cpu['server']:.2f}, this "
        f"benchmark {cpu['bench']:.2f} (of {r['cores']} cores)")  # fmt: skip
    start, end = (", ".join(f"{x:.2f}" for x in r[k]) for k in ("load_average", "load_average_end"))
    say(f"load average (1, 5, 15 min) at the start and the end: {start} -> {end}")


def cameras_for(args: argparse.Namespace) -> RtspServer:
    mounts = 1 if args.mounts == "shared" else args.sources
    return RtspServer(mounts=mounts, width=args.width, height=args.height, fps=args.fps, keyint=args.keyint,
                      bitrate_kbps=args.bitrate_kbps)  # fmt: skip


def source_bodies(args: argparse.Namespace, cameras: RtspServer) -> list[dict[str, Any]]:
    same = {"model": args.model, "max_fps": args.max_fps}
    same |= {"max_age_ms": args.max_age_ms} if args.max_age_ms is not None else {}
    w, h = args.width, args.height  # two zones, the frame's left and right halves
    halves = [[[x, 0], [x + w / 2, 0], [x + w / 2, h], [x, h]] for x in (0, w / 2)]
    same |= (
        {"track": True, "zones": [{"id": f"z{i}", "polygon": p} for i, p in enumerate(halves)]} if args.track else {}
    )
    shared = args.mounts == "shared"
    return [{"url": cameras.url(0 if shared else k), "id": f"cam{k:02d}", **same} for k in range(args.sources)]


def main(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    if (why := rtsp_available()) is not None:
        say(f"cannot run the cameras: {why}")
        return 2
    source = Path(args.repository) / args.model
    if not source.is_dir():
        say(f"{args.repository} holds no model {args.model}")
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vs-sources-bench-"))
    versions = {int(p.name): p for p in source.iterdir() if p.is_dir() and p.name.isdigit()}
    config = (source / "config.toml").read_text() if (source / "config.toml").is_file() else ""
    repo = repository(work / "repository", {args.model: (versions, config)})
    results = header(config={k: v for k, v in vars(args).items() if not callable(v)}, load_average=os.getloadavg())
    results["work"] = str(work)  # the server's log, the repository and the frames
    with cameras_for(args) as cameras:
        images = work / "frames"
        grab_frames(cameras.url(0), images, FRAMES_GRABBED)
        idle_cpu = launcher.tree_cpu_s(cameras.pid)
        options = argparse.Namespace(model=args.model, repository=args.repository, bench_seconds=args.capacity_seconds)
        pipeline = in_process(options, images)  # the in-process detection pipeline at batch 8
        say(f"capacity: in-process pipeline (batch {PIPELINE_BATCH}, {FRAMES_GRABBED} JPEGs of the cameras' frames) "
            f"{pipeline['pipeline_images_per_s']:.1f} images/s (RTSP server with no client meanwhile: "
            f"{launcher.tree_cpu_s(cameras.pid) - idle_cpu:.2f} s CPU)")  # fmt: skip
        token = secrets.token_hex(16)
        with launcher.start(repo, "--admin-token", token, workers=args.workers, log=work / "server.log") as running:
            server = Server(running, token, args.model)
            results["start_retries"] = server.start_sources(source_bodies(args, cameras), timeout_s=120)
            say(f"{args.sources} sources running ({results['start_retries']} retried to start); warming up "
                f"{args.warmup_s:g} s, then {args.minutes:g} min measured")  # fmt: skip
            time.sleep(args.warmup_s)
            results.update(judge(args, measure(args, server, cameras, say), pipeline))
            results["exit_code"] = running.stop()
    results["load_average_end"] = os.getloadavg()
    report(args, results, say)
    return conclude(results, began, args.out, as_json=args.json)
