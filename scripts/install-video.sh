#!/usr/bin/env bash
# Debian's GStreamer RTSP server and H.264 encoder, run by Debian's Python, for the camera-source tests
# (loadtest/rtsp_server.py). Installs them when missing and we are root (CI, fresh machines); otherwise says
# how, and the RTSP tests skip (or fail under VISIONSERVE_REQUIRE_RTSP=1).
#   python3-gi                  PyGObject for /usr/bin/python3
#   gir1.2-gst-rtsp-server-1.0  gst-rtsp-server's bindings; pulls libgstrtspserver-1.0-0 (the server library)
#   gstreamer1.0-plugins-base   videotestsrc, videoconvert, appsrc/appsink
#   gstreamer1.0-plugins-good   rtph264pay, rtpbin (the server library depends on it too)
#   gstreamer1.0-plugins-ugly   x264enc
# gstreamer1.0-rtsp is not needed: it holds only rtspclientsink (publishing to a server), not the server.
set -euo pipefail
check='import gi
gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import Gst, GstRtspServer
Gst.init(None)
assert all(Gst.ElementFactory.find(e) for e in ("videotestsrc", "x264enc", "rtph264pay"))'
if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c "$check" >/dev/null 2>&1; then
    exit 0
fi
packages="python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-ugly"
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's GStreamer RTSP server for the camera-source tests: $packages"
    apt-get update -qq
    # shellcheck disable=SC2086 # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 $packages >/dev/null
else
    echo "note: GStreamer's RTSP server is missing under /usr/bin/python3; install Debian's python3 $packages" \
         "to run the RTSP camera-source tests (they are skipped without them)"
fi
