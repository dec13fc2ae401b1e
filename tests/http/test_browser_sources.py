"""The demo page's sources view, in real headless Chromium (``test_browser.py``'s browser), against a real server
pulling real file sources (docs/sources.md): the admin token entered in the page (a wrong one refused, said), the
sources listed, a classifier's source watched (its top class over the frame), then a detector's (its boxes drawn over
each frame, as many as the last message holds), its end shown with its reason. A screenshot shows the last frame as
the server sent it, and the box colour along the edges of its boxes."""

from __future__ import annotations

import base64
import io
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.http.conftest import ADMIN_TOKEN, RunningServer, start_server, stop_server
from tests.http.test_browser import WAIT_S
from tests.http.test_browser import browser as browser  # the fixture, shared
from tests.http.test_browser_detect import EDGE_PX, _is_box_colour
from tests.sources.video import write_mp4

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Played in real time at 1 fps, the file lasts 10 x WAIT_S (300 s): longer than every bounded wait the test makes
# before it ends the file itself (six of WAIT_S), so it runs while watched whatever the machine's speed (a 10 s file
# once had to outlast Chromium's steps). The test then plays the rest as fast as answered (PATCH ``pace``).
FRAMES, FPS, WIDTH, HEIGHT = 10 * WAIT_S, 1, 320, 240
END_WAIT_S = 120  # the rest of the file decoded, the frames handed on answered: seconds, more on a slow machine
# What the sources view shows, and the last result it drew (``watch``, the page's own state), read in one go.
VIEW = """const view = document.getElementById('sources-view'), img = document.getElementById('sources-frame');
const last = watch.last;
return {hidden: view.hidden, state: view.dataset.state || '', frame: view.dataset.frame || '',
  detections: view.dataset.detections || '', drawn: view.dataset.drawn || '',
  boxes: document.querySelectorAll('#sources-boxes g.box').length,
  labels: [...document.querySelectorAll('#sources-boxes g.box text')].map(t => t.textContent),
  watching: document.getElementById('sources-watching').textContent,
  top: document.getElementById('sources-top').hidden ? null : document.getElementById('sources-top').textContent,
  image: img.getAttribute('src') ? img.getAttribute('src').slice(0, 23) : '', natural: [img.naturalWidth,
  img.naturalHeight], picture: !document.getElementById('sources-picture').hidden,
  counts: document.getElementById('sources-counts').textContent,
  end: document.getElementById('sources-end').textContent,
  last: last ? {source: last.source, frame: last.frame, width: last.width, height: last.height,
                image: last.image || '', detections: last.detections, predictions: last.predictions} : null,
  threshold: Number(document.getElementById('score').value)};"""
# The listed sources: each row's cells' text, by id.
ROWS = """return Object.fromEntries([...document.querySelectorAll('#sources tr.source')]
  .map(tr => [tr.dataset.id, [...tr.cells].map(td => td.textContent)]));"""


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources-page-media")
    write_mp4(root / "clip.mp4", frames=FRAMES, fps=FPS, width=WIDTH, height=HEIGHT)
    return root


@pytest.fixture(scope="module")
def sources_server(media: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("sources-page-repo")
    for name in ("digits", "digits-detect"):
        shutil.copytree(ROOT / "examples" / "model_repository" / name, repo / name)
    log = tmp_path_factory.mktemp("logs") / "sources-page-server.log"
    running = start_server(repo, log, "--admin-token", ADMIN_TOKEN, "--source-root", str(media),
                           real_models=("digits", "digits-detect"))  # fmt: skip
    yield running
    stop_server(running)


def _wait(browser: Any, script: str, ok: Callable[[Any], bool], what: str, timeout_s: float = WAIT_S) -> Any:
    """Until ``script``'s answer satisfies ``ok`` (bounded by ``timeout_s``); that answer."""
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[Any] = []
    try:
        WebDriverWait(browser, timeout_s).until(lambda d: ok(seen.append(d.execute_script(script)) or seen[-1]))
    except Exception as exc:
        raise AssertionError(f"{what}: the page shows {seen[-1] if seen else None}") from exc
    return seen[-1]


def _until(check: Callable[[], None]) -> None:
    """``check`` until it passes (the page paints after its DOM changes), bounded by WAIT_S; its last failure."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _shot(browser: Any, name: str) -> np.ndarray:
    png = browser.get_screenshot_as_png()
    if os.environ.get("VISIONSERVE_SHOTS"):  # where to keep the screenshots, to look at them
        Path(os.environ["VISIONSERVE_SHOTS"], f"sources-{name}.png").write_bytes(png)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _check_shot(browser: Any, last: dict[str, Any]) -> None:
    """With the boxes hidden, the screenshot's frame is the last result's JPEG; with them shown, the box colour runs
    along each edge of each box (a label's tag over an edge is box-coloured too)."""
    geometry = browser.execute_script("""const img = document.getElementById('sources-frame');
img.scrollIntoView({block: 'center'});
const b = img.getBoundingClientRect();
return {rect: [b.left, b.top, b.right, b.bottom], dpr: window.devicePixelRatio};""")
    dpr = geometry["dpr"]
    left, top, right, bottom = (round(v * dpr) for v in geometry["rect"])
    sent = Image.open(io.BytesIO(base64.b64decode(last["image"]))).convert("RGB")
    assert sent.size == (last["width"], last["height"]), sent.size  # 320 wide: under the 640 shown at most

    browser.execute_script("document.getElementById('sources-boxes').style.visibility = 'hidden'")
    bare = _shot(browser, "frame")[top:bottom, left:right].astype(int)
    browser.execute_script("document.getElementById('sources-boxes').style.visibility = ''")
    want = np.asarray(sent.resize((bare.shape[1], bare.shape[0]), Image.Resampling.BILINEAR)).astype(int)
    difference = float(np.abs(bare - want).mean())
    # Measured: 2.8 for the frame sent, 9 for the frame before it (its gradient has moved 4 pixels).
    assert difference < 6, f"the frame on screen differs from the last one sent by {difference:.1f} on average"

    colour = _is_box_colour(_shot(browser, "boxes"))
    scale = (right - left) / last["width"]  # device pixels per frame pixel; same aspect, so one scale
    e = round(EDGE_PX * dpr)
    for d in last["detections"]:
        x1, y1, x2, y2 = (round(v * scale) for v in d["box"])
        a, b, p, q = left + x1, top + y1, left + x2, top + y2
        edges = {"top": [(x, b) for x in range(a, p)], "bottom": [(x, q) for x in range(a, p)],
                 "left": [(a, y) for y in range(b, q)], "right": [(p, y) for y in range(b, q)]}  # fmt: skip
        for name, along in edges.items():
            checked = along[len(along) // 10 : len(along) - len(along) // 10]
            if len(checked) < 5:  # too short to say anything
                continue
            hits = sum(bool(colour[max(0, y - e) : y + e + 1, max(0, x - e) : x + e + 1].any()) for x, y in checked)
            assert hits >= 0.9 * len(checked), f"{name} edge of {d['box']}: {hits} of {len(checked)}"


def test_a_file_source_is_listed_and_watched_with_its_boxes_drawn_over_each_frame(
    sources_server: RunningServer, media: Path, browser
) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.set_window_size(1200, 1000)
    browser.get(sources_server.url + "/")
    token = browser.find_element(By.ID, "sources-token")
    assert token.get_attribute("type") == "password"

    # A wrong token: the server's refusal, said in the page.
    token.send_keys("wrong")
    browser.find_element(By.ID, "sources-refresh").click()
    status = _wait(browser, "return document.getElementById('sources-status').textContent",
                   lambda s: s.startswith("Could not list"), "the refusal")  # fmt: skip
    assert "admin token" in status, status
    token.clear()
    token.send_keys(ADMIN_TOKEN + Keys.ENTER)  # Enter refreshes too
    _wait(browser, "return document.getElementById('sources-status').textContent",
          lambda s: s == "The server has no source.", "no source yet")  # fmt: skip
    kept = browser.execute_script("return sessionStorage.getItem('visionserve-admin-token')")
    assert kept == ADMIN_TOKEN  # the tab keeps it, so a reload does too

    def create(body: dict[str, Any]) -> dict[str, list[str]]:
        """Start the source, refresh the page's list; its rows once it lists the source."""
        created = httpx.post(f"{sources_server.url}/v1/sources", json=body, headers=AUTH, timeout=10)
        assert created.status_code == 201, created.text
        browser.find_element(By.ID, "sources-refresh").click()
        rows: dict[str, list[str]] = _wait(browser, ROWS, lambda rows: body["id"] in rows, f"{body['id']} listed")
        row = rows[body["id"]]
        assert row[1] == body["model"] and row[2] in ("connecting", "running") and row[5] == "Watch", rows
        return rows

    # A classifier: its top class over the frame, no boxes. At 1 fps a frame waits up to a second (more behind the
    # B-frames decoded ahead of it) for its time, and its age counts from its decode: the default max_age_ms (500)
    # would expire it. The point here is not expiry.
    url = f"file://{media / 'clip.mp4'}"
    create({"url": url, "model": "digits", "id": "hall", "max_age_ms": 60_000})
    browser.find_element(By.CSS_SELECTOR, "#sources tr.source[data-id='hall'] button.watch").click()
    view = _wait(browser, VIEW, lambda v: v["picture"] and v["last"] is not None and v["top"] is not None,
                 "a frame with its top class")  # fmt: skip
    best = view["last"]["predictions"][0]
    assert view["top"] == f"{best['label']} {100 * best['score']:.1f}%" and view["watching"] == "Watching hall", view
    assert view["boxes"] == 0 and view["detections"] == "" and view["last"]["source"] == "hall", view

    # A detector, watched instead (the classifier's socket closed, its late answers dropped): a frame answered with
    # boxes, the frame shown, every box of the last message drawn (the source's default score threshold is the
    # page's, 0.25), and the counts line saying so.
    assert set(create({"url": url, "model": "digits-detect", "id": "door", "max_age_ms": 60_000})) == {"hall", "door"}
    browser.find_element(By.CSS_SELECTOR, "#sources tr.source[data-id='door'] button.watch").click()
    view = _wait(browser, VIEW, lambda v: v["picture"] and v["last"] is not None and v["boxes"] > 0,
                 "a frame with its boxes")  # fmt: skip
    assert view["top"] is None and view["last"]["source"] == "door" and view["watching"] == "Watching door", view
    assert view["image"] == "data:image/jpeg;base64,", view["image"]
    assert view["natural"] == [WIDTH, HEIGHT] and view["state"] in ("open", "ended"), view
    last = view["last"]
    assert (last["width"], last["height"]) == (WIDTH, HEIGHT) and view["threshold"] == 0.25, view
    assert view["boxes"] == len(last["detections"]) == int(view["detections"]) == int(view["drawn"]), view
    assert view["labels"] == [f"{d['label']} {100 * d['score']:.1f}%" for d in last["detections"]], view
    assert view["counts"].startswith(f"Frame {last['frame']}, age "), view["counts"]
    assert f"{len(last['detections'])} box(es), {view['boxes']} drawn" in view["counts"], view["counts"]

    # The file ends (the rest played as fast as answered, at most 5 frames a second handed on, so the page reads
    # them as it read the source so far): the view says so and why, its last frame and boxes stay, and the list shows
    # the end.
    changed = httpx.patch(f"{sources_server.url}/v1/sources/door", json={"pace": "answered", "max_fps": 5},
                          headers=AUTH, timeout=10)  # fmt: skip
    assert changed.status_code == 200, changed.text
    view = _wait(browser, VIEW, lambda v: v["state"] == "ended", "the source's end", timeout_s=END_WAIT_S)
    assert view["end"] == "Source door ended: the file ended.", view["end"]
    assert view["last"] is not None and view["boxes"] == len(view["last"]["detections"]) == int(view["drawn"]), view
    answered = int(view["counts"].split("Answered ")[1].split(",")[0])
    assert 0 < answered <= FRAMES, view["counts"]
    rows = _wait(browser, ROWS, lambda rows: rows["door"][2].startswith("ended"), "the end listed")
    assert rows["door"][2] == "ended: the file ended", rows
    assert view["last"]["image"] and view["last"]["detections"], view  # boxes at 0.25 on every frame of this file
    _until(lambda: _check_shot(browser, view["last"]))
