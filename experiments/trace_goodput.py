"""Trace-driven time to target at GPU scale: does co-adapting batch and parallelism pay?

For llama3-8b and llama3-70b on 64, 256, 1,024 and 4,096 H100s and A100s, training from 0.2B
to 200B tokens along Chinchilla's loss fit (Hoffmann et al. 2022) with the critical batch of
a published law (Kaplan et al. 2020 by default: B_crit = 2e8 tokens / L^(1/0.21)), the
predicted time to the target loss (the loss at 200B tokens) of four arms, all timed on the
same prediction of every valid config by a PerformanceModel fitted on the public GPU
measurements:

(a) ``fixed``: the best fixed (batch, layout);
(b) ``follow``: the batch follows B_crit (nearest candidate), one fixed layout (the best);
(c) ``ramp``: a Llama-3-style hand ramp (4M -> 8M -> 16M tokens per step, switching at the
    same fractions of the run as Llama 3 405B: 252M and 2.87T of 15.6T tokens), with the
    best layout of each phase (a layout change costs ``--reconfig-cost-s``);
(d) ``plan``: paratune's co-adaptive plan (:func:`paratune.tuner.plan_phases`, its default
    threshold).

``bound`` is the exact dynamic programme over (stretch, batch x layout) with the switch
costs and no threshold: no schedule over these configs is faster. ``oracle`` is the best
config of every stretch with switches free, the most any schedule could gain.

Intervals: the gain of (d) over the best of (a)-(c) at the predictor's q10 and q90
throughput (the same schedules retimed), and re-planned under the law's stated uncertainty
(B* halved and doubled). Prints one row per cell and says, per cell, where co-adaptation does
not pay and why. Writes ``out/trace_goodput/`` (table CSV, plots of the gain against the GPU
count and of the schedules over tokens) and logs it all to MLflow unless ``--no-mlflow``.

    OMP_NUM_THREADS=1 python experiments/trace_goodput.py [--law kaplan2020] [--quick]

The public H100 measurements hold one global batch (256 x 4096 tokens) and the A100 ones a
single node, so every figure here leans on the model's extrapolation across batch sizes and
cluster sizes (see experiments/batch_extrapolation.py for how far it holds on vTrain).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pandas as pd

from paratune import get_model
from paratune.table import format_table
from paratune.tracking import add_no_track_argument

COPUS_GAIN = 0.039
"""The smallest average gain COPUS reports (3.9% on 8-32 GPUs): the bar where the laws say
co-adaptation should pay."""

LLAMA3_RAMP = ((0.0, 4e6), (252e6 / 15.6e12, 8e6), (2.87e12 / 15.6e12, 16e6))
"""Llama 3 405B's batch ramp: (fraction of the run's tokens, tokens per step)."""


def _arm_time(times: np.ndarray, choice: list[int], layouts: list[tuple], *,
              reconfig_cost_s: float, batch_change_cost_s: float) -> float:
    """Seconds of a per-stretch choice of configs on a ``[stretch, config]`` matrix."""
    total = float(sum(times[i, c] for i, c in enumerate(choice)))
    for a, b in itertools.pairwise(choice):
        if a != b:
            total += batch_change_cost_s if layouts[a] == layouts[b] else reconfig_cost_s
    return total


def _plan_choice(plan, index: dict[str, int]) -> list[int]:
    choice: list[int] = []
    for phase in plan.phases:
        from paratune import ParallelConfig

        k = index[ParallelConfig.from_dict(phase["config"]).key()]
        first, stop = phase["segment_range"]
        choice += [k] * (stop - first)
    return choice


def _ramp_choice(ct, segments, *, seq_len: int, reconfig_cost_s: float) -> list[int] | None:
    """Llama 3's ramp at the same fractions of this run, best layout per ramp phase."""
    total = segments[-1].end_tokens
    candidates = np.unique(ct.batch)
    wanted = []
    for s in segments:
        frac = s.start_tokens / total
        tokens = [t for f, t in LLAMA3_RAMP if frac >= f][-1]
        b = tokens / seq_len
        wanted.append(float(candidates[np.argmin(np.abs(np.log(candidates) - math.log(b)))]))
    choice: list[int] = []
    start = 0
    while start < len(segments):
        stop = start
        while stop < len(segments) and wanted[stop] == wanted[start]:
            stop += 1
        cols = np.flatnonzero(ct.batch == wanted[start])
        if not len(cols):
            return None
        k = int(cols[np.argmin(ct.times[start:stop, cols].sum(axis=0))])
        choice += [k] * (stop - start)
        start = stop
    return choice


def _follow_choice(ct, plan, index) -> list[int] | None:
    base = plan.baselines["follow_critical"]
    if base.get("config") is None:
        return None
    from paratune import ParallelConfig

    return [index[ParallelConfig.from_dict({**base["config"], "global_batch_size": int(b)}).key()]
            for b in base["batches"]]


def run_cell(predictor, model_name: str, gpus: int, hardware: str, law: str, *,
             reconfig_cost_s: float, segments: int) -> dict[str, Any]:
    from paratune import ParallelConfig
    from paratune.tuner import (
        SearchSpace,
        config_times,
        default_batch_range,
        plan_phases,
        predict_configs,
        progress_segments,
    )
    from paratune.tuner.gns_trajectory import chinchilla_loss_curve, get_law, law_trajectory

    spec = get_model(model_name)
    curve = chinchilla_loss_curve(spec.num_params)
    base_law = get_law(law)
    traj = law_trajectory(base_law, curve, seq_len=spec.seq_len)
    batches = default_batch_range(spec, gpus, traj.b_noise_in(spec.seq_len))
    space = SearchSpace.build(spec, gpus, hardware, global_batch_sizes=batches)
    ranked = predict_configs(predictor, space)
    out: dict[str, Any] = {"model": model_name, "gpus": gpus, "hardware": hardware,
                           "batches": f"{batches[0]}-{batches[-1]}", "configs": len(ranked)}
    gains = {}
    for factor in (1.0, 0.5, 2.0):
        law_f = base_law if factor == 1.0 else base_law.scaled(factor)
        traj_f = law_trajectory(law_f, curve, seq_len=spec.seq_len)
        plan = plan_phases(predictor, space, traj_f, reconfig_cost_s=reconfig_cost_s,
                           max_segments=segments, ranked=ranked)
        segs = progress_segments(traj_f, seq_len=spec.seq_len, max_segments=segments)
        ct = config_times(ranked, segs, seq_len=spec.seq_len)
        index = {c.key(): k for k, c in enumerate(ct.configs)}
        fixed_k = index[ParallelConfig.from_dict(plan.baselines["fixed"]["config"]).key()]
        arms = {"fixed": [fixed_k] * len(segs), "follow": _follow_choice(ct, plan, index),
                "ramp": _ramp_choice(ct, segs, seq_len=spec.seq_len,
                                     reconfig_cost_s=reconfig_cost_s),
                "plan": _plan_choice(plan, index)}
        bound = plan_phases(predictor, space, traj_f, reconfig_cost_s=reconfig_cost_s,
                            max_segments=segments, ranked=ranked, threshold=0.0)
        arms["bound"] = _plan_choice(bound, index)
        matrices = {"point": ct.times, **ct.quantile_times}
        timed = {}
        for which, matrix in matrices.items():
            timed[which] = {name: (_arm_time(matrix, choice, ct.layouts,
                                             reconfig_cost_s=reconfig_cost_s,
                                             batch_change_cost_s=0.0)
                                   if choice is not None else math.nan)
                            for name, choice in arms.items()}
        point = timed["point"]
        best_base = min(v for k, v in point.items() if k in ("fixed", "follow", "ramp")
                        and math.isfinite(v))

        def gain(t: dict[str, float], arm: str) -> float:
            base = min(v for k, v in t.items() if k in ("fixed", "follow", "ramp")
                       and math.isfinite(v))
            return base / t[arm] - 1.0

        gains[factor] = gain(point, "plan")
        if factor == 1.0:
            out.update({f"{k}_h": v / 3600 for k, v in point.items()})
            out["oracle_h"] = float(ct.times.min(axis=1).sum()) / 3600
            out["gain"] = gains[1.0]
            out["bound_gain"] = gain(point, "bound")
            out["oracle_gain"] = best_base / (out["oracle_h"] * 3600) - 1.0
            qs = [gain(timed[q], "plan") for q in ("q10", "q90") if q in timed]
            out["gain_q10_q90"] = (f"{min(qs):+.1%}..{max(qs):+.1%}" if qs else "n/a")
            out["best_baseline"] = min(("fixed", "follow", "ramp"),
                                       key=lambda k: point[k] if math.isfinite(point[k])
                                       else math.inf)
            out["phases"] = len(plan.phases)
            out["b_noise_range"] = (f"{segs[0].b_noise:.0f}-{segs[-1].b_noise:.0f}")
            out["_schedules"] = {name: [float(ct.batch[c]) for c in choice]
                                 for name, choice in arms.items() if choice is not None}
            out["_tokens"] = [s.start_tokens for s in segs]
            out["_plan"] = plan.to_dict()
    low, high = sorted((gains[0.5], gains[2.0]))
    out["gain_law_x0.5_x2"] = f"{low:+.1%}..{high:+.1%}"
    out["verdict"] = _verdict(out)
    return out


def _verdict(row: dict[str, Any]) -> str:
    if row["gain"] >= COPUS_GAIN:
        return f"pays: {row['gain']:+.1%} over {row['best_baseline']}"
    if row["oracle_gain"] < COPUS_GAIN:
        return (f"cannot pay: even free switches to the best config of every stretch gain "
                f"only {row['oracle_gain']:+.1%} (one config is near-best at every B_noise)")
    if row["bound_gain"] < COPUS_GAIN:
        return (f"cannot pay: the exact schedule gains {row['bound_gain']:+.1%} once "
                f"switches cost (free switches would gain {row['oracle_gain']:+.1%})")
    return (f"plan short of the bound: {row['gain']:+.1%} vs {row['bound_gain']:+.1%} "
            "(the switch threshold holds it back)")


def _plots(rows: list[dict[str, Any]], out_dir: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])
    fig, ax = plt.subplots(figsize=(7, 4))
    for (model, hw), group in frame.groupby(["model", "hardware"]):
        group = group.sort_values("gpus")
        ax.plot(group["gpus"], 100 * group["gain"], marker="o", label=f"{model} {hw} plan")
        ax.plot(group["gpus"], 100 * group["bound_gain"], ls=":", color=ax.lines[-1].get_color())
    ax.axhline(100 * COPUS_GAIN, color="grey", ls="--", lw=0.8, label="COPUS 3.9%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("gain over best of (a)-(c), % (dotted: exact bound)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    gain_path = out_dir / "gain_vs_gpus.png"
    fig.savefig(gain_path, dpi=120)
    figs = [("gain_vs_gpus.png", fig)]
    pick = max(rows, key=lambda r: r["gain"])
    fig2, ax2 = plt.subplots(figsize=(7, 4))
    for name, batches in pick["_schedules"].items():
        ax2.step(pick["_tokens"], batches, where="post", label=name)
    ax2.set_xscale("log")
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("tokens (minimal-batch progress)")
    ax2.set_ylabel("global batch (sequences)")
    ax2.set_title(f"{pick['model']} on {pick['gpus']} {pick['hardware']}", fontsize=9)
    ax2.legend(fontsize=7)
    fig2.tight_layout()
    fig2.savefig(out_dir / "schedule_over_tokens.png", dpi=120)
    figs.append(("schedule_over_tokens.png", fig2))
    return figs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="public GPU measurements directory")
    parser.add_argument("--law", default="kaplan2020")
    parser.add_argument("--models", default="llama3-8b,llama3-70b")
    parser.add_argument("--gpus", default="64,256,1024,4096")
    parser.add_argument("--hardware", default="H100,A100")
    parser.add_argument("--reconfig-cost-s", type=float, default=600.0)
    parser.add_argument("--segments", type=int, default=32)
    parser.add_argument("--n-estimators", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("out/trace_goodput"))
    add_no_track_argument(parser)
    args = parser.parse_args()

    from _public import public_data_dir

    from paratune.models import PerformanceModel, load_measurements

    data = public_data_dir(args.data)
    start = time.perf_counter()
    frame = load_measurements([data / "ultrascale_playbook_h100.csv",
                               data / "ultrascale_playbook_h100_failed.csv",
                               data / "vtrain_a100_single_node.csv"])
    predictor = PerformanceModel(n_estimators=args.n_estimators, n_jobs=1).fit(frame)
    rows = []
    for model in args.models.split(","):
        for hardware in args.hardware.split(","):
            for gpus in (int(g) for g in args.gpus.split(",")):
                rows.append(run_cell(predictor, model, gpus, hardware, args.law,
                                     reconfig_cost_s=args.reconfig_cost_s,
                                     segments=args.segments))
                r = rows[-1]
                print(f"{model} {gpus}x{hardware}: plan {r['plan_h']:.4g} h, gain "
                      f"{r['gain']:+.2%} (bound {r['bound_gain']:+.2%}); {r['verdict']}",
                      flush=True)
    shown = [{k: v for k, v in r.items() if not k.startswith("_") and k != "verdict"}
             for r in rows]
    print()
    print(format_table(shown, title=f"time to target (hours), law {args.law}, reconfiguration "
                                    f"{args.reconfig_cost_s:g} s", floatfmt=".4g"))
    print()
    for r in rows:
        print(f"{r['model']} {r['gpus']}x{r['hardware']}: {r['verdict']}")
    print(f"\n{time.perf_counter() - start:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])
    table.to_csv(args.out / "trace_goodput.csv", index=False)
    figs = _plots(rows, args.out)
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "law": args.law, "models": args.models, "gpus": args.gpus,
                "hardware": args.hardware, "reconfig_cost_s": args.reconfig_cost_s,
                "segments": args.segments, "n_estimators": args.n_estimators}) as run:
            for r in rows:
                tag = f"{r['model']}_{r['gpus']}_{r['hardware']}"
                run.log_metrics({f"gain_{tag}": r["gain"], f"bound_gain_{tag}": r["bound_gain"],
                                 f"plan_h_{tag}": r["plan_h"]})
            run.log_table(table, "trace_goodput.json")
            for name, fig in figs:
                run.log_figure(fig, name)
            run.log_dict([r["_plan"] for r in rows], "plans.json")


if __name__ == "__main__":
    main()
