"""Does the throughput-optimal parallelism change with the global batch size? From measurements.

vTrain's ground truth (Megatron-DeepSpeed GPT models on 2, 4 and 8 A100s in one node) sweeps
the global batch from 2 to 128 sequences with tensor, pipeline and data parallelism and the
micro-batch. For every (model shape, GPU count, global batch) this script takes the measured
configs and reports the fastest layout (dp, tp, pp) with its best micro-batch, the best
other layout and how much slower it is (the margin: a change of winner with a margin under
the measurement noise, about 2%, is a tie). A "change" is a batch whose winning layout
differs from the winner at the next smaller batch.

    python experiments/batch_vs_parallelism.py [--data DIR] [--min-margin 2]

Prints the full table, the per-model summary and the count of changes; writes
``out/batch_vs_parallelism/*.csv`` and ``layouts_by_batch.png`` (per group, each layout's
best throughput against the global batch: crossing lines are changes of winner) and logs
an MLflow run unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _public import public_data_dir

from paratune.table import format_table
from paratune.tracking import add_no_track_argument


def _plot(raw):
    """One panel per (model shape, GPU count): each layout's best tokens/s (over its
    micro-batches) against the global batch."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(raw.groupby(["layers", "hidden", "num_gpus"]))
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(groups) / cols), cols, squeeze=False,
                             figsize=(5 * cols, 3 * math.ceil(len(groups) / cols)))
    for ax, ((layers, hidden, gpus), group) in zip(axes.flat, groups):
        best = group.groupby(["layout", "global_batch"])["tokens_per_s"].max().reset_index()
        for layout, line in best.groupby("layout"):
            ax.plot(line["global_batch"], line["tokens_per_s"], marker="o", markersize=3,
                    label=layout)
        ax.set_xscale("log", base=2)
        ax.set_title(f"GPT L{layers} H{hidden}, {gpus} GPUs", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.supxlabel("global batch (sequences)")
    fig.supylabel("tokens/s, best micro-batch per layout")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None)
    parser.add_argument("--min-margin", type=float, default=2.0,
                        help="percent by which a new winner must beat the old one to count")
    parser.add_argument("--out", type=Path, default=Path("out/batch_vs_parallelism"))
    add_no_track_argument(parser)
    args = parser.parse_args()

    import pandas as pd

    data = public_data_dir(args.data)
    raw = pd.read_csv(data / "vtrain_a100_single_node.csv", comment="#")
    raw = raw[raw["step_time_s"] > 0].copy()
    raw["tokens_per_s"] = raw["global_batch"] * raw["seq_len"] / raw["step_time_s"]
    raw["layout"] = ("dp" + raw["dp"].astype(str) + "-tp" + raw["tp"].astype(str) + "-pp"
                     + raw["pp"].astype(str))
    rows, summary = [], []
    for (layers, hidden, gpus), group in raw.groupby(["layers", "hidden", "num_gpus"]):
        shape = f"GPT L{layers} H{hidden}"
        previous = None
        prev_layouts: set[str] = set()
        winners = []
        for gbs, sub in group.groupby("global_batch"):
            per_layout = (sub.sort_values("tokens_per_s", ascending=False)
                          .drop_duplicates("layout"))
            best = per_layout.iloc[0]
            runner = per_layout.iloc[1] if len(per_layout) > 1 else None
            margin = (100 * (best["tokens_per_s"] / runner["tokens_per_s"] - 1)
                      if runner is not None else float("nan"))
            changed = previous is not None and best["layout"] != previous["layout"]
            # A flip: both layouts measured at both batches, the order between them reversed.
            flip = bool(changed and best["layout"] in prev_layouts
                        and previous["layout"] in set(per_layout["layout"]))
            # How much the new winner beats the previous batch's winning layout at this batch.
            gain = float("nan")
            if changed:
                old = per_layout[per_layout["layout"] == previous["layout"]]
                gain = (100 * (best["tokens_per_s"] / old["tokens_per_s"].iloc[0] - 1)
                        if len(old) else float("inf"))
            rows.append({"model": shape, "gpus": int(gpus), "global_batch": int(gbs),
                         "configs": len(sub), "layouts": len(per_layout),
                         "best_layout": best["layout"], "best_mbs": int(best["micro_batch"]),
                         "best_tok_s": float(best["tokens_per_s"]),
                         "runner_up": runner["layout"] if runner is not None else "",
                         "margin_pct": margin, "changed": "yes" if changed else "",
                         "flip": "yes" if flip else "",
                         "gain_vs_prev_winner_pct": gain})
            winners.append(best["layout"])
            previous = best
            prev_layouts = set(per_layout["layout"])
        real = [r for r in rows if r["model"] == shape and r["gpus"] == gpus
                and r["changed"] and r["gain_vs_prev_winner_pct"] >= args.min_margin]
        summary.append({"model": shape, "gpus": int(gpus),
                        "batches": len(winners),
                        "winners_by_batch": " > ".join(dict.fromkeys(winners)),
                        "changes": sum(1 for r in rows if r["model"] == shape
                                       and r["gpus"] == gpus and r["changed"]),
                        f"changes_over_{args.min_margin:g}pct": len(real),
                        "flips_over_margin": sum(1 for r in real if r["flip"])})
    print(format_table(rows, title="Fastest measured layout per global batch (vTrain, A100)",
                       floatfmt=".4g"))
    print("(gain_vs_prev_winner_pct inf: the previous batch's winning layout was not measured "
          "at this batch)")
    print()
    print(format_table(summary, title="Winning layouts as the global batch grows",
                       floatfmt=".4g"))
    groups = len(summary)
    changing = sum(1 for s in summary if s[f"changes_over_{args.min_margin:g}pct"] > 0)
    total_changes = sum(s[f"changes_over_{args.min_margin:g}pct"] for s in summary)
    flips = sum(s["flips_over_margin"] for s in summary)
    flipping = sum(1 for s in summary if s["flips_over_margin"] > 0)
    print(f"\n{changing} of {groups} (model, GPU count) groups change their throughput-optimal "
          f"layout as the global batch grows, by more than {args.min_margin:g}% "
          f"({total_changes} changes in all); {flips} of the changes in {flipping} groups are "
          f"flips (both layouts measured at both batches, so not forced by dp <= batch)")
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "per_batch.csv", index=False)
    pd.DataFrame(summary).to_csv(args.out / "summary.csv", index=False)
    figure = _plot(raw)
    figure.savefig(args.out / "layouts_by_batch.png", dpi=90)
    if not args.no_mlflow:
        from paratune.hardware import get_hardware
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "data": [str((data / "vtrain_a100_single_node.csv").resolve())],
                "hardware": get_hardware("A100").name,  # as paratune reads these rows
                "min_margin_pct": args.min_margin}) as run:
            run.log_metrics({"groups": groups, "groups_changing": changing,
                             "changes": total_changes, "flips": flips,
                             "groups_flipping": flipping})
            run.log_table(pd.DataFrame(rows), "per_batch.csv")
            run.log_table(pd.DataFrame(summary), "summary.csv")
            run.log_figure(figure, "layouts_by_batch.png")


if __name__ == "__main__":
    main()
