"""Real video sources for tests, with no network beyond 127.0.0.1: an H.264 MP4 file, an HTTP MJPEG stream and a
live RTSP server (loadtest/cameras.py's handle on loadtest/rtsp_server.py, run by Debian's Python with GStreamer;
re-exported here, as the benchmark of sources uses it too and must not import tests).

    path = write_mp4(tmp_path / "clip.mp4", frames=60, fps=15)
    with MjpegServer(fps=10) as mjpeg:
        av.open(mjpeg.url, format="mpjpeg")
    with RtspServer(mounts=2) as rtsp:
        av.open(rtsp.url(1), options={"rtsp_transport": "tcp"})
"""

from __future__ import annotations

import io
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Self

import av
import numpy as np
from PIL import Image

from loadtest.cameras import (
    CANNOT_LISTEN,
    HOST,
    RTSP_CHECK,
    RTSP_SCRIPT,
    SYSTEM_PYTHON,
    RtspServer,
    rtsp_available,
)

__all__ = [
    "CANNOT_LISTEN",
    "HOST",
    "RTSP_CHECK",
    "RTSP_SCRIPT",
    "SYSTEM_PYTHON",
    "MjpegServer",
    "RtspServer",
    "jpeg",
    "moving_picture",
    "rtsp_available",
    "write_mp4",
]


def moving_picture(index: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """An RGB uint8 picture that changes with ``index``: a gradient drifting sideways and a bright square crossing
    it, over noise fixed by ``seed`` (so every frame differs from the one before, as a camera's do)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    noise = rng.integers(0, 24, size=(height, width, 1), dtype=np.int64)
    shift = index * 4
    base = np.stack([(xx + shift) % 256, yy * 255 // max(height - 1, 1), (xx + yy + 2 * shift) % 256], axis=-1)
    picture = np.clip(base + noise, 0, 255).astype(np.uint8)
    side = max(min(width, height) // 6, 2)
    left = (index * 7) % max(width - side, 1)
    top = (index * 5) % max(height - side, 1)
    picture[top : top + side, left : left + side] = (255, 255, 0)
    return picture


def write_mp4(
    path: str | Path,
    *,
    frames: int = 60,
    fps: int = 15,
    width: int = 320,
    height: int = 240,
    keyint: int = 15,
    seed: int = 0,
) -> Path:
    """An H.264 (libx264, yuv420p) MP4 of ``frames`` moving pictures that plays at ``fps``, with a keyframe at least
    every ``keyint`` frames; written with PyAV, as the server will read it. Returns the path."""
    path = Path(path)
    time_base = Fraction(1, fps)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = time_base
        stream.codec_context.gop_size = keyint
        # veryfast keeps B-frames (as most files have: decode order differs from display order), unlike ultrafast
        stream.options = {"preset": "veryfast", "keyint_min": str(min(keyint, 2)), "sc_threshold": "0"}
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(moving_picture(index, width, height, seed), format="rgb24")
            frame.pts, frame.time_base = index, time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def jpeg(picture: np.ndarray, quality: int = 80) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


class MjpegServer:
    """An HTTP MJPEG camera on 127.0.0.1 (a free port): ``GET /stream.mjpg`` answers
    ``multipart/x-mixed-replace`` with one JPEG part every ``1 / fps`` s, as IP cameras do. Each connection ends
    after ``max_frames`` parts or when the server stops; a client that goes away ends only its own stream.
    ``frames_sent`` counts parts sent over all connections. Use it as a context manager (or start/stop)."""

    BOUNDARY = "visionserveframe"
    PATH = "/stream.mjpg"
    CYCLE = 30  # distinct pictures, encoded once at start: sending costs no encoding
    SEND_TIMEOUT_S = 5.0  # a client that stops reading is dropped after this, so stop() never waits on it

    def __init__(self, *, fps: float = 15.0, width: int = 320, height: int = 240, max_frames: int = 1000) -> None:
        if fps <= 0 or max_frames < 1:
            raise ValueError(f"fps must be > 0 and max_frames >= 1, got fps={fps}, max_frames={max_frames}")
        self.fps, self.width, self.height, self.max_frames = fps, width, height, max_frames
        self.frames = [jpeg(moving_picture(index, width, height)) for index in range(self.CYCLE)]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the MJPEG server is not started")
        return f"http://{HOST}:{self._httpd.server_address[1]}{self.PATH}"

    @property
    def frames_sent(self) -> int:
        with self._lock:
            return self._sent

    def start(self) -> Self:
        if self._httpd is not None:
            raise RuntimeError("the MJPEG server is already started")
        self._stopping.clear()
        self._httpd = ThreadingHTTPServer((HOST, 0), self._handler())
        self._httpd.daemon_threads = False  # server_close() joins each connection's thread
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="mjpeg-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends every stream (each within one frame interval, or SEND_TIMEOUT_S for a client that stopped reading)
        and closes the socket."""
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        self._httpd = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _count(self) -> None:
        with self._lock:
            self._sent += 1

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = server.SEND_TIMEOUT_S

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != server.PATH:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace;boundary={server.BOUNDARY}")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                start = time.monotonic()
                try:
                    for index in range(server.max_frames):
                        # each part at its own time from the start, so the rate does not drift with send times
                        delay = start + index / server.fps - time.monotonic()
                        if server._stopping.wait(max(delay, 0.0)):
                            return
                        picture = server.frames[index % len(server.frames)]
                        head = f"--{server.BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(picture)}"
                        self.wfile.write(head.encode() + b"\r\n\r\n" + picture + b"\r\n")
                        self.wfile.flush()
                        server._count()
                except OSError:  # the client went away (reset, broken pipe) or stopped reading (timeout)
                    return

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
