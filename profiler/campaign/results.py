"""What a campaign produced: its progress, its dataset and its result."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.measurement import Status
from paratune.parallel import ParallelConfig
from paratune.profiler._journal import CampaignPaths, JournalEntry, read_journal_entries

if TYPE_CHECKING:
    from paratune.datasets import Dataset


def in_step_seconds(entry: JournalEntry | Mapping[str, Any]) -> float:
    """Seconds a journal entry (or its JSON object) spent in warm-up and measured steps."""
    if not isinstance(entry, JournalEntry):
        entry = JournalEntry.from_dict(entry)
    row, timing = entry.row, entry.timing
    measured = float(sum(row.get("step_times_s") or []))
    if not entry.ok:
        return 0.0
    if math.isfinite(timing.call_s) and math.isfinite(timing.overhead_s):
        # measure_config's time minus everything outside its warm-up and measured steps
        return max(measured, timing.call_s - timing.overhead_s)
    if all(math.isfinite(v) for v in (timing.call_s, timing.build_s, timing.teardown_s)):
        # measure_config's own time minus building and freeing: warm-up + measured steps
        # (and the barrier before each step).
        return max(measured, timing.call_s - timing.build_s - timing.teardown_s)
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
            sub = frame[(frame["world_size"] == world_size) & (frame["status"] == Status.OK.value)]
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
        from paratune.table import format_table

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
        for entry in read_journal_entries(paths.journal(world_size)):
            per[entry.status.value] += 1
        counts[world_size] = per
    return counts
