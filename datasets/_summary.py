"""What a dataset holds, in a few lines: counts by status and the fastest config per world
size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from paratune.measurement import Status
from paratune.predictor import PARALLEL_COLUMNS
from paratune.scalars import plain

if TYPE_CHECKING:
    import pandas as pd

    from paratune.datasets._store import Dataset

__all__ = ["summarise_dataset", "summary_rows"]


def _config_key(row: Mapping[str, Any]) -> str:
    from paratune.parallel import ParallelConfig

    try:
        return ParallelConfig(**{k: plain(row[k]) for k in PARALLEL_COLUMNS if k in row}).key()
    except Exception:  # a public row with an unusual layout still gets summarised
        return f"dp{row.get('dp')}-tp{row.get('tp')}-pp{row.get('pp')}"


def summary_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Per (model, hardware, world size): counts by status and the fastest ok config."""
    rows = []
    if frame.empty:
        return rows
    for (model, hardware, world_size), group in frame.groupby(
            ["model_name", "hardware", "world_size"], sort=True):
        counts = group["status"].value_counts()
        row: dict[str, Any] = {"model": model, "hardware": hardware,
                               "world_size": int(world_size), "configs": len(group)}
        for status in Status:
            row[status.value] = int(counts.get(status.value, 0))
        ok = group[(group["status"] == "ok") & group["tokens_per_s"].notna()]
        if len(ok):
            best = ok.loc[ok["tokens_per_s"].idxmax()]
            row["best_tokens_per_s"] = float(best["tokens_per_s"])
            row["best_step_s"] = float(best["step_time_s"])
            row["best_config"] = _config_key(best.to_dict())
        rows.append(row)
    return rows


def summarise_dataset(dataset: Dataset) -> str:
    """A few lines about the card and a table of counts and best configs per world size."""
    from paratune.table import format_table

    card = dataset.card
    fp = card.fingerprint or {}
    lines = [f"dataset   {dataset.path}",
             f"campaign  {card.campaign_id or '-'}   source {card.source}   "
             f"created {card.created}   schema v{card.schema_version}",
             f"rows      {len(dataset)}"]
    if fp:
        lines.append("machine   " + ", ".join(f"{k}={fp[k]}" for k in (
            "device_name", "device_count", "cpu", "torch_version", "cuda_version",
            "nccl_version") if fp.get(k) not in (None, "")))
    if card.grid:
        grid = {k: card.grid[k] for k in ("model", "world_sizes", "warmup_steps",
                                          "measured_steps") if k in card.grid}
        if grid:
            lines.append("grid      " + ", ".join(f"{k}={v}" for k, v in grid.items()))
    rows = summary_rows(dataset.frame)
    skipped = (card.notes or {}).get("skipped_per_world_size") or {}
    columns = ["model", "hardware", "world_size", "configs", "ok", "oom", "error", "timeout"]
    if skipped:
        for row in rows:
            row["skipped"] = int(skipped.get(str(row["world_size"]), 0))
        columns.append("skipped")
    columns += ["best_tokens_per_s", "best_step_s", "best_config"]
    lines.append("")
    lines.append(format_table(rows, columns, headers={"world_size": "world",
                                                      "best_tokens_per_s": "best tok/s",
                                                      "best_step_s": "step s"})
                 if rows else "(no rows)")
    return "\n".join(lines)
