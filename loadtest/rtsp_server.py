"""Simulated cameras: GStreamer's gst-rtsp-server serving live generated H.264 on 127.0.0.1, for the tests and for
``visionserve bench sources``. It imports nothing of the project.

Run by Debian's Python, which has PyGObject (the project's virtual environment has no ``gi``):

    /usr/bin/python3 loadtest/rtsp_server.py --port 0 --mounts 2

Each mount ``/cam0`` .. ``/cam{N-1}`` is a moving ball (``videotestsrc is-live=true pattern=ball``, a colour of its
own) encoded by x264 for low latency and little CPU. The media factory is shared, so a mount is encoded once however
many clients watch it, and it is offered over RTSP-interleaved TCP only, which keeps every socket on 127.0.0.1 (RTP
over UDP would bind its ports on every address). Once it listens it prints ``READY <port>`` on stdout and serves
until SIGTERM or SIGINT, then exits 0. It exits 3 when it cannot listen (the port is taken).

loadtest/cameras.py's ``RtspServer`` starts, kills and restarts it (tests/sources/video.py re-exports it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

HOST = "127.0.0.1"
CANNOT_LISTEN = 3
# One ball colour per mount (ARGB), so a picture shows which mount it came from.
COLOURS = (0xFFFFFFFF, 0xFFFF4040, 0xFF40FF40, 0xFF4080FF, 0xFFFFFF40, 0xFFFF40FF, 0xFF40FFFF, 0xFFFF9020)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1; 0 picks a free one (default: 0)")
    parser.add_argument("--mounts", type=int, default=1, help="mounts /cam0 .. /cam{N-1} (default: 1)")
    parser.add_argument("--width", type=int, default=640, help="frame width in pixels (default: 640)")
    parser.add_argument("--height", type=int, default=480, help="frame height in pixels (default: 480)")
    parser.add_argument("--fps", type=int, default=15, help="frames per second (default: 15)")
    parser.add_argument("--keyint", type=int, default=15, help="a keyframe at least every N frames (default: 15)")
    parser.add_argument("--bitrate", type=int, default=500, help="H.264 bitrate in kbit/s (default: 500)")
    parser.add_argument(
        "--watch-stdin",
        action="store_true",
        help="exit when stdin closes, so the server ends with the process that started it (default: off)",
    )
    return parser


def launch_line(args: argparse.Namespace, mount: int) -> str:
    """The pipeline of one mount, in gst-launch syntax (the payloader must be named pay0)."""
    # zerolatency: no B-frames and no lookahead, so a frame leaves the encoder as soon as it is made; threads=1:
    # on a 2-core machine shared with the tests, one thread per mount costs least. config-interval=-1 sends SPS and
    # PPS before every keyframe, so a client joining a shared stream late can decode from the first keyframe it
    # sees (the SDP's sprop-parameter-sets carry them too).
    return (
        f"( videotestsrc is-live=true pattern=ball foreground-color={COLOURS[mount % len(COLOURS)]} "
        f"! video/x-raw,format=I420,width={args.width},height={args.height},framerate={args.fps}/1 "
        f"! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={args.keyint} bitrate={args.bitrate} "
        "threads=1 ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535 or args.mounts < 1 or min(args.width, args.height, args.fps, args.keyint) < 1:
        print(f"bad arguments: {vars(args)}", file=sys.stderr)
        return 2
    # PyGObject is imported here, not at the top: the module is imported (never run) by the project's own checks
    # in environments without it.
    import gi  # type: ignore[import-not-found]

    for library in ("Gst", "GstRtsp", "GstRtspServer"):
        gi.require_version(library, "1.0")
    from gi.repository import GLib, Gst, GstRtsp, GstRtspServer  # type: ignore[import-not-found]

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address(HOST)
    # The server binds with SO_REUSEADDR (gst_rtsp_server_create_socket), so a restart right after a kill finds
    # the port free although the old connections linger in TIME_WAIT.
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    for mount in range(args.mounts):
        factory = GstRtspServer.RTSPMediaFactory()
        factory.set_launch(launch_line(args, mount))
        factory.set_shared(True)
        factory.set_protocols(GstRtsp.RTSPLowerTrans.TCP)
        mounts.add_factory(f"/cam{mount}", factory)
    try:
        source_id = server.attach(None)
    except GLib.Error as exc:  # raised by some PyGObject versions instead of returning 0
        print(f"cannot listen on {HOST}:{args.port}: {exc}", file=sys.stderr)
        return CANNOT_LISTEN
    if not source_id:
        print(f"cannot listen on {HOST}:{args.port} (is the port taken?)", file=sys.stderr)
        return CANNOT_LISTEN

    loop = GLib.MainLoop()

    def stop(*_: object) -> bool:
        loop.quit()
        return GLib.SOURCE_REMOVE

    for signum in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_HIGH, signum, stop)
    if args.watch_stdin:

        def stdin_event(fd: int, condition: int) -> bool:
            if condition & (GLib.IOCondition.HUP | GLib.IOCondition.ERR) or not os.read(fd, 4096):
                return stop()
            return GLib.SOURCE_CONTINUE

        GLib.io_add_watch(
            sys.stdin.fileno(), GLib.PRIORITY_DEFAULT, GLib.IOCondition.IN | GLib.IOCondition.HUP, stdin_event
        )
    print(f"READY {server.get_bound_port()}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
