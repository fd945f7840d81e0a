"""Per-config overhead of measure_config: time outside the warm-up and measured steps.

One group of gloo processes (world 4 by default) measures a list of layouts of the tiny model
in sequence, as a campaign does, and prints per layout the build time (mesh from the cache,
model, parallelisation, optimizer, pipeline stages), the teardown time and the whole
overhead (everything but the steps: build, barriers, teardown, fingerprint, result
reduction), each the slowest rank's. The first layout of each mesh shape also pays for
creating that shape's process groups.

    OMP_NUM_THREADS=1 python experiments/bench_config_overhead.py [--world-size 4]

Writes ``out/config_overhead/config_overhead.csv`` and logs it to MLflow unless
``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from paratune import ParallelConfig, get_model
from paratune.table import format_table
from paratune.tracking import add_no_track_argument

GLOBAL_BATCH = 8


def layouts(world: int) -> list[ParallelConfig]:
    """A campaign-like mix of layouts with ``world`` ranks (every one valid for tiny)."""
    out = []
    for dp in (d for d in (1, 2, 4, 8) if world % d == 0):
        for tp in (t for t in (1, 2, 4) if (world // dp) % t == 0):
            pp = world // (dp * tp)
            if pp > 4:
                continue
            for sharding in ("none", "zero3"):
                if sharding != "none" and dp == 1:
                    continue
                mb = max(1, GLOBAL_BATCH // (dp * max(pp, 1) * 2))
                cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=mb,
                                     global_batch_size=GLOBAL_BATCH, sharding=sharding)
                if cfg.is_valid(get_model("tiny"), world):
                    out.append(cfg)
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, warmup: int, measured: int,
            repeats: int) -> None:
    from paratune.profiler import MeasureOptions, measure_config
    from paratune.profiler.gns import init_worker
    from paratune.profiler.mesh import closing_process_group

    init_worker(rank, world, port, "cpu")
    torch.set_num_threads(1)
    spec = get_model("tiny")
    rows = []
    options = MeasureOptions(warmup_steps=warmup, measured_steps=measured)
    with closing_process_group():
        for repeat in range(repeats):
            for cfg in layouts(world):
                details: dict = {}
                start = time.perf_counter()
                m = measure_config(spec, cfg, hardware="cpu", device="cpu", options=options,
                                   details=details)
                rows.append({"repeat": repeat, "layout": cfg.key(),
                             "wall_s": time.perf_counter() - start,
                             "step_s": m.step_time_s, **details})
        if rank == 0:
            torch.save(rows, Path(out_dir) / "rows.pt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--measured", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes over the layouts (the second shows cached meshes)")
    parser.add_argument("--out", type=Path, default=Path("out/config_overhead"))
    add_no_track_argument(parser)
    args = parser.parse_args(argv)

    from paratune.profiler.gns import spawn

    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker, args.world_size, out_dir, args.warmup, args.measured, args.repeats)
        rows = torch.load(Path(out_dir) / "rows.pt", weights_only=False)
    print(format_table(rows, ["repeat", "layout", "mesh_s", "build_s", "teardown_s",
                              "overhead_s",
                              "step_s", "wall_s"], floatfmt=".3f",
                       title=f"tiny, world {args.world_size}, {args.warmup} warm-up + "
                             f"{args.measured} measured steps"))
    overheads = [r["overhead_s"] for r in rows]
    # Only passes after the first have every mesh cached; with one pass there are none.
    later = [r["overhead_s"] for r in rows if r["repeat"] > 0]
    first = rows[0]
    print(f"first config (one-time imports and its mesh's process groups): overhead "
          f"{first['overhead_s']:.3f} s, of which mesh {first['mesh_s']:.3f} s")
    cached = (f"with meshes cached (repeat >= 1): median {statistics.median(later):.3f}, "
              f"max {max(later):.3f}" if later else
              "no pass with meshes cached (--repeats 2 or more measures that)")
    print(f"overhead per config (s): median {statistics.median(overheads):.3f}, "
          f"max {max(overheads):.3f}; {cached}")

    import pandas as pd

    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "config_overhead.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "model": "tiny", "world_sizes": [args.world_size], "hardware": "cpu",
                "warmup_steps": args.warmup, "measured_steps": args.measured,
                "repeats": args.repeats, "out": str(args.out.resolve())}) as run:
            run.log_table(frame, "config_overhead.csv")
            run.log_metrics({"overhead_median_s": statistics.median(overheads),
                             "overhead_max_s": max(overheads),
                             **({"overhead_cached_median_s": statistics.median(later),
                                 "overhead_cached_max_s": max(later)} if later else {})})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
