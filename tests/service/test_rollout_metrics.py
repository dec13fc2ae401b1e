"""Rollout metrics: the document docs/rollouts.md shows, rendered by a registry holding the collector, gives each
gauge, counter and the score-shift histogram (cumulative, count and sum included although its edges are negative);
null gauges are left out; with no rollout every family is still exported, without samples."""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.core.rollout_metrics import RolloutCollector

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {
    "visionserve_rollout_info": "gauge", "visionserve_rollout_agreement": "gauge",
    "visionserve_rollout_topk_overlap": "gauge", "visionserve_rollout_latency_ratio": "gauge",
    "visionserve_rollout_fraction": "gauge", "visionserve_rollout_samples": "counter",
    "visionserve_rollout_score_shift": "histogram",
}  # fmt: skip


def contract_document() -> dict[str, Any]:
    """The example answer of ``GET /v2/models/{m}/rollout`` in docs/rollouts.md, so the test follows the contract."""
    text = (ROOT / "docs" / "rollouts.md").read_text()
    block = re.search(r"```json\n(.*?)```", text, re.DOTALL)
    assert block, "docs/rollouts.md lost its example document"
    document: dict[str, Any] = json.loads(block.group(1))
    return document


def render(*documents: dict[str, Any]) -> str:
    registry = CollectorRegistry()
    registry.register(RolloutCollector(lambda: list(documents)))
    return generate_latest(registry).decode()


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_label(parsed: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, label: str) -> dict[str, float]:
    """The samples named ``name``, keyed by their ``label``."""
    return {dict(labels)[label]: value for (n, labels), value in parsed.items() if n == name}


def test_the_contract_document_renders_every_metric() -> None:
    text = render(contract_document())
    lines = set(text.splitlines())
    expected = {
        'visionserve_rollout_info{candidate="2",mode="shadow",model="digits",primary="1",state="running"} 1.0',
        'visionserve_rollout_agreement{bound="estimate",model="digits"} 0.9951',
        'visionserve_rollout_agreement{bound="low",model="digits"} 0.9826',
        'visionserve_rollout_agreement{bound="high",model="digits"} 0.9987',
        'visionserve_rollout_topk_overlap{model="digits"} 0.991',
        'visionserve_rollout_latency_ratio{model="digits"} 1.09',
        'visionserve_rollout_fraction{kind="configured",model="digits"} 0.1',
        'visionserve_rollout_fraction{kind="effective",model="digits"} 0.1',
        'visionserve_rollout_samples_total{model="digits",outcome="compared"} 412.0',
        'visionserve_rollout_samples_total{model="digits",outcome="shed"} 37.0',
        'visionserve_rollout_samples_total{model="digits",outcome="error"} 2.0',
        "# TYPE visionserve_rollout_samples_total counter",
        "# TYPE visionserve_rollout_score_shift histogram",
    }
    assert not expected - lines, f"missing: {expected - lines}\n{text}"

    # counts [0, 0, 0, 1, 3, 400, 5, 2, 1, 0, 0] by edges -1 .. 1: cumulative, le the upper edge, then +Inf
    buckets = re.findall(r'visionserve_rollout_score_shift_bucket\{le="([^"]+)",model="digits"\} (\S+)', text)
    assert buckets == [
        ("-0.5", "0.0"), ("-0.2", "0.0"), ("-0.1", "0.0"), ("-0.05", "1.0"), ("-0.02", "4.0"), ("0.02", "404.0"),
        ("0.05", "409.0"), ("0.1", "411.0"), ("0.2", "412.0"), ("0.5", "412.0"), ("1.0", "412.0"), ("+Inf", "412.0"),
    ]  # fmt: skip
    parsed = samples_of(text)
    assert parsed[("visionserve_rollout_score_shift_count", (("model", "digits"),))] == 412
    assert parsed[("visionserve_rollout_score_shift_sum", (("model", "digits"),))] == pytest.approx(-0.0003 * 412)


def test_null_gauges_are_left_out_and_the_counters_stay() -> None:
    document = contract_document()
    comparison = document["comparison"]
    for field in ("agreement", "agreement_low", "agreement_high", "topk_overlap", "latency_ratio"):
        comparison[field] = None
    comparison.update(samples=0, agreed=0, shed=3, errors=0)
    comparison["score_shift"].update(counts=[0] * 11, mean=None)
    document["effective_fraction"] = None
    parsed = samples_of(render(document))
    names = {name for name, _ in parsed}
    assert not names & {"visionserve_rollout_agreement", "visionserve_rollout_topk_overlap",
                        "visionserve_rollout_latency_ratio"}  # fmt: skip
    assert by_label(parsed, "visionserve_rollout_fraction", "kind") == {"configured": 0.1}
    assert by_label(parsed, "visionserve_rollout_samples_total", "outcome") == {"compared": 0, "shed": 3, "error": 0}
    assert parsed[("visionserve_rollout_score_shift_sum", (("model", "digits"),))] == 0
    assert parsed[("visionserve_rollout_score_shift_count", (("model", "digits"),))] == 0


def test_no_rollout_exports_every_family_without_samples() -> None:
    none = {"model": "cats", "state": "none"}
    families = list(text_string_to_metric_families(render(none)))
    assert {f.name: f.type for f in families} == FAMILIES
    assert all(not f.samples for f in families)


def test_models_in_every_state_each_get_their_own_series() -> None:
    running = contract_document()
    promoted = copy.deepcopy(running) | {"model": "cats", "state": "promoted", "mode": "canary", "primary": 3,
                                         "candidate": 4}  # fmt: skip
    aborted = copy.deepcopy(running) | {"model": "birds", "state": "aborted"}
    parsed = samples_of(render(running, promoted, aborted))
    info = {dict(labels)["model"]: dict(labels) for (name, labels), _ in parsed.items() if name.endswith("_info")}
    assert {m: (i["state"], i["mode"], i["primary"], i["candidate"]) for m, i in info.items()} == {
        "digits": ("running", "shadow", "1", "2"),
        "cats": ("promoted", "canary", "3", "4"),
        "birds": ("aborted", "shadow", "1", "2"),
    }
    counts = by_label(parsed, "visionserve_rollout_score_shift_count", "model")
    assert counts == {"digits": 412, "cats": 412, "birds": 412}


def test_a_score_shift_whose_counts_do_not_fit_its_edges_is_logged_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    document = contract_document()
    document["comparison"]["score_shift"]["counts"] = [1, 2, 3]
    with caplog.at_level(logging.WARNING, logger="service.core.rollout_metrics"):
        parsed = samples_of(render(document))
    assert not any(name.startswith("visionserve_rollout_score_shift") for name, _ in parsed)
    assert ("visionserve_rollout_agreement", (("bound", "low"), ("model", "digits"))) in parsed  # the rest stays
    assert "score_shift has 12 edges and 3 counts" in caplog.text
