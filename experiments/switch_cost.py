"""Cost of switching a running job's layout and batch size at a step boundary.

Four gloo processes train a model one step under a layout, then switch through a cycle of
layouts with :func:`paratune.profiler.reconfigure.reconfigure` (DCP save, rebuild, DCP load
with resharding), one step after each switch. Prints seconds per phase (save, rebuild, load)
and checkpoint size per switch, writes the table to ``out/switch_cost/switch_cost.csv`` and
logs it to MLflow (experiment ``paratune-experiments``, run ``switch_cost``) unless
``--no-mlflow``.

Run: ``python experiments/switch_cost.py [--model tiny] [--repeats 2] [--no-mlflow]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from paratune.parallel import ParallelConfig
from paratune.spec import get_model
from paratune.table import format_table
from paratune.tracking import add_no_track_argument

CYCLE = [
    ParallelConfig(dp=4, global_batch_size=16, micro_batch_size=4),
    ParallelConfig(dp=2, tp=2, global_batch_size=32, micro_batch_size=16),
    ParallelConfig(pp=2, tp=2, global_batch_size=32, micro_batch_size=16),
    ParallelConfig(pp=2, dp=2, global_batch_size=64, micro_batch_size=16, sharding="zero2"),
]


def _worker(rank: int, world_size: int, port: int, model: Any, repeats: int,
            out_dir: str) -> None:
    from paratune.profiler.gns import init_worker
    from paratune.profiler.mesh import closing_process_group
    from paratune.profiler.reconfigure import RunState, reconfigure
    from paratune.profiler.trainer import Trainer, synthetic_batch

    device = init_worker(rank, world_size, port, "cpu")
    with closing_process_group():
        def build(config: ParallelConfig) -> Trainer:
            return Trainer(model, config, device=device, seed=0)

        config = CYCLE[0]
        trainer = build(config)
        trainer.step(synthetic_batch(model, config.global_batch_size, step=0))
        state = RunState(config=config)
        rows = []
        targets = (CYCLE[1:] + CYCLE[:1]) * repeats
        for i, target in enumerate(targets):
            trainer, state, cost = reconfigure(trainer, state, target,
                                               checkpoint_dir=f"{out_dir}/ckpt",
                                               build_trainer=build)
            trainer.step(synthetic_batch(model, target.global_batch_size, step=i + 1))
            rows.append({"from": config.key(), "to": target.key(), "save_s": cost.save_s,
                         "build_s": cost.build_s, "load_s": cost.load_s,
                         "total_s": cost.total_s, "checkpoint_mb": cost.checkpoint_bytes / 1e6})
            config = target
        trainer.close()
        if rank == 0:
            Path(out_dir, "rows.json").write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from paratune.profiler.gns import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/switch_cost"))
    add_no_track_argument(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = get_model(args.model)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker, 4, model, args.repeats, out_dir)
        rows = json.loads(Path(out_dir, "rows.json").read_text())
    frame = pd.DataFrame(rows)
    print(format_table(rows, title=f"Switch cost, {model.name} ({model.num_params / 1e6:.2f}M "
                                   "parameters), 4 gloo ranks", floatfmt=".3g"))
    print(f"mean {frame['total_s'].mean():.3g} s per switch (save {frame['save_s'].mean():.3g}"
          f", rebuild {frame['build_s'].mean():.3g}, load {frame['load_s'].mean():.3g}); "
          f"median {frame['total_s'].median():.3g} s")
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "switch_cost.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "model": model.name, "num_params": model.num_params, "world_sizes": [4],
                "hardware": "cpu", "repeats": args.repeats}) as run:
            run.log_metrics({"mean_total_s": frame["total_s"].mean(),
                             "median_total_s": frame["total_s"].median(),
                             "mean_save_s": frame["save_s"].mean(),
                             "mean_build_s": frame["build_s"].mean(),
                             "mean_load_s": frame["load_s"].mean()})
            run.log_table(frame, "switch_cost.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
