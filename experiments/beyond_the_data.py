"""What the model says where nobody measured: a model ten times the largest fitted,
tensor parallelism across A100 nodes from a family measured in one node, and an unmeasured
framework's GPT-175B on up to 12,288 devices.

Fits the performance model on the public measurements (as ``paratune fit`` does), then
predicts two grids no public row covers and prints what a user would act on:

* an 80B Llama-style model (80 layers, width 8192, the Ultra-Scale sweep's sequence, batch
  and vocabulary) on 64-512 H100s, every (tp, pp, dp, micro-batch, ZeRO-1 or not) layout
  the model calls feasible (as ``tune`` does): per cluster size the predicted MFU range, the
  stall probability of its pipelines, and the first choice by the point prediction, by the
  expected throughput and by the risk-aware expectation (what ``tune`` ranks by when it
  extrapolates), the last two times the probability of running, as ``tune`` ranks;
* vTrain's largest GPT (24 layers, width 2048) on 8-64 A100s: the predicted step time of
  each tensor-parallel degree, with groups of 16 across two nodes, next to the tp=8 layout of
  the same cluster;
* GPT-175B of a framework with no measurement (predicted as a well-tuned one) on 256 to
  12,288 A100s and H100s, tp8 pp8, weak scaling (half a sequence per device in the batch,
  so 32 micro-batches per pipeline throughout): what the data-parallel group's growth from
  4 to 192 costs.

There is no measurement to score these against here (the public sweeps stop at 8B and at
one A100 node); the tables show where the predictions lie, for the physics to be checked by
eye: deep pipelines of an 80B model run at about 30% of peak in the public sweep's own
framework, and a tensor-parallel group over two nodes costs a few times, not tens of times,
its collective inside one.

Writes ``large_model.csv``, ``a100_tp.csv``, ``scale_out.csv`` and ``beyond_the_data.txt``
under --out and logs them to MLflow (experiment ``paratune-experiments``, run
``beyond_the_data``) unless ``--no-track``.

    python experiments/beyond_the_data.py [--data DIR] [--out out/beyond_the_data]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _public import public_data_dir

from paratune.tracking import add_no_track_argument

WORLDS_80B = (64, 128, 256, 512)
WORLDS_A100 = (8, 16, 32, 64)
WORLDS_SCALE_OUT = (256, 1024, 4096, 12288)


def _layouts(world: int, global_batch: int, micro_batches=(1, 2, 4, 8)):
    """Every (tp, pp, dp, micro-batch) of ``world`` devices whose data-parallel replicas
    split ``global_batch`` sequences evenly."""
    for tp in (1, 2, 4, 8, 16, 32):
        for pp in (1, 2, 4, 8, 16, 32):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for mb in micro_batches:
                if global_batch % (dp * mb) == 0:
                    yield tp, pp, dp, mb


def large_model_table(model, source: str):
    """The 80B grid's predictions, one row per feasible layout."""
    import numpy as np
    import pandas as pd

    from paratune import ModelSpec, ParallelConfig
    from paratune.models import features as F
    from paratune.predictor import config_frame

    spec = ModelSpec(name="80B", num_layers=80, hidden_size=8192, num_heads=64,
                     ffn_hidden_size=28672, vocab_size=131072, seq_len=4096)
    configs = [ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=mb,
                              global_batch_size=256, sharding=sharding)
               for world in WORLDS_80B for tp, pp, dp, mb in _layouts(world, 256)
               for sharding in ("none", "zero1")]
    frame = config_frame(spec, configs, "H100")
    frame["source"] = source
    pred = model.predict(frame)
    at_peak = F.step_time_at_mfu(F.Columns(frame))
    out = pd.DataFrame({
        "world_size": frame["world_size"], "tp": frame["tp"], "pp": frame["pp"],
        "dp": frame["dp"], "micro_batch_size": frame["micro_batch_size"],
        "sharding": frame["sharding"],
        "pred_mfu": at_peak / pred["pred_step_time_s"].to_numpy(float),
        "stall_prob": pred["pred_stall_prob"].to_numpy(float),
        "feasible_prob": pred["pred_feasible_prob"].to_numpy(float),
        "tokens": pred["pred_tokens_per_sec_per_gpu"].to_numpy(float),
        "expected": pred["pred_tokens_per_sec_per_gpu_expected"].to_numpy(float),
        "q10": pred["pred_tokens_per_sec_per_gpu_q10"].to_numpy(float)})
    from paratune.models import choice_throughputs, predicted_to_run_rows

    # what tune ranks by: the expected throughput and its q10, times the probability of
    # running, among the configs predicted to run
    _, out["chosen"], out["chosen_q10"] = choice_throughputs(pred, out["tokens"].to_numpy())
    out["stall_prob"] = np.nan_to_num(out["stall_prob"])
    return out[predicted_to_run_rows(frame, pred)].reset_index(drop=True)


def _layout(row) -> str:
    return (f"tp{row['tp']} pp{row['pp']} dp{row['dp']} mb{row['micro_batch_size']} "
            f"{row['sharding']}")


def large_model_summary(table) -> list[dict]:
    """Per cluster size: feasible layouts, MFU range, pipelines' stall probability and the
    first choice by the point prediction and by each of ``tune``'s rankings."""
    import numpy as np

    from paratune.models import choice_orders

    rows = []
    for world, group in table.groupby("world_size"):
        pipelines = group[group["pp"] > 1]
        row = {"world_size": int(world), "feasible": len(group),
               "mfu_median": float(group["pred_mfu"].median()),
               "mfu_max": float(group["pred_mfu"].max()),
               "pipeline_stall_max": float(pipelines["stall_prob"].max())
               if len(pipelines) else 0.0}
        orders = choice_orders(group["chosen"].to_numpy(), group["chosen_q10"].to_numpy(),
                               np.ones(len(group), dtype=bool))
        # the point prediction is not what tune ranks by: shown for what it would choose
        picks = {"point": group["tokens"].to_numpy().argmax(),
                 "expected": orders["expected"][0], "risk_aware": orders["risk-aware"][0]}
        for rule, pick in picks.items():
            best = group.iloc[int(pick)]
            row[f"first_by_{rule}"] = f"{_layout(best)} ({best['pred_mfu']:.0%} MFU)"
        rows.append(row)
    return rows


def a100_table(model, source: str):
    """vTrain's largest GPT on 8-64 A100s: step time per tensor-parallel degree at mb 4."""
    import pandas as pd

    from paratune import ModelSpec, ParallelConfig
    from paratune.models import features as F
    from paratune.predictor import config_frame

    spec = ModelSpec(name="GPT-24L-2048H", num_layers=24, hidden_size=2048, num_heads=16,
                     ffn_hidden_size=8192, vocab_size=50257, seq_len=2048, mlp="gelu",
                     tie_embeddings=True)
    configs = [ParallelConfig(tp=tp, pp=1, dp=world // tp, micro_batch_size=4,
                              global_batch_size=max(64, 4 * world // tp), recompute="full")
               for world in WORLDS_A100 for tp in (1, 2, 4, 8, 16, 32) if tp <= world]
    frame = config_frame(spec, configs, "A100")
    frame["source"] = source
    pred = model.predict(frame)
    out = pd.DataFrame({"world_size": frame["world_size"], "tp": frame["tp"],
                        "dp": frame["dp"], "global_batch_size": frame["global_batch_size"],
                        "tp_crosses_nodes": F.tp_crosses_nodes(frame) > 0,
                        "pred_step_s": pred["pred_step_time_s"].to_numpy(float),
                        "q10_step_s": frame["global_batch_size"] * frame["seq_len"]
                        / (pred["pred_tokens_per_sec_per_gpu_q90"] * frame["world_size"]),
                        "q90_step_s": frame["global_batch_size"] * frame["seq_len"]
                        / (pred["pred_tokens_per_sec_per_gpu_q10"] * frame["world_size"])})
    tp8 = out[out["tp"] == 8].set_index(["world_size", "global_batch_size"])["pred_step_s"]
    keys = list(zip(out["world_size"], out["global_batch_size"], strict=True))
    out["vs_tp8"] = [s / tp8.get(k, float("nan")) for s, k in zip(out["pred_step_s"], keys,
                                                                   strict=True)]
    return out


def scale_out_table(model):
    """GPT-175B of a framework with no measurement (tp8 pp8, ZeRO-1, one sequence per
    micro-batch, half a sequence per device in the batch) on 256 to 12,288 A100s and
    H100s: predicted MFU and its q10-q90, the pipeline's bubble and the data-parallel
    reduction's share of the calibrated core's step."""
    import numpy as np
    import pandas as pd

    from paratune import ModelSpec, ParallelConfig
    from paratune.models import features as F
    from paratune.models._calibration import CONSTANT_NAMES, core_parts, default_constants
    from paratune.predictor import config_frame

    spec = ModelSpec(name="GPT-175B", num_layers=96, hidden_size=12288, num_heads=96,
                     ffn_hidden_size=49152, vocab_size=51200, seq_len=2048, mlp="gelu")
    rows = []
    for hardware in ("A100", "H100"):
        configs = [ParallelConfig(tp=8, pp=8, dp=world // 64, micro_batch_size=1,
                                  global_batch_size=world // 2, sharding="zero1",
                                  recompute="selective") for world in WORLDS_SCALE_OUT]
        frame = config_frame(spec, configs, hardware)
        frame["source"] = "unmeasured_framework"
        pred = model.predict(frame)
        c = F.Columns(frame)
        at_peak = F.step_time_at_mfu(c)
        parts = core_parts(c, F.analytical_step_time(c), np.ones(c.n, dtype=bool))
        parts = parts * default_constants(c)
        dp = [CONSTANT_NAMES.index("dp_intra"), CONSTANT_NAMES.index("dp_inter")]
        dp_share = parts[:, dp].sum(axis=1) / parts.sum(axis=1)
        micro_batches = F.num_microbatches(c)
        tokens = frame["global_batch_size"] * frame["seq_len"] / frame["world_size"]
        rows.append(pd.DataFrame({
            "hardware": hardware, "world_size": frame["world_size"], "dp": frame["dp"],
            "global_batch_size": frame["global_batch_size"],
            "bubble": (c.pp - 1) / (micro_batches + c.pp - 1),
            "dp_share_of_core": dp_share,
            "pred_mfu": at_peak / pred["pred_step_time_s"].to_numpy(float),
            "mfu_q10": at_peak / (tokens / pred["pred_tokens_per_sec_per_gpu_q10"]),
            "mfu_q90": at_peak / (tokens / pred["pred_tokens_per_sec_per_gpu_q90"])}))
    return pd.concat(rows, ignore_index=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the public CSVs fitted on")
    parser.add_argument("--out", default="out/beyond_the_data",
                        help="folder for the tables (default: %(default)s)")
    add_no_track_argument(parser)
    args = parser.parse_args()

    from paratune.models import PerformanceModel, load_measurements, source_family
    from paratune.table import format_table

    data = public_data_dir(args.data)
    frame = load_measurements(sorted(data.glob("*.csv")))
    model = PerformanceModel().fit(frame)
    families = source_family(frame)
    sources = frame["source"].astype(str)
    ultra = sources[families == "ultrascale"].iloc[0]
    vtrain = sources[families == "vtrain"].iloc[0]

    large = large_model_table(model, ultra)
    summary = large_model_summary(large)
    text = format_table(summary, list(summary[0]), floatfmt=".3g", title=(
        "An 80B model on H100s (10x the largest fitted), feasible layouts: predicted MFU, "
        "the pipelines' largest stall probability, the first choice by each ranking"))
    a100 = a100_table(model, vtrain)
    text += "\n\n" + format_table(
        a100.to_dict("records"), list(a100.columns), floatfmt=".3g", title=(
            "GPT-24L-2048H on A100s (vTrain measured one node): predicted step per "
            "tensor-parallel degree, and against tp=8 on the same cluster"))
    scale = scale_out_table(model)
    text += "\n\n" + format_table(
        scale.to_dict("records"), list(scale.columns), floatfmt=".3g", title=(
            "GPT-175B of a framework with no measurement, tp8 pp8 ZeRO-1 on 256-12,288 "
            "devices, weak scaling (half a sequence per device): predicted MFU and q10-q90, "
            "bubble and the data-parallel reduction's share of the core"))
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    large.to_csv(out / "large_model.csv", index=False)
    a100.to_csv(out / "a100_tp.csv", index=False)
    scale.to_csv(out / "scale_out.csv", index=False)
    (out / "beyond_the_data.txt").write_text(text + "\n")
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__) as run:
            for row in summary:
                run.log_metrics({f"80b.{row['world_size']}.mfu_max": row["mfu_max"],
                                 f"80b.{row['world_size']}.pipeline_stall_max":
                                     row["pipeline_stall_max"]})
            for row in a100[a100["tp_crosses_nodes"]].to_dict("records"):
                run.log_metric(f"a100.{row['world_size']}.tp{row['tp']}.vs_tp8",
                               float(row["vs_tp8"]))
            for row in scale.to_dict("records"):
                run.log_metric(f"175b.{row['hardware']}.{row['world_size']}.mfu",
                               float(row["pred_mfu"]))
            run.log_artifact(out)


if __name__ == "__main__":
    main()
