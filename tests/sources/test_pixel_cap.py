"""A stream whose frames are over the pixel cap (``--source-max-pixels``) is refused from its header, before a
single frame is decoded (issue 53, "Limits before cost"): an oversized camera costs neither a decode nor a frame
buffer, only the probe FFmpeg makes to open it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from service.frontend.sources.reader import Pace, Picture, Reader
from service.frontend.sources.urls import check_url
from tests.sources.video import MjpegServer, write_mp4

DEADLINE_S = 60.0  # for the reader to fail, however busy the machine


def refused(target: str, tmp_path: Path) -> tuple[Reader, list[tuple[str, str]], list[Picture]]:
    """Runs a reader with a cap of 10,000 pixels on ``target`` until it ends or fails."""
    url = check_url(target, source_root=tmp_path)
    states: list[tuple[str, str]] = []
    handed: list[Picture] = []
    done = threading.Event()

    def on_state(state: str, reason: str) -> None:
        states.append((state, reason))
        if state in ("ended", "failed"):
            done.set()

    reader = Reader(url, name="big", hand=handed.append, on_state=on_state, on_skip=lambda: None,
                    pace=Pace(realtime=True), max_pixels=10_000, connect_timeout_s=5, read_timeout_s=5)  # fmt: skip
    reader.start()
    try:
        assert done.wait(DEADLINE_S), states
    finally:
        reader.stop()
        assert reader.join(DEADLINE_S)
    return reader, states, handed


@pytest.mark.parametrize("kind", ["mp4", "mjpeg"])
def test_a_stream_over_the_pixel_cap_is_refused_from_its_header_before_any_frame_is_decoded(
    kind: str, tmp_path: Path
) -> None:
    if kind == "mp4":
        clip = write_mp4(tmp_path / "big.mp4", frames=8, width=160, height=120)
        reader, states, handed = refused(f"file://{clip}", tmp_path)
    else:
        with MjpegServer(fps=30, width=160, height=120) as camera:
            reader, states, handed = refused(camera.url, tmp_path)
    state, reason = states[-1]
    assert state == "failed", states
    assert "header" in reason and "160x120" in reason and "10000" in reason, reason
    # nothing decoded, nothing handed on, no time spent decoding: refused before the first packet's decode
    assert reader.decoded == 0 and reader.decode_s == 0.0 and handed == [], (reader.decoded, reader.decode_s)
    assert "running" not in [s for s, _ in states]


def test_a_stream_under_the_cap_is_not_refused(tmp_path: Path) -> None:
    clip = write_mp4(tmp_path / "small.mp4", frames=4, width=96, height=96)  # 9,216 pixels, under 10,000
    reader, states, handed = refused(f"file://{clip}", tmp_path)
    assert states[-1][0] == "ended" and reader.decoded == 4 and len(handed) == 4, states
