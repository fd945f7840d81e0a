"""A campaign directory's journals as a dataset, and how far its profiling got."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.datasets.journal import (
    CampaignPaths,
    journal_keys,
    load_plan,
    read_journal,
    read_journal_entries,
)
from paratune.errors import ConfigError
from paratune.measurement import Status

if TYPE_CHECKING:
    from paratune.datasets import Dataset

__all__ = ["CampaignProgress", "campaign_progress", "materialise", "plan_keys",
           "unfinished_configs"]


def plan_keys(paths: CampaignPaths, world_size: int) -> set[str]:
    """The config keys of world size ``world_size``'s plan."""
    return set(load_plan(paths.plan(world_size)).keys())


def unfinished_configs(paths: CampaignPaths, world_sizes: tuple[int, ...]
                       ) -> dict[int, set[str] | None]:
    """The world sizes with configs still to measure: per world size, the keys of its plan
    that its journal does not hold (``None`` for a world size without a plan yet)."""
    left: dict[int, set[str] | None] = {}
    for world_size in world_sizes:
        if not paths.plan(world_size).exists():
            left[world_size] = None
            continue
        keys = plan_keys(paths, world_size) - journal_keys(paths.journal(world_size))
        if keys:
            left[world_size] = keys
    return left


@dataclass
class CampaignProgress:
    """How far the profiling of a campaign directory got (see :func:`campaign_progress`)."""

    out: Path
    campaign_id: str
    planned: dict[int, int | None]
    """Per world size of the campaign: configs in its plan (``None``: not planned yet)."""
    journaled: dict[int, int]
    """Per world size: configs of its plan that its journal holds."""
    num_rows: int
    """Rows the journals hold (what :func:`materialise` writes as the dataset)."""

    @property
    def finished(self) -> bool:
        """Whether every config of every world size is journaled."""
        return all(planned is not None and self.journaled[ws] >= planned
                   for ws, planned in self.planned.items())


def campaign_progress(out: str | Path) -> CampaignProgress | None:
    """Configs planned and journaled per world size of the campaign in ``out``.

    Returns:
        ``None`` where ``out`` holds no campaign (no ``campaign.json``).
    """
    paths = CampaignPaths(Path(out))
    if not paths.campaign.exists():
        return None
    meta = json.loads(paths.campaign.read_text())
    world_sizes = tuple(int(ws) for ws in meta.get("identity", {}).get("world_sizes")
                        or sorted(map(int, meta.get("num_valid", {}))))
    left = unfinished_configs(paths, world_sizes)
    planned: dict[int, int | None] = {}
    journaled: dict[int, int] = {}
    for world_size in world_sizes:
        if left.get(world_size, set()) is None:  # no plan yet
            planned[world_size] = None
            journaled[world_size] = 0
            continue
        planned[world_size] = len(plan_keys(paths, world_size))
        journaled[world_size] = planned[world_size] - len(left.get(world_size, set()))
    num_rows = sum(len(read_journal(journal)) for journal in paths.journals())
    return CampaignProgress(out=paths.root, campaign_id=str(meta.get("campaign_id", "")),
                            planned=planned, journaled=journaled, num_rows=num_rows)


def materialise(out: str | Path) -> Dataset:
    """Write the campaign's journals as a dataset (parquet + card) in ``out``, atomically.

    Returns:
        The dataset written.

    Raises:
        ConfigError: ``out`` is not a campaign directory, or no config of it has finished.
    """
    from paratune.datasets import DatasetCard, write_dataset

    paths = CampaignPaths(Path(out))
    if not paths.campaign.exists():
        raise ConfigError("out", str(out), "holds no campaign.json: not a campaign directory")
    meta = json.loads(paths.campaign.read_text())
    entries = [entry for journal in paths.journals() for entry in read_journal_entries(journal)]
    if not entries:
        raise ConfigError("out", str(out), "no config of this campaign has finished yet: "
                          "there is nothing to write as a dataset")
    # each row with its timing (a journal written before rows held it has it beside them)
    rows = [{**entry.row, **entry.timing.to_columns()} for entry in entries]
    counts: dict[str, dict[str, int]] = {}
    for entry in entries:
        per = counts.setdefault(str(entry.row["world_size"]), {s.value: 0 for s in Status})
        per[entry.status.value] += 1
    from paratune.measurement import FINGERPRINT_FIELDS

    # the machine that measured, as its rows name it (a campaign prepared on one machine and
    # measured on another records the latter); unknown when no row names one
    fingerprint: dict[str, Any] = {}
    named = [r for r in rows if any(r.get(k) not in (None, "")
                                    for k in FINGERPRINT_FIELDS if k != "device_count")]
    if named:
        fingerprint = {k: named[0].get(k) for k in FINGERPRINT_FIELDS}
    ok_rows = [row for row, entry in zip(rows, entries) if entry.ok]
    machines: list[dict[str, Any]] = []
    if ok_rows:
        # a campaign resumed on another machine or software stack measured on several: the
        # card names the first, and its notes every one with its number of successful rows
        fields = [k for k in FINGERPRINT_FIELDS if k != "device_count"]
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for row in ok_rows:
            key = tuple(str(row.get(k)) for k in fields)
            entry = seen.setdefault(key, {**{k: row.get(k) for k in fields}, "num_ok_rows": 0})
            entry["num_ok_rows"] += 1
        machines = list(seen.values())
        fingerprint = {k: ok_rows[0].get(k) for k in FINGERPRINT_FIELDS}
    if rows:  # the machine had at least as many devices as the largest group used
        fingerprint = {**fingerprint, "device_count": max(int(r["world_size"]) for r in rows)}
    identity = meta.get("identity", {})
    card = DatasetCard(
        campaign_id=meta["campaign_id"], source="paratune", fingerprint=fingerprint,
        grid={**identity, "model": identity.get("model", {}).get("name"),
              "model_spec": identity.get("model")},
        notes={"counts_per_world_size": counts,
               "skipped_per_world_size": meta.get("num_skipped", {}),
               "valid_per_world_size": meta.get("num_valid", {}),
               **({"fingerprints": machines} if len(machines) > 1 else {})})
    import pandas as pd

    return write_dataset(paths.root, pd.DataFrame(rows), card=card)
