"""How the performance model extrapolates: every extrapolation split in one table.

Fits on a small corner of the public measurements and predicts far outside it (see
:mod:`paratune.models._splits`): a model at least 4x larger (Ultra-Scale 1B -> 8B), a
cluster 4x and 2x larger (Ultra-Scale <= 64 and <= 128 -> 256 GPUs, vTrain 2 and <= 4 -> 8
GPUs), a measurement family
with none of its rows fitted on (vTrain from Ultra-Scale and the reverse), and the
multi-node proxies (vTrain 2-4 -> 8 A100s; Ultra-Scale one node -> two). Per fold: median
APE and MAPE of tokens/s per device, Spearman within (model, cluster) groups, top-1 and
top-5 regret, the share of runs inside the predicted q10-q90 and the median predicted /
measured throughput. Nothing of a fold's test rows is used to fit or to choose anything.

Then few-shot calibration: for each family fit without it, ``calibrate`` with the first
n of its runs on its smallest cluster (one node's campaign, n = 0, 1, 2, 5, 10, 20; drawn
with --shot-seeds seeds), scored on every other run of the family and on those beyond its
smallest cluster alone; and, for how far one node's campaign can take a family at all,
calibrated on every run of that cluster and fitted with them.

With --anatomy, where each fold's errors come from: its runs by regime (measured stalled or
not, against the predicted regime), by layout and by nodes (``error_anatomy.csv``), and each
(model, cluster) group's top-1 choice by the expected and by the risk-aware throughput (the
ranking ``paratune tune`` switches to where it sees the model extrapolate): its regret,
layout and whether its run stalled (``top1_choices.csv``).

With --model-seeds N, every fold again with the model's seeds 1..N-1 (its boosters' row and
feature subsampling; the folds themselves are fixed): each figure's mean and range over the
N seeds (``model_seeds.csv``). A single seed's figure on an extrapolation fold can sit far
from the mean, since a few trees decide how a regime the fold never saw is priced.

Writes ``extrapolation.csv``, ``few_shot.csv``, ``extrapolation.txt`` and a plot per split
(``<split>.png``: a panel per fold, predicted vs measured with the runs that stalled apart and
each run's q10-q90) under --out and logs them to MLflow (experiment ``paratune-experiments``,
run ``extrapolation``; each figure a metric ``<split>.<estimator>.<fold>.<figure>``).

    python experiments/extrapolation.py [--data DIR] [--out out/extrapolation] [--baselines]
        [--splits larger-model,family] [--anatomy] [--model-seeds 5]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument


def main() -> None:
    from paratune.models import EXTRAPOLATION_SPLITS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--out", default="out/extrapolation",
                        help="folder for the table (default: %(default)s)")
    parser.add_argument("--baselines", action="store_true",
                        help="also the analytical baseline (one fitted efficiency)")
    parser.add_argument("--splits", default=",".join(EXTRAPOLATION_SPLITS),
                        help="comma-separated splits (default: all)")
    parser.add_argument("--n-estimators", type=int, default=None)
    parser.add_argument("--shot-seeds", type=int, default=5,
                        help="draws of the few-shot rows per n (0: no few-shot table)")
    parser.add_argument("--model-seeds", type=int, default=1,
                        help="refit every fold with the model's seeds 0..N-1 (its row and "
                        "feature subsampling) and add each figure's mean and range over them "
                        "(default: %(default)s, seed 0 alone)")
    parser.add_argument("--anatomy", action="store_true",
                        help="also break each fold's errors down by regime, layout and nodes, "
                        "and list each group's top-1 choices")
    add_no_track_argument(parser)
    args = parser.parse_args()
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    unknown = [s for s in splits if s not in EXTRAPOLATION_SPLITS]
    if unknown:
        parser.error(f"--splits: {unknown[0]!r} must be one of {', '.join(EXTRAPOLATION_SPLITS)}")
    if args.model_seeds < 1:
        parser.error(f"--model-seeds: {args.model_seeds} must be at least 1")

    import pandas as pd

    from paratune.models import (
        cross_validate,
        estimator_factories,
        extrapolation_table,
        load_measurements,
        plot_predictions,
    )

    data = public_data_dir(args.data)
    files = sorted(data.glob("*.csv"))
    frame = load_measurements(files)
    factories = estimator_factories(n_estimators=args.n_estimators)
    chosen = {"performance_model": factories["performance_model"]}
    if args.baselines:
        chosen["analytical"] = factories["analytical"]
    out = Path(args.out)
    rows, anatomy, choices = [], [], []
    for split in splits:
        result = cross_validate(frame, split=split, estimators=chosen)
        rows.extend({"split": split, **row} for row in result.by_fold)
        # a panel per fold: predicted vs measured, the stalled runs apart, q10-q90 bars
        plot_predictions(result, out / f"{split}.png", estimator="performance_model")
        if args.anatomy:
            from paratune.models import error_anatomy

            predictions = result.predictions["performance_model"]
            anatomy.extend({"split": split, **row} for row in error_anatomy(predictions))
            choices.extend({"split": split, **row} for row in top1_choices(predictions))
    table = extrapolation_table(rows, title="Extrapolation splits: tokens/s per device vs "
                                "measured (figures in %, Spearman and pred/meas as ratios)")
    print(table)
    spread = []
    if args.model_seeds > 1:
        seeded = [row for row in rows if row["estimator"] == "performance_model"]
        for seed in range(1, args.model_seeds):
            refit = {"performance_model": estimator_factories(
                n_estimators=args.n_estimators, random_state=seed)["performance_model"]}
            for split in splits:
                result = cross_validate(frame, split=split, estimators=refit)
                seeded.extend({"split": split, **row} for row in result.by_fold)
        spread = seed_spread(seeded)
        spread_table = format_seed_spread(spread, args.model_seeds)
        print()
        print(spread_table)
        table += "\n\n" + spread_table
    shots = few_shot(frame, chosen["performance_model"], seeds=args.shot_seeds)
    if shots:
        from paratune.table import format_table

        shot_table = format_table(shots, ["family", "rows", "mdape", "mape", "ratio_median",
                                          "coverage", "beyond"],
                                  headers={"rows": "own rows", "mdape": "MdAPE%",
                                           "mape": "MAPE%", "ratio_median": "pred/meas",
                                           "coverage": "q10-q90 cover%",
                                           "beyond": "MdAPE% beyond its smallest cluster"},
                                  floatfmt=".3g", title="Few-shot calibration: a family "
                                  "fitted without, then calibrated on n of its one-node runs")
        print()
        print(shot_table)
        table += "\n\n" + shot_table
    out.mkdir(parents=True, exist_ok=True)
    if args.anatomy:
        from paratune.table import format_table

        anatomy_table = format_table(
            [{**r, "share": 100 * r["share"], "mdape": 100 * r["mdape"]} for r in anatomy],
            ["split", "fold", "by", "group", "n", "share", "mdape", "log_bias"],
            headers={"share": "share%", "mdape": "MdAPE%",
                     "log_bias": "log(pred/meas tok/s)"}, floatfmt=".3g",
            title="Where the errors come from (regime: measured, then as predicted)")
        choice_table = format_table(
            [{**r, "regret": 100 * r["regret"]} for r in choices],
            ["split", "fold", "group", "rule", "regret", "layout", "stalled", "pred_over_meas"],
            headers={"regret": "regret%", "pred_over_meas": "pred/meas tok/s"},
            floatfmt=".3g", title="Top-1 choice per (model, cluster) group")
        print()
        print(anatomy_table)
        print()
        print(choice_table)
        table += "\n\n" + anatomy_table + "\n\n" + choice_table
        pd.DataFrame(anatomy).to_csv(out / "error_anatomy.csv", index=False)
        pd.DataFrame(choices).to_csv(out / "top1_choices.csv", index=False)
    pd.DataFrame(rows).to_csv(out / "extrapolation.csv", index=False)
    if spread:
        pd.DataFrame(spread).to_csv(out / "model_seeds.csv", index=False)
    pd.DataFrame(shots).to_csv(out / "few_shot.csv", index=False)
    (out / "extrapolation.txt").write_text(table + "\n")
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str(f.resolve()) for f in files], "splits": splits,
                            "estimators": list(chosen), "n_estimators": args.n_estimators,
                            "model_seeds": args.model_seeds})
            for row in spread:
                prefix = re.sub(r"[^A-Za-z0-9_.\-/]+", "_",
                                f"{row['split']}.performance_model.{row['held_out']}.seeds")
                run.log_metrics({f"{prefix}.{k}": float(v) for k, v in row.items()
                                 if isinstance(v, float) and v == v})
            for row in shots:
                rows_key = str(row["rows"]).replace(" ", "_")
                run.log_metrics({f"few_shot.{row['family']}.rows{rows_key}.{k}": row[k]
                                 for k in ("mdape", "mape", "ratio_median", "coverage",
                                           "beyond")})
            for row in rows:
                prefix = re.sub(r"[^A-Za-z0-9_.\-/]+", "_",
                                f"{row['split']}.{row['estimator']}.{row['held_out']}")
                run.log_metrics({f"{prefix}.{k}": float(v) for k, v in row.items()
                                 if isinstance(v, (int, float))})
            run.log_artifact(out)


SPREAD_FIGURES = ("mdape", "spearman_group", "regret_mean", "regret_top5_mean",
                  "regret_risk_mean", "coverage", "ratio_median")
"""The figures whose mean and range over the model's seeds :func:`seed_spread` gives."""


def seed_spread(rows: list[dict]) -> list[dict]:
    """Per (split, fold), each of :data:`SPREAD_FIGURES` over the rows of every model seed:
    ``<figure>`` (the mean), ``<figure>_min`` and ``<figure>_max``, and ``seeds``."""
    import numpy as np

    folds: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        folds.setdefault((row["split"], row["held_out"]), []).append(row)
    out = []
    for (split, held_out), seeded in folds.items():
        item: dict = {"split": split, "held_out": held_out, "seeds": len(seeded)}
        for figure in SPREAD_FIGURES:
            values = np.asarray([r.get(figure, np.nan) for r in seeded], dtype=float)
            values = values[np.isfinite(values)]
            item[figure] = float(values.mean()) if len(values) else np.nan
            item[f"{figure}_min"] = float(values.min()) if len(values) else np.nan
            item[f"{figure}_max"] = float(values.max()) if len(values) else np.nan
        out.append(item)
    return out


def format_seed_spread(spread: list[dict], seeds: int) -> str:
    """:func:`seed_spread` as a table: each figure's mean with its range in brackets."""
    from paratune.table import format_table

    percent = {"mdape", "regret_mean", "regret_top5_mean", "regret_risk_mean", "coverage"}
    shown = []
    for row in spread:
        item = {"split": row["split"], "held_out": row["held_out"]}
        for figure in SPREAD_FIGURES:
            scale = 100.0 if figure in percent else 1.0
            mean, lo, hi = (scale * row[k] for k in (figure, f"{figure}_min", f"{figure}_max"))
            digits = 1 if figure in percent else 2
            item[figure] = (f"{mean:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"
                            if mean == mean else "-")  # no seed gave it: NaN
        shown.append(item)
    return format_table(
        shown, ["split", "held_out", *SPREAD_FIGURES],
        headers={"mdape": "MdAPE%", "spearman_group": "Spearman(group)",
                 "regret_mean": "top-1 regret%", "regret_top5_mean": "top-5 regret%",
                 "regret_risk_mean": "top-1 risk-aware%", "coverage": "q10-q90 cover%",
                 "ratio_median": "pred/meas"},
        title=f"The same folds over the model's seeds 0-{seeds - 1}: mean (min-max)")


def top1_choices(predictions) -> list[dict]:
    """Per fold and (model, cluster) group, the configuration chosen by the expected
    throughput (times the probability of running, as ``tune`` ranks) and by the risk-aware
    one: its regret against the group's measured best, its
    layout, whether its run stalled and its predicted / measured throughput."""
    import numpy as np

    from paratune.models import (
        choice_orders,
        choice_throughputs,
        measured_step_time,
        predicted_to_run_rows,
        throughput_regret,
    )
    from paratune.models import features as F

    step = measured_step_time(predictions)
    ok = np.isfinite(step) & np.isfinite(predictions["pred_step_time_s"].to_numpy(float))
    part = predictions[ok]
    step = step[ok]
    tokens = part["global_batch_size"].to_numpy(float) * part["seq_len"].to_numpy(float)
    measured = tokens / (step * part["world_size"].to_numpy(float))
    predicted = tokens / (part["pred_step_time_s"].to_numpy(float)
                          * part["world_size"].to_numpy(float))
    stalled = F.stalled_pipeline(part, step)
    # as tune ranks and `evaluate` chooses
    _, expected, lower = choice_throughputs(part, predicted)
    runs = predicted_to_run_rows(part, part)
    keys = part[["fold", "model_name", "world_size"]].astype(str).agg("|".join, axis=1)
    out = []
    for key in dict.fromkeys(keys):
        sel = np.flatnonzero((keys == key).to_numpy())
        if len(sel) < 2:
            continue
        fold, model, world = key.split("|")
        # every order of the group at once; the risk-aware one needs a lower quantile, and a
        # predictor without one has the expected order alone
        orders = choice_orders(expected[sel], None if lower is None else lower[sel],
                               runs[sel])
        for rule in ("expected", "risk-aware"):
            if rule not in orders:
                continue
            pick = sel[int(orders[rule][0])]
            row = part.iloc[pick]
            out.append({"fold": fold, "group": f"{model} on {world}", "rule": rule,
                        "regret": throughput_regret(measured[sel].max(), measured[pick]),
                        "layout": (f"tp{row['tp']:.0f} pp{row['pp']:.0f} dp{row['dp']:.0f} "
                                   f"mb{row['micro_batch_size']:.0f} {row['sharding']}"),
                        "stalled": bool(stalled[pick]),
                        "pred_over_meas": predicted[pick] / measured[pick]})
    return out


def few_shot(frame, factory, *, seeds: int, counts=(0, 1, 2, 5, 10, 20)) -> list[dict]:
    """Per family: fitted without it, then calibrated on n of its runs on its smallest
    cluster; median APE, MAPE (in percent), median predicted / measured throughput and the
    share (in percent) inside the predicted q10-q90 of the family's other runs, averaged over
    ``seeds`` draws of the n runs, and the median APE of those beyond the smallest cluster
    alone (``beyond``).

    Two rows more per family say how far one node's campaign can take it: calibrated on
    every run of its smallest cluster (``rows`` = their number; left out where a count
    already is that number), and the model fitted with them (``rows`` = ``"<n> fitted"``),
    both scored on the runs beyond that cluster alone, so that there ``mdape`` is
    ``beyond``."""
    import numpy as np

    from paratune.models import measured_step_time, source_family

    if seeds < 1:
        return []
    families = source_family(frame)
    step = measured_step_time(frame)
    timed = np.isfinite(step)
    world = frame["world_size"].to_numpy(dtype=float)

    def score(model, rest, smallest):
        predicted = model.predict(frame[rest])
        ratio = step[rest] / predicted["pred_step_time_s"].to_numpy(float)  # pred / meas tok/s
        ape = np.abs(ratio - 1.0)
        # the measured throughput, on the scale of the predicted one and its interval
        measured = predicted["pred_tokens_per_sec_per_gpu"].to_numpy(float) / ratio
        lo, hi = (predicted[f"pred_tokens_per_sec_per_gpu_{q}"].to_numpy(float)
                  for q in ("q10", "q90"))
        inside = (measured >= np.fmin(lo, hi)) & (measured <= np.fmax(lo, hi))
        beyond = world[rest] > smallest
        return (np.median(ape), np.mean(ape), np.median(ratio), np.mean(inside),
                np.median(ape[beyond]) if beyond.any() else np.nan)

    def row(family, rows, figures):
        mdape, mape, ratio, coverage, beyond = np.mean(figures, axis=0)
        return {"family": str(family), "rows": rows, "mdape": 100 * mdape, "mape": 100 * mape,
                "ratio_median": ratio, "coverage": 100 * coverage, "beyond": 100 * beyond}

    out = []
    for family in sorted(set(families)):
        own = families == family
        if own.all():
            continue
        model = factory().fit(frame[~own])
        smallest = world[own & timed].min()
        pool = np.flatnonzero(own & timed & (world == smallest))
        for n in counts:
            if n > len(pool):
                continue
            figures = []
            for seed in range(seeds if n else 1):
                picked = np.random.default_rng(seed).choice(pool, size=n, replace=False)
                if n:  # a calibration replaces the family's last one
                    model.calibrate(frame.iloc[picked])
                else:
                    model.family_offsets_.pop(str(family), None)
                rest = own & timed
                rest[picked] = False
                figures.append(score(model, rest, smallest))
            out.append(row(family, n, figures))
        rest = own & timed
        rest[pool] = False
        if not rest.any():
            continue
        if len(pool) not in counts:
            model.calibrate(frame.iloc[pool])
            out.append(row(family, len(pool), [score(model, rest, smallest)]))
        with_pool = ~own
        with_pool[pool] = True
        out.append(row(family, f"{len(pool)} fitted",
                       [score(factory().fit(frame[with_pool]), rest, smallest)]))
    return out


if __name__ == "__main__":
    main()
