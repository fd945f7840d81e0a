"""Search regret: 200 TPE trials against exhaustive enumeration of a >= 10,000-config space.

A PerformanceModel is fitted on the public H100 measurements (Ultra-Scale Playbook, successful
and failed runs); the space is llama3-70b on 512 and 1024 H100s with global batches of
256..2048 sequences, micro-batches 1..8, every schedule (interleaved with 2 or 4 virtual
stages), every sharding level and three recomputation modes, ranked by goodput
(B_noise = 1000 sequences). Exhaustive enumeration predicts every valid config in one
vectorised pass; TPE (and random search, for scale) runs 200 trials per seed. Regret is
``1 - best found / best overall`` among feasible configs.

    OMP_NUM_THREADS=1 python experiments/search_regret.py [--seeds 5] [--trials 200]

Prints the per-seed table and a summary; writes ``out/search_regret/regret.csv`` and logs an
MLflow run (experiment ``paratune-experiments``, run ``search_regret``) unless
``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _public import public_data_dir, ultrascale_frame

from paratune.space import ConfigSpace
from paratune.spec import get_model
from paratune.table import format_table
from paratune.tracking import add_no_track_argument

MODEL = "llama3-70b"
HARDWARE = "H100"
GLOBAL_BATCH_SIZES = "256:2048"


def options() -> ConfigSpace:
    """The options searched besides the global batch (which :data:`GLOBAL_BATCH_SIZES` sets)."""
    return ConfigSpace(micro_batch_sizes=(1, 2, 4, 8), virtual_stages=(2, 4),
                       recomputes=("none", "selective", "full"))


def tracking_params(args: argparse.Namespace, data: Path) -> dict:
    """The run's params: the searched space as searched (global batches included), the
    model, hardware, samplers and the measurements the model is fitted on."""
    from paratune.tuner import SearchSpace

    world_sizes = [int(g) for g in args.gpus.split(",")]
    space = SearchSpace.build(get_model(MODEL), world_sizes[0], HARDWARE, space=options(),
                              global_batch_sizes=GLOBAL_BATCH_SIZES)
    return {"model": MODEL, "hardware": space.hardware.name, "world_sizes": world_sizes,
            "samplers": args.samplers.split(","), "seeds": list(range(args.seeds)),
            "trials": args.trials, "gns": args.gns, "objective": "goodput",
            "global_batch_sizes": list(space.global_batch_sizes),
            "space": space.space.to_dict(),
            "data": [str((data / name).resolve()) for name in (
                "ultrascale_playbook_h100.csv", "ultrascale_playbook_h100_failed.csv")]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="public measurements directory")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--gpus", default="512,1024")
    parser.add_argument("--gns", type=float, default=1000.0)
    parser.add_argument("--samplers", default="tpe,random")
    parser.add_argument("--out", type=Path, default=Path("out/search_regret"))
    add_no_track_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    from paratune.models import PerformanceModel, throughput_regret
    from paratune.tuner import Objective, SearchOptions, SearchSpace, exhaustive, optuna_search

    data = public_data_dir(args.data)
    start = time.perf_counter()
    model = PerformanceModel(n_jobs=1).fit(ultrascale_frame(data))
    fit_s = time.perf_counter() - start
    objective = Objective(kind="goodput", b_noise=args.gns)
    rows = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        space = SearchSpace.build(get_model(MODEL), gpus, HARDWARE, space=options(),
                                  global_batch_sizes=GLOBAL_BATCH_SIZES)
        full = exhaustive(model, space, objective)
        best = float(full.ranked["objective"].iloc[0])
        print(f"{gpus} GPUs: {full.num_trials} valid configs ({len(full.skipped)} skipped), "
              f"exhaustive {full.wall_time_s:.2f} s, best {full.best.key()}", flush=True)
        for sampler in args.samplers.split(","):
            for seed in range(args.seeds):
                cpu = time.process_time()
                found, _ = optuna_search(model, space, objective,
                                         SearchOptions(n_trials=args.trials, seed=seed,
                                                       sampler=sampler))
                cpu = time.process_time() - cpu
                feasible = found.ranked[found.ranked["feasible"]]
                got = float(feasible["objective"].iloc[0]) if len(feasible) else 0.0
                rows.append({"gpus": gpus, "space": full.num_trials, "sampler": sampler,
                             "seed": seed, "trials": found.num_trials,
                             "pruned": found.num_pruned, "distinct": len(found.ranked),
                             "regret_pct": 100 * throughput_regret(best, got),
                             "search_s": found.wall_time_s, "search_cpu_s": cpu,
                             "exhaustive_s": full.wall_time_s,
                             "found": found.best.key()})
                print(format_table([rows[-1]], floatfmt=".3g").splitlines()[-1], flush=True)
    print()
    print(format_table(rows, title=f"Search regret vs exhaustive ({args.trials} trials; "
                                   f"model fit {fit_s:.1f} s)", floatfmt=".3g"))
    summary = []
    for gpus in sorted({r["gpus"] for r in rows}):
        for sampler in args.samplers.split(","):
            sel = [r for r in rows if r["gpus"] == gpus and r["sampler"] == sampler]
            summary.append({"gpus": gpus, "sampler": sampler, "space": sel[0]["space"],
                            "mean_regret_pct": statistics.mean(r["regret_pct"] for r in sel),
                            "max_regret_pct": max(r["regret_pct"] for r in sel),
                            "mean_search_s": statistics.mean(r["search_s"] for r in sel),
                            "max_search_s": max(r["search_s"] for r in sel),
                            "mean_search_cpu_s": statistics.mean(r["search_cpu_s"]
                                                                 for r in sel),
                            "zero_regret_runs": sum(r["regret_pct"] <= 1e-9 for r in sel),
                            "runs": len(sel)})
    print()
    print(format_table(summary, title="Summary (target: regret < 0.5%, search < 10 s; wall "
                                      "time depends on machine load, CPU time less so)",
                       floatfmt=".3g"))
    args.out.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    pd.DataFrame(rows).to_csv(args.out / "regret.csv", index=False)
    pd.DataFrame(summary).to_csv(args.out / "summary.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params=tracking_params(args, data)) as run:
            for s in summary:
                tag = f"{s['sampler']}_{s['gpus']}"
                run.log_metrics({f"mean_regret_pct_{tag}": s["mean_regret_pct"],
                                 f"max_regret_pct_{tag}": s["max_regret_pct"],
                                 f"mean_search_s_{tag}": s["mean_search_s"],
                                 f"mean_search_cpu_s_{tag}": s["mean_search_cpu_s"]})
            run.log_table(pd.DataFrame(rows), "regret.csv")
            run.log_table(pd.DataFrame(summary), "summary.csv")


if __name__ == "__main__":
    main()
