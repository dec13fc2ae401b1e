"""The demo page with a segmenter, in real headless Chromium (``test_browser.py``'s browser): each image's
instances listed and drawn as a detector's boxes are, and each mask filled translucently over the image under its
box. A screenshot's pixels: the rectangle the segmenter outlines (tests/service/test_segment.py's) tinted with the
mask's colour inside, the dark ground around it left as it was; above every score the slider leaves nothing drawn."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.http.conftest import RunningServer, start_server, stop_server
from tests.http.test_browser import _open
from tests.http.test_browser import browser as browser  # the fixture, shared
from tests.http.test_browser_detect import CARDS, GEOMETRY, _until, _wait
from tests.service.test_segment import picture, segmenter_repo

WIDTH, HEIGHT, BOX = 128, 64, (16, 8, 80, 40)  # letterboxed into the model's 64 x 64


@pytest.fixture(scope="module")
def segment_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = segmenter_repo(tmp_path_factory.mktemp("segment-page-repo"))
    running = start_server(root, tmp_path_factory.mktemp("logs") / "segment-page.log", real_models=("seg",))
    yield running
    stop_server(running)


def _tinted(pixels: np.ndarray) -> np.ndarray:
    r, g, b = (pixels[..., i].astype(int) for i in range(3))
    return (r > 200) & (b > 200) & (g > 100) & (g < 190)  # white under the translucent magenta fill


def _shot(browser: Any) -> tuple[np.ndarray, Any]:
    geometry = browser.execute_script(GEOMETRY, "#grid svg.boxes")
    png = browser.get_screenshot_as_png()
    if os.environ.get("VISIONSERVE_SHOTS"):  # where to keep the screenshots, to look at them
        taken = len(list(Path(os.environ["VISIONSERVE_SHOTS"]).glob("segment-*.png")))
        Path(os.environ["VISIONSERVE_SHOTS"], f"segment-{taken + 1}.png").write_bytes(png)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), geometry


def _inside_and_ground(shot: np.ndarray, geometry: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The screenshot's pixels well inside the rectangle, and of the ground well away from it (a few CSS pixels
    from every edge, where anti-aliasing and the mask's rounded corners are left out)."""
    left, top, right, bottom = geometry["rect"]
    dpr, scale = geometry["dpr"], min((right - left) / WIDTH, (bottom - top) / HEIGHT)
    x0, y0 = left + (right - left - WIDTH * scale) / 2, top + (bottom - top - HEIGHT * scale) / 2

    def device(x: float, y: float) -> tuple[int, int]:
        return round((x0 + x * scale) * dpr), round((y0 + y * scale) * dpr)

    x1, y1, x2, y2 = BOX
    (a, b), (p, q) = device(x1 + 4, y1 + 6), device(x2 - 4, y2 - 4)  # below the label's tag, off the corners
    (g, h), (i, j) = device(x2 + 6, 0), device(WIDTH, HEIGHT)
    return shot[b:q, a:p], shot[h:j, g:i]


def test_a_segmenters_masks_are_filled_over_the_image_under_their_boxes(
    segment_server: RunningServer, browser, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    image = tmp_path / "rectangle.png"
    image.write_bytes(picture(WIDTH, HEIGHT, BOX))
    browser.set_window_size(1200, 1000)
    _open(browser, segment_server, "seg")
    browser.find_element(By.ID, "file").send_keys(str(image))
    card = _wait(browser, CARDS, lambda c: len(c) == 1 and c[0]["busy"] == "false" and len(c[0]["rows"]) == 1,
                 "the rectangle's instance")[0]  # fmt: skip
    assert card["error"] == "" and card["drawn"] == ["one 90.0%"], card

    def masked() -> None:
        inside, ground = _inside_and_ground(*_shot(browser))
        assert _tinted(inside).mean() > 0.95, "the mask is not filled over the rectangle"
        assert not _tinted(ground).any() and (ground.max(axis=2) < 60).all(), "the fill spilled onto the ground"

    _until(masked)
    browser.find_element(By.ID, "score").send_keys(Keys.END)  # above every score: nothing drawn, mask included
    _wait(browser, CARDS, lambda c: c[0]["rows"] == [] and c[0]["drawn"] == [], "nothing above 1.00")

    def cleared() -> None:
        inside, _ = _inside_and_ground(*_shot(browser))
        assert not _tinted(inside).any() and (inside.min(axis=2) > 240).all(), "a mask is still drawn"

    _until(cleared)
