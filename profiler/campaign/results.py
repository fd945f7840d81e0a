"""What a campaign produced: its progress, its dataset and its result."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.measurement import Status
from paratune.parallel import ParallelConfig
from paratune.profiler._journal import (
    CampaignPaths,
    read_journal,
)
from paratune.profiler.campaign.plan import _plan_keys, _unfinished

if TYPE_CHECKING:
    from paratune.datasets import Dataset


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
    left = _unfinished(paths, world_sizes)
    planned: dict[int, int | None] = {}
    journaled: dict[int, int] = {}
    for world_size in world_sizes:
        if left.get(world_size, set()) is None:  # no plan yet
            planned[world_size] = None
            journaled[world_size] = 0
            continue
        planned[world_size] = len(_plan_keys(paths, world_size))
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
    rows = [entry["row"] for journal in paths.journals() for entry in read_journal(journal)]
    if not rows:
        raise ConfigError("out", str(out), "no config of this campaign has finished yet: "
                          "there is nothing to write as a dataset")
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        per = counts.setdefault(str(row["world_size"]), {s.value: 0 for s in Status})
        per[row["status"]] = per.get(row["status"], 0) + 1
    from paratune.measurement import FINGERPRINT_FIELDS

    # the machine that measured, as its rows name it (a campaign prepared on one machine and
    # measured on another records the latter); unknown when no row names one
    fingerprint: dict[str, Any] = {}
    named = [r for r in rows if any(r.get(k) not in (None, "")
                                    for k in FINGERPRINT_FIELDS if k != "device_count")]
    if named:
        fingerprint = {k: named[0].get(k) for k in FINGERPRINT_FIELDS}
    ok_rows = [r for r in rows if r["status"] == Status.OK.value]
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


def in_step_seconds(entry: dict[str, Any]) -> float:
    """Seconds a journal entry spent in warm-up and measured steps."""
    row = entry["row"]
    measured = float(sum(row.get("step_times_s") or []))
    if row["status"] != Status.OK.value:
        return 0.0
    call_s, build_s, teardown_s = (entry.get(k) for k in ("call_s", "build_s", "teardown_s"))
    if call_s is not None and entry.get("overhead_s") is not None:
        # measure_config's time minus everything outside its warm-up and measured steps
        return max(measured, float(call_s) - float(entry["overhead_s"]))
    if None not in (call_s, build_s, teardown_s):
        # measure_config's own time minus building and freeing: warm-up + measured steps
        # (and the barrier before each step).
        return max(measured, float(call_s) - float(build_s) - float(teardown_s))
    median = float(row.get("step_time_s") or 0.0)
    return measured + int(row.get("warmup_steps") or 0) * (median if math.isfinite(median)
                                                           else 0.0)


@dataclass
class CampaignResult:
    """What a campaign produced."""

    out: Path
    campaign_id: str
    dataset: Dataset
    counts: dict[int, dict[str, int]]
    """Per world size: configs ``valid``, ``skipped`` and per status."""
    wall_s: float
    """Wall time of this run (a resumed campaign counts only the resumed part)."""
    num_measured: int
    """Configs finished in this run (any status)."""
    in_step_s: float
    """Seconds those configs spent in warm-up and measured steps."""
    run_id: str | None = None
    """MLflow run id."""
    worker_cpu_s: float = math.nan
    """CPU seconds (user + system) used by the worker processes of this run: with ``n``
    free cores a CPU campaign cannot take less than ``worker_cpu_s / n`` seconds of wall
    time, whatever else the machine is running."""

    @property
    def overhead_per_config_s(self) -> float:
        """Wall time outside warm-up and measured steps, per config finished in this run."""
        if not self.num_measured:
            return math.nan
        return (self.wall_s - self.in_step_s) / self.num_measured

    def summary_rows(self) -> list[dict[str, Any]]:
        frame = self.dataset.frame
        rows = []
        for world_size, counts in self.counts.items():
            row: dict[str, Any] = {"world_size": world_size, **counts}
            sub = frame[(frame["world_size"] == world_size) & (frame["status"] == "ok")]
            if len(sub):
                best = sub.loc[sub["tokens_per_s"].idxmax()]
                row["best_tokens_per_s"] = float(best["tokens_per_s"])
                row["best_step_s"] = float(best["step_time_s"])
                row["best_config"] = ParallelConfig.from_dict(
                    {k: best[k].item() if hasattr(best[k], "item") else best[k]
                     for k in ParallelConfig.__dataclass_fields__}).key()
            rows.append(row)
        return rows

    def summary(self) -> str:
        """The summary table: counts per status and the best config per world size."""
        from paratune._table import format_table

        columns = ["world_size", "valid", "ok", "oom", "error", "timeout", "skipped",
                   "best_tokens_per_s", "best_step_s", "best_config"]
        table = format_table(self.summary_rows(), columns,
                             headers={"world_size": "world", "best_tokens_per_s": "best tok/s",
                                      "best_step_s": "step s"},
                             title=f"campaign {self.campaign_id} -> {self.out}")
        return f"{table}\n{self.footer()}"

    def footer(self) -> str:
        """One line on this run: configs measured and time spent, or that nothing was new."""
        if not self.num_measured:
            finished = sum(counts.get(s.value, 0) for counts in self.counts.values()
                           for s in Status)
            return (f"nothing new to measure: {finished} configs already measured "
                    f"({self.wall_s:.1f} s this run)")
        cpu_s = 0.0 if self.worker_cpu_s <= 0 else self.worker_cpu_s  # never "-0"; nan kept
        return (f"{self.num_measured} configs in {self.wall_s:.1f} s this run "
                f"(workers used {cpu_s:.0f} CPU s); "
                f"{self.overhead_per_config_s:.2f} s per config outside warm-up and "
                f"measured steps")


def _counts(paths: CampaignPaths, meta: dict[str, Any], world_sizes: tuple[int, ...]
            ) -> dict[int, dict[str, int]]:
    counts = {}
    for world_size in world_sizes:
        per = {"valid": int(meta["num_valid"][str(world_size)]),
               "skipped": int(meta["num_skipped"][str(world_size)])}
        per.update({s.value: 0 for s in Status})
        for entry in read_journal(paths.journal(world_size)):
            per[entry["row"]["status"]] += 1
        counts[world_size] = per
    return counts
