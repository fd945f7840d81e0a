"""The profiler's side of a campaign directory: per-rank events, failure records, and the
settling of configs a dead launch left unfinished.

The directory's layout, plans and journal are records of the store layer
(:mod:`paratune.datasets.journal`); their names are re-exported here for the profiler's
modules. The journal is written by one process at a time (rank 0 of the live worker group,
or the campaign parent once it has killed a group), so appends never interleave. Events let
whoever picks up after a dead group tell a config that crashed or hung from one never
started.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratune.datasets.journal import (
    CampaignPaths,
    JournalEntry,
    WorldSizePlan,
    append_record,
    journal_keys,
    load_plan,
    read_journal,
    read_journal_entries,
    read_plan,
    write_plan,
)
from paratune.fileio import append_jsonl, read_jsonl
from paratune.measurement import Measurement, Status
from paratune.parallel import ParallelConfig

__all__ = ["CampaignPaths", "EventLog", "JournalEntry", "Outcome", "WorldSizePlan",
           "append_record", "failure_record", "journal_keys", "load_plan", "read_journal",
           "read_journal_entries", "read_plan", "resolve_unfinished", "write_plan"]

EXIT_RELAUNCH = 75
"""Worker exit code: ranks disagreed about a config's outcome; start a fresh group."""
EXIT_TIMEOUT = 124
"""Worker exit code: the watchdog found a config running past its timeout."""


def failure_record(plan: WorldSizePlan | Mapping[str, Any], config: ParallelConfig,
                   status: Status, error: str, *, fingerprint: dict[str, Any] | None = None
                   ) -> Measurement:
    """The record of a config that produced no measurement.

    ``fingerprint`` is that of the machine that ran (or tried to run) the config; without
    one the plan's is taken, which only a campaign measured on the machine that prepared it
    has (see :func:`~paratune.profiler.campaign.prepare_campaign`), else the record's
    fingerprint stays unknown.
    """
    plan = WorldSizePlan.of(plan)
    return Measurement(model=plan.model, config=config, hardware=plan.hardware,
                       devices_per_node=plan.devices_per_node, status=status,
                       error=error[:4000], warmup_steps=plan.warmup_steps,
                       fingerprint=dict(fingerprint or plan.fingerprint or {}),
                       campaign_id=plan.campaign_id)




# ---------------------------------------------------------------------- events
class EventLog:
    """One rank's event file: ``start`` / ``fail`` / ``timeout`` / ``interrupted`` / ``end``
    per config. ``interrupted`` says the rank was stopped from outside (SIGTERM or SIGINT)
    while the config ran; it is no evidence against the config."""

    def __init__(self, path: str | Path, *, rank: int, attempt: str) -> None:
        self.path = Path(path)
        self.rank = rank
        self.attempt = attempt
        self._lock = threading.Lock()  # the main thread, the watchdog and the stop handler

    def write(self, event: str, key: str = "", **data: Any) -> None:
        with self._lock:
            append_jsonl(self.path, {"event": event, "key": key, "rank": self.rank,
                                     "attempt": self.attempt, "time": time.time(), **data})


class EventTail:
    """Incremental reader of an event file (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_events(paths: CampaignPaths, world_size: int) -> list[dict[str, Any]]:
    events = []
    for rank in range(world_size):
        events.extend(read_jsonl(paths.events(world_size, rank)))
    return events


@dataclass
class Outcome:
    """What the events say about one config that has no journal record."""

    key: str
    attempts: set[str] = field(default_factory=set)
    causes: list[dict[str, Any]] = field(default_factory=list)
    """``fail`` and ``timeout`` events."""
    interrupted: dict[str, set[int]] = field(default_factory=dict)
    """Launch -> the ranks that wrote an ``interrupted`` event for this config."""

    def counted_attempts(self, world_size: int) -> set[str]:
        """The launches that count as attempts of this config: those that started it, less
        those stopped from outside, where every rank wrote ``interrupted`` (a rank that
        crashed writes none, and its peers, stopped after it, do not clear it)."""
        every = set(range(world_size))
        return {a for a in self.attempts if not every <= self.interrupted.get(a, set())}

    def status_and_error(self) -> tuple[Status, str] | None:
        """A definite outcome, or ``None`` when the evidence is only that it was started.

        The earliest failure or timeout is the cause: a peer's error after a rank timed out
        (or failed) is a consequence of it.
        """
        if not self.causes:
            return None
        root = min(self.causes, key=lambda e: e.get("time", 0.0))
        if root["event"] == "timeout":
            return Status.TIMEOUT, (f"no result within the per-config timeout of "
                                    f"{root.get('timeout_s', 0):g} s")
        oom = root.get("status") == Status.OOM.value
        return (Status.OOM if oom else Status.ERROR), root.get("error", "")


def unfinished(events: list[dict[str, Any]], finished: set[str]) -> dict[str, Outcome]:
    """Configs started (in any launch) that have no journal record, with their evidence."""
    outcomes: dict[str, Outcome] = {}
    for event in events:
        key = event.get("key", "")
        if not key or key in finished:
            continue
        outcome = outcomes.setdefault(key, Outcome(key))
        kind = event.get("event")
        if kind == "start":
            outcome.attempts.add(event.get("attempt", ""))
        elif kind in ("fail", "timeout"):
            outcome.causes.append(event)
        elif kind == "interrupted":
            outcome.interrupted.setdefault(event.get("attempt", ""), set()).add(
                int(event.get("rank", -1)))
    return outcomes


def resolve_unfinished(paths: CampaignPaths, plan: WorldSizePlan | Mapping[str, Any], *,
                       max_attempts: int = 2,
                       fingerprint: dict[str, Any] | None = None) -> list[Measurement]:
    """Journal the configs that previous launches left without a record, where the evidence
    is definite: a rank reported a failure or a timeout, or the config was started in
    ``max_attempts`` launches that all died. Configs merely started once are left to be
    measured again, and so are those of launches stopped from outside (every rank wrote
    ``interrupted``): a stop is not an attempt. Used by workers started by torchrun (which
    restarts the group after a failure); the local launcher resolves each failure itself as
    it sees it.

    Args:
        fingerprint: Of the machine resolving them (the one the configs ran on), recorded
            with each failure (see :func:`failure_record`).

    Returns:
        The failure records appended to the journal.
    """
    plan = WorldSizePlan.of(plan)
    world_size = plan.world_size
    journal = paths.journal(world_size)
    finished = journal_keys(journal)
    by_key = {c.key(): c for c in plan.configs}
    records = []
    for key, outcome in unfinished(read_events(paths, world_size), finished).items():
        if key not in by_key:
            continue
        decided = outcome.status_and_error()
        attempts = outcome.counted_attempts(world_size)
        if decided is None and len(attempts) >= max_attempts:
            decided = (Status.ERROR, f"the process group died while measuring this config "
                                     f"in {len(attempts)} launches")
        if decided is None:
            continue
        record = failure_record(plan, by_key[key], *decided, fingerprint=fingerprint)
        append_record(journal, record, resolved_by="restart")
        records.append(record)
    return records
