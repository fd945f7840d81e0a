"""Verified runs on the target cluster needed to get within 5% of its best, where the model
extrapolates.

For each fold of each extrapolation split (:mod:`paratune.models._splits`: a larger model,
a larger cluster, another measurement family, more nodes) a performance model is fitted on
the fold's training rows. Each (model, GPU count, device) group of the fold's predicted
rows is one job on the target cluster; its candidates are the configurations it measured
(run or failed), and verifying one means revealing its measured outcome (tokens/s, or a
failure). The budget is the number of verified runs until one is within ``--tolerance`` (5%)
of the group's measured best. Orders compared:

* ``tuner`` (the ``tune --verify K`` list where the model extrapolates): the ranking by
  the risk-aware expectation (:func:`paratune.tuner.risk_aware_ranking`: the geometric
  mean of the expected throughput and its 10th percentile, times the probability of
  running, the configs within 30% of the best expected first), feasible first, in the
  layout-diverse order of :func:`paratune.tuner.verification_order`;
* ``risk_top``: the same ranking in rank order (no diversity);
* ``expected_diverse`` / ``expected_top``: the ranking by the expected throughput times the
  probability of running (the tuner's where it interpolates), diverse and in rank order;
* ``q10_top`` / ``point_top``: by the 10th percentile, and by the point prediction (each
  times the probability of running);
* ``refit`` (with ``--refit``): the tuner's order, refitted after each verified run (with
  the group's verified rows added) for the first ``--refit-runs`` runs, then kept;
* ``random``: the expected number in random order, ``(n + 1) / (h + 1)`` for ``h`` hits
  among ``n`` candidates (draws without replacement);
* ``grid``: a NeMo-style grid, every candidate run: ``n``.

    OMP_NUM_THREADS=1 python experiments/verify_budget.py [--data DIR] [--tolerance 0.05]
        [--splits larger-model,...] [--refit] [--n-estimators N]

Prints one row per group and a summary per split (median, mean and max runs, the share of
groups within 3); writes ``out/verify_budget/``; logs an MLflow run (experiment
``paratune-experiments``, run ``verify_budget``) unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument

ORDERS = {"tuner": ("risk", None), "risk_top": ("risk", 1.0),
          "expected_diverse": ("expected", None), "expected_top": ("expected", 1.0),
          "q10_top": ("q10", 1.0), "point_top": ("point", 1.0)}
"""Order name -> (ranked quantity, layout discount; ``None``: the tuner's)."""
GOAL = 3
"""Verified runs the tuner's list should need at most."""


def _runs_to_hit(order: list[int], hit: list[bool]) -> int:
    """Runs in ``order`` until the first hit (all of them where none hits)."""
    for n, i in enumerate(order, start=1):
        if hit[i]:
            return n
    return len(order)


def _ranked(model: Any, space: Any, configs: list[Any], *, by: str) -> Any:
    """The tuner's ranking of ``configs`` (feasible first) by ``by``: ``risk`` (the
    risk-aware expectation the tuner ranks by where the model extrapolates,
    :func:`paratune.tuner.risk_aware_ranking`), ``expected`` (its ranking otherwise),
    ``q10`` or ``point``, each times the probability of running, as the tuner's objective
    is; a ``row`` column keeps each config's position."""
    import numpy as np

    from paratune.predictor import running_weight
    from paratune.tuner import Objective, evaluate, rank, risk_aware_ranking

    objective = Objective(risk_quantile="q10") if by == "q10" else Objective()
    scored = evaluate(model, space, configs, objective)
    scored["row"] = np.arange(len(configs))
    if by == "point":
        scored["objective"] = (scored["tokens_per_s"]
                               * running_weight(scored["feasible_prob"])).fillna(0.0)
    elif by == "risk":
        return risk_aware_ranking(rank(scored))
    return rank(scored)


def candidates(group: Any) -> tuple[list[Any], list[float], Any]:
    """One candidate per configuration of ``group``: the configs, their measured tokens/s
    (NaN where no run succeeded; the best of its successful runs otherwise), and the rows
    (first of each config) to add when a refit takes the verified runs."""
    import math

    from paratune.batch import ConfigBatch
    from paratune.models import config_identity

    group = group.reset_index(drop=True)
    identity = config_identity(group)
    ok = group["status"].astype(str) == "ok"
    tps = group["tokens_per_s"].where(ok)
    best = tps.groupby(identity).max()
    first = ~identity.duplicated()
    rows = group[first.to_numpy()].reset_index(drop=True)
    measured = [float(best[k]) if not math.isnan(best[k]) else math.nan
                for k in identity[first.to_numpy()]]
    return ConfigBatch.from_frame(rows).configs(), measured, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="within this fraction of the group's best (default: %(default)s)")
    parser.add_argument("--splits", default=None,
                        help="comma-separated extrapolation splits (default: all)")
    parser.add_argument("--refit", action="store_true",
                        help="also refit after each verified run (slower)")
    parser.add_argument("--refit-runs", type=int, default=GOAL - 1,
                        help="verified runs refitted after, with --refit (default: %(default)s)")
    parser.add_argument("--n-estimators", type=int, default=None,
                        help="trees of the performance model (default: its own)")
    parser.add_argument("--discounts", default="",
                        help="more orders to compare: comma-separated [QUANTITY:]DISCOUNT, "
                             "QUANTITY risk (default), expected, q10 or point, DISCOUNT the "
                             "layout discount of verification_order")
    parser.add_argument("--out", type=Path, default=Path("out/verify_budget"))
    add_no_track_argument(parser)
    args = parser.parse_args()
    if not 0 <= args.tolerance < 1:
        parser.error("--tolerance must be in [0, 1)")

    import numpy as np
    import pandas as pd

    from paratune.measurement import Measurement
    from paratune.models import (
        EXTRAPOLATION_SPLITS,
        PerformanceModel,
        extrapolation_split,
        load_measurements,
    )
    from paratune.table import format_table
    from paratune.tuner import LAYOUT_DISCOUNT, SearchSpace, verification_order

    orders_wanted = {name: (by, LAYOUT_DISCOUNT if d is None else d)
                     for name, (by, d) in ORDERS.items()}
    for text in filter(None, args.discounts.split(",")):
        by, _, discount = text.rpartition(":")
        orders_wanted[f"{by or 'risk'}_d{discount}"] = (by or "risk", float(discount))

    splits = args.splits.split(",") if args.splits else list(EXTRAPOLATION_SPLITS)
    for name in splits:
        if name not in EXTRAPOLATION_SPLITS:
            parser.error(f"--splits: {name!r} is not one of {', '.join(EXTRAPOLATION_SPLITS)}")
    data = public_data_dir(args.data)
    files = sorted(data.glob("*.csv"))
    frame = load_measurements(files).reset_index(drop=True)
    params = {} if args.n_estimators is None else {"n_estimators": args.n_estimators}

    def fit(train: pd.DataFrame) -> PerformanceModel:
        return PerformanceModel(n_jobs=1, **params).fit(train)

    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for split_name in splits:
        for fold in extrapolation_split(frame, split_name).folds:
            model = fit(frame[fold.train])
            test = frame[fold.test]
            keys = ["model_name", "world_size", "hardware", "source"]
            for key, group in test.groupby(keys, sort=True):
                configs, measured, group_rows = candidates(group)
                measured_arr = np.asarray(measured, dtype=float)
                if not np.isfinite(measured_arr).any() or len(configs) < 2:
                    continue
                best = float(np.nanmax(measured_arr))
                hit = list(np.isfinite(measured_arr)
                           & (measured_arr >= (1 - args.tolerance) * best))
                first = group.iloc[0].to_dict()
                spec = Measurement.from_row(first).model
                space = SearchSpace.build(
                    spec, int(key[1]), str(key[2]),
                    global_batch_sizes=sorted({c.global_batch_size for c in configs}),
                    devices_per_node=int(first["devices_per_node"]))
                row: dict[str, Any] = {"split": split_name, "fold": fold.label,
                                       "model": key[0], "gpus": int(key[1]),
                                       "source": str(key[3]).split("_")[0],
                                       "configs": len(configs), "hits": int(sum(hit))}
                orders = {}
                for order_name, (by, discount) in orders_wanted.items():
                    ranked = _ranked(model, space, configs, by=by)
                    positions = verification_order(ranked, discount=discount)
                    order = [int(ranked["row"].iloc[i]) for i in positions]
                    orders[order_name] = order
                    row[order_name] = _runs_to_hit(order, hit)
                if args.refit:
                    verified: list[int] = []
                    current = model
                    while len(verified) < min(args.refit_runs, len(configs)):
                        ranked = _ranked(current, space, configs, by="risk")
                        order = [int(ranked["row"].iloc[i])
                                 for i in verification_order(ranked)]
                        nxt = next(i for i in order if i not in verified)
                        verified.append(nxt)
                        if hit[nxt]:
                            break
                        added = group_rows.iloc[verified]
                        current = fit(pd.concat([frame[fold.train], added], ignore_index=True))
                    if any(hit[i] for i in verified):
                        row["refit"] = len(verified)
                    else:
                        ranked = _ranked(current, space, configs, by="risk")
                        rest = [int(ranked["row"].iloc[i])
                                for i in verification_order(ranked)]
                        rest = [i for i in rest if i not in verified]
                        row["refit"] = len(verified) + _runs_to_hit(rest, hit)
                n, h = len(configs), int(sum(hit))
                row["random"] = (n + 1) / (h + 1)
                row["grid"] = n
                rows.append(row)
                print(format_table([row], floatfmt=".3g").splitlines()[-1], flush=True)
    columns = ["split", "fold", "model", "gpus", "source", "configs", "hits", *orders_wanted,
               *(["refit"] if args.refit else []), "random", "grid"]
    print()
    print(format_table(rows, columns, floatfmt=".3g",
                       title=f"Verified runs to get within {100 * args.tolerance:g}% of each "
                             "group's measured best"))
    strategies = [*orders_wanted, *(["refit"] if args.refit else []), "random", "grid"]
    summary = []
    for split_name in splits:
        part = [r for r in rows if r["split"] == split_name]
        if not part:
            continue
        entry: dict[str, Any] = {"split": split_name, "groups": len(part)}
        for s in strategies:
            values = [float(r[s]) for r in part]
            entry[f"{s}_median"] = statistics.median(values)
            entry[f"{s}_mean"] = statistics.mean(values)
            entry[f"{s}_max"] = max(values)
            entry[f"{s}_within_{GOAL}_pct"] = 100.0 * float(np.mean(np.asarray(values)
                                                                     <= GOAL))
        summary.append(entry)
    wall = time.perf_counter() - start
    print()
    for s in strategies:
        print(format_table([{"split": e["split"], "groups": e["groups"],
                             **{f: e[f"{s}_{f}"] for f in ("median", "mean", "max",
                                                           f"within_{GOAL}_pct")}}
                            for e in summary],
                           floatfmt=".3g", title=f"{s}: verified runs needed"))
        print()
    print(f"wall {wall:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "groups.csv", index=False)
    pd.DataFrame(summary).to_csv(args.out / "summary.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "data": [str(f.resolve()) for f in files], "tolerance": args.tolerance,
                "splits": splits, "refit": args.refit, "refit_runs": args.refit_runs,
                "n_estimators": args.n_estimators}) as run:
            for entry in summary:
                run.log_metrics({f"{entry['split']}.{k}": float(v) for k, v in entry.items()
                                 if k != "split"})
            run.log_metrics({"wall_s": wall})
            run.log_table(pd.DataFrame(rows), "groups.csv")


if __name__ == "__main__":
    main()
