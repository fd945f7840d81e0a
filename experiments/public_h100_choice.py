"""The tuner's top choice among the measured configs of each (model, GPU count) of the public
H100 data, against the measured best.

For each group of the Ultra-Scale Playbook sweep (1B/3B/8B on 8..256 H100s, global batch 256
sequences), a PerformanceModel is fitted on every *other* group (leave-one-group-out, so the
choice is a prediction, not a lookup), the tuner ranks the group's measured configs (those
that ran and those that crashed or ran out of memory) by predicted throughput times the
probability of running under its memory constraint, and its top choice is compared with
the measured best. A choice that failed in the measurements scores 0%.

    OMP_NUM_THREADS=1 python experiments/public_h100_choice.py [--data DIR]

Prints one row per group and a summary; writes ``out/public_h100_choice/choice.csv`` and logs
an MLflow run unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _public import public_data_dir, ultrascale_frame

from paratune.table import format_table
from paratune.tracking import add_no_track_argument


def main() -> None:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--data", default=None)
    parser.add_argument("--n-estimators", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("out/public_h100_choice"))
    add_no_track_argument(parser)
    args = parser.parse_args()

    import pandas as pd

    from paratune.batch import ConfigBatch
    from paratune.measurement import Measurement
    from paratune.models import PerformanceModel
    from paratune.tuner import Objective, SearchSpace, evaluate, rank

    data = public_data_dir(args.data)
    frame = ultrascale_frame(data)
    frame = frame.reset_index(drop=True)
    rows = []
    start = time.perf_counter()
    for (name, gpus), group in frame.groupby(["model_name", "world_size"], sort=True):
        train = frame.drop(index=group.index)
        model = PerformanceModel(n_estimators=args.n_estimators, n_jobs=1).fit(train)
        spec = Measurement.from_row(group.iloc[0].to_dict()).model
        configs = ConfigBatch.from_frame(group).configs()
        batches = sorted({c.global_batch_size for c in configs})
        space = SearchSpace.build(spec, int(gpus), "H100", global_batch_sizes=batches,
                                  devices_per_node=8)
        objective = Objective()  # throughput, memory constraint, p(runs) >= 0.5
        if len(batches) > 1:  # not the case in this sweep; keep the comparison per batch
            raise SystemExit(f"{name}/{gpus}: several global batches {batches}")
        scored = evaluate(model, space, configs, objective)
        scored["measured_tokens_per_s"] = group["tokens_per_s"].to_numpy()
        scored["measured_status"] = group["status"].to_numpy()
        ranked = rank(scored)
        ok = group[group["status"] == "ok"]
        best = float(ok["tokens_per_s"].max())
        pick = ranked.iloc[0]
        got = float(pick["measured_tokens_per_s"]) if pick["measured_status"] == "ok" else 0.0
        # where the measured best sits in the tuner's ranking
        best_rank = int(ranked.index[(ranked["measured_status"] == "ok") & (
            ranked["measured_tokens_per_s"] == best)][0]) + 1
        top5 = ranked.head(5)
        top5_best = float(top5.loc[top5["measured_status"] == "ok",
                                   "measured_tokens_per_s"].max() if (
            top5["measured_status"] == "ok").any() else 0.0)
        rows.append({"model": name, "gpus": int(gpus), "configs": len(group),
                     "ran": len(ok), "measured_best": best,
                     "choice": ConfigBatch.from_frame(ranked.head(1)).config_at(0).key(),
                     "choice_status": pick["measured_status"], "choice_measured": got,
                     "choice_vs_best_pct": 100 * got / best,
                     "top5_vs_best_pct": 100 * top5_best / best,
                     "best_rank_in_tuner": best_rank})
        print(format_table([rows[-1]], floatfmt=".4g").splitlines()[-1], flush=True)
    print()
    print(format_table(rows, title="Tuner's top choice among measured configs vs measured best "
                                   "(leave-one-group-out model)", floatfmt=".4g"))
    shares = [r["choice_vs_best_pct"] for r in rows]
    summary = {"groups": len(rows), "median_choice_vs_best_pct": statistics.median(shares),
               "mean_choice_vs_best_pct": statistics.mean(shares),
               "min_choice_vs_best_pct": min(shares),
               "groups_within_5pct": sum(s >= 95 for s in shares),
               "groups_choice_failed": sum(r["choice_status"] != "ok" for r in rows),
               "mean_top5_vs_best_pct": statistics.mean(r["top5_vs_best_pct"] for r in rows),
               "wall_s": time.perf_counter() - start}
    print()
    print(format_table([summary], floatfmt=".4g"))
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "choice.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "data": [str((data / name).resolve()) for name in (
                    "ultrascale_playbook_h100.csv", "ultrascale_playbook_h100_failed.csv")],
                "hardware": "H100-80GB", "n_estimators": args.n_estimators, "seed": 0,
                "protocol": "leave-one-(model, gpus)-group-out"}) as run:
            run.log_metrics(summary)
            run.log_table(pd.DataFrame(rows), "choice.csv")


if __name__ == "__main__":
    main()
