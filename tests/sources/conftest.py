"""Fixtures for camera sources: a live RTSP server, an MP4 file and an HTTP MJPEG stream (tests/sources/video.py).

The RTSP fixtures need GStreamer under Debian's Python (scripts/install-video.sh installs it); without it they skip
with the reason, or fail where VISIONSERVE_REQUIRE_RTSP=1 says it must be there (CI).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sources.video import MjpegServer, RtspServer, rtsp_available, write_mp4


def require_rtsp() -> None:
    """Skips the test (fails it under VISIONSERVE_REQUIRE_RTSP=1) when rtsp_server.py cannot run here."""
    reason = rtsp_available()
    if reason is None:
        return
    if os.environ.get("VISIONSERVE_REQUIRE_RTSP") == "1":
        pytest.fail(f"VISIONSERVE_REQUIRE_RTSP=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def rtsp_server() -> Iterator[RtspServer]:
    """A running RTSP server shared by a module's tests: mounts /cam0 and /cam1, 640x480 at 15 fps, a keyframe every
    15 frames. Tests must not kill it; :func:`own_rtsp_server` is one to kill."""
    require_rtsp()
    with RtspServer(mounts=2) as server:
        yield server


@pytest.fixture
def own_rtsp_server() -> Iterator[RtspServer]:
    """A running RTSP server (one mount, 640x480 at 15 fps) for one test, which may kill and restart it."""
    require_rtsp()
    with RtspServer() as server:
        yield server


@pytest.fixture
def mp4_file(tmp_path: Path) -> Path:
    """An H.264 MP4: 60 frames of 320x240 at 15 fps (4 s), a keyframe every 15 frames."""
    return write_mp4(tmp_path / "clip.mp4")


@pytest.fixture
def mjpeg_server() -> Iterator[MjpegServer]:
    """An HTTP MJPEG camera at 15 fps, 320x240, each connection ending after 1000 frames; ``.url`` to open."""
    with MjpegServer() as server:
        yield server
