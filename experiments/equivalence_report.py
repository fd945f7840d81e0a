"""How exactly does each parallel layout reproduce the single-process training step?

Runs ``--steps`` optimizer steps (default 2: the second one depends on the optimizer state,
which sharding splits across ranks) of the same model (same seed, same global batches) in one
process and
under each layout in one group of 4 gloo processes (and, with ``--with-3d``, full
pp x dp x tp layouts in a group of 8), and prints, per layout, the largest
relative difference of the loss (any step), of any gradient (last step) and of any updated
parameter (after the last step; per tensor:
``max|x - x_ref| / max|x_ref|``, then the largest over tensors). Run in float64 (the test's
setting) and float32.

In float32 the updated parameters differ more than the gradients: Adam's first step moves
each element by about ``lr * sign(g)``, so an element whose gradient is at the float32
rounding level can move the other way; with ``lr = 1e-3`` that shows as ~1e-3 relative to
the tensor's largest entry. The float64 run removes that noise floor.

    python experiments/equivalence_report.py [--dtype float64 float32] [--steps 2] [--with-3d]
        [--out out/equivalence]

Logs the table to MLflow (``MLFLOW_TRACKING_URI``, default ``./mlflow.db``; experiment
``paratune-experiments``, run ``equivalence_report``) unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from paratune import ParallelConfig, get_model
from paratune.profiler.equivalence import run_layouts
from paratune.table import format_table
from paratune.tracking import add_no_track_argument

GLOBAL_BATCH = 8
LAYOUTS = [
    ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=GLOBAL_BATCH),
    ParallelConfig(tp=4, micro_batch_size=4, global_batch_size=GLOBAL_BATCH),
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH),
    ParallelConfig(pp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH),
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=GLOBAL_BATCH),
    ParallelConfig(pp=4, micro_batch_size=2, global_batch_size=GLOBAL_BATCH, schedule="gpipe"),
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=GLOBAL_BATCH,
                   schedule="interleaved_1f1b", virtual_stages=2),
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, sharding="zero1"),
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, sharding="zero2"),
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, sharding="zero3"),
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                   sharding="zero3"),
    ParallelConfig(pp=2, dp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                   sharding="zero2", schedule="gpipe"),
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                   recompute="full"),
    ParallelConfig(pp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                   recompute="selective"),
]
# GPT-style variant of the model: tied embeddings, GELU MLP, 2 kv heads.
GPT_LAYOUTS = [
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, sharding="zero3"),
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                   recompute="full"),
]


# Full 3D layouts need 8 processes (``--with-3d``).
LAYOUTS_3D = [
    ParallelConfig(pp=2, dp=2, tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH),
    ParallelConfig(pp=2, dp=2, tp=2, micro_batch_size=1, global_batch_size=GLOBAL_BATCH,
                   sharding="zero3", schedule="interleaved_1f1b", virtual_stages=2,
                   recompute="selective"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float64", "float32"],
                        choices=["float64", "float32"])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per layout")
    parser.add_argument("--out", type=Path, default=Path("out/equivalence"))
    add_no_track_argument(parser)
    parser.add_argument("--with-3d", action="store_true",
                        help="also run pp2 x dp2 x tp2 layouts in a group of 8 processes")
    args = parser.parse_args(argv)

    spec = get_model(args.model, seq_len=args.seq_len)
    rows = []
    for dtype_name in args.dtype:
        start = time.perf_counter()
        gpt = spec.replace(tie_embeddings=True, mlp="gelu", num_kv_heads=2)
        layouts = LAYOUTS + [(gpt, c) for c in GPT_LAYOUTS]
        results = run_layouts(spec, layouts, world_size=4, seed=args.seed, steps=args.steps,
                              dtype=getattr(torch, dtype_name))
        names = [c.key() for c in LAYOUTS] + [f"gpt:{c.key()}" for c in GPT_LAYOUTS]
        if args.with_3d:
            results += run_layouts(spec, LAYOUTS_3D, world_size=8, seed=args.seed,
                                   steps=args.steps, dtype=getattr(torch, dtype_name))
            names += [c.key() for c in LAYOUTS_3D]
        elapsed = time.perf_counter() - start
        for name, result in zip(names, results):
            rows.append({"dtype": dtype_name, "layout": name,
                         "loss_rel": result.loss_rel_diff, "grad_rel": result.grad_rel_diff,
                         "param_rel": result.param_rel_diff, "worst_param": result.worst_param,
                         "status": "ok" if result.ok else
                         (result.error.strip().splitlines() or ["missing"])[-1][:60]})
        print(f"{dtype_name}: {len(results)} layouts, {elapsed:.1f} s")
    print(format_table(rows, ["dtype", "layout", "loss_rel", "grad_rel", "param_rel",
                              "worst_param", "status"], floatfmt=".2e",
                       title=f"Largest relative difference vs one process ({spec.name}, "
                             f"seq_len={spec.seq_len}, global batch {GLOBAL_BATCH})"))
    for dtype_name in args.dtype:
        mine = [r for r in rows if r["dtype"] == dtype_name]
        print(f"{dtype_name} worst: loss {max(r['loss_rel'] for r in mine):.2e}, "
              f"grad {max(r['grad_rel'] for r in mine):.2e}, "
              f"param {max(r['param_rel'] for r in mine):.2e}")

    import pandas as pd

    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "equivalence.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "model": spec.name, "seq_len": spec.seq_len, "seed": args.seed, "steps": args.steps,
                "global_batch_size": GLOBAL_BATCH, "hardware": "cpu",
                "world_sizes": [4, 8] if args.with_3d else [4],
                "dtypes": list(args.dtype)}) as run:
            run.log_table(frame, "equivalence.csv")
            for dtype_name in args.dtype:
                mine = frame[frame["dtype"] == dtype_name]
                run.log_metrics({f"{dtype_name}_max_loss_rel": float(mine["loss_rel"].max()),
                                 f"{dtype_name}_max_grad_rel": float(mine["grad_rel"].max()),
                                 f"{dtype_name}_max_param_rel": float(mine["param_rel"].max())})
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
