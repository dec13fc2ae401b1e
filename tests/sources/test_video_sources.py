"""The test video sources work as the server will use them: opened and decoded by PyAV (FFmpeg), RTSP over TCP
included, and an RTSP server killed and restarted on its port serves again."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from service.launcher import tree_cpu_s
from tests.sources.conftest import require_rtsp
from tests.sources.video import MjpegServer, RtspServer, rtsp_available, write_mp4

ROOT = Path(__file__).resolve().parents[2]
RTSP_OPTIONS = {"rtsp_transport": "tcp"}
TIMEOUT_S = (5.0, 5.0)  # PyAV's (open, read) timeouts: a read that waits longer raises instead of hanging
DEADLINE_S = 60.0  # for any one client to get what it waits for, however busy the machine


@dataclass
class Watch:
    """What one client saw: decoded frames, and the index of the first keyframe packet among those it received."""

    frames: list[np.ndarray] = field(default_factory=list)
    sizes: set[tuple[int, int]] = field(default_factory=set)
    packets: int = 0
    first_keyframe_packet: int | None = None
    decode_errors: int = 0  # packets FFmpeg would not decode, passed over
    error: BaseException | None = None


def watch(url: str, frames: int, into: Watch, *, keep: int = 2, options: dict[str, str] | None = None) -> Watch:
    """Opens ``url`` and decodes until ``frames`` frames came (or DEADLINE_S passed), keeping the first ``keep``
    pictures and the ``frames``-th; an exception is kept in ``into.error`` rather than raised (for threads)."""
    deadline = time.monotonic() + DEADLINE_S
    count = 0
    try:
        with av.open(url, options=options, timeout=TIMEOUT_S) as container:
            for packet in container.demux(video=0):
                if packet.size == 0:  # the demuxer's flush packet: the stream ended
                    break
                if packet.is_keyframe and into.first_keyframe_packet is None:
                    into.first_keyframe_packet = into.packets
                into.packets += 1
                try:
                    decoded = packet.decode()
                except av.error.InvalidDataError:  # a packet of a shared stream being prepared again for a newcomer:
                    into.decode_errors += 1  # passed over, as the server's reader passes it over
                    continue
                for frame in decoded:
                    count += 1
                    into.sizes.add((frame.width, frame.height))
                    if len(into.frames) < keep or count == frames:
                        into.frames.append(frame.to_ndarray(format="rgb24"))
                if count >= frames or time.monotonic() > deadline:
                    break
    except Exception as exc:
        into.error = exc
    return into


def test_rtsp_over_tcp_decodes_640x480_moving_frames_with_an_early_keyframe(rtsp_server: RtspServer) -> None:
    seen = watch(rtsp_server.url(), 20, Watch(), options=RTSP_OPTIONS)
    assert seen.error is None and len(seen.frames) == 3 and seen.sizes == {(640, 480)}, (seen.error, seen.sizes)
    # a keyframe among the first 2 s of packets (one packet per frame at 15 fps)
    assert seen.first_keyframe_packet is not None and seen.first_keyframe_packet < 2 * 15, seen.first_keyframe_packet
    assert not np.array_equal(seen.frames[0], seen.frames[-1])  # the picture moves


def test_two_rtsp_clients_at_once_both_decode_and_a_late_one_soon_gets_a_keyframe(rtsp_server: RtspServer) -> None:
    first, second = Watch(), Watch()
    early = threading.Thread(target=watch, args=(rtsp_server.url(1), 40, first), kwargs={"options": RTSP_OPTIONS})
    early.start()
    deadline = time.monotonic() + DEADLINE_S
    while len(first.frames) < 2 and early.is_alive() and time.monotonic() < deadline:  # it is decoding
        time.sleep(0.02)
    # joins a stream already running (the media is shared): it starts mid-GOP, yet sees a keyframe within 2 s
    watch(rtsp_server.url(1), 20, second, options=RTSP_OPTIONS)
    early.join(DEADLINE_S)
    for seen in (first, second):
        assert seen.error is None and seen.sizes == {(640, 480)} and len(seen.frames) == 3, (seen.error, seen.sizes)
    assert second.first_keyframe_packet is not None and second.first_keyframe_packet < 2 * 15


def test_a_killed_rtsp_server_restarts_on_its_port_and_serves_again(own_rtsp_server: RtspServer) -> None:
    server = own_rtsp_server
    port = server.port
    with av.open(server.url(), options=RTSP_OPTIONS, timeout=TIMEOUT_S) as container:
        packets = container.demux(video=0)
        assert any(packet.decode() for packet, _ in zip(packets, range(60), strict=False))
        server.kill()
        # the connection is reset: the demuxer ends (a flush packet) or raises, within its 5 s read timeout
        after = 0
        try:
            for packet in packets:
                if packet.size == 0:
                    break
                after += 1  # what was already buffered
                assert after < 200, "packets keep coming from a killed server"
        except av.error.FFmpegError:
            pass
    started = time.monotonic()
    server.restart()
    restarted = time.monotonic()
    with av.open(server.url(), options=RTSP_OPTIONS, timeout=TIMEOUT_S) as container:
        opened = time.monotonic()
        frame = next(container.decode(video=0))
    first = time.monotonic()
    assert server.port == port and (frame.width, frame.height) == (640, 480)
    print(
        f"\nRTSP restart: restart() took {restarted - started:.3f} s; from its return, open {opened - restarted:.3f} s,"
        f" first decoded frame {first - restarted:.3f} s"
    )


def test_the_mp4_decodes_every_frame_at_its_size_and_rate(tmp_path: Path) -> None:
    path = write_mp4(tmp_path / "clip.mp4", frames=45, fps=12, width=160, height=96, keyint=10)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        assert stream.average_rate == 12
    assert len(frames) == 45 and {(f.width, f.height) for f in frames} == {(160, 96)}
    times = [f.pts * f.time_base for f in frames if f.pts is not None and f.time_base is not None]
    assert len(times) == 45 and times[0] == 0 and {b - a for a, b in itertools.pairwise(times)} == {Fraction(1, 12)}
    assert sum(f.key_frame for f in frames) >= 45 // 10  # a keyframe at least every keyint frames
    assert not np.array_equal(frames[0].to_ndarray(format="rgb24"), frames[1].to_ndarray(format="rgb24"))


def test_the_mp4_fixture(mp4_file: Path) -> None:
    with av.open(str(mp4_file)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 60


def test_mjpeg_opens_in_pyav_and_survives_clients_leaving(mjpeg_server: MjpegServer) -> None:
    for format in (None, "mpjpeg"):  # FFmpeg finds mpjpeg on its own; naming it works too
        with av.open(mjpeg_server.url, format=format, timeout=TIMEOUT_S) as container:
            assert container.format.name == "mpjpeg"
            frames = [frame for frame, _ in zip(container.decode(video=0), range(5), strict=False)]
        # closed mid-stream: the server's write fails, which must end that stream only
        assert [(f.width, f.height) for f in frames] == [(320, 240)] * 5
        assert not np.array_equal(frames[0].to_ndarray(format="rgb24"), frames[-1].to_ndarray(format="rgb24"))
    assert mjpeg_server.frames_sent >= 10


def test_an_mjpeg_stream_ends_after_max_frames() -> None:
    with MjpegServer(fps=50, width=64, height=48, max_frames=4) as server:
        decoded = 0
        # FFmpeg's mpjpeg demuxer reports a stream the camera closed as an I/O error (EIO), not as its end
        with (
            av.open(server.url, timeout=TIMEOUT_S) as container,
            pytest.raises(av.error.OSError) as raised,
        ):
            for _ in container.decode(video=0):
                decoded += 1
        assert raised.value.errno == errno.EIO and decoded == 4 and server.frames_sent == 4


@pytest.mark.slow
def test_one_rtsp_mount_feeds_16_tcp_clients(rtsp_server: RtspServer) -> None:
    """Every client gets frames from one shared encode; prints the server's CPU use while they watch."""
    clients = 16
    frames = 150  # 10 s at 15 fps
    seen = [Watch() for _ in range(clients)]
    threads = [
        threading.Thread(
            target=watch, args=(rtsp_server.url(0), frames, s), kwargs={"options": RTSP_OPTIONS, "keep": 0}
        )
        for s in seen
    ]
    cpu_before, started = tree_cpu_s(rtsp_server.pid), time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S + 30)
    cpu_s, wall_s = tree_cpu_s(rtsp_server.pid) - cpu_before, time.monotonic() - started
    assert [s.error for s in seen] == [None] * clients
    assert [len(s.frames) for s in seen] == [1] * clients  # each decoded all `frames` (the last is kept)
    print(f"\nRTSP server, 1 mount 640x480@15 to {clients} TCP clients: {cpu_s:.2f} s CPU in {wall_s:.1f} s "
          f"({100 * cpu_s / wall_s:.1f}% of one core)")  # fmt: skip


def test_install_video_is_quiet_when_everything_is_there() -> None:
    if rtsp_available() is not None:
        require_rtsp()
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-video.sh")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == done.stderr == "", (done.stdout, done.stderr)
    assert os.access(ROOT / "scripts" / "install-video.sh", os.X_OK)


def test_a_realtime_files_frame_is_aged_from_its_play_time_not_from_its_decode(tmp_path: Path) -> None:
    """At 2 fps the reader decodes each frame up to half a second before it plays: its age starts when it is handed
    on (at its play time), so a frame is not old before anyone could have seen it (every frame of a 1 fps file was
    past the default 500 ms age limit once)."""
    from service.frontend.sources.reader import Pace, Picture, Reader
    from service.frontend.sources.urls import check_url

    clip = write_mp4(tmp_path / "slow.mp4", frames=4, fps=2, width=160, height=120)
    url = check_url(f"file://{clip}", source_root=tmp_path)
    handed: list[tuple[Picture, float]] = []
    states: list[str] = []
    ended = threading.Event()

    def on_state(state: str, _reason: str) -> None:
        states.append(state)
        if state in ("ended", "failed"):
            ended.set()

    reader = Reader(url, name="slow", hand=lambda p: handed.append((p, time.perf_counter())), on_state=on_state,
                    on_skip=lambda: None, pace=Pace(realtime=True), max_pixels=10**7, connect_timeout_s=5,
                    read_timeout_s=5)  # fmt: skip
    reader.start()
    try:
        assert ended.wait(DEADLINE_S), states
    finally:
        reader.stop()
        assert reader.join(DEADLINE_S)
    assert states[-1] == "ended" and len(handed) == 4, (states, handed)
    first = handed[0][0]
    for picture, at in handed:
        assert picture.pts is not None and first.pts is not None
        # nothing runs between reading the clock and handing the frame on but a comparison: no machine makes
        # this a quarter of a frame's 500 ms interval, while decoding ahead made it most of it
        assert at - picture.decoded < 0.125, (picture.index, at - picture.decoded)
        # and the frame was handed on no earlier than its play time
        assert picture.decoded - first.decoded >= picture.pts - first.pts - 0.01, picture.index
