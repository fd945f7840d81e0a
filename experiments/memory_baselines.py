"""Peak memory and out-of-memory: the performance model against the standard baselines.

Scores, on the same Ultra-Scale Playbook H100 rows (successful and failed files):

* the peak memory per device: paratune's memory regressor, paratune's analytical estimate,
  and Megatron-LM's theoretical memory formula (:func:`megatron_theoretical_memory`);
* whether a configuration runs: paratune's feasibility classifier, and the rule "an
  estimate under 80% of device memory never runs out of memory" (Fujii et al. 2024,
  "Accelerating Large Language Model Training with 4D Parallelism and Memory Consumption
  Estimator", 454 runs on A100/H100) applied to Megatron-LM's formula and to paratune's
  estimates; also the formula under the whole device memory.

A configuration is feasible when it ran at least once; a *false fit* is one predicted
feasible that then failed (the failed file's runs crashed or ran out of memory), the costly
mistake; a *false refusal* one predicted infeasible that ran.

Two scenarios: in distribution (grouped 5-fold cross-validation over configurations, each
configuration's rows in one fold) and the larger model (fit on the 1B model's rows only,
predict the 8B model's, 8x the parameters).

Logs to MLflow (experiment ``paratune-experiments``, run ``memory_baselines``; metrics
``<scenario>.<predictor>.<figure>``, percentages in percent) and writes the table to --out.

    python experiments/memory_baselines.py [--data DIR] [--out out/memory_baselines]
        [--n-estimators N] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir, ultrascale_frame

from paratune.tracking import add_no_track_argument

GIB = 2.0**30
FUJII_FRACTION = 0.8
"""Fujii et al. 2024: an estimate under 80% of the device memory never ran out of memory."""


def megatron_theoretical_memory(frame: Any, *, sequence_parallel: bool = False
                                ) -> dict[str, np.ndarray]:
    """Megatron-LM's theoretical memory footprint per device, row by row.

    The formula of ``megatron/training/theoretical_memory_usage.py`` (NVIDIA/Megatron-LM,
    ``report_theoretical_memory``; activations after Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", Table 2), for dense models:

    * weights and optimizer: the most loaded shard (the first pipeline stage: its layers
      and the embedding, plus the output layer where the pipeline has one stage and the
      embeddings are untied) over ``tp``, at 18 bytes per parameter, or ``6 + 12 / dp``
      with the distributed optimizer (here: any ZeRO sharding);
    * activations, with sequence parallelism and selective recomputation:
      ``s*b*h*(18 + 4*ffn/h)`` per layer for all layers (the first stage holds ``pp``
      micro-batches of ``layers/pp`` layers), the embedding's input (``8*s*b*pp``) and
      dropout (``s*b*h*pp``), the interleaved schedule's penalty
      ``1 + (pp - 1)/(pp*v)``, otherwise ``min(1, microbatches/pp)``, and with one stage the
      output layer's inputs ``4*s*b*h*(1 + V/h)``; all over ``tp``;
    * activations otherwise (Megatron's "without SP" branch): ``s*b*h*(10 + 24/tp)`` per
      layer, the same embedding and schedule terms, with one stage the logits and final norm
      output ``2*(s*b*V/tp + s*b*h)``, and 5% for temporaries.

    As in Megatron-LM, full recomputation and the CUDA context are not counted, the
    attention's query projection is ``hidden`` wide, and norms are RMSNorm (one weight) for
    SwiGLU models and LayerNorm (two) for GeLU ones.

    Args:
        frame: Rows with paratune's config columns (:data:`paratune.predictor.CONFIG_COLUMNS`).
        sequence_parallel: Whether the runs used sequence parallelism (only with selective
            recomputation does it pick the first activation formula, as in Megatron-LM).

    Returns:
        ``weight_optimizer_bytes``, ``activation_bytes`` and ``total_bytes`` per row.
    """

    def col(name: str) -> np.ndarray:
        return np.asarray(frame[name], dtype=float)

    h, layers, ffn, vocab, seq = (col(k) for k in ("hidden_size", "num_layers",
                                                   "ffn_hidden_size", "vocab_size", "seq_len"))
    heads = col("num_heads")
    kv = np.asarray(frame["num_kv_heads"], dtype=float)
    kv = np.where(np.isfinite(kv) & (kv > 0), kv, heads)
    tp, pp, dp, micro = (col(k) for k in ("tp", "pp", "dp", "micro_batch_size"))
    n_micro = col("global_batch_size") / (dp * micro)
    swiglu = np.asarray(frame["mlp"].astype(str).str.lower() == "swiglu")
    untied = ~np.asarray(frame["tie_embeddings"].astype(str).str.lower().isin(
        ("true", "1", "yes", "1.0")))
    distributed_optimizer = ~np.asarray(frame["sharding"].astype(str).str.lower().isin(
        ("none", "", "nan", "0")))
    recompute = frame["recompute"].astype(str).str.lower().to_numpy()
    interleaved = frame["schedule"].astype(str).str.lower().to_numpy() == "interleaved_1f1b"
    virtual = np.where(interleaved, col("virtual_stages"), np.nan)

    # weights and optimizer state
    norm = np.where(swiglu, 1.0, 2.0)
    gated = np.where(swiglu, 1.5, 1.0)
    attention = 2.0 * h * h * (1.0 + kv / heads)
    per_layer = 2.0 * h * (ffn * gated + norm) + attention
    embedding = h * vocab
    block = per_layer * layers + norm * h
    shard = (block / pp + embedding) / tp + np.where(untied & (pp == 1), embedding / tp, 0.0)
    bytes_per_param = np.where(distributed_optimizer, 6.0 + 12.0 / dp, 18.0)
    weights = shard * bytes_per_param

    # activations (of the first pipeline stage, the most loaded)
    sbh = seq * micro * h
    embedding_terms = 8.0 * seq * micro * pp + sbh * pp
    penalty = np.where(interleaved, 1.0 + (pp - 1.0) / (pp * np.nan_to_num(virtual, nan=1.0)),
                       np.where(pp > 1, np.minimum(1.0, n_micro / pp), 1.0))
    with_sp = (sbh * (18.0 + 4.0 * ffn / h) * layers + embedding_terms) * penalty
    with_sp = (with_sp + np.where(pp == 1, sbh * 4.0 * (1.0 + vocab / h), 0.0)) / tp
    without_sp = (sbh * (10.0 + 24.0 / tp) * layers + embedding_terms) * penalty
    logits = seq * micro * vocab / tp + sbh
    without_sp = (without_sp + np.where(pp == 1, 2.0 * logits, 0.0)) * 1.05
    use_sp = sequence_parallel & (recompute == "selective")
    activations = np.where(use_sp, with_sp, without_sp)
    return {"weight_optimizer_bytes": weights, "activation_bytes": activations,
            "total_bytes": weights + activations}


def _memory_scores(part: Any, estimates: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Median APE and median ratio of each estimate against the measured peak."""
    from paratune.models import measured_memory_gb

    measured = measured_memory_gb(part)
    out = {}
    for name, estimate in estimates.items():
        rows = np.isfinite(measured) & np.isfinite(estimate) & (measured > 0)
        ratio = estimate[rows] / measured[rows]
        out[name] = {"mem_n": float(rows.sum()),
                     "mem_mdape_pct": 100.0 * float(np.median(np.abs(ratio - 1.0))),
                     "mem_median_ratio": float(np.median(ratio)),
                     "mem_under_10pct_pct": 100.0 * float(np.mean(ratio < 0.9))}
    return out


def _feasibility_scores(table: Any, calls: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Accuracy, false fits and false refusals of each feasibility call, per configuration."""
    feasible = table["feasible"].to_numpy().astype(bool)
    out = {}
    for name, fits in calls.items():
        out[name] = {"configs": float(len(feasible)),
                     "accuracy_pct": 100.0 * float(np.mean(fits == feasible)),
                     "false_fits": float(np.sum(fits & ~feasible)),
                     "false_fits_pct_of_failed": 100.0 * float(np.sum(fits & ~feasible))
                     / max(int((~feasible).sum()), 1),
                     "false_refusals_pct_of_feasible": 100.0 * float(np.sum(~fits & feasible))
                     / max(int(feasible.sum()), 1)}
    return out


def score(part: Any) -> list[dict[str, Any]]:
    """Rows of the results table for one scenario's predicted rows (measurement columns and
    the performance model's prediction columns)."""
    from paratune.models import feasibility_table
    from paratune.models import features as F

    part = part.reset_index(drop=True)
    megatron_gib = megatron_theoretical_memory(part)["total_bytes"] / GIB
    analytical = F.analytical_memory_gb(part)
    regressor = np.asarray(part["pred_peak_mem_gb"], dtype=float)
    memory = _memory_scores(part, {"paratune memory regressor": regressor,
                                   "paratune analytical": analytical,
                                   "Megatron-LM formula": megatron_gib})
    # one row per configuration (feasible: it ran at least once); the first row's values
    table = feasibility_table(part.assign(_megatron=megatron_gib, _analytical=analytical))
    capacity = F.Columns(table).memory_gb
    regressor_t = np.asarray(table["pred_peak_mem_gb"], dtype=float)
    analytical_t = np.asarray(table["_analytical"], dtype=float)
    megatron_t = np.asarray(table["_megatron"], dtype=float)
    # each call, and the memory estimate it goes by
    calls = {
        "paratune feasibility classifier":
            (np.asarray(table["pred_feasible_prob"], dtype=float) >= 0.5,
             "paratune memory regressor"),
        "paratune memory regressor < 80%":
            (regressor_t < FUJII_FRACTION * capacity, "paratune memory regressor"),
        "paratune analytical < 80%":
            (analytical_t < FUJII_FRACTION * capacity, "paratune analytical"),
        "Megatron-LM formula < 80% (Fujii et al.)":
            (megatron_t < FUJII_FRACTION * capacity, "Megatron-LM formula"),
        "Megatron-LM formula < 100%": (megatron_t < capacity, "Megatron-LM formula"),
    }
    feasibility = _feasibility_scores(table, {k: v[0] for k, v in calls.items()})
    return [{"predictor": name, "memory_estimate": estimate, **feasibility[name],
             **memory[estimate]} for name, (_, estimate) in calls.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs")
    parser.add_argument("--out", default="out/memory_baselines",
                        help="folder for the table (default: %(default)s)")
    parser.add_argument("--n-estimators", type=int, default=None,
                        help="trees of the performance model (default: its own)")
    parser.add_argument("--seed", type=int, default=0, help="fold assignment and model seed")
    add_no_track_argument(parser)
    args = parser.parse_args()

    import time

    import pandas as pd

    from paratune.models import PerformanceModel, cross_validate
    from paratune.table import format_table

    start = time.perf_counter()
    data = public_data_dir(args.data)
    frame = ultrascale_frame(data).reset_index(drop=True)
    params = {} if args.n_estimators is None else {"n_estimators": args.n_estimators}

    def factory() -> PerformanceModel:
        return PerformanceModel(random_state=args.seed, **params)

    scenarios: dict[str, Any] = {}
    cv = cross_validate(frame, split="random", estimators={"performance_model": factory},
                        n_splits=5, random_state=args.seed, progress=False)
    scenarios["in distribution (5-fold CV)"] = cv.predictions["performance_model"]
    names = frame["model_name"].astype(str)
    train, test = frame[names == "1B"], frame[names == "8B"].reset_index(drop=True)
    pred = factory().fit(train).predict(test)
    scenarios["larger model (fit 1B, predict 8B)"] = pd.concat(
        [test, pred.reset_index(drop=True)], axis=1)

    results = []
    for scenario, part in scenarios.items():
        for row in score(part):
            results.append({"scenario": scenario, **row})
    columns = ["scenario", "predictor", "memory_estimate", "configs", "accuracy_pct", "false_fits",
               "false_fits_pct_of_failed", "false_refusals_pct_of_feasible", "mem_n",
               "mem_mdape_pct", "mem_median_ratio", "mem_under_10pct_pct"]
    table = format_table(results, columns, floatfmt=".2f",
                         title="Memory and feasibility on the Ultra-Scale H100 rows")
    print(table)
    wall = time.perf_counter() - start
    print(f"wall {wall:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(results).to_csv(out / "memory_baselines.csv", index=False)
    (out / "memory_baselines.txt").write_text(table + "\n")
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            run.log_params({"data": [str(p.resolve()) for p in sorted(data.glob("ultrascale*"))],
                            "n_estimators": args.n_estimators, "seed": args.seed,
                            "fujii_fraction": FUJII_FRACTION})
            for row in results:
                for key, value in row.items():
                    if isinstance(value, str) or not np.isfinite(value):
                        continue
                    name = f"{row['scenario']}.{row['predictor']}.{key}"
                    name = "".join(ch if ch.isalnum() or ch in "._-/" else "_" for ch in name)
                    run.log_metrics({name: value})
            run.log_metrics({"wall_s": wall})
            run.log_artifact(out)


if __name__ == "__main__":
    main()
