"""Files of a campaign directory, the journal of finished configs, and per-rank events.

Layout of a campaign directory ``OUT``::

    campaign.json            what is profiled (model, grid, steps, world sizes, ...)
    plan-ws<N>.json          the valid configs of world size N, in profiling order
    skipped.csv              configs not profiled and the rule each breaks
    journal-ws<N>.jsonl      one fsync'd line per finished config (the source of truth)
    events/ws<N>/rank<R>.jsonl   what each rank started, and how it failed
    logs/                    worker output, one file per rank and launch
    card.json, measurements-*.parquet   the dataset materialised from the journals

The journal is written by one process at a time (rank 0 of the live worker group, or the
campaign parent once it has killed a group), so appends never interleave. Events let whoever
picks up after a dead group tell a config that crashed or hung from one never started.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratune._io import append_jsonl, atomic_write_text, read_jsonl
from paratune.errors import ConfigError
from paratune.measurement import Measurement, Status
from paratune.parallel import ParallelConfig
from paratune.spec import ModelSpec

__all__ = ["CampaignPaths", "EventLog", "Outcome", "failure_record", "journal_keys",
           "plan_devices_per_node", "read_journal", "resolve_unfinished"]

EXIT_RELAUNCH = 75
"""Worker exit code: ranks disagreed about a config's outcome; start a fresh group."""
EXIT_TIMEOUT = 124
"""Worker exit code: the watchdog found a config running past its timeout."""


@dataclass(frozen=True)
class CampaignPaths:
    """Paths inside one campaign directory."""

    root: Path

    @property
    def campaign(self) -> Path:
        return self.root / "campaign.json"

    @property
    def skipped(self) -> Path:
        return self.root / "skipped.csv"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def plan(self, world_size: int) -> Path:
        return self.root / f"plan-ws{world_size}.json"

    def journal(self, world_size: int) -> Path:
        return self.root / f"journal-ws{world_size}.jsonl"

    def events(self, world_size: int, rank: int) -> Path:
        return self.root / "events" / f"ws{world_size}" / f"rank{rank}.jsonl"

    def journals(self) -> list[Path]:
        return sorted(self.root.glob("journal-ws*.jsonl"),
                      key=lambda p: int(p.stem.removeprefix("journal-ws")))


# ---------------------------------------------------------------------- plans
def write_plan(paths: CampaignPaths, world_size: int, plan: dict[str, Any]) -> None:
    atomic_write_text(paths.plan(world_size), json.dumps(plan, indent=1) + "\n")


def read_plan(path: str | Path) -> dict[str, Any]:
    """A world size's plan (model, configs, steps, device, timeout)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("plan", str(path), "no such file (run 'paratune profile "
                          "--print-command' to write the plans first)") from None


def plan_configs(plan: dict[str, Any]) -> list[ParallelConfig]:
    return [ParallelConfig.from_dict(c) for c in plan["configs"]]


def plan_model(plan: dict[str, Any]) -> ModelSpec:
    return ModelSpec.from_dict(plan["model"])


# ---------------------------------------------------------------------- journal
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
_STATUSES = frozenset(s.value for s in Status)
_REJECTED: set[tuple[str, tuple[int, ...]]] = set()  # (file, entries) already warned about


def _entry_problem(entry: dict[str, Any]) -> str | None:
    """Why a journal entry cannot be trusted (``None``: it can): no ``row`` object, a row
    without a valid config or status, or a ``key`` that is not its row's config."""
    row = entry.get("row")
    if not isinstance(row, dict):
        return "no row"
    try:
        key = ParallelConfig(**{name: row[name] for name in _CONFIG_FIELDS}).key()
    except (KeyError, TypeError, ValueError) as exc:
        return f"its row has no valid config ({exc})"
    if entry.get("key") != key:
        return f"its key {entry.get('key')!r} is not its row's config {key}"
    if row.get("status") not in _STATUSES:
        return f"its row's status {row.get('status')!r} is not one of {sorted(_STATUSES)}"
    return None


def _valid_entries(path: str | Path) -> Iterator[dict[str, Any]]:
    """The journal's entries that can be trusted, in order. One that cannot (see
    :func:`_entry_problem`: a line edited or written by something else) is left out as a
    torn line is, with a warning, so that its config counts as unfinished and is measured
    again; never is a row kept under another config's key."""
    rejected: list[tuple[int, str]] = []
    for number, entry in enumerate(read_jsonl(path), start=1):
        problem = _entry_problem(entry)
        if problem is None:
            yield entry
        else:
            rejected.append((number, problem))
    key = (str(Path(path).resolve()), tuple(n for n, _ in rejected))
    if rejected and key not in _REJECTED:  # once per file and set of entries: readers poll
        _REJECTED.add(key)
        logging.getLogger(__name__).warning(
            "%s: rejected %d journal entr%s (entry %d: %s%s); %s measured again", path,
            len(rejected), "y" if len(rejected) == 1 else "ies", rejected[0][0],
            rejected[0][1], "; ..." if len(rejected) > 1 else "",
            "its config is" if len(rejected) == 1 else "their configs are")


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """Journal entries (``key``, ``world_size``, ``row`` and timing), first one per key;
    entries whose key is not their row's config, or without a row, are left out (see
    :func:`_valid_entries`)."""
    seen: set[str] = set()
    entries = []
    for entry in _valid_entries(path):
        if entry["key"] in seen:
            continue
        seen.add(entry["key"])
        entries.append(entry)
    return entries


def journal_keys(path: str | Path) -> set[str]:
    """The configs the journal holds a trusted record of."""
    return {entry["key"] for entry in _valid_entries(path)}


def append_record(path: str | Path, measurement: Measurement, **timing: Any) -> None:
    """Append one finished config durably (fsync'd before this returns)."""
    append_jsonl(path, {"key": measurement.config.key(), "world_size": measurement.world_size,
                        "row": measurement.to_row(), **timing})


def plan_devices_per_node(plan: dict[str, Any]) -> int:
    """Devices per node recorded with every row of a world size's plan, ok or failed (the
    campaign's ``devices_per_node``, else the world size: one node)."""
    return int(plan.get("devices_per_node") or plan.get("world_size") or 1)


def failure_record(plan: dict[str, Any], config: ParallelConfig, status: Status, error: str, *,
                   fingerprint: dict[str, Any] | None = None) -> Measurement:
    """The record of a config that produced no measurement.

    ``fingerprint`` is that of the machine that ran (or tried to run) the config; without
    one the plan's is taken, which only a campaign measured on the machine that prepared it
    has (see :func:`~paratune.profiler.campaign.prepare_campaign`), else the record's
    fingerprint stays unknown.
    """
    return Measurement(model=plan_model(plan), config=config, hardware=plan["hardware"],
                       devices_per_node=plan_devices_per_node(plan),
                       status=status, error=error[:4000], warmup_steps=int(plan["warmup_steps"]),
                       fingerprint=dict(fingerprint or plan.get("fingerprint") or {}),
                       campaign_id=plan.get("campaign_id", ""))


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


def resolve_unfinished(paths: CampaignPaths, plan: dict[str, Any], *, max_attempts: int = 2,
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
    world_size = int(plan["world_size"])
    journal = paths.journal(world_size)
    finished = journal_keys(journal)
    by_key = {c.key(): c for c in plan_configs(plan)}
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
