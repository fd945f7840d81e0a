"""The two-batch noise-scale estimator against least squares, where B_simple is known.

x ~ N(0, I_d), y = w* . x + noise (std sigma), loss 0.5 (w . x - y)^2, evaluated at
w = w* + delta: the per-example gradient has mean G = delta and covariance
Sigma = (|delta|^2 + sigma^2) I + delta delta^T, so
B_simple = (d (|delta|^2 + sigma^2) + |delta|^2) / |delta|^2.

Prints, per seed, the estimate after N steps (small batches of 8, big batch of 32, EMA
0.995), the true value and the relative error; with ``--adam`` the Adam-preconditioned
estimate against its own closed form (weights 1 / (sqrt(v_hat) + eps) frozen after 50 steps).

With ``--parallel``, also trains a two-layer Llama-style model for two steps on text under
three 3D-parallel layouts of four gloo processes (dp2 x tp2, pp2 x dp2 with ZeRO-2, dp4; and
dp2 x tp2 Adam-preconditioned) and prints the largest relative difference of the loss, the
small- and big-batch gradient norms and B_simple from the same training in one process
(float64, the same batches).

Run: ``python experiments/gns_least_squares.py [--seeds 10] [--steps 800] [--adam]
[--parallel] [--out out/gns_least_squares] [--no-mlflow]``. Writes ``estimates.csv`` (and
``parallel.csv``) under ``--out`` and logs an MLflow run (experiment
``paratune-experiments``, run ``gns_least_squares``) unless ``--no-mlflow``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

from paratune.profiler.gns import (
    GradientNoiseScale,
    adam_preconditioners,
    micro_batch_gradients,
    single_process_reference,
)
from paratune.table import format_table
from paratune.tracking import add_no_track_argument


def run(seed: int, *, dim: int, sigma: float, steps: int, adam: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(dim, generator=gen, dtype=torch.float64)
    delta = torch.randn(dim, generator=gen, dtype=torch.float64)
    delta = delta / delta.norm() * 0.8
    model = nn.Linear(dim, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])

    def backward(size: int) -> None:
        x = torch.randn(size, dim, generator=gen, dtype=torch.float64)
        y = x @ w_star + sigma * torch.randn(size, generator=gen, dtype=torch.float64)
        (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()

    weights, w = None, torch.ones(dim, dtype=torch.float64)
    if adam:
        opt = torch.optim.Adam(model.parameters(), lr=0.0)
        for _ in range(50):
            opt.zero_grad()
            backward(32)
            opt.step()
        weights = adam_preconditioners([opt])
        w = weights[model.weight].flatten()
    gns = GradientNoiseScale(beta=0.995)
    for _ in range(steps):
        small, big = micro_batch_gradients(list(model.parameters()),
                                           [lambda: backward(8)] * 4, preconditioners=weights)
        est = gns.update(small, big, 8, 32)
    truth = float((w * ((delta.norm() ** 2 + sigma**2) + delta**2)).sum()
                  / (w * delta**2).sum())
    return {"seed": seed, "estimate": est.b_simple, "true": truth,
            "rel_error": est.b_simple / truth - 1}


def parallel_check(*, steps: int = 2) -> list[dict[str, float | str]]:
    """Largest relative difference, per layout, between four gloo processes and one process
    on the same batches (float64)."""
    from paratune import ParallelConfig, get_model
    from paratune.profiler.gns import measure_layouts

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec = get_model("tiny").replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                     ffn_hidden_size=176, seq_len=32)
    gb = 8
    layouts = [
        ("dp2xtp2", {"config": ParallelConfig(dp=2, tp=2, global_batch_size=gb)}, 2, "none"),
        ("pp2xdp2 zero2", {"config": ParallelConfig(pp=2, dp=2, global_batch_size=gb,
                                                    sharding="zero2")}, 2, "none"),
        ("dp4", {"config": ParallelConfig(dp=4, global_batch_size=gb)}, 4, "none"),
        ("dp2xtp2 adam", {"config": ParallelConfig(dp=2, tp=2, global_batch_size=gb),
                          "precondition": "adam"}, 2, "adam"),
    ]
    got = measure_layouts(spec, [run for _, run, _, _ in layouts], world_size=4, steps=steps)
    references: dict[tuple[int, str], list[dict[str, float]]] = {}
    rows = []
    for (name, _, num_small, precondition), run in zip(layouts, got):
        key = (num_small, precondition)
        if key not in references:
            references[key] = single_process_reference(spec, gb, steps, num_small=num_small,
                                              precondition=precondition)
        row: dict[str, float | str] = {"layout": name, "mode": run[0]["mode"]}
        for field in ("loss", "small_sqnorm", "big_sqnorm", "b_simple"):
            row[field] = max(abs((s["estimate"]["b_simple"] if field == "b_simple"
                                  else s[field]) / r[field] - 1)
                             for s, r in zip(run, references[key]))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--adam", action="store_true")
    parser.add_argument("--parallel", action="store_true",
                        help="also compare 3D-parallel layouts with one process (4 gloo ranks)")
    parser.add_argument("--out", type=Path, default=Path("out/gns_least_squares"))
    add_no_track_argument(parser)
    args = parser.parse_args(argv)
    rows = [run(s, dim=args.dim, sigma=args.sigma, steps=args.steps, adam=args.adam)
            for s in range(args.seeds)]
    print(format_table(rows, title="B_simple: two-batch estimate vs closed form"
                       + (" (Adam-preconditioned)" if args.adam else "")))
    errors = [abs(r["rel_error"]) for r in rows]
    max_error, mean_error = max(errors), sum(errors) / len(errors)
    print(f"max |relative error| {max_error:.3f}, mean {mean_error:.3f}")
    parallel = parallel_check() if args.parallel else []
    if parallel:
        print()
        print(format_table(parallel, floatfmt=".2g",
                           title="3D-parallel (4 gloo ranks) vs one process, same batches, "
                                 "float64: largest relative difference over 2 steps"))
        worst = max(max(float(r[f]) for r in parallel)
                    for f in ("loss", "small_sqnorm", "big_sqnorm", "b_simple"))
        print(f"largest relative difference over all layouts and quantities {worst:.2g}")
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "estimates.csv", index=False)
    if parallel:
        pd.DataFrame(parallel).to_csv(args.out / "parallel.csv", index=False)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "seeds": list(range(args.seeds)), "steps": args.steps, "dim": args.dim,
                "sigma": args.sigma, "adam": args.adam, "parallel": args.parallel}) as tracked:
            tracked.log_metrics({"max_abs_rel_error": max_error,
                                 "mean_abs_rel_error": mean_error})
            tracked.log_table(pd.DataFrame(rows), "estimates.csv")
            if parallel:
                tracked.log_metrics({f"parallel_max_rel_diff_{f}": max(float(r[f])
                                                                       for r in parallel)
                                     for f in ("loss", "small_sqnorm", "big_sqnorm",
                                               "b_simple")})
                tracked.log_table(pd.DataFrame(parallel), "parallel.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
