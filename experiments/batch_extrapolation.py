"""Throughput across batch sizes: fit on small global batches, predict larger ones (vTrain).

vTrain's A100 measurements (Megatron-DeepSpeed GPT on 2, 4 and 8 GPUs) vary the global batch
from 2 to 128 sequences. A PerformanceModel is fitted on the runs with a global batch of at
most ``--fit-max`` (32) and predicts the runs at 64 and 128, which it never saw: per batch, the
median absolute percentage error of the predicted throughput and the regret of the layout it
would choose (for each model shape, GPU count and batch: the measured throughput of the
predicted-best config against the measured best, ``1 - chosen / best``). Targets: median APE
<= 10%, regret <= 5%.

    OMP_NUM_THREADS=1 python experiments/batch_extrapolation.py [--fit-max 32]

Writes ``out/batch_extrapolation/`` and logs to MLflow unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pandas as pd

from paratune.table import format_table
from paratune.tracking import add_no_track_argument


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="public GPU measurements directory")
    parser.add_argument("--fit-max", type=int, default=32,
                        help="largest global batch of the fitted runs (default: %(default)s)")
    parser.add_argument("--n-estimators", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/batch_extrapolation"))
    add_no_track_argument(parser)
    args = parser.parse_args()

    from _public import public_data_dir

    from paratune.models import PerformanceModel, load_measurements, throughput_regret
    from paratune.predictor import PRED_TOKENS_PER_SEC_PER_GPU

    data = public_data_dir(args.data)
    frame = load_measurements([data / "vtrain_a100_single_node.csv"])
    frame = frame[frame["status"] == "ok"].reset_index(drop=True)
    train = frame[frame["global_batch_size"] <= args.fit_max]
    test = frame[frame["global_batch_size"] > args.fit_max].reset_index(drop=True)
    model = PerformanceModel(n_estimators=args.n_estimators, n_jobs=1,
                             random_state=args.seed).fit(train)
    pred = model.predict(test)
    test = test.assign(predicted=pred[PRED_TOKENS_PER_SEC_PER_GPU].to_numpy(float))
    test["ape"] = (test["predicted"] / test["tokens_per_s_per_device"] - 1.0).abs()
    rows = []
    shape = ["num_layers", "hidden_size", "num_heads", "world_size"]
    for batch, group in test.groupby("global_batch_size"):
        regrets = []
        for _, cell in group.groupby(shape):
            if len(cell) < 2:
                continue
            chosen = cell.loc[cell["predicted"].idxmax(), "tokens_per_s_per_device"]
            regrets.append(throughput_regret(cell["tokens_per_s_per_device"].max(), chosen))
        rows.append({"global_batch": int(batch), "runs": len(group),
                     "choices": len(regrets), "median_ape": float(group["ape"].median()),
                     "p90_ape": float(group["ape"].quantile(0.9)),
                     "mean_regret": float(np.mean(regrets)) if regrets else float("nan"),
                     "max_regret": float(np.max(regrets)) if regrets else float("nan")})
    rows.append({"global_batch": f"all > {args.fit_max}", "runs": len(test),
                 "choices": sum(r["choices"] for r in rows),
                 "median_ape": float(test["ape"].median()),
                 "p90_ape": float(test["ape"].quantile(0.9)),
                 "mean_regret": float(np.nansum([r["mean_regret"] * r["choices"] for r in rows])
                                      / max(1, sum(r["choices"] for r in rows))),
                 "max_regret": float(np.nanmax([r["max_regret"] for r in rows]))})
    print(format_table(rows, title=f"vTrain A100: fitted on global batch <= {args.fit_max} "
                                   f"({len(train)} runs), predicted above it", floatfmt=".4g"))
    args.out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "batch_extrapolation.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={"fit_max": args.fit_max,
                                                "n_estimators": args.n_estimators,
                                                "seed": args.seed}) as run:
            for r in rows[:-1]:
                run.log_metrics({f"median_ape_gb{r['global_batch']}": r["median_ape"],
                                 f"mean_regret_gb{r['global_batch']}": r["mean_regret"]})
            run.log_metrics({"median_ape": rows[-1]["median_ape"],
                             "mean_regret": rows[-1]["mean_regret"]})
            run.log_table(table, "batch_extrapolation.json")


if __name__ == "__main__":
    main()
