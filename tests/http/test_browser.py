"""The demo page in real headless Chromium: pick, paste or drop several images, read each one's classes, error and
timings, change the model and top-k, and use it from the keyboard. Its server serves ``digits`` and ``tricky`` (the
same model, its labels HTML that must show as text), and ``lazy`` (the same model again, on demand: loaded by its
first request, which the model list shows). The rollout table is checked twice: against answers the browser's
``fetch`` is handed (a 404, from a server without rollouts, stands for no rollout), and against a real shadow
rollout from a model's config.toml. Live mode streams Chromium's fake camera, and a video file recorded in the
page, to the model over its WebSocket and shows each answer."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import RunningServer, start_server, stop_server
from tests.http.test_image_api import digit_png
from tests.service.test_rollout_metrics import contract_document

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
# The labels of ``tricky``: markup and a script that would run if a label were ever inserted as HTML.
TRICKY_LABELS = [f"<b>{i}</b>" if i % 2 else f'<img src=x onerror="window.pwned={i}">{i}' for i in range(10)]
WAIT_S = 30  # bounded waits on what the page shows; a real model answers in milliseconds
# Run before the page's own script: ``fetch`` of /v2/models/{m}/rollout answers from window.rolloutStub where it
# names the model (a document, or a status number such as 404), else reaches the server; each model asked is noted.
ROLLOUT_STUB = """window.rolloutStub = %s; window.rolloutAsked = [];
const serverFetch = window.fetch;
window.fetch = (url, init) => {
  const match = /^\\/v2\\/models\\/([^/]+)\\/rollout$/.exec(String(url));
  if (!match) return serverFetch(url, init);
  const model = decodeURIComponent(match[1]);
  window.rolloutAsked.push(model);
  const stub = window.rolloutStub[model];
  if (stub === undefined) return serverFetch(url, init);
  const [status, body] = typeof stub === 'number' ? [stub, {error: `stubbed ${stub}`}] : [200, stub];
  return Promise.resolve(new Response(JSON.stringify(body), {status, headers: {'content-type': 'application/json'}}));
};"""
# What the live mode shows: the last answer, its classes, the running counts, the status line, the canvas's size.
LIVE_SHOWN = """const text = (id) => document.getElementById(id).textContent;
    return {status: text('live-status'), frame: text('live-frame'), result: text('live-result'), age: text('live-age'),
        rtt: text('live-rtt'), detail: text('live-detail'),
        pressed: document.getElementById('live-toggle').getAttribute('aria-pressed'),
        labels: [...document.querySelectorAll('#live-predictions td.label')].map(td => td.textContent),
        markup: document.querySelectorAll('#live-predictions td.label *').length,
        canvas: [document.getElementById('live-canvas').width, document.getElementById('live-canvas').height],
        counts: Object.fromEntries(['sent', 'answered', 'superseded', 'expired', 'errors', 'skipped'].map(
            k => [k, Number(text(`live-${k}`))]))}"""
# Records a second of a moving canvas as WebM (MediaRecorder) and hands it to the live mode's file input.
RECORD_VIDEO = """const done = arguments[arguments.length - 1];
const canvas = Object.assign(document.createElement('canvas'), {width: 64, height: 48});
const g = canvas.getContext('2d');
const recorder = new MediaRecorder(canvas.captureStream(25), {mimeType: 'video/webm'});
const chunks = [];
recorder.ondataavailable = (e) => chunks.push(e.data);
recorder.onstop = () => {
  const dt = new DataTransfer();
  dt.items.add(new File(chunks, 'moving.webm', {type: 'video/webm'}));
  const input = document.getElementById('live-file');
  input.files = dt.files;
  input.dispatchEvent(new Event('change', {bubbles: true}));
  done(dt.files[0].size);
};
let x = 0;
const draw = setInterval(() => { g.fillStyle = '#fff'; g.fillRect(0, 0, 64, 48); g.fillStyle = '#000';
  g.fillRect(x++ % 48, 10, 16, 28); }, 40);
recorder.start(100);
setTimeout(() => { clearInterval(draw); recorder.stop(); }, 1000);"""
# What the rollout table shows: each row's cells by class name, how many elements its cells hold, and whether the
# section is hidden.
ROLLOUT_ROWS = """return {hidden: document.getElementById('rollouts-section').hidden,
    markup: document.querySelectorAll('#rollouts tbody td *').length,
    rows: [...document.querySelectorAll('#rollouts tr.rollout')].map(tr =>
        Object.fromEntries([...tr.cells].map(td => [td.className, td.textContent])))}"""


@pytest.fixture(scope="module")
def page_server(served_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("page-repo")
    shutil.copytree(served_repo / "digits", root / "digits")
    shutil.copytree(served_repo / "digits", root / "tricky")
    for spec_path in (root / "tricky").glob("*/spec.json"):
        spec = json.loads(spec_path.read_text())
        assert len(spec["labels"]) == len(TRICKY_LABELS)
        spec["labels"] = TRICKY_LABELS
        spec_path.write_text(json.dumps(spec))
    shutil.copytree(served_repo / "digits", root / "lazy")
    (root / "lazy" / "config.toml").write_text('residency = "on_demand"\n')
    running = start_server(root, tmp_path_factory.mktemp("logs") / "page-server.log", real_models=("digits", "tricky"))
    yield running
    stop_server(running)


@pytest.fixture
def browser(tmp_path: Path):  # type: ignore[no-untyped-def]
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("VISIONSERVE_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromedriver are required here (scripts/install-browser.sh installs them)")
        pytest.skip("chromium and chromedriver are not installed (scripts/install-browser.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-quic", f"--user-data-dir={tmp_path / 'profile'}",
                # live mode: a generated camera (a moving test pattern), its permission granted without asking
                "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser: Any, server: RunningServer, model: str = "digits") -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(server.url + "/")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#model option[value='{model}']"))
    Select(browser.find_element(By.ID, "model")).select_by_value(model)


def _cards(
    browser: Any, count: int, rows: int | None = None, errors: int = 0, labels_from: list[str] | None = None
) -> list[dict[str, Any]]:
    """Wait until the grid holds ``count`` finished cards (``rows`` predictions each where no error, ``errors``
    of them failed, every label one of ``labels_from``); what each shows."""
    from selenium.webdriver.support.ui import WebDriverWait

    script = """return [...document.querySelectorAll('#grid .card')].map(c => ({
        busy: c.getAttribute('aria-busy'), name: c.querySelector('.name').textContent,
        labels: [...c.querySelectorAll('tr.prediction td.label')].map(td => td.textContent),
        scores: [...c.querySelectorAll('tr.prediction td.score')].map(td => td.textContent),
        markup: c.querySelectorAll('td.label *').length, error: c.querySelector('.error').textContent,
        timing: c.querySelector('.timing').textContent,
        thumbnail: c.querySelector('img').complete && c.querySelector('img').naturalWidth > 0}))"""

    def ready(driver: Any) -> list[dict[str, Any]] | None:
        cards: list[dict[str, Any]] = driver.execute_script(script)
        if len(cards) != count or any(c["busy"] != "false" for c in cards):
            return None
        if sum(bool(c["error"]) for c in cards) != errors:
            return None
        if rows is not None and any(len(c["labels"]) != rows for c in cards if not c["error"]):
            return None
        if labels_from is not None and any(label not in labels_from for c in cards for label in c["labels"]):
            return None
        return cards

    try:
        cards: list[dict[str, Any]] = WebDriverWait(browser, WAIT_S).until(ready)
    except Exception as exc:
        raise AssertionError(
            f"the grid never showed {count} cards of {rows} rows: {browser.execute_script(script)}"
        ) from exc
    return cards


def test_two_images_chosen_at_once_rerun_when_top_k_and_model_change(
    page_server: RunningServer, browser, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    paths = []
    for index in (3, 5):
        png, _ = digit_png(index)
        paths.append(tmp_path / f"digit-{index}.png")
        paths[-1].write_bytes(png)
    _open(browser, page_server)
    browser.find_element(By.ID, "file").send_keys("\n".join(str(p) for p in paths))
    cards = _cards(browser, 2, rows=5)
    assert [c["name"] for c in cards] == ["digit-3.png", "digit-5.png"]
    assert cards[0]["labels"][0] == str(digit_png(3)[1])
    for card in cards:
        assert card["thumbnail"], "the thumbnail did not load"
        assert sorted(card["labels"]) == sorted(set(card["labels"])) and all(s.endswith("%") for s in card["scores"])
        for stage in ("queue", "preprocess", "compute", "total", "round trip"):
            assert stage in card["timing"], card["timing"]
    # The chart and its summary come from the server's own Server-Timing totals, one point per request.
    points = browser.find_element(By.CSS_SELECTOR, "#chart polyline").get_attribute("points").split()
    assert len(points) == 2
    assert "Last 2 requests, server total" in browser.find_element(By.ID, "latency").text

    # top-k changed from the keyboard: the same two images are classified again, with fewer rows.
    topk = browser.find_element(By.ID, "topk")
    topk.send_keys(Keys.CONTROL, "a")
    topk.send_keys("2")
    _cards(browser, 2, rows=2)
    topk.send_keys(Keys.ARROW_UP)
    _cards(browser, 2, rows=3)
    WebDriverWait(browser, WAIT_S).until(
        lambda d: len(d.find_element(By.CSS_SELECTOR, "#chart polyline").get_attribute("points").split()) == 6
    )

    # Another model: the images are classified again, and its labels (HTML) appear as text, never as markup.
    Select(browser.find_element(By.ID, "model")).select_by_value("tricky")
    cards = _cards(browser, 2, rows=3, labels_from=TRICKY_LABELS)
    assert cards[0]["labels"][0] == TRICKY_LABELS[digit_png(3)[1]]
    assert all(c["markup"] == 0 for c in cards), "a label was inserted as HTML"
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_element(By.ID, "error").text == ""


def test_the_model_list_shows_residency_and_a_first_request_makes_an_on_demand_model_resident(
    page_server: RunningServer, browser, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    script = """return Object.fromEntries([...document.querySelectorAll('#models tr.model')].map(tr =>
        [tr.cells[0].textContent.split(' ')[0], [tr.querySelector('.residency').textContent,
                                                 tr.querySelector('.resident').textContent]]))"""

    def rows(ok: Any) -> dict[str, list[str]]:
        seen: list[dict[str, list[str]]] = []
        try:
            WebDriverWait(browser, WAIT_S).until(lambda d: ok(seen.append(d.execute_script(script)) or seen[-1]))
        except Exception as exc:
            raise AssertionError(f"the model list shows {seen[-1] if seen else None}") from exc
        return seen[-1]

    _open(browser, page_server, "lazy")
    shown = rows(lambda r: {"digits", "lazy"} <= r.keys())
    assert shown["digits"][0] == "pinned" and re.fullmatch(r"yes, [\d.]+ [MG]B", shown["digits"][1]), shown
    assert shown["lazy"] == ["on demand", "no"], shown
    png = tmp_path / "digit.png"
    png.write_bytes(digit_png(3)[0])
    browser.find_element(By.ID, "file").send_keys(str(png))
    _cards(browser, 1, rows=5)  # its first request loaded it; the list is read again after the answer
    shown = rows(lambda r: r.get("lazy", [""])[1] != "no")
    assert shown["lazy"][0] == "on demand" and re.fullmatch(r"yes, [\d.]+ [MG]B", shown["lazy"][1]), shown


def test_a_corrupt_file_shows_its_error_beside_it(page_server: RunningServer, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    good = tmp_path / "digit.png"
    good.write_bytes(digit_png(3)[0])
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    _open(browser, page_server)
    browser.find_element(By.ID, "file").send_keys(f"{bad}\n{good}")
    cards = _cards(browser, 2, rows=5, errors=1)
    assert cards[0]["name"] == "broken.png" and "image" in cards[0]["error"] and cards[0]["labels"] == []
    assert "compute" in cards[0]["timing"]  # the server's timing of the request that refused it
    assert cards[1]["name"] == "digit.png" and cards[1]["error"] == "" and len(cards[1]["labels"]) == 5
    assert browser.find_element(By.ID, "error").text == ""

    # A request the server refuses whole (top-k out of range) shows its message beside each image.
    topk = browser.find_element(By.ID, "topk")
    topk.send_keys(Keys.CONTROL, "a")
    topk.send_keys("0")
    cards = _cards(browser, 2, errors=2)
    assert all("top_k must be an integer from 1 to 1000" in c["error"] for c in cards)


def test_pasted_and_dropped_images_are_classified(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    _open(browser, page_server)
    encoded = [base64.b64encode(digit_png(i)[0]).decode() for i in (1, 2, 3)]
    make_files = """const files = arguments[0].map((b64, i) => new File(
        [Uint8Array.from(atob(b64), ch => ch.charCodeAt(0))], `image-${i}.png`, {type: 'image/png'}));
      const dt = new DataTransfer(); files.forEach(f => dt.items.add(f));"""
    browser.execute_script(
        make_files + "document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt}));", encoded[:1]
    )
    assert [c["name"] for c in _cards(browser, 1, rows=5)] == ["image-0.png"]
    browser.execute_script(
        make_files + "document.getElementById('drop').dispatchEvent("
        "new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));",
        encoded,
    )
    assert [c["name"] for c in _cards(browser, 3, rows=5)] == ["image-0.png", "image-1.png", "image-2.png"]


def test_every_control_is_labelled_and_reached_by_the_keyboard(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _open(browser, page_server)
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select, button, textarea')]"
        ".filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')).map(e => e.id)"
    )
    assert unlabelled == []
    assert browser.find_element(By.ID, "file").get_attribute("multiple") is not None
    browser.find_element(By.TAG_NAME, "h1").click()  # Tab starts from the top (the page is taller than a screen)
    reached = []
    for _ in range(10):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        reached.append(browser.execute_script("return document.activeElement.id"))
    first = reached.index("model") if "model" in reached else -1
    order = ["model", "topk", "file", "live-source", "live-file", "live-fps", "live-max-age", "live-toggle"]
    assert reached[first : first + len(order)] == order, reached  # Tab goes through them in order


def test_the_openapi_ui_renders_from_this_server_alone(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(page_server.url + "/docs")
    title = WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .info .title")
    )[0]
    assert "visionserve" in title.text
    assert browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock"), "no operation was rendered"
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(page_server.url) or url.startswith("data:") for url in loaded), loaded


def _rollouts(browser: Any, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Wait until the rollout table satisfies ``ok``; what it shows."""
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[dict[str, Any]] = []

    def shown(driver: Any) -> bool:
        seen.append(driver.execute_script(ROLLOUT_ROWS))
        return ok(seen[-1])

    try:
        WebDriverWait(browser, WAIT_S).until(shown)
    except Exception as exc:
        raise AssertionError(f"the rollout table shows {seen[-1] if seen else None}") from exc
    return seen[-1]


def test_the_rollout_table_shows_each_rollout_and_a_404_as_none(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    running = contract_document() | {"model": "tricky"}
    running["verdict_reason"] = '<img src=x onerror="window.pwned=1">412 of 1000 samples'  # text, never markup
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                            {"source": ROLLOUT_STUB % json.dumps({"tricky": running, "lazy": 404})})  # fmt: skip
    _open(browser, page_server)
    shown = _rollouts(browser, lambda t: bool(t["rows"]))
    assert shown["rows"] == [{
        "model": "tricky", "mode": "shadow", "versions": "v1 -> v2", "samples": "412",
        "agreement": "99.51% [98.26%, 99.87%]", "latency-ratio": "1.09x", "shed": "37",
        "verdict": 'wait: <img src=x onerror="window.pwned=1">412 of 1000 samples',
    }]  # fmt: skip
    assert not shown["hidden"] and shown["markup"] == 0 and browser.execute_script("return window.pwned === undefined")
    # digits' rollout came from the server: a 404 without the route, {"state": "none"} with it; no row either way.
    assert sorted(browser.execute_script("return window.rolloutAsked"))[:3] == ["digits", "lazy", "tricky"]
    answer = httpx.get(page_server.url + "/v2/models/digits/rollout")
    assert answer.status_code == 404 or answer.json()["state"] == "none", answer.text

    # Decided: what was done and why; then nothing beside any model, and the section goes away.
    aborted = running | {"state": "aborted", "reason": "agreement 0.9 is below 0.99", "verdict": "abort"}
    browser.execute_script("window.rolloutStub.tricky = arguments[0]; loadModels();", aborted)
    shown = _rollouts(browser, lambda t: bool(t["rows"]) and t["rows"][0]["verdict"].startswith("aborted"))
    assert shown["rows"][0]["verdict"] == "aborted: agreement 0.9 is below 0.99"
    none = {"model": "tricky", "state": "none"}
    browser.execute_script("window.rolloutStub.tricky = arguments[0]; loadModels();", none)
    assert _rollouts(browser, lambda t: t["hidden"])["rows"] == []

    # Nothing yet compared: no agreement or ratio to show. A failure other than a 404 shows beside its model.
    empty = running | {"verdict_reason": "0 of 1000 samples", "auto": False}
    nothing = dict.fromkeys(("agreement", "agreement_low", "agreement_high", "latency_ratio"))
    empty["comparison"] = running["comparison"] | nothing | {"samples": 0, "shed": 0}
    browser.execute_script("window.rolloutStub.tricky = arguments[0]; window.rolloutStub.lazy = 500; loadModels();",
                           empty)  # fmt: skip
    shown = _rollouts(browser, lambda t: len(t["rows"]) == 2)
    rows = {row["model"]: row for row in shown["rows"]}
    assert rows["lazy"] == {"model": "lazy", "error": "Could not read its rollout: stubbed 500"}
    assert rows["tricky"]["agreement"] == "none yet" and rows["tricky"]["latency-ratio"] == "none yet"
    assert rows["tricky"]["samples"] == "0" and rows["tricky"]["verdict"] == "wait: 0 of 1000 samples (auto off)"

    # A detector's rollout: its agreement is on boxes, said beside it with the mean F1.
    boxes = running | {"verdict_reason": "box agreement 412/412"}
    boxes["comparison"] = running["comparison"] | {"box_f1_mean": 0.95}
    browser.execute_script("window.rolloutStub.tricky = arguments[0]; window.rolloutStub.lazy = 404; loadModels();",
                           boxes)  # fmt: skip
    shown = _rollouts(browser, lambda t: len(t["rows"]) == 1 and "boxes" in t["rows"][0]["agreement"])
    assert shown["rows"][0]["agreement"] == "99.51% [98.26%, 99.87%], boxes (mean F1 0.950)"


def test_a_shadow_rollout_shows_what_its_route_answers(served_repo: Path, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    root = tmp_path / "repo"
    shutil.copytree(served_repo / "digits", root / "ab")
    shutil.copytree(root / "ab" / "1", root / "ab" / "2")  # the same weights: the candidate agrees on everything
    config = root / "ab" / "config.toml"
    rollout = '\n[rollout]\ncandidate = 2\nmode = "shadow"\nfraction = 1.0\nauto = false\n'
    config.write_text(config.read_text() + rollout)
    server = start_server(root, tmp_path / "server.log", real_models=("ab",))
    try:
        _open(browser, server, "ab")
        png = tmp_path / "digit.png"
        png.write_bytes(digit_png(3)[0])
        browser.find_element(By.ID, "file").send_keys(str(png))
        _cards(browser, 1, rows=5)
        deadline = time.monotonic() + WAIT_S
        while True:  # the shadow's work is done (or shed) after the answer
            document = httpx.get(server.url + "/v2/models/ab/rollout").json()
            comparison = document["comparison"]
            if comparison["samples"] + comparison["shed"] + comparison["errors"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert document["state"] == "running" and comparison["samples"] == 1, document
        browser.execute_script("loadModels();")
        shown = _rollouts(browser, lambda t: bool(t["rows"]) and t["rows"][0]["samples"] == "1")
        assert shown["rows"] == [{
            "model": "ab", "mode": "shadow", "versions": "v1 -> v2", "samples": "1",
            "agreement": "100.00% [{:.2%}, 100.00%]".format(comparison["agreement_low"]),
            "latency-ratio": "{:.2f}x".format(comparison["latency_ratio"]), "shed": "0",
            "verdict": f"wait: {document['verdict_reason']} (auto off)",
        }]  # fmt: skip
    finally:
        stop_server(server)


def _live(browser: Any, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Wait until the live mode shows what ``ok`` wants; what it shows."""
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[dict[str, Any]] = []

    def shown(driver: Any) -> bool:
        seen.append(driver.execute_script(LIVE_SHOWN))
        return ok(seen[-1])

    try:
        WebDriverWait(browser, WAIT_S).until(shown)
    except Exception as exc:
        raise AssertionError(f"the live mode shows {seen[-1] if seen else None}") from exc
    return seen[-1]


def _all_answered(shown: dict[str, Any]) -> bool:
    counts = shown["counts"]
    return counts["answered"] + counts["superseded"] + counts["expired"] + counts["errors"] == counts["sent"]


def test_live_mode_streams_the_camera_and_shows_each_answer(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _open(browser, page_server)
    assert browser.find_element(By.ID, "live-fps").get_attribute("value") == "5"
    browser.find_element(By.ID, "live-toggle").click()
    shown = _live(browser, lambda s: s["result"] == "result" and s["counts"]["answered"] >= 3)
    assert shown["status"] == "Streaming the camera to digits." and shown["pressed"] == "true", shown
    assert re.fullmatch(r"\d+\.\d ms", shown["age"]) and re.fullmatch(r"\d+\.\d ms", shown["rtt"]), shown
    assert len(shown["labels"]) == 5 and set(shown["labels"]) <= {str(i) for i in range(10)}, shown
    assert shown["canvas"] == [640, 480] and shown["counts"]["errors"] == 0, shown  # the fake camera's frames

    # Another model while live: a new stream to it; its labels (HTML) appear as text, never as markup.
    Select(browser.find_element(By.ID, "model")).select_by_value("tricky")
    shown = _live(browser, lambda s: s["status"] == "Streaming the camera to tricky." and s["counts"]["answered"] >= 2
                  and s["result"] == "result" and set(s["labels"]) <= set(TRICKY_LABELS))  # fmt: skip
    assert len(shown["labels"]) == 5 and shown["markup"] == 0 and browser.execute_script("return !window.pwned")

    # Stopped: no more frames go, the ones sent are answered, and the counts add up.
    browser.find_element(By.ID, "live-toggle").click()
    shown = _live(browser, lambda s: s["status"] == "Live stopped.")
    assert _all_answered(shown) and shown["counts"]["sent"] >= 2 and shown["pressed"] == "false", shown
    time.sleep(0.5)
    assert browser.execute_script(LIVE_SHOWN)["counts"] == shown["counts"]
    assert not browser.execute_script("return document.getElementById('live-video').srcObject")  # camera released


def test_live_mode_streams_a_video_file(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _open(browser, page_server)
    browser.set_script_timeout(WAIT_S)
    assert browser.execute_async_script(RECORD_VIDEO) > 0
    assert Select(browser.find_element(By.ID, "live-source")).first_selected_option.get_attribute("value") == "video"
    fps = browser.find_element(By.ID, "live-fps")
    fps.clear()
    fps.send_keys("10")
    browser.find_element(By.ID, "live-toggle").click()
    shown = _live(browser, lambda s: s["result"] == "result" and s["counts"]["answered"] >= 3)
    assert shown["status"] == "Streaming moving.webm to digits." and shown["canvas"] == [64, 48], shown
    assert len(shown["labels"]) == 5 and re.fullmatch(r"\d+\.\d ms", shown["age"]), shown
    browser.find_element(By.ID, "live-toggle").click()
    shown = _live(browser, lambda s: s["status"] == "Live stopped.")
    assert _all_answered(shown) and shown["counts"]["errors"] == 0, shown


def test_live_mode_says_why_it_did_not_start(page_server: RunningServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _open(browser, page_server)
    Select(browser.find_element(By.ID, "live-source")).select_by_value("video")
    browser.find_element(By.ID, "live-toggle").click()
    assert _live(browser, lambda s: s["status"].startswith("Live stopped"))["status"] == (
        "Live stopped: could not start: choose a video file first."
    )
    fps = browser.find_element(By.ID, "live-fps")
    fps.clear()
    fps.send_keys("0")
    browser.find_element(By.ID, "live-toggle").click()
    shown = _live(browser, lambda s: s["status"].startswith("Not started"))
    assert shown["status"] == "Not started: frames per second must be a number in (0, 30], got 0."
    assert shown["pressed"] == "false" and shown["counts"]["sent"] == 0
