"""The URL policy of pulled sources: every refusal, masking, and av.open reading (or not reading) with its options.

The servers here are threads on 127.0.0.1 free ports; the videos are written with PyAV's libx264 into tmp_path.
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from service.core.errors import BadInputError
from service.frontend.sources.urls import ALLOWED_SCHEMES, SourceUrl, check_url, mask

SECRET = "s3cretPW"
MJPEG_FRAMES = 60  # the MJPEG route sends this many frames, then ends: a bounded stream


class Routes(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 answering fixed bodies by path, and ``/mjpeg`` as multipart/x-mixed-replace."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies: dict[str, tuple[str, bytes]] = {}
        self.asked: list[str] = []
        self.base = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Routes

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.server.asked.append(path)
        if path == "/mjpeg":
            self._mjpeg()
            return
        if path not in self.server.bodies:
            self.send_error(404)
            return
        content_type, body = self.server.bodies[path]
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _mjpeg(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
        self.end_headers()
        try:
            for i in range(MJPEG_FRAMES):
                jpeg = io.BytesIO()
                Image.fromarray(np.full((48, 64, 3), i * 4, np.uint8)).save(jpeg, "JPEG")
                part = jpeg.getvalue()
                head = f"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: {len(part)}\r\n\r\n".encode()
                self.wfile.write(head + part + b"\r\n")
        except OSError:  # the reader went away after the frames it wanted
            pass


@pytest.fixture
def routes() -> Iterator[Routes]:
    server = Routes()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def write_video(path: Path, fmt: str, frames: int = 10, options: dict[str, str] | None = None) -> None:
    """A tiny H.264 video (64x48, 10 fps) written with PyAV in container ``fmt``."""
    with av.open(str(path), "w", format=fmt, options=options or {}) as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20 % 256, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def read_frames(target: str, fmt: str | None, options: dict[str, str], wanted: int = 3) -> int:
    """How many video frames (up to ``wanted``) av.open reads from ``target``; raises what av.open raises."""
    count = 0
    with av.open(target, format=fmt, options=dict(options), timeout=(5.0, 5.0)) as container:
        for _ in container.decode(video=0):
            count += 1
            if count >= wanted:
                break
    return count


def read_source(url: SourceUrl, wanted: int = 3) -> int:
    return read_frames(url.target, url.format, url.options, wanted)


def playlist(*segments: str) -> tuple[str, bytes]:
    lines = ["#EXTM3U", "#EXT-X-VERSION:3", "#EXT-X-TARGETDURATION:2", "#EXT-X-MEDIA-SEQUENCE:0"]
    for segment in segments:
        lines += ["#EXTINF:1.0,", segment]
    return "application/vnd.apple.mpegurl", ("\n".join([*lines, "#EXT-X-ENDLIST", ""])).encode()


def refused(url: object, **kwargs: object) -> str:
    """The message of the BadInputError that check_url raises for ``url``; it never holds the secret."""
    kwargs.setdefault("source_root", None)
    with pytest.raises(BadInputError) as caught:
        check_url(url, **kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert SECRET not in message
    assert caught.value.http_status == 400
    return message


# Masking


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("rtsp://user:pass@host:554/x", "rtsp://***@host:554/x"),
        ("rtsp://admin@cam/live", "rtsp://***@cam/live"),
        ("rtsp://u:pa/ss@cam/x", "rtsp://***@cam/x"),  # an unencoded '/' in the password
        ("rtsp:u:pass@cam/x", "rtsp:***@cam/x"),
        ("http://cam/mjpeg?token=abc&fps=5&api_key=k1&Signature=zz#f", "http://cam/mjpeg?token=***&fps=***&api_key=***&Signature=***#f"),
        ("https://cam/x?password=p&auth=a&user=u", "https://cam/x?password=***&auth=***&user=***"),
        ("rtsp://cam:554/live", "rtsp://cam:554/live"),
        ("http://cam/x?fps=5", "http://cam/x?fps=***"),  # every query value: a secret need not be named like one
        ("http://cam/x?SECRET&a=", "http://cam/x?***&a=***"),  # a parameter without '=' is a value
        ("file:///videos/a.mp4", "file:///videos/a.mp4"),
        # An '@' past the authority separates nothing: the host stays, the query's values go.
        ("http://cam/x?user=a@b.com&token=SECRET", "http://cam/x?user=***&token=***"),
        ("http://u:p@cam:8080/x@2x.jpg?t=a@b", "http://***@cam:8080/x@2x.jpg?t=***"),
        ("http://a@b:pw@cam/x", "http://***@cam/x"),  # the last '@' of the authority
        ("rtsp://u:p#ss@cam/x", "rtsp://***@cam/x"),  # an unencoded '#' in the password (a port that is no number)
        ("http://u:p?ss@cam/x?t=1", "http://***@cam/x?t=***"),  # an unencoded '?'
        ("http://[::1]:8554/x?t=1", "http://[::1]:8554/x?t=***"),
        ("user:pw@host/x", "***@host/x"),  # no scheme: 'user' is no scheme but a user name
    ],
)  # fmt: skip
def test_mask(url: str, shown: str) -> None:
    assert mask(url) == shown


def test_shown_is_masked_and_given_kept() -> None:
    url = check_url(f"rtsp://user:{SECRET}@cam.local:554/live?token={SECRET}", source_root=None)
    assert url.shown == "rtsp://***@cam.local:554/live?token=***"
    assert SECRET in url.given and SECRET in url.target  # av.open needs them; only shown is ever displayed


def test_a_message_naming_the_url_or_its_secrets_is_redacted() -> None:
    url = check_url(f"http://camuser:{SECRET}%21@127.0.0.1:9/x?token={SECRET}", source_root=None)
    said = f"Connection refused: '{url.given}' (user camuser, password {SECRET}!)"
    redacted = url.redact(said)
    assert SECRET not in redacted and "camuser" not in redacted
    assert url.shown == "http://***@127.0.0.1:9/x?token=***"
    assert redacted.startswith(f"Connection refused: '{url.shown}'")


# Refusals


@pytest.mark.parametrize(
    "url",
    [
        f"ftp://user:{SECRET}@host/x.mp4",
        "concat:/etc/passwd|/etc/hostname",
        "data:video/mp4;base64,AAAA",
        "pipe:0",
        "unix:/tmp/socket",
        "subfile,,start,0,end,10,,:/etc/passwd",
        "gopher://host/x",
        "tcp://127.0.0.1:9/x",
        "hls+http://host/x.m3u8",
        "/etc/passwd",
        f"admin:{SECRET}@cam/live",
    ],
)
def test_unknown_schemes_are_refused(url: str) -> None:
    message = refused(url)
    assert "scheme" in message and "allowed schemes: rtsp, rtsps, http, https, file" in message
    assert "admin" not in message


@pytest.mark.parametrize(
    "url", ["rtsp:///live", "rtsp:live", f"http://user:{SECRET}@/x", "https://", "rtsps://:554/x", "http:/x"]
)
def test_network_urls_need_a_host(url: str) -> None:
    message = refused(url)
    assert "has no host" in message and "://host[:port]/path" in message


def test_an_invalid_port_is_refused() -> None:
    message = refused(f"rtsp://user:{SECRET}@cam:notaport/live")
    assert "invalid host or port" in message and "rtsp://***@cam:notaport/live" in message
    assert "percent-encoded" in refused(f"rtsp://user:{SECRET[:3]}#{SECRET[3:]}@cam/live")


def test_a_password_with_an_unencoded_slash_is_never_shown() -> None:
    message = refused(f"rtsp://user:ab/{SECRET}@cam/live")  # urlsplit sees host "user", port "ab"
    assert "rtsp://***@cam/live" in message


@pytest.mark.parametrize("value", [42, None, b"rtsp://cam/x", ["rtsp://cam/x"]])
def test_non_strings_are_refused(value: object) -> None:
    assert "must be a string" in refused(value)


def test_empty_and_over_long_urls_are_refused() -> None:
    assert "empty" in refused("")
    message = refused(f"rtsp://user:{SECRET}@cam/" + "x" * 2100)
    assert "at most 2048" in message
    check_url("rtsp://cam/" + "x" * (2048 - len("rtsp://cam/")), source_root=None)  # 2048 exactly passes


@pytest.mark.parametrize(
    "url",
    [
        f"rtsp://user:{SECRET}@cam/live stream",
        "rtsp://cam/live\n",
        "rtsp://cam/live\r\nX-Header: 1",
        "rtsp://cam/\tlive",
        "rtsp://cam/live\x00.mp4",
        "http://cam/\x7f",
        "http://cam/\u200bx",  # zero-width space (format character)
        " rtsp://cam/live",
    ],
)
def test_whitespace_and_control_characters_are_refused(url: str) -> None:
    assert "whitespace or a control character" in refused(url)


@pytest.mark.parametrize("transport", ["http", "TCP", "udp_multicast", ""])
def test_unknown_rtsp_transports_are_refused(transport: str) -> None:
    message = refused("rtsp://cam/live", rtsp_transport=transport)
    assert "rtsp_transport must be one of tcp, udp" in message


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A source root holding clip.mp4 and sub/clip.mp4, beside an outside/ folder holding secret.mp4."""
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    write_video(tmp_path / "root" / "clip.mp4", "mp4")
    write_video(tmp_path / "outside" / "secret.mp4", "mp4")
    os.link(tmp_path / "root" / "clip.mp4", tmp_path / "root" / "sub" / "clip.mp4")
    return tmp_path / "root"


def test_file_urls_need_a_source_root(root: Path) -> None:
    message = refused(f"file://{root}/clip.mp4", source_root=None)
    assert "start the server with --source-root DIR" in message


@pytest.mark.parametrize(
    "form", ["file:clip.mp4", "file:./clip.mp4", "file://localhost/{root}/clip.mp4", "file:/{root}"]
)
def test_file_urls_are_absolute_without_host(root: Path, form: str) -> None:
    message = refused(form.format(root=root), source_root=root)
    assert "file:///absolute/path" in message


def test_file_urls_take_no_query(root: Path) -> None:
    assert "no query or fragment" in refused(f"file://{root}/clip.mp4?x=1", source_root=root)
    assert "no query or fragment" in refused(f"file://{root}/clip.mp4#t=1", source_root=root)


def test_files_outside_the_root_are_refused(root: Path) -> None:
    outside = root.parent / "outside" / "secret.mp4"
    for url in [f"file://{root}/../outside/secret.mp4", f"file://{outside}", "file:///etc/hostname"]:
        assert "outside the source root" in refused(url, source_root=root)
    # The containment is checked before existence: a refusal does not tell whether the file outside exists.
    assert "outside the source root" in refused("file:///no/such/file.mp4", source_root=root)


def test_a_symlink_out_of_the_root_is_refused(root: Path) -> None:
    (root / "escape.mp4").symlink_to(root.parent / "outside" / "secret.mp4")
    (root / "escape_dir").symlink_to(root.parent / "outside", target_is_directory=True)
    assert "outside the source root" in refused(f"file://{root}/escape.mp4", source_root=root)
    assert "outside the source root" in refused(f"file://{root}/escape_dir/secret.mp4", source_root=root)
    # A root given through a symlink is resolved too: files under its target are inside.
    (root.parent / "root_link").symlink_to(root, target_is_directory=True)
    inside = check_url(f"file://{root}/clip.mp4", source_root=root.parent / "root_link")
    assert inside.target == str((root / "clip.mp4").resolve())


def test_missing_files_directories_and_devices_are_refused(root: Path) -> None:
    assert "does not exist" in refused(f"file://{root}/missing.mp4", source_root=root)
    assert "is a directory" in refused(f"file://{root}/sub", source_root=root)
    os.mkfifo(root / "pipe.mp4")
    assert "not a regular file" in refused(f"file://{root}/pipe.mp4", source_root=root)


def test_percent_encoded_controls_in_file_paths_are_refused(root: Path) -> None:
    assert "control character" in refused(f"file://{root}/clip.mp4%00.txt", source_root=root)
    assert "control character" in refused(f"file://{root}/clip%0a.mp4", source_root=root)


# What check_url gives back


def test_rtsp_options() -> None:
    url = check_url("RTSP://cam:554/live", source_root=None, read_timeout_s=2.5)
    assert (url.scheme, url.target, url.live, url.format) == ("rtsp", "rtsp://cam:554/live", True, None)
    probe = {"analyzeduration": "300000"}
    assert url.options == {"protocol_whitelist": "tcp", "rtsp_transport": "tcp", "timeout": "2500000", **probe}
    udp = check_url("rtsp://cam/live", source_root=None, rtsp_transport="udp").options
    assert udp == {"protocol_whitelist": "rtp,udp,tcp", "rtsp_transport": "udp", "timeout": "5000000", **probe}
    assert check_url("rtsps://cam/live", source_root=None).options["protocol_whitelist"] == "tls,tcp"
    assert check_url("rtsps://cam/x", source_root=None, rtsp_transport="udp").options["protocol_whitelist"] == (
        "rtp,udp,tls,tcp"
    )


def test_http_options() -> None:
    for scheme in ("http", "https"):
        url = check_url(f"{scheme}://cam/video.mjpg", source_root=None, read_timeout_s=3)
        assert url.options == {
            "protocol_whitelist": "http,https,tcp,tls,crypto",
            "timeout": "3000000",
            "rw_timeout": "3000000",
            "analyzeduration": "300000",
        }
        assert url.live and url.format is None
    # The transport applies to RTSP only.
    assert "rtsp_transport" not in check_url("http://cam/x", source_root=None, rtsp_transport="udp").options


def test_whitelists_never_name_file_for_network_schemes() -> None:
    for scheme in ALLOWED_SCHEMES[:-1]:
        for transport in ("tcp", "udp"):
            options = check_url(f"{scheme}://cam/x", source_root=None, rtsp_transport=transport).options
            assert "file" not in options["protocol_whitelist"].split(",")


# Reading with the options: positive per scheme


def test_a_file_in_the_root_is_read(root: Path) -> None:
    url = check_url(f"file://{root}/sub/../sub/clip.mp4", source_root=root)
    assert (url.scheme, url.live, url.format) == ("file", False, None)
    assert url.target == str((root / "sub" / "clip.mp4").resolve())
    assert url.options["protocol_whitelist"] == "file"
    assert read_source(url) == 3
    (root / "inner_link.mp4").symlink_to(root / "clip.mp4")  # a symlink that stays inside is fine
    assert read_source(check_url(f"file://{root}/inner_link.mp4", source_root=root)) == 3
    spaced = root / "a clip.mp4"
    spaced.write_bytes((root / "clip.mp4").read_bytes())
    assert check_url(f"file://{root}/a%20clip.mp4", source_root=root).target == str(spaced.resolve())


def test_a_playlist_file_in_the_root_cannot_reach_outside(root: Path) -> None:
    write_video(root.parent / "outside" / "secret.ts", "mpegts")
    content = playlist(f"file://{root.parent}/outside/secret.ts")[1]
    (root / "evil.m3u8").write_bytes(content)
    url = check_url(f"file://{root}/evil.m3u8", source_root=root)
    with pytest.raises(av.error.FFmpegError):  # "Format not on whitelist" (in FFmpeg's log)
        read_source(url)
    # The same playlist without format_whitelist does read the file outside: the option is what stops it.
    assert read_frames(url.target, None, {"protocol_whitelist": "file"}) == 3


def test_mjpeg_over_http_is_read(routes: Routes) -> None:
    url = check_url(routes.base + "/mjpeg", source_root=None)
    assert url.format is None  # FFmpeg's probe finds mpjpeg from the bytes
    with av.open(url.target, format=url.format, options=dict(url.options), timeout=(5.0, 5.0)) as container:
        assert container.format.name == "mpjpeg"
        frame = next(container.decode(video=0))
        assert (frame.width, frame.height) == (64, 48)


def test_hls_over_http_is_read(routes: Routes, tmp_path: Path) -> None:
    hls = tmp_path / "hls"
    hls.mkdir()
    write_video(hls / "index.m3u8", "hls", frames=30, options={"hls_time": "1", "hls_playlist_type": "vod"})
    for path in hls.iterdir():
        kind = "application/vnd.apple.mpegurl" if path.suffix == ".m3u8" else "video/mp2t"
        routes.bodies["/" + path.name] = (kind, path.read_bytes())
    url = check_url(routes.base + "/index.m3u8", source_root=None)
    assert read_source(url, wanted=30) == 30
    assert any(asked.endswith(".ts") for asked in routes.asked)


def test_encrypted_hls_is_read(routes: Routes, tmp_path: Path) -> None:
    hls = tmp_path / "hls"
    hls.mkdir()
    (hls / "k.key").write_bytes(bytes(range(16)))
    (hls / "keyinfo").write_text(f"k.key\n{hls / 'k.key'}\n")
    write_video(hls / "index.m3u8", "hls", options={"hls_key_info_file": str(hls / "keyinfo"), "hls_time": "1"})
    assert "AES-128" in (hls / "index.m3u8").read_text()
    for path in hls.iterdir():
        routes.bodies["/" + path.name] = ("application/octet-stream", path.read_bytes())
    assert read_source(check_url(routes.base + "/index.m3u8", source_root=None)) == 3


# HLS escapes


@pytest.fixture
def segment(tmp_path: Path) -> Path:
    path = tmp_path / "seg.ts"
    write_video(path, "mpegts")
    return path


def test_hls_segments_on_another_http_server_are_read(routes: Routes, segment: Path) -> None:
    other = Routes()
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        other.bodies["/seg.ts"] = ("video/mp2t", segment.read_bytes())
        routes.bodies["/other.m3u8"] = playlist(other.base + "/seg.ts")
        assert read_source(check_url(routes.base + "/other.m3u8", source_root=None)) == 3
        assert other.asked == ["/seg.ts"]
    finally:
        other.shutdown()
        other.server_close()
        thread.join(10)


def test_hls_cannot_read_local_files(routes: Routes, segment: Path) -> None:
    routes.bodies["/hostname.m3u8"] = playlist("file:///etc/hostname")
    routes.bodies["/segment.m3u8"] = playlist(f"file://{segment}")
    routes.bodies["/concat.m3u8"] = playlist(f"concat:{segment}|{segment}")
    routes.bodies["/seg.ts"] = ("video/mp2t", segment.read_bytes())
    key_line = '#EXT-X-KEY:METHOD=AES-128,URI="file:///etc/hostname"\n#EXTINF'
    content_type, body = playlist(routes.base + "/seg.ts")
    routes.bodies["/key.m3u8"] = (content_type, body.replace(b"#EXTINF", key_line.encode(), 1))
    for name in ("hostname", "segment", "concat", "key"):
        url = check_url(f"{routes.base}/{name}.m3u8", source_root=None)
        with pytest.raises(av.error.FFmpegError):
            read_source(url)
    # With 'file' in the whitelist the segment playlist is read: the test above can fail, and the whitelist is what
    # stops it (FFmpeg's own extension check stops /etc/hostname, not a file named .ts).
    url = check_url(routes.base + "/segment.m3u8", source_root=None)
    widened = url.options | {"protocol_whitelist": url.options["protocol_whitelist"] + ",file"}
    assert read_frames(url.target, url.format, widened) == 3


# Timeouts


def open_in_thread(url: SourceUrl, connect_s: float, read_s: float, bound_s: float) -> tuple[float, BaseException]:
    """Seconds until av.open with ``url``'s options failed, and what it raised; fails the test if it had not ended
    after ``bound_s`` (the thread is left behind as a daemon)."""
    outcome: dict[str, object] = {}

    def attempt() -> None:
        started = time.monotonic()
        try:
            with av.open(url.target, format=url.format, options=dict(url.options), timeout=(connect_s, read_s)) as c:
                next(c.decode(video=0))
        except BaseException as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"av.open of {url.shown} had not ended after {bound_s} s"
    error = outcome.get("error")
    assert isinstance(error, BaseException), f"av.open of {url.shown} succeeded against a silent server"
    return float(outcome["seconds"]), error  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "path", ["rtsp://127.0.0.1:{port}/live", "http://127.0.0.1:{port}/x.m3u8", "http://127.0.0.1:{port}/mjpeg"]
)
@pytest.mark.parametrize("server", ["silent", "bound"])
def test_unanswered_connections_time_out(path: str, server: str) -> None:
    connect_s, read_s = 1.0, 1.0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        if server == "silent":
            sock.listen(1)  # the kernel completes the handshake; nothing ever answers
        url = check_url(
            path.format(port=sock.getsockname()[1]),
            source_root=None,
            connect_timeout_s=connect_s,
            read_timeout_s=read_s,
        )
        seconds, error = open_in_thread(url, connect_s, read_s, bound_s=connect_s + 30)
    print(f"{server:6} {url.shown:34} failed after {seconds:.2f} s: {type(error).__name__}")
    assert isinstance(error, av.error.FFmpegError)
    assert seconds < connect_s + 2
