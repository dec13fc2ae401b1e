"""The demo page in real headless Chromium: load it, pick an image, read the classes and the timings."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.http.conftest import RunningServer
from tests.http.test_image_api import digit_png

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


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


def test_the_demo_page_classifies_a_picked_image(server: RunningServer, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    png, label = digit_png(3)
    picture = tmp_path / "digit.png"
    picture.write_bytes(png)
    browser.get(server.url + "/")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option[value='digits']"))
    browser.find_element(By.CSS_SELECTOR, "#model option[value='digits']").click()
    browser.find_element(By.ID, "file").send_keys(str(picture))
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "results").is_displayed())
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.prediction")
    assert len(rows) == 5
    assert rows[0].find_element(By.CSS_SELECTOR, ".label").text == str(label)
    assert rows[0].find_element(By.CSS_SELECTOR, ".score").text.endswith("%")
    timing = browser.find_element(By.ID, "timing").text
    assert "queue" in timing and "preprocess" in timing and "compute" in timing and "round trip" in timing
    assert browser.find_element(By.ID, "error").text == ""


def test_the_demo_page_shows_the_error_of_a_bad_file(server: RunningServer, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    browser.get(server.url + "/")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    browser.find_element(By.ID, "file").send_keys(str(bad))
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").text)
    assert "image" in browser.find_element(By.ID, "error").text
