"""How much does one hold-out split decide the Ultra-Scale top-1 regret?

The performance-model targets are scored on one held-out part of the measurements. With
about 18 (model, cluster) groups in the Ultra-Scale sweep, a single group whose chosen
configuration stalls (several times its prediction) moves the mean top-1 regret by tens of
points. This script repeats such a scoring over ``--seeds`` random hold-outs:
``--test-size`` of the configurations (a configuration's repeated and failed runs together)
held out, the estimators fitted on the rest of all public measurements (Ultra-Scale and
vTrain), and the held-out Ultra-Scale rows scored with :func:`paratune.models._evaluate.metrics`:

* ``mdape``: median absolute percentage error of tokens/s per GPU;
* ``regret``: mean top-1 regret per (model, cluster) group, choosing by the expected
  throughput over the normal and the stalled regime where the estimator gives one, times
  the probability of running (as the tuner chooses);
* ``regret_point``: the same, choosing by the point prediction
  (``pred_tokens_per_sec_per_gpu``, the likelier regime's throughput) times the
  probability of running;
* ``feasibility``: feasibility accuracy over the held-out configurations.

It prints one row per split and estimator, then the mean, median, minimum and maximum over
the splits; writes both (``per_split.csv``, ``summary.csv``, ``holdout_regret.txt``) and a
plot of each split's figures (``per_split.png``) under ``--out``, and logs them to MLflow
(experiment ``paratune-experiments``, run ``holdout_regret``) unless ``--no-mlflow``.

    python experiments/holdout_regret.py [--data DIR] [--seeds 10] [--test-size 0.3]
        [--out out/holdout_regret] [--no-mlflow]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument

FIGURES = ("mdape", "regret", "regret_point", "feasibility")


def score(estimator, train, test):
    """Fit on ``train`` and score the Ultra-Scale rows of ``test``."""
    from paratune.models import metrics
    from paratune.predictor import PRED_TOKENS_EXPECTED

    estimator.fit(train)
    ultra = test["source"].astype(str).str.startswith("ultrascale").to_numpy()
    rows = test[ultra].reset_index(drop=True)
    pred = estimator.predict(test)[ultra].reset_index(drop=True)
    chosen = metrics(rows, pred)
    point = metrics(rows, pred.drop(columns=[PRED_TOKENS_EXPECTED], errors="ignore"))
    return {"mdape": chosen["mdape"], "regret": chosen["regret_mean"],
            "regret_point": point["regret_mean"],
            "feasibility": chosen["feasibility_accuracy"]}


def _plot(per_split, test_size: float):
    """Each split's figures per estimator: one point per split, the median as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    estimators = list(dict.fromkeys(per_split["estimator"]))
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(3.2 * len(FIGURES), 4))
    for ax, figure in zip(axes, FIGURES):
        for i, name in enumerate(estimators):
            values = per_split.loc[per_split["estimator"] == name, figure].to_numpy()
            jitter = np.linspace(-0.15, 0.15, len(values)) if len(values) > 1 else [0.0]
            ax.scatter(i + np.asarray(jitter), values, s=18, alpha=0.8)
            ax.hlines(np.median(values), i - 0.25, i + 0.25, color="black")
        ax.set_xticks(range(len(estimators)), estimators, rotation=15, fontsize=8)
        ax.set_title(f"{figure} (%)")
    fig.suptitle(f"Ultra-Scale held-out figures over {per_split['split'].nunique()} splits "
                 f"({test_size:.0%} held out); bar: median")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--seeds", type=int, default=10, help="hold-out splits to score")
    parser.add_argument("--test-size", type=float, default=0.3,
                        help="share of the configurations held out per split")
    parser.add_argument("--out", type=Path, default=Path("out/holdout_regret"),
                        help="folder for the tables and the plot (default: %(default)s)")
    add_no_track_argument(parser)
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if not 0 < args.test_size < 1:
        parser.error("--test-size must be between 0 and 1")

    import pandas as pd
    from sklearn.model_selection import GroupShuffleSplit
    from tqdm.auto import tqdm

    from paratune.models import (
        PerformanceModel,
        RawConfigBaseline,
        config_identity,
        load_measurements,
    )
    from paratune.table import format_table

    data = public_data_dir(args.data)
    files = sorted(data.glob("*.csv"))
    frame = load_measurements(files)
    identity = config_identity(frame).to_numpy()
    rows = []
    for seed in tqdm(range(args.seeds), desc="hold-out splits", unit="split"):
        split = GroupShuffleSplit(n_splits=1, test_size=args.test_size, random_state=seed)
        train_idx, test_idx = next(split.split(frame, groups=identity))
        train = frame.iloc[train_idx].reset_index(drop=True)
        test = frame.iloc[test_idx].reset_index(drop=True)
        for name, estimator in (("performance_model", PerformanceModel(random_state=seed)),
                                ("xgb_raw_config", RawConfigBaseline(random_state=seed))):
            figures = score(estimator, train, test)
            rows.append({"split": seed, "estimator": name,
                         **{k: 100 * v for k, v in figures.items()}})
    per_split = pd.DataFrame(rows)
    table = format_table(rows, ["split", "estimator", *FIGURES], floatfmt=".1f",
                         title=f"Ultra-Scale held-out figures (%), {args.test_size:.0%} of the "
                               "configurations held out per split")
    summary_rows = []
    for name, part in per_split.groupby("estimator", sort=False):
        for stat in ("mean", "median", "min", "max"):
            summary_rows.append({"estimator": name, "over splits": stat,
                                 **{k: float(getattr(part[k], stat)()) for k in FIGURES}})
    summary = format_table(summary_rows, ["estimator", "over splits", *FIGURES], floatfmt=".1f",
                           title=f"Over {args.seeds} splits (%)")
    print(table)
    print()
    print(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table + "\n\n" + summary + "\n"
    per_split.to_csv(args.out / "per_split.csv", index=False)
    pd.DataFrame(summary_rows).to_csv(args.out / "summary.csv", index=False)
    (args.out / "holdout_regret.txt").write_text(text)
    figure = _plot(per_split, args.test_size)
    figure.savefig(args.out / "per_split.png", dpi=110)
    print(f"\ntables and plot in {args.out}")

    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str(f.resolve()) for f in files],
                            "seeds": list(range(args.seeds)), "test_size": args.test_size})
            run.log_metrics({f"{r['estimator']}_{k}_{r['over splits']}_pct": r[k]
                             for r in summary_rows for k in FIGURES})
            run.log_text(text, "holdout_regret.txt")
            run.log_table(per_split, "per_split.csv")
            run.log_table(pd.DataFrame(summary_rows), "summary.csv")
            run.log_figure(figure, "per_split.png")


if __name__ == "__main__":
    main()
