"""The demo page in real headless Chromium: pick, paste or drop several images, read each one's classes, error and
timings, change the model and top-k, and use it from the keyboard. Its server serves ``digits`` and ``tricky`` (the
same model, its labels HTML that must show as text), and ``lazy`` (the same model again, on demand: loaded by its
first request, which the model list shows)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.http.conftest import RunningServer, start_server, stop_server
from tests.http.test_image_api import digit_png

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
# The labels of ``tricky``: markup and a script that would run if a label were ever inserted as HTML.
TRICKY_LABELS = [f"<b>{i}</b>" if i % 2 else f'<img src=x onerror="window.pwned={i}">{i}' for i in range(10)]
WAIT_S = 30  # bounded waits on what the page shows; a real model answers in milliseconds


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
                "--disable-quic", f"--user-data-dir={tmp_path / 'profile'}"):  # fmt: skip
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
    browser.find_element(By.TAG_NAME, "body").click()
    reached = []
    for _ in range(8):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        reached.append(browser.execute_script("return document.activeElement.id"))
    first = reached.index("model") if "model" in reached else -1
    assert reached[first : first + 3] == ["model", "topk", "file"], reached  # Tab goes through them in order


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
