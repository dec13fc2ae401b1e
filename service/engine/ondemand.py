"""Many models on one device (README, "Many models on one device"): on-demand models loaded by their first request
(every request arriving meanwhile waits for that one load), charged to a memory budget, and the least recently used
evicted for a load; pinned models are charged too. The accounts and the choice of what to evict are
:mod:`service.engine.residency`'s; what a load costs is measured here, across it (:func:`settled_used_bytes`), and a
load that overlapped another is charged an estimate instead (``resident_bytes_estimated``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec

from service.core.errors import DeadlineExceededError, MemoryBudgetError, VisionServeError
from service.core.repository import ModelEntry
from service.core.spec import encode_spec
from service.core.status import EngineState
from service.engine.residency import Accounts, Charge, NoRoom, give_back_memory, settled_used_bytes
from service.engine.table import ModelTable
from service.runtime import choose_backend
from service.transport.messages import ModelInfo, VersionKey

log = logging.getLogger("visionserve.engine")
# A model's size before its first exclusive measurement, over its files' size: resnet18 in onnxruntime on the CPU
# held 1.0-1.2x its 46.8 MB file once loaded (scripts/many_models_bench.py); twice over-charged every first load.
ESTIMATE_OVER_FILE = 1.25


class Residency:
    """The engine's resident models beyond the pinned ones: loads on demand, evictions, and the numbers. Handed the
    model ``table``, the loader (``load``: every version of an entry into the table), where a model's memory lives
    (``place``), and whether this is the primary engine (it shows the CPU's row)."""

    def __init__(
        self,
        table: ModelTable,
        load: Callable[[ModelEntry], Awaitable[None]],
        budgets: dict[str, int],
        *,
        place: Callable[[ModelEntry], str],
        primary: bool = True,
        drain_timeout_s: float = 30.0,
        min_residency_s: float = 1.0,
        max_parallel_loads: int = 1,
        cold_start_limit_s: float = 30.0,
    ) -> None:
        self.table = table
        self._load_versions = load
        self._place = place
        self.primary = primary
        self.drain_timeout_s = drain_timeout_s
        self.accounts = Accounts(budgets, min_residency_s=min_residency_s)
        self.cold_start_limit_s = cold_start_limit_s
        self.on_demand: dict[str, ModelEntry] = {}  # every on-demand model, resident or not
        self.why_not: dict[str, str] = {}  # a non-resident on-demand model: why (never loaded, evicted, refused)
        self.estimated: set[str] = set()  # charged by estimate (its load overlapped another)
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._waiting: dict[str, int] = {}  # requests waiting for a model's load (it is busy meanwhile)
        self._slots = asyncio.Semaphore(max_parallel_loads)
        self._active_loads = 0
        self._starts = 0  # loads started, ever: a load during which it moved overlapped another
        # Counted here and read at scrape time (a Prometheus call per request costs throughput: docs/performance.md).
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.loads: Counter[tuple[str, str]] = Counter()  # (model, reason) -> count
        self.evictions: Counter[tuple[str, str]] = Counter()  # (model, reason: lru | unload) -> count
        self._holds: dict[str, set[tuple[bytes, str]]] = {}  # model -> (front end's peer, holder) holding it
        self.live_peer: Callable[[bytes], bool] = lambda peer: True  # a front end's holds end with it
        self.cold_starts: list[tuple[str, float]] = []  # (model, seconds), folded into a histogram at scrape

    # ---- requests -------------------------------------------------------------------------------------------
    def hit(self, name: str) -> None:
        self.hits[name] += 1
        self.accounts.touch(name)

    async def wait_for(self, name: str, deadline: float | None) -> float:
        """Make ``name`` resident (its load started, or joined); the seconds this request waited for it."""
        self.misses[name] += 1
        started = time.monotonic()
        self._waiting[name] = self._waiting.get(name, 0) + 1
        try:
            task = self._loading.get(name)
            if task is None:
                task = self._loading[name] = asyncio.create_task(self._load(name, "on_demand"))
                task.add_done_callback(self._loaded)
            limit = self.cold_start_limit_s if deadline is None else min(self.cold_start_limit_s, deadline - started)
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=max(0.0, limit))
            except TimeoutError:
                raise DeadlineExceededError(
                    f"model {name!r} was still loading after {limit:.1f} s (its first request's load; "
                    f"--cold-start-limit-s {self.cold_start_limit_s:g})"
                ) from None
        finally:
            self._waiting[name] -= 1
        waited = time.monotonic() - started
        self.cold_starts.append((name, waited))
        self.accounts.touch(name)
        return waited

    def _loaded(self, task: asyncio.Task[None]) -> None:
        """A load ended: forget it; its error was each waiter's (read here too, so none goes unretrieved)."""
        for name, loading in list(self._loading.items()):
            if loading is task:
                del self._loading[name]
        if not task.cancelled() and task.exception() is not None:
            log.warning("an on-demand load failed: %s", task.exception())

    def hold(self, name: str, holder: tuple[bytes, str], hold: bool) -> int:
        """``holder`` (a front end's source) keeps ``name`` resident while it runs (``hold``), or no longer: how
        many hold it now."""
        holders = self._holds.setdefault(name, set())
        if hold:
            holders.add(holder)
        else:
            holders.discard(holder)
        return len(holders)

    def held(self, name: str) -> bool:
        """A source of a live front end runs on ``name``."""
        holders = self._holds.get(name)
        if not holders:
            return False
        holders.difference_update({h for h in holders if not self.live_peer(h[0])})
        return bool(holders)

    def busy(self, name: str) -> bool:
        """Work queued, in flight, or waiting for its load, or held by a source: such a model is never evicted."""
        return bool(self._waiting.get(name)) or name in self._loading or self.held(name) or self.table.busy(name)

    # ---- loading and evicting -------------------------------------------------------------------------------
    def offer(self, entry: ModelEntry) -> None:
        """An on-demand model: listed now, loaded by its first request."""
        self.on_demand[entry.name] = entry
        self.why_not.setdefault(entry.name, "on demand: not loaded yet (its first request loads it)")

    async def load(self, entry: ModelEntry, reason: str) -> None:
        """Load ``entry`` now (at start for a pinned model, or asked by the repository API), charged like any. It is
        the model's one load while it runs: requests arriving meanwhile wait for it, as for an on-demand load."""
        await self.settle(entry.name)
        task = self._loading[entry.name] = asyncio.create_task(self._load(entry.name, reason, entry))
        task.add_done_callback(self._loaded)
        await task

    async def load_extra(self, key: VersionKey, entry: ModelEntry, load: Callable[[], Awaitable[None]]) -> None:
        """Another version of a resident model (a rollout's candidate), charged under ``key`` as a pinned model:
        room is made as for any load, and what the load measurably took stays charged until
        :meth:`release_extra`."""
        async with self._slots:
            device = self._place(entry)
            need = int(ESTIMATE_OVER_FILE * _files_bytes(entry) / max(1, len(entry.versions)))
            await self._make_room(key, device, need)
            self.accounts.charge(key, device, need, pinned=True)
            try:
                before = await asyncio.to_thread(settled_used_bytes, device)
                await load()
                after = await asyncio.to_thread(settled_used_bytes, device)
            except BaseException:
                self.accounts.release(key)
                raise
            self.accounts.charge(key, device, max(after - before, need), pinned=True)
        self.table.changed()

    def release_extra(self, key: VersionKey) -> None:
        """The version charged under ``key`` left (a rollout decided)."""
        if self.accounts.release(key) is not None:
            self.table.changed()

    def decided(self, name: str, key: VersionKey, *, promoted: bool, versions: int) -> Charge | None:
        """A rollout of ``name`` decided; its candidate was charged under ``key`` (loaded for the rollout) or shares
        the model's charge (loaded with it: ``versions`` loaded, the leaving one included). Aborted: the candidate's
        own charge leaves, counted (``leaving``) until its version is closed. Promoted: the old primary leaves, so
        the model's own charge covers both versions until that one is closed. Returns the charge leaving, or the
        leaving version's share of the model's, for :meth:`close`."""
        extra = self.accounts.release(key)
        own = self.accounts.charges.get(name)
        if extra is None:  # loaded with the model: what closing it frees comes off, at most its share
            if own is None or versions < 2:
                return None
            return Charge(name, own.device, own.bytes // versions, own.pinned, own.loaded_at, own.last_used)
        self.table.changed()
        if promoted and own is not None:
            self.accounts.charge(name, own.device, own.bytes + extra.bytes, pinned=own.pinned)
            return own  # no longer in the accounts: what :meth:`close` may take off the model's charge
        self.accounts.leaving.append(extra)
        return extra

    async def close(self, charge: Charge | None, close: Callable[[], Awaitable[None]]) -> None:
        """Run ``close`` (the version leaving a decided rollout) and give back its ``charge``: the candidate's
        whole, or off the promoted model's charge what closing the old primary measurably freed (at most its own
        charge; nothing where a load ran meanwhile and the measure would mix the two: counted high, not low)."""
        if charge is None:
            await close()
            return
        starts = self._starts
        before = await asyncio.to_thread(settled_used_bytes, charge.device)
        try:
            await close()
        finally:
            if any(c is charge for c in self.accounts.leaving):
                self.accounts.leaving.remove(charge)
            else:
                after = await asyncio.to_thread(settled_used_bytes, charge.device)
                alone = self._starts == starts and self._active_loads == 0
                model = self.accounts.charges.get(charge.model)
                if model is not None and alone:
                    model.bytes -= min(charge.bytes, max(0, before - after))
                    self.accounts.sizes[charge.model] = model.bytes
            self.table.changed()

    @contextlib.contextmanager
    def leaving(self, name: str) -> Iterator[None]:
        """``name``'s copy, out of the table, closes in the block (evicted, or loaded again by the repository API):
        its charge is counted as leaving until the block ends, and a new load is charged as its own."""
        charge = self.accounts.release(name)
        if charge is not None:
            self.accounts.leaving.append(charge)
        try:
            yield
        finally:
            if charge is not None:
                self.accounts.leaving.remove(charge)

    def reoffer(self, entry: ModelEntry) -> None:
        """``entry`` was loaded again: on demand from now on, or pinned, as its config now says."""
        if entry.config.residency == "on_demand":
            self.offer(entry)
        else:
            self.on_demand.pop(entry.name, None)

    def unloaded(self, name: str) -> None:
        """A pinned model was unloaded by request: its charges (its rollout candidate's too) go, counted."""
        self.accounts.release(name)
        for key in [k for k in self.accounts.charges if isinstance(k, VersionKey) and k.name == name]:
            self.release_extra(key)
        self.evictions[(name, "unload")] += 1

    def loading(self) -> list[asyncio.Task[None]]:
        """The loads in progress."""
        return list(self._loading.values())

    async def settle(self, name: str) -> None:
        """Wait for a load of ``name`` in progress, whatever its outcome (an explicit load or unload goes after)."""
        task = self._loading.get(name)
        if task is not None:
            await asyncio.wait([task])

    async def _load(self, name: str, reason: str, entry: ModelEntry | None = None) -> None:
        entry = entry or self.on_demand[name]
        pinned = entry.config.residency == "pinned"
        async with self._slots:
            device = self._place(entry)
            drill = entry.config.faults.resident_bytes  # a model this big, by its config (tests, drills)
            need = drill or self.accounts.sizes.get(name) or int(ESTIMATE_OVER_FILE * _files_bytes(entry))
            await self._make_room(name, device, need)
            self.accounts.charge(name, device, need, pinned=pinned)  # held while it loads: no other load takes it
            self._active_loads += 1
            self._starts += 1
            starts, overlapped = self._starts, self._active_loads > 1
            try:
                before = await asyncio.to_thread(settled_used_bytes, device)
                await self._load_versions(entry)
                after = await asyncio.to_thread(settled_used_bytes, device)
                overlapped = overlapped or self._active_loads > 1 or self._starts != starts  # another ran meanwhile
            finally:
                self._active_loads -= 1
                if name not in self.table.models:
                    self.accounts.release(name)
        if name not in self.table.models:
            reason_text = self.table.load_error(name)
            self.why_not[name] = f"failed to load: {reason_text}"
            raise VisionServeError(f"model {name!r} failed to load: {reason_text or 'see the log'}")
        measured = drill or max(after - before, _files_bytes(entry))
        overlapped = overlapped and not drill
        size = need if overlapped else measured
        (self.estimated.add if overlapped else self.estimated.discard)(name)
        self.accounts.charge(name, device, size, pinned=pinned)
        if not overlapped:
            self.accounts.sizes[name] = measured
        self.why_not.pop(name, None)
        self.table.changed()
        self.loads[(name, reason)] += 1
        log.info("model %s resident on %s: %.1f MB%s", name, device, size / 1e6, " (estimated)" if overlapped else "")

    async def _make_room(self, key: str | VersionKey, device: str, need: int) -> None:
        """Evict what the accounts choose so that ``need`` bytes fit for ``key`` (a model, or one version of it);
        wait for a young model to come of age (within the cold-start limit); refuse with 503 when nothing may go."""
        name = str(key)
        give_up = time.monotonic() + self.cold_start_limit_s
        while True:
            try:
                victims = self.accounts.victims(device, need, self.busy)
            except NoRoom as exc:
                if exc.wait_s is not None and time.monotonic() + exc.wait_s < give_up:
                    await asyncio.sleep(exc.wait_s)
                    continue
                if isinstance(key, str):
                    self.why_not[key] = f"refused: {exc}"
                self.table.changed()
                raise MemoryBudgetError(f"model {name!r} cannot be loaded: {exc}") from None
            if not victims:
                return  # it fits, and the caller reserves it before anything else runs (no await in between)
            # One at a time, looking again after each: evicting awaits, and meanwhile another load may take the room
            # or the next victim may get work (it is then busy, and must not go).
            await self.evict(victims[0], f"evicted (least recently used) to make room for {name!r}")

    async def evict(self, name: str, why: str, *, reason: str = "lru") -> None:
        """Take ``name`` out of memory. The accounts never choose a busy model; an unload asked for by the
        repository API may find one busy, and its queued work is finished first (``close`` drains it). Its memory
        stays counted until it is closed (a draining model still holds it)."""
        engines = self.table.models.pop(name, None)
        if engines is None:
            return  # not resident: a reservation of a load in progress is that load's to keep or release
        with self.leaving(name):
            self._starts += 1  # memory falls meanwhile: a load measured across this is no exclusive measurement
            if name in self.on_demand:
                self.why_not[name] = why
            self.table.changed()
            for engine in engines.values():
                await engine.close(self.drain_timeout_s)
            await asyncio.to_thread(give_back_memory)
        self.evictions[(name, reason)] += 1
        log.info("model %s %s", name, why)

    # ---- what it shows --------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The numbers ``/metrics`` shows (folded at scrape time)."""
        cold = self.cold_starts[:]  # read on a scrape's thread while the loop appends: take what is there
        del self.cold_starts[: len(cold)]
        charges = [*self.accounts.charges.values(), *self.accounts.leaving]
        # One engine per GPU: the CPU's row comes from the primary alone (unless another holds a model there).
        devices = sorted({c.device for c in charges} | ({"cpu"} if self.primary else set()))
        used = {d: sum(c.bytes for c in charges if c.device == d) for d in devices}
        resident = [c for c in list(self.accounts.charges.values()) if c.model in self.table.models]
        return {
            "resident": [(c.model, c.device, c.bytes) for c in resident],
            "devices": [(d, used[d], self.accounts.budget(d)) for d in devices],
            "hits": self.hits.copy(), "misses": self.misses.copy(), "loads": self.loads.copy(),
            "evictions": self.evictions.copy(), "cold_starts": cold,
        }  # fmt: skip

    def describe(self, name: str) -> dict[str, Any]:
        """What metadata and the index say of ``name``'s residency."""
        resident = name in self.table.models
        charge = self.accounts.charges.get(name) if resident else None
        entry = self.on_demand.get(name) or self.table.configs.get(name)
        return {
            "residency": entry.config.residency if entry is not None else "pinned",
            "resident": resident,
            "resident_bytes": charge.bytes if charge else 0,
            "resident_bytes_estimated": name in self.estimated,
            "why_not_resident": None if resident else self.why_not.get(name, "not loaded"),
        }

    def available(self) -> list[ModelInfo]:
        """The catalog rows of on-demand models not resident now: listed, state AVAILABLE, so front ends route
        their requests here (where the first one loads them)."""
        rows = []
        for name, entry in sorted(self.on_demand.items()):
            if name in self.table.models:
                continue
            devices = (self._place(entry),)
            for number, version in sorted(entry.versions.items()):
                try:
                    backend = choose_backend(version, entry.config)
                except VisionServeError:
                    backend = "unknown"
                state = EngineState(state="AVAILABLE", backend=backend, devices=devices,
                                    precision=entry.config.precision, note=self.why_not.get(name))  # fmt: skip
                rows.append(ModelInfo(model=name, version=number, spec_json=encode_spec(version.spec),
                                      config=msgspec.to_builtins(entry.config),
                                      state={**msgspec.to_builtins(state), **self.describe(name)}))  # fmt: skip
        return rows


def _files_bytes(entry: ModelEntry) -> int:
    """What the artifact files the model will load weigh, every version: the least its weights take in memory."""
    total = 0
    for version in entry.versions.values():
        try:
            path = version.files.get(choose_backend(version, entry.config))
        except VisionServeError:
            path = None
        sizes = [p.stat().st_size for p in ([path] if path else version.files.values()) if p.is_file()]
        total += max(sizes, default=0)
    return total
