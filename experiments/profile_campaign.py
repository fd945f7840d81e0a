"""How long does a full profiling campaign take, and how repeatable are its step times?

1. Runs the campaign ``paratune profile`` runs by default (the ``tiny`` model, every valid
   config of its default grid, world sizes 1, 2 and 4, 3 warm-up and 10 measured steps) and
   prints the number of configs (valid and skipped), the wall time, and the per-config
   overhead outside warm-up and measured steps.
2. Runs a second, smaller campaign over a subset of the same configs and prints, per config,
   the ratio of the two campaigns' median step times.

    python experiments/profile_campaign.py [--out out/profile_campaign] [--no-mlflow]

A campaign directory that already holds a finished campaign is reused (its figures are read
from ``figures.json``), and an interrupted one resumes where it stopped, so rerunning the
script only redoes what is missing (the wall time is then this run's, ``resumed`` says so).
Writes ``repeatability.csv`` and ``figures.json`` under ``--out`` (each campaign's dataset
under ``full/`` and ``repeat/``). Logs the
figures and tables to MLflow (``MLFLOW_TRACKING_URI``, default ``./mlflow.db``; experiment
``paratune-experiments``, run ``profile_campaign``; each campaign also has its own run in
``paratune-profile``) unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from paratune import get_model
from paratune.datasets import read_dataset
from paratune.fileio import atomic_write_text
from paratune.profiler.campaign import CampaignSpec, run_campaign
from paratune.space import ConfigSpace
from paratune.table import format_table
from paratune.tracking import add_no_track_argument


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def _campaign(spec: CampaignSpec, out: Path, *, track: bool) -> dict:
    """Run (or reuse) one campaign and return its figures."""
    figures_path = out / "figures.json"
    if figures_path.exists():
        return json.loads(figures_path.read_text())
    resume = (out / "campaign.json").exists()
    load_before = _load_average()
    result = run_campaign(spec, out, resume=resume, track=track, progress=True)
    print(result.summary())
    counts = result.counts
    figures = {
        "campaign_id": result.campaign_id,
        "valid": sum(c["valid"] for c in counts.values()),
        "skipped": sum(c["skipped"] for c in counts.values()),
        "ok": sum(c["ok"] for c in counts.values()),
        "failed": sum(c["oom"] + c["error"] + c["timeout"] for c in counts.values()),
        "measured_now": result.num_measured,
        "wall_s": result.wall_s,
        "in_step_s": result.in_step_s,
        "overhead_per_config_s": result.overhead_per_config_s,
        "worker_cpu_s": result.worker_cpu_s,
        "resumed": resume,
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "cpu_count": os.cpu_count(),
    }
    atomic_write_text(figures_path, json.dumps(figures, indent=1) + "\n")
    return figures


def _overhead_breakdown(out: Path) -> dict:
    """Per-config overhead between two ``ok`` configs measured one after the other by the
    same worker group (the steady state), and the time a failed config costs (its group is
    torn down and a new one started), from the journal timestamps."""
    from paratune.datasets.journal import read_journal
    from paratune.profiler.campaign import in_step_seconds

    steady, failed = [], []
    for journal in sorted(out.glob("journal-ws*.jsonl")):
        previous = None
        for entry in read_journal(journal):
            row = entry["row"]
            if previous is not None:
                gap = row["timestamp"] - previous["row"]["timestamp"]
                if row["status"] != "ok":
                    failed.append(gap)
                elif (previous["row"]["status"] == "ok"
                      and entry.get("attempt") == previous.get("attempt")):
                    steady.append(gap - in_step_seconds(entry))
            previous = entry
    out_figures = {"steady_overhead_configs": len(steady), "failed_configs": len(failed)}
    if steady:
        out_figures.update(steady_overhead_median_s=statistics.median(steady),
                           steady_overhead_max_s=max(steady))
    if failed:
        out_figures["failed_config_cost_median_s"] = statistics.median(failed)
    return out_figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--repeat-world-sizes", default="1,2,4",
                        help="world sizes of the repeat campaign")
    parser.add_argument("--out", type=Path, default=Path("out/profile_campaign"))
    add_no_track_argument(parser)
    args = parser.parse_args(argv)
    track = not args.no_mlflow
    model = get_model(args.model)
    world_sizes = tuple(int(w) for w in args.world_sizes.split(","))

    started = time.monotonic()
    full = _campaign(CampaignSpec(model=model, world_sizes=world_sizes), args.out / "full",
                     track=track)
    print(format_table([full], ["valid", "skipped", "ok", "failed", "measured_now", "resumed",
                                "wall_s", "overhead_per_config_s", "worker_cpu_s",
                                "load_average_before", "load_average_after"],
                       title=f"full campaign ({args.model}, world sizes {args.world_sizes})"))
    breakdown = _overhead_breakdown(args.out / "full")
    full.update(breakdown)
    print(format_table([breakdown], title="overhead outside warm-up and measured steps: "
                                          "steady state per config, and per failed config"))

    # The repeat: the same micro-batch size, no sharding or recomputation variants, so every
    # degree layout and schedule is measured a second time in a separate campaign.
    repeat_space = ConfigSpace(global_batch_sizes=(8,), micro_batch_sizes=(2,),
                               shardings=("none",), recomputes=("none",))
    repeat_sizes = tuple(int(w) for w in args.repeat_world_sizes.split(","))
    repeat = _campaign(CampaignSpec(model=model, world_sizes=repeat_sizes,
                                    space=repeat_space), args.out / "repeat", track=track)
    first = read_dataset(args.out / "full").frame
    second = read_dataset(args.out / "repeat").frame
    key_cols = ["dp", "tp", "pp", "micro_batch_size", "global_batch_size", "schedule",
                "virtual_stages", "sharding", "recompute"]
    merged = first[first["status"] == "ok"].merge(
        second[second["status"] == "ok"], on=key_cols, suffixes=("_a", "_b"))
    rows = []
    for _, row in merged.iterrows():
        rows.append({"world_size": int(row["world_size_a"]),
                     "config": f"dp{row['dp']}-tp{row['tp']}-pp{row['pp']}-"
                               f"{row['schedule']}",
                     "median_a_s": row["step_time_s_a"], "median_b_s": row["step_time_s_b"],
                     "ratio_b_over_a": row["step_time_s_b"] / row["step_time_s_a"],
                     # spread of the steps within each campaign, for scale
                     "p90_over_p10_a": row["step_time_p90_s_a"] / row["step_time_p10_s_a"],
                     "p90_over_p10_b": row["step_time_p90_s_b"] / row["step_time_p10_s_b"]})
    rows.sort(key=lambda r: (r["world_size"], r["config"]))
    print()
    print(format_table(rows, title="step-time repeatability: median step time in two "
                                   "campaigns", floatfmt=".3f"))
    ratios = [r["ratio_b_over_a"] for r in rows]
    summary = {}
    if ratios:
        summary = {"configs_compared": len(ratios), "ratio_median": statistics.median(ratios),
                   "ratio_min": min(ratios), "ratio_max": max(ratios),
                   "abs_log_ratio_mean": statistics.fmean(abs(math.log(r)) for r in ratios)}
        print(f"\nratio of medians over {len(ratios)} configs: median "
              f"{summary['ratio_median']:.3f}, range {summary['ratio_min']:.3f} .. "
              f"{summary['ratio_max']:.3f}")
    print(f"(script wall time {time.monotonic() - started:.0f} s)")
    import pandas as pd

    pd.DataFrame(rows, columns=["world_size", "config", "median_a_s", "median_b_s",
                                "ratio_b_over_a", "p90_over_p10_a", "p90_over_p10_b"]).to_csv(
        args.out / "repeatability.csv", index=False)
    atomic_write_text(args.out / "figures.json", json.dumps(
        {"full": full, "repeat": repeat, "repeatability": summary}, indent=1) + "\n")
    print(f"tables in {args.out}")

    if track:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "model": model.name, "world_sizes": list(world_sizes),
                "repeat_world_sizes": list(repeat_sizes), "hardware": "cpu"}) as run:
            run.log_metrics({f"full_{k}": v for k, v in full.items()
                             if isinstance(v, (int, float))})
            run.log_metrics({f"repeat_{k}": v for k, v in repeat.items()
                             if isinstance(v, (int, float))})
            run.log_metrics(summary)
            run.log_artifact(args.out / "repeatability.csv")
            run.log_artifact(args.out / "figures.json")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        # Measured configs are journaled: the same command resumes the campaign.
        print("interrupted; run the same command again to resume the campaign where it "
              "stopped", file=sys.stderr)
        raise SystemExit(130) from None
