"""``paratune fit``, ``paratune calibrate``, ``paratune predict`` and ``paratune evaluate``."""

from __future__ import annotations

import argparse

from paratune.cli import at_least
from paratune.predictor import MEMORY_FRACTION, MIN_FEASIBLE_PROB
from paratune.tracking import add_track_flag

__all__ = ["register"]

SPLIT_NAMES = ("random", "cluster", "model", "larger-model", "larger-cluster", "family",
               "multi-node")
"""``--split`` choices (the same as :data:`paratune.models._evaluate.SPLITS`, kept here so
that ``paratune --help`` imports nothing heavy)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the model subcommands (argparse only; heavy imports happen in the handlers)."""
    fit = subparsers.add_parser(
        "fit", help="fit the performance model on measurements",
        description="Fit the performance model (XGBoost on analytical features) on paratune "
                    "dataset directories and/or public-format CSVs; logs to MLflow.")
    fit.add_argument("data", nargs="+", metavar="DATA",
                     help="paratune dataset directories or public measurement CSVs")
    fit.add_argument("--out", required=True, metavar="MODEL_DIR",
                     help="directory to write (new or empty, or a saved model with --force)")
    fit.add_argument("--force", action="store_true",
                     help="replace the model already saved in --out")
    fit.add_argument("--n-estimators", type=at_least(1), default=None,
                     help="trees of the step-time model, half median and half refinement; "
                          "its quantile, stall, memory and feasibility boosters get a quarter, "
                          "10 to 100 (default: the model's defaults, 500 and 100)")
    fit.add_argument("--experiment", default="paratune-fit", help="MLflow experiment name")
    add_track_flag(fit)
    fit.set_defaults(func=_fit, field_flags={"out": "--out"})

    calibrate = subparsers.add_parser(
        "calibrate", help="few-shot: move a saved model toward a handful of a family's runs",
        description="Calibrate a saved model on a handful of runs (a framework's or cluster's "
                    "one-node campaign, 5-10 runs): a family it has no measurement of gets "
                    "two constants of its own from 3 runs on (an efficiency and a cost per "
                    "layer pass), else one efficiency factor; runs out of memory move its "
                    "memory threshold; the model is saved back.")
    calibrate.add_argument("data", nargs="+", metavar="DATA",
                           help="paratune dataset directories or public measurement CSVs")
    calibrate.add_argument("--model", required=True, metavar="MODEL_DIR",
                           help="saved performance model to calibrate in place (the --out of "
                                "paratune fit)")
    calibrate.set_defaults(func=_calibrate, field_flags={"model": "--model"})

    predict = subparsers.add_parser(
        "predict", help="predict step time, throughput, memory and feasibility for a CSV",
        description="Predict every row of INPUT (public measurement format or paratune config "
                    "columns); OUT gets the input columns plus pred_* columns and pred_error. "
                    "To choose among configs as tune does, keep those with pred_feasible_prob "
                    f">= {MIN_FEASIBLE_PROB} and pred_peak_mem_gb within "
                    f"{MEMORY_FRACTION:.0%} of device memory, and rank them by "
                    "pred_tokens_per_sec_per_gpu_expected x pred_feasible_prob (a stalled "
                    "pipeline at its stalled speed, a failed run as nothing).")
    predict.add_argument("input", metavar="INPUT.csv",
                         help="rows to predict (public measurement format or paratune config "
                              "columns)")
    predict.add_argument("--model", required=True, metavar="MODEL_DIR",
                         help="saved performance model (the --out of paratune fit)")
    predict.add_argument("--out", required=True, metavar="OUT.csv",
                         help="CSV to write: the input columns plus pred_* and pred_error "
                              "(an existing file only with --force)")
    predict.add_argument("--force", action="store_true", help="replace an existing OUT")
    predict.set_defaults(func=_predict, field_flags={"out": "--out"})

    evaluate = subparsers.add_parser(
        "evaluate", help="cross-validate the performance model (and baselines)",
        description="Grouped cross-validation (random configurations, the largest cluster "
                    "size held out, or each model held out) or an extrapolation split (fit on "
                    "the smallest models, on a quarter of the largest cluster, without a "
                    "measurement family, or on one node; predict beyond). Prints MAPE, median "
                    "APE, Spearman, top-1 and top-5 regret (also risk-aware), q10-q90 "
                    "coverage and feasibility accuracy; writes a predicted-vs-measured plot.")
    evaluate.add_argument("data", nargs="+", metavar="DATA",
                          help="paratune dataset directories or public measurement CSVs")
    evaluate.add_argument("--split", choices=SPLIT_NAMES, default="random",
                          help="random: random configurations per fold; cluster: the largest "
                               "cluster size held out; model: each model held out in turn; "
                               "larger-model: fit on the smallest model, predict the largest; "
                               "larger-cluster: fit on at most a quarter of the largest "
                               "cluster, predict it; family: each measurement family left out; "
                               "multi-node: the largest single-node cluster from smaller ones, "
                               "two nodes from one (default: %(default)s)")
    evaluate.add_argument("--baselines", action="store_true",
                          help="also evaluate the analytical, raw-config XGBoost and "
                               "HistGradientBoosting baselines")
    evaluate.add_argument("--n-estimators", type=at_least(1), default=None,
                          help="trees per booster of every learned estimator (default: each "
                               "estimator's own)")
    evaluate.add_argument("--plot", default="predicted_vs_measured.png", metavar="PNG",
                          help="predicted-vs-measured plot to write: a file (.png added "
                               "without an extension) or a directory to write "
                               "predicted_vs_measured.png in (default: %(default)s)")
    evaluate.add_argument("--folds", type=at_least(2), default=5,
                          help="folds of the random split (at least 2)")
    evaluate.add_argument("--model-seed", type=at_least(0), default=0,
                          help="seed of the learned estimators' row and feature subsampling "
                               "(default: %(default)s); beyond the data a fold's figures move "
                               "with it, so compare a few")
    evaluate.add_argument("--experiment", default="paratune-evaluate",
                          help="MLflow experiment name (default: %(default)s)")
    add_track_flag(evaluate)
    evaluate.add_argument("--no-progress", action="store_true",
                          help="no progress bar of the fits (shown on a terminal's stderr)")
    evaluate.set_defaults(func=_evaluate, field_flags={"plot": "--plot"})


def _fit(args: argparse.Namespace) -> int:
    from paratune.models._workflows import fit_model

    _model, summary = fit_model(args.data, args.out, n_estimators=args.n_estimators,
                                experiment=None if args.no_track else args.experiment,
                                force=args.force)
    print(summary)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from paratune.models._workflows import calibrate_model

    print(calibrate_model(args.data, args.model))
    return 0


def _predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from paratune.errors import ConfigError
    from paratune.models._estimators import load_model
    from paratune.models._predict_io import predict_csv

    if not args.force and Path(args.out).is_file():  # refused before anything is read
        raise ConfigError("out", args.out, "exists: pass --force to replace it, or give "
                          "another --out")
    model = load_model(args.model)
    out = predict_csv(model, args.input, args.out)
    failed = int((out["pred_error"] != "").sum())
    print(f"predicted {len(out) - failed} of {len(out)} rows -> {args.out}"
          + (f" ({failed} rows with pred_error)" if failed else ""))
    warned = out["pred_warning"].fillna("").astype(str) if "pred_warning" in out else None
    if warned is not None and (warned != "").any():
        # each kind of reason with its row count: the text with its figures as N (a figure
        # stands alone; the digits of a name, such as a family's, stay)
        kinds = warned[warned != ""].str.replace(r"(?<![\w.-])\d+(\.\d+)?(?![\w-]|\.\w)",
                                                 "N", regex=True)
        for text, count in kinds.value_counts().items():
            print(f"warning: {count} {'row' if count == 1 else 'rows'}: {text} "
                  "(see pred_warning, pred_extrapolation_doublings)")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from paratune.models._workflows import EvaluationSpec, evaluate_model, plot_path

    spec = EvaluationSpec(split=args.split, baselines=args.baselines,
                          n_estimators=args.n_estimators, folds=args.folds,
                          model_seed=args.model_seed)
    result, run_id = evaluate_model(args.data, spec, plot=args.plot,
                                    experiment=None if args.no_track else args.experiment,
                                    progress=False if args.no_progress else None)
    print(result.table())
    print(f"plot: {plot_path(args.plot)}")
    if run_id:
        from paratune.tracking import ui_command

        print(f"MLflow run {run_id}: {ui_command()}")
    return 0
