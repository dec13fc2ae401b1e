"""Several engines' Prometheus texts as one, for a server with an engine per GPU."""

from __future__ import annotations

from typing import Any


def merge_exposition(texts: list[Any]) -> bytes:
    """Several engines' Prometheus texts as one (families merged by name; samples never overlap: each engine
    labels its own devices, and only the first renders the front ends' request families)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(bytes(text).decode()):
            seen = families.get(family.name)
            if seen is None:
                families[family.name] = family
            else:
                seen.samples.extend(family.samples)
    lines: list[str] = []
    for family in families.values():
        lines.append(f"# HELP {family.name} {family.documentation}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {sample.value!r}" if labels else f"{sample.name} {sample.value!r}")
    return ("\n".join(lines) + "\n").encode()
