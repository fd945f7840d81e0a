"""How much of the Ultra-Scale prediction error is the measurements' own noise?

The Ultra-Scale sweep measured many layouts twice: once without sharding and once with
ZeRO-1, everything else equal. Those twins should run within a few percent of each other
(ZeRO-1 moves the same gradient bytes, split into reduce-scatter and all-gather), with at most
a systematic offset per cluster size. This script measures:

* **twin noise**: per cluster size, the median log ratio ZeRO-1 / no sharding (the
  systematic offset) and the median absolute deviation of the twins from it;
* **implied run noise**: if each run's log step time deviates from its layout's true value
  by independent noise, a twin difference carries two such deviations, so a run's median
  deviation is about the twins' spread over sqrt(2). A predictor that knew every layout's
  true step time would still show this median APE against single runs: a floor for the
  median APE the performance model is scored on;
* **twin oracle**: the median APE of predicting each run from its measured twin times the
  offset of its cluster size (computed without that pair);
* **twin oracle regret**: in each (model, cluster) group, the layout whose ZeRO-1 run was
  fastest, timed by its no-sharding run, against the fastest no-sharding run (and the other
  way round): the top-1 regret of choosing by a repeat measurement, which no predictor of the
  runs' true times can be sure to beat;
* **error budget of the regret**: the mean top-1 regret, over the same (model, cluster,
  fold) groups as ``evaluate_predictor.py``'s random split, of a predictor that knew every
  run's measured time up to independent log-normal errors of a given median APE (and no
  outliers): the median APE a predictor needs before the top-1 regret target is in reach;
* **stall regime**: pipeline runs with MFU under 10% and more than 0.5 s per micro-batch
  (:func:`paratune.models.features.stalled_pipeline`, the model's own definition):
  the distribution of their time per micro-batch, by model size (a fixed cost per
  micro-batch, not a slower version of the normal step).

    python experiments/noise_floor.py [--data DIR] [--out out/noise_floor] [--no-mlflow]

Prints the tables; writes them (``twins_by_nodes.csv``, ``twin_pairs.csv``,
``error_budget.csv``, ``stalls.csv``, ``noise_floor.txt``) and two plots (``twins.png``: the
twins' log ratio by cluster size; ``error_budget.png``: top-1 regret against the predictor's
median APE) under ``--out``, and logs them to MLflow (experiment ``paratune-experiments``,
run ``noise_floor``) unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument

KEY = ["model_name", "world_size", "dp", "tp", "pp", "micro_batch_size", "global_batch_size"]


def twins(frame):
    """One row per layout measured both without sharding and with ZeRO-1."""
    import pandas as pd

    ok = frame[np.isfinite(frame["step_time_s"])]
    wide = ok.pivot_table(index=KEY, columns="sharding", values="step_time_s", aggfunc="median")
    if not {"none", "zero1"} <= set(wide.columns):
        raise SystemExit("no layouts measured both without sharding and with zero1")
    pairs = wide[["none", "zero1"]].dropna().reset_index()
    pairs["log_ratio"] = np.log(pairs["zero1"] / pairs["none"])
    pairs["nodes"] = pairs["world_size"] // 8
    return pd.DataFrame(pairs)


def twin_oracle_ape(pairs) -> np.ndarray:
    """APE of predicting each twin from the other, with the leave-pair-out offset of its
    cluster size; two errors per pair."""
    errors = []
    for i, row in pairs.iterrows():
        same = pairs[(pairs["world_size"] == row["world_size"]) & (pairs.index != i)]
        offset = float(np.median(same["log_ratio"])) if len(same) else 0.0
        errors.append(abs(row["zero1"] / (row["none"] * np.exp(offset)) - 1.0))
        errors.append(abs(row["none"] / (row["zero1"] * np.exp(-offset)) - 1.0))
    return np.asarray(errors)


def twin_oracle_regret(pairs) -> np.ndarray:
    """Top-1 regret per (model, cluster) group and direction of choosing by one twin and
    being timed by the other (groups of at least two pairs)."""
    from paratune.models import throughput_regret

    regrets = []
    for _, group in pairs.groupby(["model_name", "world_size"]):
        if len(group) < 2:
            continue
        for chooser, timer in (("zero1", "none"), ("none", "zero1")):
            chosen = group[timer].to_numpy()[int(np.argmin(group[chooser].to_numpy()))]
            # step times: the throughput is their inverse
            regrets.append(throughput_regret(1.0 / group[timer].min(), 1.0 / chosen))
    return np.asarray(regrets)


# median |z| of a standard normal: a log-normal error of scale sigma has median APE
# exp(0.6745 * sigma) - 1
_MEDIAN_ABS_Z = 0.6744897501960817


def error_budget_regret(frame, mdape: float, *, seeds: int = 5, draws: int = 10,
                        random_state: int = 0) -> tuple[float, float]:
    """Mean top-1 regret and share of groups within 5% of their best, over ``seeds`` random
    5-fold splits and ``draws`` noise draws, of predictions that are the measured step times
    times independent log-normal errors of median APE ``mdape``."""
    import pandas as pd

    from paratune.models import cv_folds, metrics

    rng = np.random.default_rng(random_state)
    sigma = np.log1p(mdape) / _MEDIAN_ABS_Z
    step = frame["step_time_s"].to_numpy(float)
    regrets, within = [], []
    for seed in range(seeds):
        labels = np.empty(len(frame), dtype=object)
        for label, test in cv_folds(frame, "random", n_splits=5, random_state=seed):
            labels[test] = label
        split = frame.assign(fold=labels)
        for _ in range(draws):
            noisy = step * np.exp(rng.normal(0.0, sigma, len(step)))
            pred = pd.DataFrame({"pred_step_time_s": noisy,
                                 "pred_feasible_prob": np.isfinite(step).astype(float)},
                                index=frame.index)
            figures = metrics(split, pred)
            regrets.append(figures["regret_mean"])
            within.append(figures["regret_within_5pct"])
    return float(np.mean(regrets)), float(np.mean(within))


def _plots(pairs, budget: list[dict], run_noise_pct: float) -> dict:
    """The twins' log ratio by cluster size, and the error budget's regret curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    nodes = sorted(pairs["nodes"].unique())
    ax.boxplot([100 * (np.exp(pairs.loc[pairs["nodes"] == n, "log_ratio"]) - 1) for n in nodes],
               tick_labels=[str(n) for n in nodes], showfliers=True)
    ax.axhline(0, color="grey", linewidth=1)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("nodes (8 H100 each)")
    ax.set_ylabel("ZeRO-1 twin vs no sharding, step time (%)")
    ax.set_title(f"{len(pairs)} twin layouts: run noise about {run_noise_pct:.0f}%")
    fig.tight_layout()
    figures["twins.png"] = fig

    fig, ax = plt.subplots(figsize=(6, 4.5))
    x = [b["predictor_mdape_pct"] for b in budget]
    ax.plot(x, [b["regret_mean_pct"] for b in budget], marker="o")
    ax.axhline(2, color="grey", linestyle="--", linewidth=1, label="regret target (2%)")
    ax.axvline(run_noise_pct, color="tab:red", linestyle=":", linewidth=1,
               label=f"implied run noise ({run_noise_pct:.1f}%)")
    ax.set_xlabel("predictor median APE (%), independent log-normal errors")
    ax.set_ylabel("mean top-1 regret (%)")
    ax.legend()
    fig.tight_layout()
    figures["error_budget.png"] = fig
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--out", type=Path, default=Path("out/noise_floor"),
                        help="folder for the tables and plots (default: %(default)s)")
    add_no_track_argument(parser)
    args = parser.parse_args()

    import pandas as pd

    from paratune.models import features as F
    from paratune.models import load_measurements, measured_step_time
    from paratune.table import format_table

    data = public_data_dir(args.data)
    frame = load_measurements([data / "ultrascale_playbook_h100.csv"])
    frame["step_time_s"] = measured_step_time(frame)
    pairs = twins(frame)
    oracle = twin_oracle_ape(pairs)

    pairs["deviation"] = pairs["log_ratio"] - pairs.groupby("nodes")["log_ratio"].transform(
        "median")
    rows = []
    for nodes, part in pairs.groupby("nodes"):
        offset = float(np.median(part["log_ratio"]))
        spread = float(np.median(np.abs(part["deviation"])))
        ape = twin_oracle_ape(part.reset_index(drop=True))
        rows.append({"nodes": int(nodes), "pairs": len(part),
                     "zero1_vs_none_pct": 100 * (np.exp(offset) - 1),
                     "twin_spread_pct": 100 * (np.exp(spread) - 1),
                     "implied_run_noise_pct": 100 * (np.exp(spread / np.sqrt(2)) - 1),
                     "twin_oracle_mdape_pct": 100 * float(np.median(ape))})
    spread_all = float(np.median(np.abs(pairs["deviation"])))
    noise_all = 100 * (np.exp(spread_all / np.sqrt(2)) - 1)
    rows.append({"nodes": "all", "pairs": len(pairs), "zero1_vs_none_pct": float("nan"),
                 "twin_spread_pct": 100 * (np.exp(spread_all) - 1),
                 "implied_run_noise_pct": noise_all,
                 "twin_oracle_mdape_pct": 100 * float(np.median(oracle))})
    table = format_table(rows, ["nodes", "pairs", "zero1_vs_none_pct", "twin_spread_pct",
                                "implied_run_noise_pct", "twin_oracle_mdape_pct"],
                         floatfmt=".1f",
                         title="Twin layouts (no sharding vs ZeRO-1): offset, spread, implied "
                               "noise of one run, and the twin oracle's median APE")
    print(table)
    multi = frame[np.isfinite(frame["step_time_s"])]
    share = float((multi["world_size"] > 16).mean())
    print(f"\n{100 * share:.0f}% of the successful runs are on 4 or more nodes, where twins "
          "disagree most.")
    regret = twin_oracle_regret(pairs)
    print(f"\nTwin oracle top-1 regret over {len(regret)} (model, cluster, direction) choices: "
          f"mean {100 * regret.mean():.1f}%, median {100 * np.median(regret):.1f}%, "
          f"{100 * np.mean(regret <= 0.05):.0f}% within 5% of the best.")

    budget = []
    for mdape in (0.02, 0.04, 0.055, 0.075, 0.10):
        mean, within = error_budget_regret(frame, mdape)
        budget.append({"predictor_mdape_pct": 100 * mdape, "regret_mean_pct": 100 * mean,
                       "within_5pct_pct": 100 * within})
    budget_table = format_table(budget, ["predictor_mdape_pct", "regret_mean_pct",
                                         "within_5pct_pct"], floatfmt=".1f",
                                title="Top-1 regret of the measurements with independent "
                                      "log-normal errors (5 fold seeds x 10 draws, "
                                      "random split groups)")
    print()
    print(budget_table)

    per_mb = frame["step_time_s"] / frame["num_microbatches"]
    stalled = frame[F.stalled_pipeline(frame, frame["step_time_s"].to_numpy())].copy()
    stalled["s_per_microbatch"] = per_mb[stalled.index]
    stall_rows = []
    for model, part in stalled.groupby("model_name"):
        q = np.percentile(part["s_per_microbatch"], [10, 50, 90])
        stall_rows.append({"model": model, "runs": len(part), "p10_s": q[0], "median_s": q[1],
                           "p90_s": q[2]})
    stall = format_table(stall_rows, ["model", "runs", "p10_s", "median_s", "p90_s"],
                         floatfmt=".2f",
                         title="Stalled pipeline runs (MFU < 10%, > 0.5 s per micro-batch): "
                               "seconds per micro-batch")
    print()
    print(stall)
    pipeline = frame[(frame["pp"] > 1) & np.isfinite(frame["step_time_s"])]
    print(f"\n{len(stalled)} of {len(pipeline)} successful pipeline runs are stalled.")

    args.out.mkdir(parents=True, exist_ok=True)
    text = table + "\n\n" + budget_table + "\n\n" + stall + "\n"
    tables = {"twins_by_nodes.csv": pd.DataFrame(rows),
              "twin_pairs.csv": pairs.drop(columns=["deviation"]),
              "error_budget.csv": pd.DataFrame(budget), "stalls.csv": pd.DataFrame(stall_rows)}
    for name, part in tables.items():
        part.to_csv(args.out / name, index=False)
    (args.out / "noise_floor.txt").write_text(text)
    figures = _plots(pairs, budget, noise_all)
    for name, figure in figures.items():
        figure.savefig(args.out / name, dpi=110)
    print(f"\ntables and plots in {args.out}")

    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str((data / "ultrascale_playbook_h100.csv").resolve())],
                            "hardware": "H100-80GB"})
            run.log_metrics({"twin_oracle_mdape_pct": 100 * float(np.median(oracle)),
                             "twin_oracle_regret_mean_pct": 100 * float(regret.mean()),
                             "implied_run_noise_pct": noise_all,
                             "twin_pairs": float(len(pairs)),
                             "stalled_pipeline_runs": float(len(stalled)),
                             "stall_median_s_per_microbatch":
                                 float(np.median(stalled["s_per_microbatch"]))})
            run.log_metrics({f"error_budget_regret_pct_at_mdape_{row['predictor_mdape_pct']:g}":
                             row["regret_mean_pct"] for row in budget})
            run.log_text(text, "noise_floor.txt")
            for name, part in tables.items():
                run.log_table(part, name)
            for name, figure in figures.items():
                run.log_figure(figure, name)


if __name__ == "__main__":
    main()
