"""Tracking sources against a real server process (docs/tracking.md): every detection of a tracking source carries
its track id, its counts are answered and zeroed, lines and zones change while it runs and are kept with it, and a
hostile or misplaced request is a 400 naming what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import RunningServer
from tests.sources.test_sources_served import AUTH, events, wait_for
from tests.sources.test_sources_served import media as media  # the fixtures, shared
from tests.sources.test_sources_served import served as served

GATE = {"id": "gate", "points": [[80, 10], [80, 110]]}
DESK = {"id": "desk", "polygon": [[10, 10], [70, 10], [70, 110], [10, 110]]}


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/sources", json=body, headers=AUTH, timeout=30)


def test_a_tracking_source_tracks_every_box_counts_and_resets(served: RunningServer, media: Path) -> None:
    body = {"url": f"file://{media / 'clip.mp4'}", "model": "digits-detect", "id": "tracked", "pace": "answered",
            "track": {"lost_track_buffer_s": 2}, "lines": [GATE], "zones": [DESK]}  # fmt: skip
    created = post(served.url, body)
    assert created.status_code == 201, created.text
    track = created.json()["track"]
    assert track["settings"]["lost_track_buffer_s"] == 2 and track["lines"][0]["id"] == "gate", track
    messages = events(served.url, "tracked")
    results = [m for m in messages if m.get("status") == "result"]
    boxes = [d for m in results for d in m["detections"]]
    assert results and boxes and all("track_id" in d for d in boxes), messages[:3]
    tracked = {d["track_id"] for d in boxes if d["track_id"] is not None}
    assert tracked and all(isinstance(i, int) and i > 0 for i in tracked)
    for event in (m for m in messages if m.get("type") == "event"):
        assert event["source"] == "tracked" and event["track_id"] in tracked, event
        assert (event["event"], event.get("line", event.get("zone"))) in {
            ("cross", "gate"), ("enter", "desk"), ("exit", "desk")}, event  # fmt: skip
    counts = httpx.get(f"{served.url}/v1/sources/tracked/counts", headers=AUTH, timeout=10).json()
    assert set(counts) == {"lines", "zones"} and set(counts["lines"]["gate"]) == {"in", "out"}, counts
    crossed = [e for e in messages if e.get("event") == "cross"]
    assert sum(sum(c.values()) for c in counts["lines"]["gate"].values()) == len(crossed), (counts, crossed)
    assert set(counts["zones"]["desk"]) == {"occupancy", "entered", "exited", "dwell_s"}, counts
    reset = httpx.post(f"{served.url}/v1/sources/tracked/counts/reset", headers=AUTH, timeout=10)
    assert reset.status_code == 200 and reset.json()["lines"]["gate"] == {"in": {}, "out": {}}, reset.text
    assert httpx.get(f"{served.url}/v1/sources/tracked/counts", timeout=10).status_code in (401, 403)  # admin only
    httpx.delete(f"{served.url}/v1/sources/tracked", headers=AUTH, timeout=30)


def test_lines_and_zones_change_while_it_runs(served: RunningServer, media: Path) -> None:
    body = {"url": f"file://{media / 'clip.mp4'}", "model": "digits-detect", "id": "moved", "track": True,
            "max_age_ms": 60_000}  # fmt: skip
    assert post(served.url, body).status_code == 201
    try:
        changed = httpx.patch(f"{served.url}/v1/sources/moved", json={"zones": [DESK]}, headers=AUTH, timeout=10)
        assert changed.status_code == 200 and changed.json()["track"]["zones"][0]["id"] == "desk", changed.text
        counts = httpx.get(f"{served.url}/v1/sources/moved/counts", headers=AUTH, timeout=10).json()
        assert list(counts["zones"]) == ["desk"] and counts["lines"] == {}, counts
        bad = httpx.patch(f"{served.url}/v1/sources/moved", json={"lines": [{"id": "l", "points": [[1, 1], [1, 1]]}]},
                          headers=AUTH, timeout=10)  # fmt: skip
        assert bad.status_code == 400 and "lines[0].points" in bad.text, bad.text
        assert wait_for(served.url, "moved", ("running", "ended"))["track"]["zones"][0]["id"] == "desk"
    finally:
        httpx.delete(f"{served.url}/v1/sources/moved", headers=AUTH, timeout=30)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "digits", "track": True}, "needs a detector"),
        ({"model": "digits-detect", "zones": [{"id": "z", "polygon": [[0, 0], [5, 5]]}]}, "zones[0].polygon"),
        (
            {"model": "digits-detect", "lines": [{"id": "l", "points": [[0, 0], [5, 5]], "classes": ["cat"]}]},
            "'cat' not among the model's labels",
        ),
        ({"model": "digits-detect", "track": {"matching_iou": "high"}}, "track: Expected `float`"),
    ],
)
def test_a_misplaced_or_hostile_tracking_request_is_a_400_naming_it(
    served: RunningServer, media: Path, body: dict[str, Any], words: str
) -> None:
    refused = post(served.url, {"url": f"file://{media / 'clip.mp4'}", "id": "refused", **body})
    assert refused.status_code == 400 and words in refused.text, refused.text


def test_a_nan_or_a_huge_number_in_a_line_is_a_400(served: RunningServer, media: Path) -> None:
    for value in ("NaN", "Infinity", "1" * 5000):
        raw = (f'{{"url": "file://{media / "clip.mp4"}", "model": "digits-detect", "id": "nan", '
               f'"lines": [{{"id": "l", "points": [[{value}, 0], [5, 5]]}}]}}')  # fmt: skip
        refused = httpx.post(f"{served.url}/v1/sources", content=raw, headers=AUTH, timeout=30)
        assert refused.status_code == 400, (value[:10], refused.status_code, refused.text)


def test_watch_events_prints_each_entry_among_the_frames_and_without_it_passes_them_over(
    served: RunningServer, media: Path
) -> None:
    from tests.http.conftest import ADMIN_TOKEN
    from tests.sources.test_watch import finish, start_watching
    from tests.sources.video import write_mp4

    if not (media / "long.mp4").exists():  # 20 s in real time: it runs while watch starts and takes its frames
        write_mp4(media / "long.mp4", frames=300, fps=15, width=160, height=120)
    whole = {"id": "all", "polygon": [[-1, -1], [200, -1], [200, 200], [-1, 200]]}  # every tracked box is in it
    for id, flags in (("evented", ("--events",)), ("quiet", ())):
        body = {"url": f"file://{media / 'long.mp4'}", "model": "digits-detect", "id": id, "track": True,
                "max_age_ms": 60_000}  # fmt: skip
        assert post(served.url, body).status_code == 201
        process = start_watching(served.url, id, "--count", "40", *flags, token=ADMIN_TOKEN)
        # The zone once watch listens: it counts afresh, so each box tracked from then on enters it.
        assert httpx.patch(f"{served.url}/v1/sources/{id}", json={"zones": [whole]}, headers=AUTH).status_code == 200
        code, out, _ = finish(process)
        entered = [line for line in out.splitlines() if line.startswith("event enter all  track ")]
        assert code == 0 and out.splitlines()[-1].startswith("took 40 answers"), out[-500:]
        assert (len(entered) > 0) == bool(flags), out[-2000:]  # without --events none, and no early end
        httpx.delete(f"{served.url}/v1/sources/{id}", headers=AUTH, timeout=30)
