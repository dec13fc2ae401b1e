"""The demo page's sources view of a tracking source (docs/tracking.md), in real headless Chromium against a real
server: each tracked box labelled with its track, the source's line and zone drawn over the frame with their counts,
the counts said in words; a screenshot finds the line's colour along the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.http.conftest import ADMIN_TOKEN, RunningServer
from tests.http.test_browser import browser as browser  # the fixture, shared
from tests.http.test_browser_sources import AUTH, HEIGHT, WIDTH, _shot, _until, _wait
from tests.http.test_browser_sources import media as media  # the fixtures, shared
from tests.http.test_browser_sources import sources_server as sources_server

LINE = [[WIDTH / 2, 20], [WIDTH / 2, HEIGHT - 20]]
ZONE = [[20, 20], [120, 20], [120, 120], [20, 120]]
OVERLAY = """const svg = document.getElementById('sources-boxes');
return {lines: svg.querySelectorAll('line.count-line').length, zones: svg.querySelectorAll('polygon.zone').length,
  tags: [...svg.querySelectorAll('text.line-tag, text.zone-tag')].map(t => t.textContent),
  labels: [...svg.querySelectorAll('g.box text')].map(t => t.textContent),
  tally: document.getElementById('sources-tally').textContent,
  ids: (watch.last ? watch.last.detections || [] : []).map(d => d.track_id),
  end: document.getElementById('sources-end').textContent};"""


def test_a_tracking_source_shows_its_tracks_line_zone_and_counts(
    sources_server: RunningServer, media: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    # The shared file plays in real time at 1 fps for minutes: it runs while watched; deleted at the end.
    body = {"url": f"file://{media / 'clip.mp4'}", "model": "digits-detect", "id": "tracked", "max_age_ms": 60_000,
            "track": True, "lines": [{"id": "gate", "points": LINE}],
            "zones": [{"id": "desk", "polygon": ZONE}]}  # fmt: skip
    created = httpx.post(f"{sources_server.url}/v1/sources", json=body, headers=AUTH, timeout=10)
    assert created.status_code == 201, created.text
    assert created.json()["track"]["lines"][0]["id"] == "gate"
    browser.set_window_size(1200, 1000)
    browser.get(sources_server.url + "/")
    browser.find_element(By.ID, "sources-token").send_keys(ADMIN_TOKEN + Keys.ENTER)
    _wait(browser, "return [...document.querySelectorAll('#sources tr.source')].map(r => r.dataset.id)",
          lambda ids: "tracked" in ids, "the source listed")  # fmt: skip
    browser.find_element(By.CSS_SELECTOR, "#sources tr.source[data-id='tracked'] button.watch").click()
    shown = _wait(browser, OVERLAY, lambda v: v["lines"] == 1 and v["zones"] == 1 and v["tally"]
                  and any(isinstance(i, int) for i in v["ids"]), "the line, the zone, a tracked box")  # fmt: skip
    assert shown["tags"][0].startswith("desk: ") and shown["tags"][1].startswith("gate: in "), shown
    assert "gate: in " in shown["tally"] and "desk: inside " in shown["tally"], shown
    tracked = [label for label in shown["labels"] if label.startswith("#")]
    assert tracked, shown  # "#3 7 91.2%": the track, then the label and score

    def line_drawn() -> None:
        geometry = browser.execute_script("""const img = document.getElementById('sources-frame');
img.scrollIntoView({block: 'center'});
const b = img.getBoundingClientRect();
return {rect: [b.left, b.top, b.right, b.bottom], dpr: window.devicePixelRatio};""")
        left, top, right, _ = (round(v * geometry["dpr"]) for v in geometry["rect"])
        shot = _shot(browser, "tracks").astype(int)
        scale = (right - left) / WIDTH
        x = left + round(LINE[0][0] * scale)
        ys = range(top + round(LINE[0][1] * scale) + 30, top + round(LINE[1][1] * scale) - 5, 4)
        yellow = [bool(((np.abs(shot[y, x - 3 : x + 4] - (255, 208, 0)) < 60).all(axis=1)).any()) for y in ys]
        assert sum(yellow) >= 0.8 * len(yellow), f"{sum(yellow)} of {len(yellow)} points of the line are its colour"

    _until(line_drawn)
    httpx.delete(f"{sources_server.url}/v1/sources/tracked", headers=AUTH, timeout=30)
