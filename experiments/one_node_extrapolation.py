"""From one node to many: how well the model predicts a cluster after seeing one node of it.

A profiling campaign often has one node to measure on, and the question is how the job runs
on many. The public H100 sweep answers it: the model is fitted on every public measurement
except the Ultra-Scale runs on more than one node (so on its 8-GPU runs and on vTrain), and
predicts those runs, per cluster size. Printed per size:

* ``mdape``: median absolute percentage error of tokens/s per GPU over all timed runs;
* ``mdape_no_pp``: the same over the runs without a pipeline (no stalled regime);
* ``bias_not_stalled``: the median ratio of predicted to measured step time over the runs
  that did not stall (1: no systematic error; over 1: predicted too slow);
* ``stalled``: the share of the size's pipeline runs that stalled (none of the 8-GPU runs
  the model saw did, so it cannot know the regime: those runs are its misses);

once with the default model and once with ``--min-family-rows`` low enough that the 8-GPU
Ultra-Scale runs get a step-time model of their own (the situation of a family measured on
one node only).

A second table splits that bias by what leaves the node: only data parallelism (no
pipeline), the pipeline, or tensor parallelism (its groups cross nodes). It says where a
model measured on one node goes wrong when it meets inter-node links: its learned
correction was fitted to traffic over the node's own links.

    python experiments/one_node_extrapolation.py [--data DIR] [--out out/one_node_extrapolation]
        [--no-mlflow]

Writes ``one_node_extrapolation.csv``, ``by_crossing.csv`` and the ``.txt`` under ``--out``
and logs them to MLflow (experiment ``paratune-experiments``, run ``one_node_extrapolation``)
unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument

FAMILY_ROWS = 50  # under the 8-GPU Ultra-Scale runs' count, so they get their own model


def figures(model, test) -> dict[str, float]:
    """The figures of one cluster size (see the module docstring)."""
    from paratune.models import features as F
    from paratune.models import measured_step_time

    step = measured_step_time(test)
    timed = np.isfinite(step)
    pred = model.predict(test)["pred_step_time_s"].to_numpy()
    ape = np.abs(step / pred - 1)
    flat = timed & (test["pp"].to_numpy() == 1)
    stalled = F.stalled_pipeline(test, step)
    pipeline = timed & (test["pp"].to_numpy() > 1)
    calm = timed & ~stalled
    return {"runs": int(timed.sum()), "mdape": 100 * float(np.median(ape[timed])),
            "mdape_no_pp": 100 * float(np.median(ape[flat])) if flat.any() else np.nan,
            "bias_not_stalled": float(np.median(pred[calm] / step[calm])),
            "stalled": 100 * float(stalled[pipeline].mean()) if pipeline.any() else np.nan}


def crossing(test) -> np.ndarray:
    """What leaves the node in each row: ``tp`` (a tensor-parallel group crosses nodes),
    ``pp`` (else a pipeline does), ``dp`` (else only data parallelism), or ``none``."""
    from paratune.models import features as F

    c = F.Columns(test)
    return np.select([F.tp_crosses_nodes(c) > 0, F.pp_crosses_nodes(c) > 0,
                      F.dp_crosses_nodes(c) > 0], ["tp", "pp", "dp"], default="none")


def bias_by_crossing(model, test) -> list[dict]:
    """Median predicted / measured step time of the runs that did not stall, per
    :func:`crossing` category."""
    from paratune.models import features as F
    from paratune.models import measured_step_time

    step = measured_step_time(test)
    calm = np.isfinite(step) & ~F.stalled_pipeline(test, step)
    pred = model.predict(test)["pred_step_time_s"].to_numpy()
    kind = crossing(test)
    rows = []
    for name in ("dp", "pp", "tp"):
        sel = calm & (kind == name)
        if sel.any():
            ratio = pred[sel] / step[sel]
            rows.append({"crosses nodes": name, "runs": int(sel.sum()),
                         "bias_not_stalled": float(np.median(ratio)),
                         "mdape": 100 * float(np.median(np.abs(1 / ratio - 1)))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--out", type=Path, default=Path("out/one_node_extrapolation"),
                        help="folder for the tables (default: %(default)s)")
    add_no_track_argument(parser)
    args = parser.parse_args()

    import pandas as pd

    from paratune.models import PerformanceModel, load_measurements, source_family
    from paratune.table import format_table

    data = public_data_dir(args.data)
    files = sorted(data.glob("*.csv"))
    frame = load_measurements(files)
    ultra = source_family(frame) == "ultrascale"
    world = frame["world_size"].to_numpy()
    train = frame[~ultra | (world <= 8)]
    rows, split_rows = [], []
    for label, family_rows in (("default", PerformanceModel().min_family_rows),
                               ("own model for the 8-GPU runs", FAMILY_ROWS)):
        model = PerformanceModel(min_family_rows=family_rows).fit(train)
        for size in sorted(set(world[ultra & (world > 8)])):
            rows.append({"model": label, "gpus": int(size),
                         **figures(model, frame[ultra & (world == size)])})
        split_rows += [{"model": label, **r}
                       for r in bias_by_crossing(model, frame[ultra & (world > 8)])]
    table = format_table(rows, ["model", "gpus", "runs", "mdape", "mdape_no_pp",
                                "bias_not_stalled", "stalled"], floatfmt=".3g",
                         title="Ultra-Scale runs on 2 to 32 nodes, predicted by a model fitted "
                               "without them (on the 8-GPU runs and vTrain); %, bias as a ratio")
    split = format_table(split_rows, ["model", "crosses nodes", "runs", "bias_not_stalled",
                                      "mdape"], floatfmt=".3g",
                         title="The same runs that did not stall, by what leaves the node "
                               "(dp: only data parallelism; pp: the pipeline; tp: tensor "
                               "parallelism); mdape in %")
    print(table)
    print()
    print(split)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "one_node_extrapolation.csv", index=False)
    pd.DataFrame(split_rows).to_csv(args.out / "by_crossing.csv", index=False)
    (args.out / "one_node_extrapolation.txt").write_text(table + "\n\n" + split + "\n")
    print(f"\ntables in {args.out}")

    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str(p.resolve()) for p in files],
                            "family_rows_own_model": FAMILY_ROWS})
            for r in rows:
                which = "default" if r["model"] == "default" else "own_model"
                run.log_metrics({f"{key}_{r['gpus']}gpus_{which}": r[key]
                                 for key in ("mdape", "mdape_no_pp", "bias_not_stalled")})
            for r in split_rows:
                which = "default" if r["model"] == "default" else "own_model"
                run.log_metrics({f"bias_not_stalled_{r['crosses nodes']}_crossing_{which}":
                                 r["bias_not_stalled"]})
            run.log_text(table + "\n\n" + split, "one_node_extrapolation.txt")
            run.log_table(pd.DataFrame(rows), "one_node_extrapolation.csv")


if __name__ == "__main__":
    main()
