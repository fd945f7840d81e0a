"""Other frameworks' published runs, none of their rows fitted on.

Fits the performance model on the public measurements (as ``paratune fit`` does: the
Ultra-Scale Playbook's nanotron sweep on H100 and vTrain's Megatron-DeepSpeed runs on A100),
then predicts the runs of the CSVs given (default: every ``published_*.csv`` under the
repository's ``data/``, e.g. Megatron-LM's 22B-1T GPT runs on 8-512 A100 of Korthikanti et
al. 2022 and its weak scaling from 1.7B on 32 A100 to 1T on 3,072 of Narayanan et al. 2021),
whose framework the model has no measurement of. Such a family is predicted as a
well-tuned framework on that hardware (the calibrated core with its default constants, see
:mod:`paratune.models._calibration`), with a warning and a widened interval.

Per source: the rows, median APE and MAPE of tokens/s per device, the median predicted /
measured throughput and the share of runs inside the predicted q10-q90; per row, the
measured and predicted MFU. Targets: median predicted / measured within [0.8, 1.25] and
median APE <= 20% for each source.

Writes ``published_runs.csv`` (per row), ``published_runs.txt`` and ``published_runs.png`` (a
panel per source: predicted vs measured tokens/s per device, each run's q10-q90 as a bar)
under --out and logs them
to MLflow (experiment ``paratune-experiments``, run ``published_runs``; metrics
``<source>.<figure>``).

    python experiments/published_runs.py [--data DIR] [--out out/published_runs] [CSV ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import REPO, public_data_dir

from paratune.tracking import add_no_track_argument

RATIO_TARGET = (0.8, 1.25)
"""The target's range of the median predicted / measured throughput of a source."""
MDAPE_TARGET = 20.0
"""The target's largest median APE of a source (percent)."""


def score(predictions) -> list[dict]:
    """Per source of ``predictions`` (measurement rows with the model's columns), the
    figures of :func:`paratune.models.metrics`: rows, median APE and MAPE of tokens/s per
    device (percent), median predicted / measured throughput, q10-q90 coverage (percent)
    and ``targets_met`` (the ratio within :data:`RATIO_TARGET` and the median APE at most
    :data:`MDAPE_TARGET`), ``feasible_right`` (percent of the source's runs whose outcome,
    ran or out of memory, the feasibility probability calls right at 0.5), ``false_fits``
    (failed runs called feasible) and ``mdape_mem`` (median APE of the peak memory, percent,
    NaN where the source reports none)."""
    from paratune.models import metrics

    out = []
    for source in sorted(predictions["source"].astype(str).unique()):
        rows = predictions[predictions["source"].astype(str) == source]
        m = metrics(rows, rows)
        met = (RATIO_TARGET[0] <= m["ratio_median"] <= RATIO_TARGET[1]
               and 100 * m["mdape"] <= MDAPE_TARGET)
        failed = (rows["status"].astype(str) != "ok").to_numpy()
        called = rows["pred_feasible_prob"].to_numpy(float) >= 0.5
        out.append({"source": source, "rows": int(m["n"]), "mdape": 100 * m["mdape"],
                    "mape": 100 * m["mape"], "ratio_median": m["ratio_median"],
                    "coverage": 100 * m["coverage"], "targets_met": bool(met),
                    "feasible_right": 100 * float((called != failed).mean()),
                    "false_fits": int((called & failed).sum()),
                    "mdape_mem": 100 * m["mdape_mem"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="*", type=Path,
                        help="published runs in the public format (default: data/published_*.csv)")
    parser.add_argument("--data", default=None, help="folder of the public CSVs fitted on")
    parser.add_argument("--out", default="out/published_runs",
                        help="folder for the tables (default: %(default)s)")
    add_no_track_argument(parser)
    args = parser.parse_args()
    files = args.csv or sorted((REPO / "data").glob("published_*.csv"))
    if not files:
        parser.error("no published runs given and none under data/")

    import pandas as pd

    from paratune.models import PerformanceModel, load_measurements
    from paratune.models import features as F
    from paratune.models._evaluate_report import fold_panels, plot_panels
    from paratune.table import format_table

    data = public_data_dir(args.data)
    fitted_on = sorted(data.glob("*.csv"))
    model = PerformanceModel().fit(load_measurements(fitted_on))
    published = load_measurements(files)
    predictions = pd.concat([published.reset_index(drop=True),
                             model.predict(published).reset_index(drop=True)], axis=1)
    scores = score(predictions)
    shown = [{**row, "targets": "met" if row["targets_met"] else "MISSED"} for row in scores]
    table = format_table(shown, ["source", "rows", "mdape", "mape", "ratio_median", "coverage",
                                 "feasible_right", "false_fits", "mdape_mem", "targets"],
                         headers={"mdape": "MdAPE%", "mape": "MAPE%",
                                  "ratio_median": "pred/meas", "coverage": "q10-q90 cover%",
                                  "feasible_right": "ran/OOM right%", "false_fits": "false fits",
                                  "mdape_mem": "memory MdAPE%",
                                  "targets": f"pred/meas in {list(RATIO_TARGET)}, "
                                             f"MdAPE <= {MDAPE_TARGET:g}%"},
                         floatfmt=".3g", title="Published runs of frameworks with no "
                         "measurement fitted on (tokens/s per device)")
    c = F.Columns(published)
    at_peak = F.step_time_at_mfu(c)
    rows = pd.DataFrame({
        "source": published["source"].astype(str), "model": published["model_name"],
        "world_size": published["world_size"],
        "layout": [f"tp{t} pp{p}{f' v{v}' if v > 1 else ''} dp{d} mb{m} {r}"
                   for t, p, v, d, m, r in zip(
                       published["tp"], published["pp"], published["virtual_stages"],
                       published["dp"], published["micro_batch_size"], published["recompute"],
                       strict=True)],
        "measured_step_s": predictions["step_time_s"],
        "pred_step_s": predictions["pred_step_time_s"],
        "measured_mfu": at_peak / predictions["step_time_s"].to_numpy(float),
        "pred_mfu": at_peak / predictions["pred_step_time_s"].to_numpy(float)})
    detail = format_table(rows.to_dict("records"), list(rows.columns), floatfmt=".3g",
                          title="Per run")
    text = table + "\n\n" + detail
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "published_runs.csv", index=False)
    (out / "published_runs.txt").write_text(text + "\n")
    plot_panels(fold_panels(predictions, by="source"), out / "published_runs.png",
                title="Published runs, none fitted on: predicted vs measured, q10-q90 bars")
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str(f.resolve()) for f in fitted_on],
                            "published": [str(f.resolve()) for f in files]})
            for row in scores:
                run.log_metrics({f"{row['source']}.{k}": float(v) for k, v in row.items()
                                 if k != "source"})
            run.log_artifact(out)


if __name__ == "__main__":
    main()
