"""Which URLs the server may pull video from, and the FFmpeg options that hold FFmpeg to that choice.

A server that opens URLs on request must be neither an open proxy nor a file reader, so :func:`check_url` admits a
URL only with a scheme of :data:`ALLOWED_SCHEMES`, a host if it is a network URL, at most :data:`MAX_URL_CHARS`
characters and no whitespace or control character (percent-encode them); a ``file`` URL only as ``file:///path``
with no query or fragment, from a server started with ``--source-root DIR``, its path (percent-decoded, resolved,
symlinks followed) a regular file inside that folder. Relative forms (``file:x.mp4``) are refused rather than read
against the root: one written form means one rule to check and nothing for the reader to guess. The containment is
checked before the existence, so a refusal does not tell whether a file outside the root exists. ``target`` is the
resolved path, so FFmpeg opens the very file that was checked (a symlink inside the root swapped after the check by
someone who can write there is the one race left; the root is the operator's folder).

The scheme check alone would not be enough: FFmpeg opens further URLs on its own (an HLS playlist names segment
and key URLs, a concat list names files), so every :class:`SourceUrl` carries ``protocol_whitelist``, which FFmpeg
applies to every nested open as well. Each list below is the smallest that read frames in tries with PyAV 18.1.0
(FFmpeg 8, libavformat 62.12) against servers on 127.0.0.1:

- ``rtsp`` over TCP: ``tcp`` (RTSP is a demuxer, not a protocol; ``rtsp`` in the list changes nothing); over UDP:
  ``rtp,udp,tcp`` (without ``rtp`` or ``udp``: "Unable to open an input RTP port"). Tried against a GStreamer RTSP
  server.
- ``rtsps``: ``tls,tcp`` (``tls`` opens ``tcp``), plus ``rtp,udp`` over UDP; tried as far as FFmpeg sending its
  RTSP ``OPTIONS`` over TLS to a TLS server.
- ``http`` and ``https``: ``http,https,tcp,tls,crypto``. ``http,tcp`` reads plain HTTP (MJPEG and HLS), ``https``
  needs ``https,tls,tcp``; both schemes get both so that a redirect or a playlist moving between them works, and
  ``crypto`` is what AES-128 encrypted HLS segments are read through ("Protocol 'crypto' not on whitelist"
  otherwise). Without ``file`` in the list, a playlist naming ``file:///...`` segments or keys cannot read them;
  FFmpeg's HLS demuxer refuses ``concat:`` segments by itself.
- ``file``: ``file``, and ``format_whitelist`` as well: an ``.m3u8`` or ``ffconcat`` file inside the root may
  name files outside it, and with ``file`` allowed FFmpeg reads them (an HLS playlist in the root read a segment
  outside it), so local files are opened only with demuxers that open nothing else (:data:`FILE_FORMATS`).

MJPEG over HTTP needs no forced format: FFmpeg's probe finds ``mpjpeg`` from the bytes themselves, whatever the
Content-Type (tried with ``multipart/x-mixed-replace``, ``application/octet-stream`` and ``text/plain``), and HLS
is found from the playlist, so ``format`` stays ``None`` for every scheme today.

Timeouts. FFmpeg's ``timeout`` option (microseconds) is the socket I/O timeout of the ``rtsp`` demuxer (which hands
it to ``tcp`` for the connect too) and of ``http``; ``rw_timeout`` (microseconds) bounds each read of any protocol.
FFmpeg has no separate connect timeout for these, so the connect bound is PyAV's open timeout: the reader calls
``av.open(target, format=..., options=..., timeout=(connect_timeout_s, read_timeout_s))``, whose interrupt callback
ends the open (connect, handshake, stream probing) after ``connect_timeout_s`` and each later read after
``read_timeout_s``. Without either, opening a listening server that never answers waits for ever.

RTSP runs over TCP by default: interleaved RTP passes firewalls and NAT and loses no packets to a busy receiver.

FFmpeg does not verify TLS certificates by default (a self-signed server was read over ``https``); that is left as
FFmpeg has it, for cameras with their own certificates.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from service.core.errors import BadInputError, ConfigError
from service.core.errors import shown as quoted

ALLOWED_SCHEMES = ("rtsp", "rtsps", "http", "https", "file")
MAX_URL_CHARS = 2048
ANALYZE_US = 300_000  # a live stream's probe, microseconds
RTSP_TRANSPORTS = ("tcp", "udp")
NAME_MAX_BYTES, PATH_MAX_BYTES = 255, 4096  # Linux's NAME_MAX and PATH_MAX, for the message only

# Demuxers a local file may be read with: containers and elementary streams that open no other file or URL (no
# hls, dash, concat, image2 sequences). FFmpeg matches a demuxer if any of its names is listed ("mov" covers mp4).
FILE_FORMATS = "mov,mp4,matroska,webm,mpegts,avi,flv,h264,hevc,mjpeg,mpjpeg,jpeg_pipe,m4v,mpeg,ivf,asf"

_WHITELISTS = {
    ("rtsp", "tcp"): "tcp",
    ("rtsp", "udp"): "rtp,udp,tcp",
    ("rtsps", "tcp"): "tls,tcp",
    ("rtsps", "udp"): "rtp,udp,tls,tcp",
    ("http", "tcp"): "http,https,tcp,tls,crypto",
    ("https", "tcp"): "http,https,tcp,tls,crypto",
}

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_HEAD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:(//)?")
_ALLOWED_TEXT = ", ".join(ALLOWED_SCHEMES)
_CONTROL = ("Cc", "Cf", "Cs", "Co", "Cn")  # Unicode's control, format, surrogate, private and unassigned


@dataclass(frozen=True)
class SourceUrl:
    """A URL that passed :func:`check_url`, with what ``av.open`` needs to open it and nothing more."""

    given: str  # the URL as given (never logged or shown: it may hold credentials)
    scheme: str
    target: str  # what av.open opens: the URL (scheme lower-cased), or the resolved local path for file://
    live: bool  # True for rtsp/rtsps/http(s) streams; False for files (they end, they play at their own rate)
    shown: str  # for display, logs and API answers: its secrets masked (mask)
    format: str | None  # an av.open format where one must be forced, else None
    options: dict[str, str] = field(default_factory=dict)  # FFmpeg options for av.open

    def redact(self, text: str) -> str:
        """``text`` (FFmpeg's message, which names the URL, credentials and all) with the URL in it shown masked,
        and any secret of it left elsewhere in the text (a password, a query value of 4 characters or more: a
        shorter one would mask the digits of an errno) replaced by ``***``."""
        for form in sorted({self.given, self.target} - {self.shown}, key=len, reverse=True):
            text = text.replace(form, self.shown)
        for secret in sorted(_secrets(self.given), key=len, reverse=True):
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return text


def mask(url: str) -> str:
    """``url`` as an answer, a log line or a message may show it, its secrets replaced by ``***``: the user
    information (``rtsp://***@host:554/x``) and every query value (``?token=***&fps=***``; a query parameter
    without ``=`` is one value). The one function that shows a source's URL; text that is no URL comes back with
    the same done where it can be.

    The user information is what precedes the last ``@`` of the authority (``urlsplit``'s netloc, which ends at the
    first ``/``, ``?`` or ``#``, as FFmpeg splits it): an ``@`` in the path or the query is no separator
    (``http://cam/x?user=a@b.com`` keeps its host). One case reads further: an authority without ``@`` whose port is
    no number (``rtsp://u:pa/ss@cam/x``: a password holding an unencoded ``/``, ``?`` or ``#``, which check_url
    refuses) is masked up to the last ``@``, so the refusal does not show the password's tail."""
    found = _HEAD.match(url)
    head = found.group(0) if found else ""
    if not head.endswith("//") and head[:-1].lower() not in ALLOWED_SCHEMES:
        head = ""  # in 'user:password@host' the "scheme" is a user name
    rest = url[len(head) :]
    # The authority ends at the first '/', '?' or '#' (without '//' urlsplit finds none; the same text is read so).
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    elif "@" in tail and _odd_port(authority):
        authority, tail = "***", "@" + tail.rpartition("@")[2]
    before, question, query = tail.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        params = (p.partition("=") for p in query.split("&"))
        query = "&".join(f"{name}=***" if equals else ("***" if name else "") for name, equals, _ in params)
        tail = before + question + query + hash_ + fragment
    return head + authority + tail


def _secrets(url: str) -> set[str]:
    """What :func:`mask` hides of an admitted URL, written as given and percent-decoded: its user information (and
    the user name and password apart) and each query value."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    found = {userinfo, *userinfo.split(":", 1)}
    for param in parts.query.split("&"):
        name, equals, value = param.partition("=")
        found.add(value if equals else name)
    return {text for secret in found for text in (secret, unquote(secret)) if text}


def _odd_port(authority: str) -> bool:
    """An authority that is ``name:text`` with text no port number (IPv6's brackets left aside)."""
    host_port = authority.rpartition("]")[2]
    _, colon, port = host_port.rpartition(":")
    return bool(colon) and not port.isdigit()


def check_url(
    url: object,
    *,
    source_root: Path | None,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 5.0,
    rtsp_transport: str = "tcp",
) -> SourceUrl:
    """The :class:`SourceUrl` for ``url``, or :class:`BadInputError` naming what is wrong and what is allowed (the
    rules are in the module's docstring; messages show the URL only masked). ``connect_timeout_s`` and
    ``read_timeout_s`` are the server's settings: one that is not a positive number is a :class:`ConfigError`."""
    for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
    if rtsp_transport not in RTSP_TRANSPORTS:
        raise BadInputError(f"rtsp_transport must be one of {', '.join(RTSP_TRANSPORTS)}, got {rtsp_transport!r}")
    if not isinstance(url, str):
        raise BadInputError(f"a source URL must be a string, got {type(url).__name__}")
    if not url:
        raise BadInputError(f"a source URL is empty; allowed schemes: {_ALLOWED_TEXT}")
    if len(url) > MAX_URL_CHARS:
        raise BadInputError(f"a source URL is {len(url)} characters long; at most {MAX_URL_CHARS} are allowed")
    _refuse_odd_characters(url, "a source URL")
    found = _SCHEME.match(url)
    if found is None:
        raise BadInputError(f"a source URL needs a scheme (scheme://...); allowed schemes: {_ALLOWED_TEXT}")
    scheme = found.group(1).lower()
    if scheme not in ALLOWED_SCHEMES:
        named = "" if "@" in url else f" {scheme[:20]!r}"  # in 'user:password@host' the "scheme" is a user name
        raise BadInputError(f"source URL scheme{named} is not allowed; allowed schemes: {_ALLOWED_TEXT}")
    shown = mask(url)
    if scheme == "file":
        return _check_file(url, shown, source_root)
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises on a port that is not a number in 0-65535
    except ValueError:
        raise BadInputError(
            f"source URL {shown} has an invalid host or port (a user name or password holding '/', '?', '#', '@' "
            f"or ':' must be percent-encoded)"
        ) from None
    if not host:
        raise BadInputError(f"source URL {shown} has no host; a {scheme} URL is written {scheme}://host[:port]/path")
    target = scheme + url[len(scheme) :]  # FFmpeg matches "rtsp:" case-sensitively when it picks the demuxer
    read_us = str(round(read_timeout_s * 1_000_000))
    options = {"protocol_whitelist": _WHITELISTS[scheme, rtsp_transport if scheme.startswith("rtsp") else "tcp"]}
    # How long FFmpeg reads a live stream to learn its parameters before the first frame: 5 s by default, which
    # held an RTSP camera's open (and each reconnect) for 2 s against GStreamer's server; 0.3 s opened it in 0.5 s.
    options["analyzeduration"] = str(ANALYZE_US)
    if scheme.startswith("rtsp"):
        options |= {"rtsp_transport": rtsp_transport, "timeout": read_us}
    else:
        options |= {"timeout": read_us, "rw_timeout": read_us}
    return SourceUrl(given=url, scheme=scheme, target=target, live=True, shown=shown, format=None, options=options)


def _check_file(url: str, shown: str, source_root: Path | None) -> SourceUrl:
    """The :class:`SourceUrl` of a ``file:///path`` URL whose path resolves to a regular file inside ``source_root``."""
    if source_root is None:
        raise BadInputError(
            "file:// sources are refused: this server has no source root (start the server with --source-root DIR "
            f"to read files under DIR); allowed schemes here: {', '.join(s for s in ALLOWED_SCHEMES if s != 'file')}"
        )
    if not url[len("file:") :].startswith("///"):
        raise BadInputError(
            f"a file URL is written file:///absolute/path (under the source root), got {shown}; relative forms "
            "such as file:x.mp4 and hosts such as file://host/x are refused"
        )
    parts = urlsplit(url)
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise BadInputError(f"a file URL takes no query or fragment ('?' or '#'), got {shown}; percent-encode them")
    path_text = unquote(parts.path)
    _refuse_odd_characters(path_text, "a file URL's decoded path", spaces_allowed=True)
    root = source_root.resolve()
    if not root.is_dir():
        raise ConfigError(f"the source root {source_root} is not a directory (--source-root)")
    try:
        path = Path(path_text).resolve()  # follows every symlink that exists, '..' included
        if not path.is_relative_to(root):
            raise BadInputError(
                f"url: file {path_text} is outside the source root {root}; only files under it are read"
            )
        if not path.exists():
            raise BadInputError(f"url: file {path_text} does not exist under the source root {root}")
        if path.is_dir():
            raise BadInputError(f"url: file {path_text} is a directory; a file source names one video file")
        if not path.is_file():
            raise BadInputError(
                f"url: file {path_text} is not a regular file (a device, socket or pipe); name a video file"
            )
    except OSError as exc:  # a name past NAME_MAX (ENAMETOOLONG), a path past PATH_MAX, a folder not searchable
        raise BadInputError(
            f"url: file {quoted(path_text)} cannot be looked up: {exc.strerror or exc} (each name in a path is at most "
            f"{NAME_MAX_BYTES} bytes, the whole path at most {PATH_MAX_BYTES})"
        ) from None
    options = {"protocol_whitelist": "file", "format_whitelist": FILE_FORMATS}
    return SourceUrl(given=url, scheme="file", target=str(path), live=False, shown=shown, format=None, options=options)


def _refuse_odd_characters(text: str, what: str, *, spaces_allowed: bool = False) -> None:
    """Refuse whitespace and control characters (they split or end arguments and log lines; FFmpeg stops at NUL);
    a decoded file path may hold plain spaces (``%20``)."""
    for position, char in enumerate(text):
        if (char.isspace() and not (spaces_allowed and char == " ")) or unicodedata.category(char) in _CONTROL:
            raise BadInputError(
                f"{what} holds whitespace or a control character (U+{ord(char):04X}) at position {position}; "
                "percent-encode it"
            )
