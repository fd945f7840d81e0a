"""A campaign directory's records: its layout, the plan of each world size, and the journal.

Layout of a campaign directory ``OUT``::

    campaign.json            what is profiled (model, grid, steps, world sizes, ...)
    plan-ws<N>.json          the valid configs of world size N, in profiling order
    skipped.csv              configs not profiled and the rule each breaks
    journal-ws<N>.jsonl      one fsync'd line per finished config (the source of truth)
    events/ws<N>/rank<R>.jsonl   what each rank started, and how it failed
    logs/                    worker output, one file per rank and launch
    card.json, measurements-*.parquet   the dataset materialised from the journals

A plan is a :class:`WorldSizePlan`, a journal line a :class:`JournalEntry`. The profiler
writes them (one process at a time appends to a journal); this layer reads them and turns the
journals into a dataset (:mod:`paratune.datasets.materialise`), so that it never needs the
profiler.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError
from paratune.fileio import append_jsonl, atomic_write_text, read_jsonl
from paratune.measurement import Measurement, Status, StepTiming
from paratune.parallel import ParallelConfig
from paratune.spec import ModelSpec

__all__ = ["CampaignPaths", "JournalEntry", "WorldSizePlan", "append_record", "journal_keys",
           "load_plan", "read_journal", "read_journal_entries", "read_plan", "write_plan"]


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
@dataclass(frozen=True, kw_only=True)
class WorldSizePlan:
    """What the workers of one world size profile: the content of ``plan-ws<N>.json``."""

    campaign_id: str
    """The campaign's identity (recorded with every row)."""
    world_size: int
    """Ranks of the group."""
    model: ModelSpec
    """The model trained."""
    hardware: str
    """:class:`~paratune.hardware.HardwareSpec` name recorded with the rows."""
    device: str
    """``"cpu"`` (gloo) or ``"cuda"`` (NCCL)."""
    devices_per_node: int
    """Devices per node recorded with every row, ok or failed."""
    warmup_steps: int
    """Steps run before timing each config."""
    measured_steps: int
    """Steps timed per config."""
    seed: int = 0
    """Initialisation and data seed."""
    timeout_s: float
    """Seconds one config may take."""
    data: str = "synthetic"
    """Training tokens: ``"synthetic"`` or ``"text"``."""
    configs: tuple[ParallelConfig, ...] = ()
    """The configs, in profiling order."""
    fingerprint: dict[str, Any] | None = None
    """The preparing machine's fingerprint where it also measures (for the records of
    configs that fail under the local launcher's supervision), else ``None``."""

    def keys(self) -> list[str]:
        """The configs' keys, in profiling order."""
        return [config.key() for config in self.configs]

    def to_dict(self) -> dict[str, Any]:
        """The plan file's JSON object (no ``fingerprint`` key when there is none)."""
        data: dict[str, Any] = {
            "campaign_id": self.campaign_id, "world_size": self.world_size,
            "model": self.model.to_dict(), "hardware": self.hardware, "device": self.device,
            "devices_per_node": self.devices_per_node, "warmup_steps": self.warmup_steps,
            "measured_steps": self.measured_steps, "seed": self.seed,
            "timeout_s": self.timeout_s, "data": self.data}
        if self.fingerprint is not None:
            data["fingerprint"] = dict(self.fingerprint)
        data["configs"] = [config.to_dict() for config in self.configs]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "plan") -> WorldSizePlan:
        """Parse a plan file's object (written by this or an earlier version: a plan without
        ``devices_per_node`` is one node of its world size, one without ``data`` synthetic).

        Raises:
            ConfigError: a required key is missing (``plan``, naming it and ``where``).
        """
        try:
            world_size = int(data["world_size"])
            return cls(
                campaign_id=str(data.get("campaign_id", "")), world_size=world_size,
                model=ModelSpec.from_dict(data["model"]), hardware=str(data["hardware"]),
                device=str(data.get("device", "cpu")),
                devices_per_node=int(data.get("devices_per_node") or world_size or 1),
                warmup_steps=int(data["warmup_steps"]),
                measured_steps=int(data["measured_steps"]), seed=int(data.get("seed", 0)),
                timeout_s=float(data["timeout_s"]), data=str(data.get("data", "synthetic")),
                configs=tuple(ParallelConfig.from_dict(c) for c in data.get("configs", [])),
                fingerprint=(dict(data["fingerprint"]) if data.get("fingerprint") is not None
                             else None))
        except KeyError as exc:
            raise ConfigError("plan", where, f"has no {exc.args[0]!r}: not a paratune "
                              "plan") from None

    @classmethod
    def of(cls, plan: WorldSizePlan | Mapping[str, Any]) -> WorldSizePlan:
        """``plan`` itself, or parsed from a plan file's object (:func:`read_plan`)."""
        return plan if isinstance(plan, WorldSizePlan) else cls.from_dict(plan)


def write_plan(paths: CampaignPaths, plan: WorldSizePlan) -> None:
    """Write ``plan-ws<N>.json`` atomically."""
    atomic_write_text(paths.plan(plan.world_size), json.dumps(plan.to_dict(), indent=1) + "\n")


def read_plan(path: str | Path) -> dict[str, Any]:
    """A world size's plan file as its JSON object (see :func:`load_plan` for the record).

    Raises:
        ConfigError: there is no such file.
    """
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("plan", str(path), "no such file (run 'paratune profile "
                          "--print-command' to write the plans first)") from None


def load_plan(path: str | Path) -> WorldSizePlan:
    """A world size's plan file as a :class:`WorldSizePlan`."""
    return WorldSizePlan.from_dict(read_plan(path), where=str(path))


# ---------------------------------------------------------------------- journal
_TIMING_KEYS = tuple(f.name for f in dataclasses.fields(StepTiming))
_ENTRY_KEYS = ("key", "world_size", "row", "attempt", "resolved_by")


@dataclass(frozen=True, kw_only=True)
class JournalEntry:
    """One line of a journal: a finished config's record and how it was obtained."""

    key: str
    """The config's key (that of ``row``'s config)."""
    world_size: int
    """The group's size."""
    row: dict[str, Any]
    """The :meth:`~paratune.Measurement.to_row` of the record."""
    timing: StepTiming = field(default_factory=StepTiming)
    """Where the config's time went (from the row's timing columns, or, in journals written
    before they existed, from the entry's own keys)."""
    attempt: str | None = None
    """The launch that journaled it."""
    resolved_by: str | None = None
    """``"parent"`` or ``"restart"`` for a failure journaled by whoever picked up after a
    dead group; ``None`` when the group itself journaled it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else on the line (load average, memory details, ...)."""

    @property
    def status(self) -> Status:
        return Status(self.row["status"])

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def measurement(self) -> Measurement:
        return Measurement.from_row(self.row)

    def to_dict(self) -> dict[str, Any]:
        """The journal line's JSON object."""
        data: dict[str, Any] = {"key": self.key, "world_size": self.world_size, "row": self.row}
        data.update(self.timing.to_dict())
        for name in ("attempt", "resolved_by"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        data.update(self.extra)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JournalEntry:
        """Parse a trusted line (see :func:`read_journal_entries`)."""
        row = dict(data["row"])
        timing = StepTiming.from_columns(row)
        if not timing.to_dict():  # a journal written before the row held its timing
            timing = StepTiming.from_dict(data)
        return cls(key=str(data["key"]), world_size=int(data.get("world_size", 0)), row=row,
                   timing=timing, attempt=data.get("attempt"),
                   resolved_by=data.get("resolved_by"),
                   extra={k: v for k, v in data.items()
                          if k not in _ENTRY_KEYS and k not in _TIMING_KEYS})


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
    """Journal entries as their JSON objects (``key``, ``world_size``, ``row`` and timing),
    first one per key; entries whose key is not their row's config, or without a row, are
    left out (see :func:`_valid_entries`)."""
    seen: set[str] = set()
    entries = []
    for entry in _valid_entries(path):
        if entry["key"] in seen:
            continue
        seen.add(entry["key"])
        entries.append(entry)
    return entries


def read_journal_entries(path: str | Path) -> list[JournalEntry]:
    """:func:`read_journal` as :class:`JournalEntry` records."""
    return [JournalEntry.from_dict(entry) for entry in read_journal(path)]


def journal_keys(path: str | Path) -> set[str]:
    """The configs the journal holds a trusted record of."""
    return {entry["key"] for entry in _valid_entries(path)}


def append_record(path: str | Path, measurement: Measurement, **extra: Any) -> None:
    """Append one finished config durably (fsync'd before this returns); ``extra`` (the
    launch, who resolved it, load average, ...) goes on the line beside the record."""
    append_jsonl(path, {"key": measurement.config.key(), "world_size": measurement.world_size,
                        "row": measurement.to_row(), **extra})
