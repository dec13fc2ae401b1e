"""The demo page's files ship with the package: each exists as package data, ``GET /`` serves exactly what they
compose (their text, in ``index.html``'s order, the one templated value filled), nothing loads from elsewhere, and
pyproject's package data lists every one of them, so a non-editable install (the images' ``pip install .``) has
them too."""

from __future__ import annotations

import re
import tomllib
from importlib.resources import files
from pathlib import Path
from urllib.parse import urlsplit

from service.frontend.http.demo import PAGE, REQUEST_SCORE_THRESHOLD
from service.inprocess import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "service.frontend.http"
ASSETS = files(PACKAGE) / "static" / "demo"
ATTRIBUTE_URLS = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def asset_names() -> set[str]:
    return {f.name for f in ASSETS.iterdir() if f.name.endswith((".html", ".css", ".js"))}


def composed() -> str:
    """``index.html`` with each ``@include NAME`` line replaced by NAME's text: what the page must be."""
    lines = []
    for line in (ASSETS / "index.html").read_text(encoding="utf-8").splitlines(keepends=True):
        name = line.removeprefix("@include ").strip()
        lines.append((ASSETS / name).read_text(encoding="utf-8") if line.startswith("@include ") else line)
    return "".join(lines).replace("@REQUEST_SCORE_THRESHOLD@", str(REQUEST_SCORE_THRESHOLD))


def test_every_part_is_a_file_the_page_includes() -> None:
    index = (ASSETS / "index.html").read_text(encoding="utf-8")
    included = set(re.findall(r"^@include (\S+)$", index, re.MULTILINE))
    assert included == asset_names() - {"index.html"}, "a file the page never includes, or an include with no file"
    for name in ("demo.css", "demo.js", "boxes.js", "live.js", "sources.js"):
        assert (ASSETS / name).is_file() and len((ASSETS / name).read_text(encoding="utf-8")) > 100, name
    assert "@include" not in PAGE and "@REQUEST_SCORE_THRESHOLD@" not in PAGE
    assert f"const BOX_REQUEST_THRESHOLD = {REQUEST_SCORE_THRESHOLD};" in PAGE


def test_get_slash_serves_the_files_composed_and_nothing_from_elsewhere(server: InProcessServer) -> None:
    with server.client() as client:
        page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.content == composed().encode("utf-8") == PAGE.encode("utf-8")
    assert page.text.count("<script") == 1 and page.text.count("<style") == 1  # inline, one of each
    urls = ATTRIBUTE_URLS.findall(page.text)
    assert not [u for u in urls if urlsplit(u).scheme in ("http", "https") or u.startswith("//")], urls
    assert "<link" not in page.text and "@import" not in page.text


def test_the_wheel_lists_every_asset_as_package_data() -> None:
    """setuptools globs each package-data pattern in the package's folder; the union must hold every asset."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = settings["tool"]["setuptools"]["package-data"][PACKAGE]
    package_dir = ROOT.joinpath(*PACKAGE.split("."))
    shipped = {path.relative_to(package_dir).as_posix() for pattern in patterns for path in package_dir.glob(pattern)}
    assert {f"static/demo/{name}" for name in asset_names()} <= shipped, (patterns, sorted(shipped))
