"""What an engine shows of its models, read from its model table: the catalog its front ends route by, each
version's statistics, and the repository index (Triton's). Plain reads, no event loop and no side effect."""

from __future__ import annotations

import operator
from typing import Any

import msgspec

from service.core.metrics import ModelCounts
from service.core.spec import encode_spec
from service.engine.ondemand import Residency
from service.engine.rollout import Rollouts
from service.engine.table import ModelTable
from service.transport.messages import Catalog, ModelInfo, Snapshot


def catalog(table: ModelTable, residency: Residency, rollouts: Rollouts) -> Catalog:
    """Every version served here (the on-demand ones not resident too), the load errors, and the routes."""
    models = [
        ModelInfo(
            model=name,
            version=number,
            spec_json=encode_spec(engine.spec),
            config=msgspec.to_builtins(table.configs[name].config),
            state={**msgspec.to_builtins(engine.state()), **residency.describe(name)},
        )
        for name, versions in sorted(table.models.items())
        for number, engine in sorted(versions.items())
    ]
    models += residency.available()
    return Catalog(sorted(models, key=lambda m: (m.model, m.version)), table.wire_errors(), dict(table.unloaded),
                   table.version, rollouts.routes(), rollouts.sticky_headers())  # fmt: skip


def stats(table: ModelTable, snapshots: list[Snapshot]) -> list[dict[str, Any]]:
    """A row per version: the front ends' counts (from their latest ``snapshots``), the engine's batches."""
    counts: dict[tuple[str, int], dict[str, int]] = {}
    for snapshot in snapshots:
        for c in snapshot.counts:
            into = counts.setdefault((c.model, c.version), {})
            for field in ModelCounts.__struct_fields__[2:]:
                merge = max if field == "last_inference_ms" else operator.add
                into[field] = merge(into.get(field, 0), getattr(c, field))
    rows = []
    for name, versions in sorted(table.models.items()):
        for number, engine in sorted(versions.items()):
            batcher = engine.batcher
            rows.append({
                "model": name, "version": number, **counts.get((name, number), {}),
                "batches": batcher.batches,
                "batch_sizes": {str(k): [v, batcher.size_compute_ns.get(k, 0)]
                                for k, v in sorted(batcher.size_counts.items())},
            })  # fmt: skip
    return rows


def index(names: list[str], table: ModelTable, residency: Residency) -> list[dict[str, Any]]:
    """Every model of the repository (``names``) with its state, the ones not loaded too."""
    rows: list[dict[str, Any]] = []
    for name in sorted(set(names) | set(table.models) | {k for k in table.errors if isinstance(k, str)}):
        if "/" in name:
            continue
        # Triton's rows for a pinned model; an on-demand model's say whether it is resident, and why not.
        on_demand = residency.on_demand.get(name)
        described = residency.describe(name) if on_demand is not None else {}
        if name in table.models:
            rows += [{"name": name, "version": str(v), "state": "READY", **described}
                     for v in sorted(table.models[name])]  # fmt: skip
            continue
        if on_demand is not None:
            why = described["why_not_resident"]
            rows += [{"name": name, "version": str(v), "state": "AVAILABLE", "reason": why, **described}
                     for v in sorted(on_demand.versions)]  # fmt: skip
            continue
        reason = table.unloaded.get(name) or table.load_error(name)
        rows.append({"name": name, "state": "UNAVAILABLE", "reason": reason or "not loaded"})
    return rows
