"""Which measurement families stall, and what the stalled regime does to the others.

About a third of the Ultra-Scale (nanotron) pipeline runs stall: a roughly fixed second per
micro-batch at a few percent of peak. vTrain's Megatron-DeepSpeed pipeline runs never do. The
performance model learns the stalled regime from the families that show it and keeps a stall
probability of 0 for a family with many pipeline runs and none stalled
(``PerformanceModel.stall_free_families_``). This script fits the model on all public
measurements and prints:

* per family: its timed pipeline runs, how many stalled, and the slowest run's step time
  as a share of the stall threshold (:func:`paratune.models.features.stall_floor_s`);
* vTrain's 8-GPU layouts scaled out to 2 and 4 nodes (``dp`` or ``pp`` times the node
  count; global batch and micro-batch kept, layouts whose layers or batch do not divide
  dropped): the stall probability the classifier learned from all families would give them,
  the one the model predicts, and the share of each over 0.5, with the median ratio of the
  predicted step time to the analytical estimate.

There is no measurement of these scaled-out layouts here: the table says what the model
predicts, not how far off it is.

    python experiments/stall_families.py [--data DIR] [--out out/stall_families] [--no-mlflow]

Writes ``families.csv``, ``scaled_out.csv`` and ``stall_families.txt`` under ``--out`` and
logs them to MLflow (experiment ``paratune-experiments``, run ``stall_families``) unless
``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument

SCALE_OUT = (2, 4)


def scaled_out(frame, nodes: int, axis: str):
    """The single-node (8-device) rows of ``frame`` on ``nodes`` nodes, ``axis`` (``dp`` or
    ``pp``) multiplied by ``nodes``; rows whose layers or global batch do not divide are
    dropped."""
    base = frame[(frame["world_size"] == 8) & (frame["devices_per_node"] == 8)]
    out = base.assign(**{axis: base[axis] * nodes, "world_size": base["world_size"] * nodes})
    keep = (out["num_layers"] % out["pp"] == 0) & (
        out["global_batch_size"] % (out["dp"] * out["micro_batch_size"]) == 0)
    return out[keep].reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--out", type=Path, default=Path("out/stall_families"),
                        help="folder for the tables (default: %(default)s)")
    add_no_track_argument(parser)
    args = parser.parse_args()

    import pandas as pd

    from paratune.models import (
        PerformanceModel,
        load_measurements,
        measured_step_time,
        source_family,
    )
    from paratune.models import features as F
    from paratune.predictor import CONFIG_COLUMNS
    from paratune.table import format_table

    data = public_data_dir(args.data)
    frame = load_measurements(sorted(data.glob("*.csv")))
    model = PerformanceModel().fit(frame)

    step = measured_step_time(frame)
    share = step / F.stall_floor_s(frame)
    family = source_family(frame)
    pipeline = np.isfinite(step) & (frame["pp"].to_numpy() > 1)
    family_rows = []
    for name, (runs, stalls) in sorted(model.pipeline_runs_.items()):
        rows = pipeline & (family == name)
        family_rows.append({"family": name, "pipeline_runs": runs, "stalled": stalls,
                            "slowest_vs_threshold": float(np.nanmax(share[rows])),
                            "stall_free": name in model.stall_free_families_})
    families = format_table(family_rows, ["family", "pipeline_runs", "stalled",
                                          "slowest_vs_threshold", "stall_free"],
                            floatfmt=".2f",
                            title="Timed pipeline runs per measurement family")

    vtrain = frame[family == "vtrain"]
    unrestricted = copy.copy(model)
    unrestricted.stall_free_families_ = []
    scale_rows = []
    for nodes in SCALE_OUT:
        for axis in ("dp", "pp"):
            configs = scaled_out(vtrain, nodes, axis)
            pred = model.predict(configs[[*CONFIG_COLUMNS, "source"]])
            # what the classifier learned from every family says, with no family held free
            learned = unrestricted.predict(configs[[*CONFIG_COLUMNS, "source"]])[
                "pred_stall_prob"].to_numpy()
            pipe = configs["pp"].to_numpy() > 1
            predicted = pred["pred_stall_prob"].to_numpy()
            ratio = pred["pred_step_time_s"] / pred["analytical_step_time_s"]
            scale_rows.append({
                "layouts": f"{axis} x{nodes} ({8 * nodes} GPUs)", "pipelines": int(pipe.sum()),
                "learned_mean": float(learned[pipe].mean()),
                "learned_over_half_pct": 100 * float((learned[pipe] > 0.5).mean()),
                "predicted_mean": float(predicted[pipe].mean()),
                "predicted_over_half_pct": 100 * float((predicted[pipe] > 0.5).mean()),
                "step_vs_analytical_median": float(np.median(ratio[pipe]))})
    scaled = format_table(scale_rows, ["layouts", "pipelines", "learned_mean",
                                       "learned_over_half_pct", "predicted_mean",
                                       "predicted_over_half_pct", "step_vs_analytical_median"],
                          floatfmt=".3g",
                          title="vTrain's 8-GPU layouts scaled out: stall probability of their "
                                "pipelines, learned from all families vs predicted")
    print(families)
    print()
    print(scaled)
    args.out.mkdir(parents=True, exist_ok=True)
    text = families + "\n\n" + scaled + "\n"
    tables = {"families.csv": pd.DataFrame(family_rows), "scaled_out.csv": pd.DataFrame(scale_rows)}
    for name, part in tables.items():
        part.to_csv(args.out / name, index=False)
    (args.out / "stall_families.txt").write_text(text)
    print(f"\ntables in {args.out}")

    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str(p.resolve()) for p in sorted(data.glob("*.csv"))],
                            "stall_free_families": model.stall_free_families_})
            run.log_metrics({f"learned_stall_prob_{r['layouts'].split(' (')[0].replace(' ', '_')}":
                             r["learned_mean"] for r in scale_rows})
            run.log_text(text, "stall_families.txt")
            for name, part in tables.items():
                run.log_table(part, name)


if __name__ == "__main__":
    main()
