"""The demo page with a detector, in real headless Chromium (``test_browser.py``'s browser): each image's boxes are
listed and drawn over it, and a screenshot's pixels show the box colour along each box's edges and nowhere else over
the image; the score-threshold slider, moved from the keyboard, filters them without a new request. Its server
serves the shipped ``digits-detect`` and ``digits`` side by side, and ``tricky-detect`` (the detector again, its
labels HTML that must show as text). Live mode draws a detector's answer over the frame: the stream's answers come
from a stand-in WebSocket the page is handed, as test_browser.py hands ``fetch`` its rollout answers."""

from __future__ import annotations

import base64
import io
import json
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

from tests.http.conftest import RunningServer, start_server, stop_server
from tests.http.test_browser import LIVE_SHOWN, RECORD_VIDEO, TRICKY_LABELS, WAIT_S, _live, _open
from tests.http.test_browser import browser as browser  # the fixture, shared

ROOT = Path(__file__).resolve().parents[2]
CANVAS = ROOT / "examples" / "digits-canvas.png"
CANVAS_DIGITS = ["3", "7", "8"]  # what the canvas holds at the default threshold (README, tests/serve_only.py)
EDGE_PX = 3  # CSS pixels either side of a box's edge where its stroke (3 px, centred on the edge) must show
CLEAR_PX = 6  # CSS pixels around each edge and tag left out of the control region (anti-aliasing, rounding)
# Run before the page's own script: a WebSocket that answers each frame sent as a detector's stream does, with the
# boxes in window.stubBoxes (in the frame's pixels); the URLs opened are noted.
STREAM_STUB = """window.stubBoxes = %s; window.socketsOpened = [];
class StubSocket {
  static CONNECTING = 0; static OPEN = 1; static CLOSING = 2; static CLOSED = 3;
  constructor(url) {
    this.url = url; this.readyState = 0; this.bufferedAmount = 0; window.socketsOpened.push(String(url));
    setTimeout(() => { this.readyState = 1; if (this.onopen) this.onopen({}); }, 0);
  }
  async send(blob) {
    const bytes = new Uint8Array(await blob.arrayBuffer());
    const length = new DataView(bytes.buffer).getUint32(0);
    const header = JSON.parse(new TextDecoder().decode(bytes.slice(4, 4 + length)));
    const canvas = document.getElementById('live-canvas');
    const answer = {id: header.id, ts: header.ts, status: 'result', age_ms: 1.5, version: 1,
      detections: window.stubBoxes, width: canvas.width, height: canvas.height, timings_ms: {compute: 1.0}};
    if (this.readyState === 1 && this.onmessage) this.onmessage({data: JSON.stringify(answer)});
  }
  close(code, reason) {
    if (this.readyState === 3) return;
    this.readyState = 3;
    setTimeout(() => { if (this.onclose) this.onclose({code, reason}); }, 0);
  }
}
window.WebSocket = StubSocket;"""
# Records a second of the canvas image (arguments[0]: a PNG, base64) as WebM and hands it to the live mode's file input.
RECORD_CANVAS = """const done = arguments[arguments.length - 1];
const picture = new Image();
picture.onload = () => {
  const canvas = Object.assign(document.createElement('canvas'), {width: picture.width, height: picture.height});
  const recorder = new MediaRecorder(canvas.captureStream(25), {mimeType: 'video/webm'});
  const chunks = [];
  recorder.ondataavailable = (e) => chunks.push(e.data);
  recorder.onstop = () => {
    const dt = new DataTransfer();
    dt.items.add(new File(chunks, 'canvas.webm', {type: 'video/webm'}));
    const input = document.getElementById('live-file');
    input.files = dt.files;
    input.dispatchEvent(new Event('change', {bubbles: true}));
    done(dt.files[0].size);
  };
  const draw = setInterval(() => canvas.getContext('2d').drawImage(picture, 0, 0), 40);
  recorder.start(100);
  setTimeout(() => { clearInterval(draw); recorder.stop(); }, 1000);
};
picture.src = 'data:image/png;base64,' + arguments[0];"""
# What each card shows: its rows (label, score, box), the summary, the overlay's boxes and the labels drawn there.
CARDS = """return [...document.querySelectorAll('#grid .card')].map(c => ({
    busy: c.getAttribute('aria-busy'), error: c.querySelector('.error').textContent,
    found: c.querySelector('.found').textContent,
    rows: [...c.querySelectorAll('tr.detection')].map(tr => [...tr.cells].map(td => td.textContent)),
    predictions: c.querySelectorAll('tr.prediction').length,
    drawn: [...c.querySelectorAll('svg.boxes g.box text')].map(t => t.textContent),
    markup: c.querySelectorAll('td.label *, svg.boxes text *').length}))"""
# Where an overlay lies on screen (CSS pixels), the screen's pixels per CSS pixel, and each drawn label's tag.
GEOMETRY = """const svg = document.querySelector(arguments[0]);
svg.scrollIntoView({block: 'center'});
const r = (e) => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
return {rect: r(svg), dpr: window.devicePixelRatio, inner: window.innerWidth,
        tags: [...svg.querySelectorAll('g.tag')].map(r)};"""


@pytest.fixture(scope="module")
def detect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    shipped = ROOT / "examples" / "model_repository"
    root = tmp_path_factory.mktemp("detect-page-repo")
    for name in ("digits", "digits-detect"):
        shutil.copytree(shipped / name, root / name)
    shutil.copytree(shipped / "digits-detect", root / "tricky-detect")
    spec_path = root / "tricky-detect" / "1" / "spec.json"
    spec = json.loads(spec_path.read_text())
    spec["labels"] = TRICKY_LABELS
    spec_path.write_text(json.dumps(spec))
    log = tmp_path_factory.mktemp("logs") / "detect-page-server.log"
    running = start_server(root, log, real_models=("digits", "digits-detect", "tricky-detect"))
    yield running
    stop_server(running)


def _wait(browser: Any, script: str, ok: Callable[[Any], bool], what: str, *args: Any) -> Any:
    """Until ``script``'s answer satisfies ``ok`` (bounded by WAIT_S); that answer."""
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[Any] = []
    try:
        WebDriverWait(browser, WAIT_S).until(lambda d: ok(seen.append(d.execute_script(script, *args)) or seen[-1]))
    except Exception as exc:
        raise AssertionError(f"{what}: the page shows {seen[-1] if seen else None}") from exc
    return seen[-1]


def _is_box_colour(pixels: np.ndarray) -> np.ndarray:
    r, g, b = (pixels[..., i].astype(int) for i in range(3))
    return (r > 200) & (g < 90) & (b > 200)  # the page's magenta, anti-aliased edges allowed


def _check_shot(browser: Any, overlay: str, size: tuple[int, int], boxes: list[list[float]]) -> None:
    """A screenshot shows the box colour along each edge of ``boxes`` (in the image's pixels, ``size`` its width and
    height) drawn by ``overlay`` and nowhere else over the image, leaving out each edge's band and each label's tag."""
    geometry = browser.execute_script(GEOMETRY, overlay)
    png = browser.get_screenshot_as_png()
    if os.environ.get("VISIONSERVE_SHOTS"):  # where to keep the screenshots, to look at them
        Path(os.environ["VISIONSERVE_SHOTS"], f"{overlay.strip('#').replace(' ', '-')}-{len(boxes)}.png").write_bytes(
            png
        )
    shot = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    dpr = geometry["dpr"]
    assert abs(shot.shape[1] - geometry["inner"] * dpr) <= 2, (shot.shape, geometry)  # the shot is the viewport
    left, top, right, bottom = geometry["rect"]
    width, height = size
    scale = min((right - left) / width, (bottom - top) / height)  # object-fit: contain, and the SVG's "meet"
    x0, y0 = left + (right - left - width * scale) / 2, top + (bottom - top - height * scale) / 2

    def device(x: float, y: float) -> tuple[int, int]:  # image pixels -> the screenshot's pixels
        return round((x0 + x * scale) * dpr), round((y0 + y * scale) * dpr)

    colour = _is_box_colour(shot)
    clear = np.zeros(colour.shape, bool)  # what the control region leaves out
    c = round(CLEAR_PX * dpr)
    for tag in geometry["tags"]:
        x1, y1, x2, y2 = (round(v * dpr) for v in tag)
        clear[max(0, y1 - c) : y2 + c, max(0, x1 - c) : x2 + c] = 1
    e = round(EDGE_PX * dpr)
    for x1, y1, x2, y2 in boxes:
        (a, b), (p, q) = device(x1, y1), device(x2, y2)
        edges = {"top": [(x, b) for x in range(a, p)], "bottom": [(x, q) for x in range(a, p)],
                 "left": [(a, y) for y in range(b, q)], "right": [(p, y) for y in range(b, q)]}  # fmt: skip
        for name, along in edges.items():
            checked = along[len(along) // 10 : len(along) - len(along) // 10]  # a tag over it is box-coloured too
            hits = sum(bool(colour[max(0, y - e) : y + e + 1, max(0, x - e) : x + e + 1].any()) for x, y in checked)
            assert len(checked) >= 5 and hits >= 0.9 * len(checked), f"{name} edge of {[x1, y1, x2, y2]}: {hits}"
        band = np.zeros_like(clear)  # around the outline; the box's inside stays checked
        band[max(0, b - c) : q + c + 1, max(0, a - c) : p + c + 1] = 1
        band[b + c : q - c, a + c : p - c] = 0
        clear |= band
    (ix, iy), (jx, jy) = device(0, 0), device(width, height)
    control = ~clear[iy:jy, ix:jx]
    assert control.mean() > 0.3, "the control region is too small to mean anything"
    stray = colour[iy:jy, ix:jx] & control
    where = (np.argwhere(stray)[:3] + np.array([iy, ix])) / dpr  # (y, x) in CSS pixels, to say where
    assert not stray.any(), f"{int(stray.sum())} box-coloured pixels away from the boxes, at {where.tolist()}"


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


def _detect_requests(browser: Any) -> int:
    return int(browser.execute_script("return performance.getEntriesByType('resource')"
                                      ".filter(e => e.name.includes('/detect?')).length"))  # fmt: skip


def test_a_detectors_boxes_are_drawn_over_the_image_and_the_slider_filters_them(
    detect_server: RunningServer, browser
) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    def detect(threshold: float) -> dict[str, Any]:
        url = f"{detect_server.url}/v1/models/digits-detect/detect?score_threshold={threshold}"
        answer = httpx.post(url, content=CANVAS.read_bytes(), headers={"content-type": "image/png"}, timeout=30)
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()["results"][0]
        return result

    tasks = {m["name"]: m["task"] for m in httpx.get(detect_server.url + "/v1/models", timeout=30).json()}
    assert tasks == {"digits": "classify", "digits-detect": "detect", "tricky-detect": "detect"}, tasks
    expected, everything = detect(0.25), detect(0.05)
    size = (expected["width"], expected["height"])
    assert sorted(d["label"] for d in expected["detections"]) == CANVAS_DIGITS, expected

    browser.set_window_size(1200, 1000)
    _open(browser, detect_server, "digits-detect")
    assert not browser.find_element(By.ID, "topk").is_displayed()  # top-k has no meaning for boxes
    assert browser.find_element(By.ID, "score-value").text == "0.25"
    browser.find_element(By.ID, "file").send_keys(str(CANVAS))
    n = len(expected["detections"])
    card = _wait(browser, CARDS, lambda c: len(c) == 1 and c[0]["busy"] == "false" and len(c[0]["rows"]) == n,
                 "the canvas's boxes")[0]  # fmt: skip
    assert card["error"] == "" and card["markup"] == 0 and card["predictions"] == 0, card
    assert card["found"].startswith(f"{n} of {len(everything['detections'])} boxes"), card["found"]
    for (label, score, box), want in zip(card["rows"], expected["detections"], strict=True):
        assert label == want["label"] and score == f"{100 * want['score']:.1f}%", (card["rows"], want)
        assert np.allclose([float(v) for v in box.split(", ")], want["box"], atol=0.051), (box, want)
    assert card["drawn"] == [f"{d['label']} {100 * d['score']:.1f}%" for d in expected["detections"]]
    boxes = [d["box"] for d in expected["detections"]]
    _until(lambda: _check_shot(browser, "#grid svg.boxes", size, boxes))

    # The slider, from the keyboard: above every score, nothing is listed or drawn; at its lowest, all that was
    # asked for. Neither sends a request.
    requests = _detect_requests(browser)
    slider = browser.find_element(By.ID, "score")
    slider.send_keys(Keys.END)
    card = _wait(browser, CARDS, lambda c: c[0]["rows"] == [] and c[0]["drawn"] == [], "no boxes above 1.00")[0]
    assert browser.find_element(By.ID, "score-value").text == "1.00" and card["found"].startswith("0 of"), card
    _until(lambda: _check_shot(browser, "#grid svg.boxes", size, []))
    slider.send_keys(Keys.HOME)
    card = _wait(browser, CARDS, lambda c: len(c[0]["rows"]) == len(everything["detections"]), "every box")[0]
    assert browser.find_element(By.ID, "score-value").text == "0.05"
    assert len(card["drawn"]) == len(everything["detections"]) and _detect_requests(browser) == requests

    # Another detector, its labels HTML: drawn and listed as text, never as markup.
    Select(browser.find_element(By.ID, "model")).select_by_value("tricky-detect")
    card = _wait(browser, CARDS, lambda c: c[0]["busy"] == "false" and c[0]["rows"]
                 and all(row[0] in TRICKY_LABELS for row in c[0]["rows"]), "tricky labels")[0]  # fmt: skip
    assert card["markup"] == 0 and browser.execute_script("return window.pwned === undefined"), card
    assert all(text.rsplit(" ", 1)[0] in TRICKY_LABELS for text in card["drawn"]), card["drawn"]

    # The classifier beside it: its classes again, no boxes, top-k back in the slider's place.
    Select(browser.find_element(By.ID, "model")).select_by_value("digits")
    card = _wait(browser, CARDS, lambda c: c[0]["busy"] == "false" and c[0]["predictions"] == 5, "classes")[0]
    assert card["rows"] == [] and card["drawn"] == [] and card["found"] == "" and card["error"] == "", card
    assert browser.find_element(By.ID, "topk").is_displayed()
    assert not browser.find_element(By.ID, "score").is_displayed()


def test_live_mode_draws_a_detectors_boxes_over_the_frame(detect_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    shown = {"box": [8.0, 20.0, 40.0, 44.0], "label": "<b>1</b>", "index": 1, "score": 0.9}
    faint = {"box": [44.0, 4.0, 60.0, 20.0], "label": "2", "index": 2, "score": 0.1}  # under the default 0.25
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                            {"source": STREAM_STUB % json.dumps([shown, faint])})  # fmt: skip
    browser.set_window_size(1200, 1000)
    _open(browser, detect_server, "digits-detect")
    browser.set_script_timeout(WAIT_S)
    assert browser.execute_async_script(RECORD_VIDEO) > 0  # a 64x48 video: a black bar moving over white
    browser.find_element(By.ID, "live-toggle").click()
    live = _live(browser, lambda s: s["result"] == "result" and s["labels"] == ["<b>1</b>"])
    assert live["canvas"] == [64, 48] and live["markup"] == 0, live
    url = browser.execute_script("return window.socketsOpened[0]")
    assert "/v1/models/digits-detect/stream?" in url and "score_threshold=0.05" in url and "top_k" not in url, url
    _until(lambda: _check_shot(browser, "#live-boxes", (64, 48), [shown["box"]]))

    browser.find_element(By.ID, "score").send_keys(Keys.END)
    _live(browser, lambda s: s["labels"] == [])
    _until(lambda: _check_shot(browser, "#live-boxes", (64, 48), []))
    browser.find_element(By.ID, "live-toggle").click()
    assert _live(browser, lambda s: s["status"] == "Live stopped.")["counts"]["errors"] == 0
    assert browser.execute_script(LIVE_SHOWN)["pressed"] == "false"


def test_live_mode_streams_a_video_to_a_detector_and_draws_its_boxes(detect_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    browser.set_window_size(1200, 1000)
    _open(browser, detect_server, "digits-detect")
    browser.set_script_timeout(WAIT_S)
    assert browser.execute_async_script(RECORD_CANVAS, base64.b64encode(CANVAS.read_bytes()).decode()) > 0
    browser.find_element(By.ID, "live-toggle").click()
    live = _live(browser, lambda s: s["result"] == "result" and s["counts"]["answered"] >= 2 and bool(s["labels"]))
    assert live["canvas"] == [288, 192] and set(live["labels"]) <= set(CANVAS_DIGITS), live
    browser.find_element(By.ID, "live-toggle").click()
    live = _live(browser, lambda s: s["status"] == "Live stopped.")
    assert live["counts"]["errors"] == 0, live
    # The last answer stays drawn over the last frame sent: its boxes above the threshold, in the frame's pixels.
    found = browser.execute_script("return live.found")
    assert (found["width"], found["height"]) == (288, 192), found
    boxes = [d["box"] for d in found["detections"] if d["score"] >= 0.25]
    assert boxes and len(boxes) == len(live["labels"]), (found, live)
    _until(lambda: _check_shot(browser, "#live-boxes", (288, 192), boxes))
