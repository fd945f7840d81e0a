"""Time to a target loss: co-tuning batch size and parallelism against tuning either alone.

Real training of a small Llama-style model on the standard library's source text (byte
level) with four gloo processes on this machine, to a fixed validation loss, in four arms:

1. ``fixed``: the fixed (global batch, parallelism) with the best predicted time to target;
2. ``batch``: global batch follows the B_noise measured online, parallelism fixed;
3. ``coadapt``: global batch follows B_noise and the parallelism is re-tuned (the fastest
   measured layout for each batch) whenever the batch changes;
4. ``plan``: the phases of :func:`paratune.tuner._plan.plan_phases` (what ``paratune plan``
   prints) computed from a pilot run's B_noise trajectory.

Step times of the configs the runs use are measured first on this machine, keyed by the full
config and by whether the run measures the noise scale: the plain config of every (layout,
batch), which the fixed and plan arms run and the plan chooses from (a measured-table
predictor instead of a fitted model), and the noise-measuring config of every (layout,
batch), timed with the meter's step (in ``accumulate`` mode two chunks of half the batch,
one reduction each), which the pilot and the batch and coadapt arms run and coadapt chooses
its layouts by. Switches go through ``torch.distributed.checkpoint`` and their cost counts in
the wall time; evaluation does not. Arms are interleaved seed by seed so drifting machine
load hits all of them alike. The plan arm needs the pilot run: its wall time is reported
with the plan arm (``pilot_s``, ``time_with_pilot_mean_s``).

``--out`` is bound to the settings its measurements were made with (``settings.json``, from
the first measurement on): a rerun into it with another ``--target``, ``--lr``, ``--batches``,
``--pilot-batch``, ... is refused, naming the setting, instead of reusing runs measured under
the old one. Values no run can use are refused before anything is written. Every measurement is
kept there as soon as it is made (each profiled step time and switch cost in
``profile.jsonl``, each finished run in ``runs.jsonl``): a killed experiment, rerun with the
same command, measures only what is missing. One experiment at a time may use an ``--out``.

Run: ``python experiments/time_to_target.py`` (``--help`` for options). Prints the table of
time and steps to target per arm (mean and spread over seeds) and logs everything to MLflow
(experiment ``paratune-experiments``, run ``time_to_target``): the table, every run's curve,
the B_noise trajectories, the plan and the plots (unless ``--no-mlflow``); the tables and
plots are also written under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pandas as pd

from paratune.cli import at_least
from paratune.fileio import atomic_write_text, exclusive_lock, read_jsonl
from paratune.predictor import (
    PRED_FEASIBLE_PROB,
    PRED_PEAK_MEM_GB,
    PRED_STEP_TIME_S,
    PRED_TOKENS_PER_SEC_PER_GPU,
)
from paratune.spec import get_model
from paratune.table import format_table
from paratune.tracking import add_no_track_argument

ARMS = ("fixed", "batch", "coadapt", "plan")


# Columns of the two printed views of the summary (summary.csv holds every column).
WALL_COLUMNS = {"arm": "arm", "runs": "runs", "reached": "reached", "time_mean_s": "time_s",
                "time_std_s": "std", "steps_mean": "steps", "switches_mean": "switches",
                "gain_vs_best_baseline_pct": "gain_%", "time_with_pilot_mean_s": "+pilot_s",
                "gain_with_pilot_pct": "+pilot gain_%"}
MODELLED_COLUMNS = {"arm": "arm", "modelled_mean_s": "modelled_s", "modelled_std_s": "std",
                    "modelled_gain_pct": "gain_%",
                    "modelled_with_pilot_mean_s": "+pilot_s",
                    "modelled_gain_with_pilot_pct": "+pilot gain_%"}

WORLD_SIZE = 4
"""The gloo processes every run and profiling uses."""

SETTINGS_VERSION = 3
"""Version of ``settings.json`` and of the profile table (2: rows keyed by config and
``measure``). The measurement journal ``profile.jsonl`` only adds a file (``profile.json``
keeps its format), so a version-2 folder stays valid and is not refused."""


def step_times(profile: dict[str, Any]) -> dict[tuple[str, bool], float]:
    """Measured step time by (full config key, whether the run measures the noise scale)."""
    from paratune.parallel import ParallelConfig

    return {(ParallelConfig.from_dict(r["config"]).key(), bool(r["measure"])): r["step_time_s"]
            for r in profile["table"]}


class MeasuredPredictor:
    """A predictor that answers from measured step times of the plain (not noise-measuring)
    configs profiled here: those the fixed and plan arms run."""

    def __init__(self, table: list[dict[str, Any]], seq_len: int) -> None:
        self.seq_len = seq_len
        self.times = {key: t for (key, measure), t in step_times({"table": table}).items()
                      if not measure}

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        from paratune.parallel import ParallelConfig
        from paratune.predictor import PARALLEL_COLUMNS

        rows = []
        for record in frame[list(PARALLEL_COLUMNS)].to_dict("records"):
            key = ParallelConfig.from_dict(record).key()
            step = self.times.get(key, math.nan)
            world = record["dp"] * record["tp"] * record["pp"]
            tokens = record["global_batch_size"] * self.seq_len / step / world
            rows.append({PRED_STEP_TIME_S: step, PRED_TOKENS_PER_SEC_PER_GPU: tokens,
                         PRED_FEASIBLE_PROB: 1.0 if math.isfinite(step) else 0.0,
                         PRED_PEAK_MEM_GB: 0.1})
        return pd.DataFrame(rows, index=frame.index)


def _spawn(job: Any) -> None:
    from _ttt_worker import worker

    from paratune.profiler.gns import spawn

    spawn(worker, WORLD_SIZE, job)


def _pilot_loss_at(curve: list[dict[str, Any]], tokens: float) -> float:
    xs = np.array([c["tokens"] for c in curve], dtype=float)
    ys = np.array([c["val_loss"] for c in curve], dtype=float)
    return float(np.interp(tokens, xs, ys))


def make_plan(profile: dict[str, Any], pilot: dict[str, Any], model: Any, batches: list[int],
              out: Path) -> dict[str, Any]:
    """The arms' settings from the measured table and the pilot run."""
    from _ttt_worker import LAYOUTS

    from paratune.space import ConfigSpace
    from paratune.tuner import Objective, SearchSpace, plan_phases
    from paratune.tuner.gns_trajectory import load_trajectory

    predictor = MeasuredPredictor(profile["table"], model.seq_len)
    trajectory_path = out / "pilot_trajectory.csv"
    pd.DataFrame(pilot["gns"]).to_csv(trajectory_path, index=False)
    trajectory = load_trajectory(trajectory_path, smooth=5)
    space = SearchSpace.build(
        model, 4, "cpu", global_batch_sizes=batches,
        space=ConfigSpace(global_batch_sizes=tuple(batches),
                          micro_batch_sizes=tuple(sorted({b // d for b in batches
                                                          for d in (1, 2, 4)} - {0})),
                          schedules=("1f1b",), shardings=("none", "zero2"),
                          recomputes=("none",), tp_degrees=(1, 2), pp_degrees=(1, 2)))
    switch_s = float(np.mean([c["total_s"] for c in profile["switch_costs"]]))
    plan = plan_phases(predictor, space, trajectory, reconfig_cost_s=switch_s,
                       batch_change_cost_s=switch_s, threshold=0.05, max_segments=16,
                       objective=Objective(memory_limit_gb=1e6))
    print(plan.table())
    phases = [{**p, "start_loss": _pilot_loss_at(pilot["curve"], p["start_tokens"])}
              for p in plan.phases]
    phases[0]["start_loss"] = math.inf
    times = measuring_times(profile, model, batches)
    best_layout = best_layouts(times, batches)

    def follow_time(layout: str) -> float:
        total = 0.0
        for seg in plan.segments:
            b = min(batches, key=lambda x: abs(math.log(x) - math.log(seg.b_noise)))
            if (layout, b) not in times:
                return math.inf
            total += seg.e_min * (1 + b / seg.b_noise) / b * times[(layout, b)]
        return total

    follow_layout = min(LAYOUTS, key=follow_time)
    fixed = plan.baselines["fixed"]["config"]
    settings = {"plan": plan.to_dict(), "phases": phases, "best_layout": best_layout,
                "follow_layout": follow_layout, "fixed_config": fixed,
                "switch_cost_s": switch_s,
                "predicted_follow_layout_s": {lay: follow_time(lay) for lay in LAYOUTS}}
    atomic_write_text(out / "plan.json", json.dumps(settings, indent=1, default=str))
    return settings


def measuring_times(profile: dict[str, Any], model: Any, batches: list[int]
                    ) -> dict[tuple[str, int], float]:
    """Step time of the noise-measuring run of each usable (layout, batch): the config
    :func:`measured_config_for` gives (what the batch and coadapt arms run), timed with the
    meter's step; (layout, batch) pairs a measuring run cannot use are absent."""
    from _ttt_worker import LAYOUTS, measured_config_for

    times = step_times(profile)
    usable = {}
    for layout in LAYOUTS:
        for b in batches:
            config = measured_config_for(model, layout, b)
            if config is not None and (config.key(), True) in times:
                usable[(layout, b)] = times[(config.key(), True)]
    return usable


def best_layouts(times: dict[tuple[str, int], float], batches: list[int]) -> dict[int, str]:
    """The fastest layout at each batch by ``times`` ((layout, batch) -> step time)."""
    best = {}
    for b in batches:
        candidates = {lay: t for (lay, batch), t in times.items() if batch == b}
        if candidates:
            best[b] = min(candidates, key=candidates.__getitem__)
    return best


def arm_runs(settings: dict[str, Any], batches: list[int], seeds: list[int]
             ) -> list[dict[str, Any]]:
    specs = {
        "fixed": {"policy": "fixed", "config": settings["fixed_config"]},
        "batch": {"policy": "follow", "batches": batches, "layout": settings["follow_layout"],
                  "best_layout": settings["best_layout"]},
        "coadapt": {"policy": "follow", "batches": batches, "layout": None,
                    "best_layout": settings["best_layout"]},
        "plan": {"policy": "phases", "phases": settings["phases"]},
    }
    runs = []
    for i, seed in enumerate(seeds):
        order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]  # rotate against load drift
        runs += [{"name": f"{arm}-seed{seed}", "arm": arm, "seed": seed, **specs[arm]}
                 for arm in order]
    return runs


def modelled_time(run: dict[str, Any], profile: dict[str, Any], *,
                  require_reached: bool = True) -> float:
    """Time to target with the load taken out: each stretch of steps priced at the profiled
    step time of the config it ran under (full key, noise-measuring or not), plus the mean
    measured switch cost. ``require_reached=False`` prices a run that stopped short (the
    pilot's cost)."""
    if require_reached and not run["reached"]:
        return math.nan
    times = step_times(profile)
    switch_s = float(np.mean([c["total_s"] for c in profile["switch_costs"]]))
    curve = run["curve"]
    total = run["num_switches"] * switch_s
    for prev, cur in itertools.pairwise(curve):
        total += (cur["step"] - prev["step"]) * times.get((cur["config"], bool(cur["measure"])),
                                                          math.nan)
    return total


def pilot_cost(pilot: dict[str, Any], profile: dict[str, Any]) -> dict[str, float]:
    """What the pilot run the plan is computed from cost: its wall time (evaluation
    excluded, like the arms') and its modelled time, whether or not it reached the target."""
    return {"pilot_s": float(pilot["curve"][-1]["time_s"]),
            "pilot_modelled_s": modelled_time(pilot, profile, require_reached=False)}


def summarise(results: list[dict[str, Any]], profile: dict[str, Any],
              pilot: dict[str, Any]) -> pd.DataFrame:
    """Per arm: time and steps to target. The plan arm needs the pilot run, so its row also
    carries the pilot's cost (``pilot_s``) and the totals with it (``*_with_pilot_*``); the
    other arms need no pilot (0)."""
    cost = pilot_cost(pilot, profile)
    rows = []
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        t = np.array([r["time_s"] for r in mine], dtype=float)
        m = np.array([modelled_time(r, profile) for r in mine], dtype=float)
        s = np.array([r["steps"] for r in mine], dtype=float)
        ok = np.isfinite(t)
        pilot_s = cost["pilot_s"] if arm == "plan" else 0.0
        pilot_m = cost["pilot_modelled_s"] if arm == "plan" else 0.0
        rows.append({"arm": arm, "runs": len(mine), "reached": int(ok.sum()),
                     "pilot_s": pilot_s, "pilot_modelled_s": pilot_m,
                     "time_with_pilot_mean_s": (float(np.mean(t[ok])) + pilot_s if ok.any()
                                                else math.nan),
                     "modelled_with_pilot_mean_s": (float(np.mean(m[ok])) + pilot_m
                                                    if ok.any() else math.nan),
                     "time_mean_s": float(np.mean(t[ok])) if ok.any() else math.nan,
                     "time_std_s": float(np.std(t[ok], ddof=1)) if ok.sum() > 1 else math.nan,
                     "time_min_s": float(np.min(t[ok])) if ok.any() else math.nan,
                     "time_max_s": float(np.max(t[ok])) if ok.any() else math.nan,
                     "modelled_mean_s": float(np.mean(m[ok])) if ok.any() else math.nan,
                     "modelled_std_s": float(np.std(m[ok], ddof=1)) if ok.sum() > 1 else math.nan,
                     "steps_mean": float(np.mean(s[ok])) if ok.any() else math.nan,
                     "steps_std": float(np.std(s[ok], ddof=1)) if ok.sum() > 1 else math.nan,
                     "switches_mean": float(np.mean([r["num_switches"] for r in mine])),
                     "switch_s_mean": float(np.mean([r["switch_s"] for r in mine]))})
    frame = pd.DataFrame(rows)
    best_baseline = frame[frame["arm"].isin(["fixed", "batch"])]["time_mean_s"].min()
    frame["gain_vs_best_baseline_pct"] = 100 * (1 - frame["time_mean_s"] / best_baseline)
    best_modelled = frame[frame["arm"].isin(["fixed", "batch"])]["modelled_mean_s"].min()
    frame["modelled_gain_pct"] = 100 * (1 - frame["modelled_mean_s"] / best_modelled)
    frame["gain_with_pilot_pct"] = 100 * (1 - frame["time_with_pilot_mean_s"] / best_baseline)
    frame["modelled_gain_with_pilot_pct"] = 100 * (1 - frame["modelled_with_pilot_mean_s"]
                                                   / best_modelled)
    return frame


def experiment_settings(args: argparse.Namespace, model: Any, batches: list[int],
                        job_fields: dict[str, Any]) -> dict[str, Any]:
    """What the runs journaled under ``--out`` depend on (seeds are not: more seeds add
    runs). JSON-normalised."""
    settings = {"version": SETTINGS_VERSION, "model": model.to_dict(), "target": args.target,
                "lr": args.lr, "batches": batches, "pilot_batch": args.pilot_batch,
                "eval_every_tokens": args.eval_every_tokens, "max_tokens": args.max_tokens,
                "corpus_mb": args.corpus_mb, **job_fields}
    return json.loads(json.dumps(settings))


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Bind ``out`` to ``settings``: record them until something is measured; then refuse to
    continue into the directory with other settings, naming the first that differs.

    Raises:
        ConfigError: a setting differs from the recorded one, or ``out`` holds runs or a
            profile (whole or partial) from before settings were recorded (nothing is
            changed either way).
    """
    from _ttt_worker import PROFILE_JOURNAL

    from paratune.errors import ConfigError

    path = out / "settings.json"
    measured = [name for name in ("runs.jsonl", "profile.json", PROFILE_JOURNAL)
                if (out / name).exists()]
    if not path.exists() and measured:
        raise ConfigError("out", str(out), f"holds {' and '.join(measured)} measured before "
                          "their settings were recorded (settings.json), so they cannot be "
                          "matched to this run's; use another --out or empty this one")
    if not measured:
        # nothing measured yet (a first run, or one that ended before its first
        # measurement): these settings are the ones its measurements will be made with
        atomic_write_text(path, json.dumps(settings, indent=1))
        return
    recorded = json.loads(path.read_text())
    for name in [*settings, *(n for n in recorded if n not in settings)]:
        if settings.get(name) != recorded.get(name):
            raise ConfigError(name, settings.get(name), f"differs from {recorded.get(name)!r}, "
                              f"the value the runs in {out} were measured with; use another "
                              "--out (or empty this one) to measure with the new value")


def plots(results: list[dict[str, Any]], pilot: dict[str, Any], out: Path, target: float
          ) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    figures = {}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        curve = pd.DataFrame(r["curve"])
        label = r["arm"] if r["seed"] == min(x["seed"] for x in results) else None
        axes[0].plot(curve["time_s"], curve["val_loss"], color=colours[r["arm"]], alpha=0.7,
                     label=label)
        axes[1].plot(curve["step"], curve["val_loss"], color=colours[r["arm"]], alpha=0.7,
                     label=label)
    for ax, xlabel in zip(axes, ("wall time (s, evaluation excluded)", "optimizer steps")):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.legend()
    fig.tight_layout()
    figures["loss_vs_time.png"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    gns = pd.DataFrame(pilot["gns"])
    axes[0].plot(gns["tokens"], gns["b_simple"], color="black", label="pilot (fixed batch)")
    for r in results:
        if r["gns"]:
            g = pd.DataFrame(r["gns"])
            axes[0].plot(g["tokens"], g["b_simple"], color=colours[r["arm"]], alpha=0.5,
                         label=r["arm"] if r["seed"] == min(x["seed"] for x in results)
                         else None)
        curve = pd.DataFrame(r["curve"])
        axes[1].step(curve["tokens"], curve["batch"], where="post", color=colours[r["arm"]],
                     alpha=0.6)
    axes[0].set_xlabel("tokens")
    axes[0].set_ylabel("B_simple (sequences)")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[1].set_xlabel("tokens")
    axes[1].set_ylabel("global batch (sequences)")
    axes[1].set_yscale("log", base=2)
    fig.tight_layout()
    figures["b_noise_and_batch.png"] = fig
    for name, figure in figures.items():
        figure.savefig(out / name, dpi=110)
    return figures


def _integers(minimum: int):
    """An argparse ``type``: comma-separated integers no smaller than ``minimum``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated integers >= {minimum}, not {text!r}")
        return values

    return parse


def main(argv: list[str] | None = None) -> int:
    from _ttt_worker import LAYOUTS, Job, config_for

    from paratune.errors import ConfigError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/time_to_target"),
                        help="folder of the journaled runs, tables and plots "
                             "(default: %(default)s)")
    parser.add_argument("--seeds", type=_integers(0), default=[0, 1, 2],
                        help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--target", type=at_least(1e-9, float), default=2.0,
                        help="validation loss to reach")
    parser.add_argument("--lr", type=at_least(1e-12, float), default=2e-3)
    parser.add_argument("--batches", type=_integers(1), default=[4, 8, 16, 32, 64],
                        help="comma-separated global batch sizes (default: 4,8,16,32,64)")
    parser.add_argument("--pilot-batch", type=at_least(1), default=16)
    parser.add_argument("--lr-rule", choices=("sqrt", "linear", "none"), default="sqrt",
                        help="how the learning rate follows the batch: --lr at --lr-base-batch, "
                             "scaled by sqrt (Adam's rule, default), linearly, or not")
    parser.add_argument("--lr-base-batch", type=at_least(1), default=16,
                        help="global batch at which --lr holds (default: %(default)s)")
    parser.add_argument("--gns-every", type=at_least(1), default=4,
                        help="measure the noise scale on every K-th step (default: "
                             "%(default)s)")
    parser.add_argument("--eval-every-tokens", type=at_least(1), default=4096)
    parser.add_argument("--max-tokens", type=at_least(1), default=3_000_000)
    parser.add_argument("--corpus-mb", type=at_least(1e-3, float), default=4.0)
    add_no_track_argument(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seeds = args.seeds
    batches = sorted(args.batches)
    model = get_model("tiny").replace(name="tiny-text", num_layers=2, hidden_size=64,
                                      num_heads=4, num_kv_heads=2, ffn_hidden_size=176,
                                      seq_len=64)
    # every layout runs every batch (and the pilot's dp4 its batch): refused here, before a
    # process starts, rather than by a worker part-way through the profiling
    for flag, values, layouts in (("--batches", batches, LAYOUTS),
                                  ("--pilot-batch", [args.pilot_batch], ["dp4"])):
        for batch, layout in itertools.product(values, layouts):
            try:
                config_for(layout, batch).validate(model, WORLD_SIZE)
            except ConfigError as error:
                parser.error(f"argument {flag}: {batch} cannot run on the {layout} layout "
                             f"of {WORLD_SIZE} processes: {error}")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    base = dict(model=model, out_dir=str(out), target_loss=args.target, lr=args.lr,
                corpus_bytes=int(args.corpus_mb * (1 << 20)), val_seqs=64,
                eval_every_tokens=args.eval_every_tokens, max_tokens=args.max_tokens,
                batches=batches, gns_beta=0.9, lr_rule=args.lr_rule,
                lr_base_batch=args.lr_base_batch, gns_every=args.gns_every)

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(exclusive_lock(
                out / "experiment.lock", field="out", value=str(out),
                what="running the time-to-target experiment into it"))
            check_settings(out, experiment_settings(
                args, model, batches, {"val_seqs": base["val_seqs"],
                                       "gns_beta": base["gns_beta"],
                                       "lr_rule": args.lr_rule,
                                       "lr_base_batch": args.lr_base_batch,
                                       "gns_every": args.gns_every,
                                       "profile_steps": Job.profile_steps}))
        except ConfigError as error:
            parser.error(str(error))
        return _run(args, model, batches, seeds, base, out)


def _run(args: argparse.Namespace, model: Any, batches: list[int], seeds: list[int],
         base: dict[str, Any], out: Path) -> int:
    from _ttt_worker import Job, config_for

    started = time.perf_counter()

    # 1. Step times of every (layout, batch), switch cost, and the pilot's B_noise trajectory
    # (a profiling killed earlier resumes from its journal: only what is missing is measured).
    pilot_run = {"name": "pilot", "arm": "pilot", "seed": 1000, "policy": "fixed",
                 "measure": True, "config": config_for("dp4", args.pilot_batch).to_dict()}
    if not (out / "profile.json").exists() or "pilot" not in {
            r["name"] for r in read_jsonl(out / "runs.jsonl")}:
        _spawn(Job(**base, runs=[pilot_run], profile=not (out / "profile.json").exists()))
    profile = json.loads((out / "profile.json").read_text())
    print(format_table([{k: v for k, v in r.items() if k != "config"}
                        for r in profile["table"]], title="Measured step times (4 gloo ranks)"))
    print(format_table(profile["switch_costs"], title="Switch cost (DCP save, rebuild, load)"))
    pilot = next(r for r in read_jsonl(out / "runs.jsonl") if r["name"] == "pilot")

    # 2. Plan and arm settings.
    settings = make_plan(profile, pilot, model, batches, out)

    # 3. The arms, seed by seed.
    runs = arm_runs(settings, batches, seeds)
    _spawn(Job(**base, runs=runs))
    results = [r for r in read_jsonl(out / "runs.jsonl") if r["arm"] in ARMS
               and r["seed"] in seeds]
    summary = summarise(results, profile, pilot)
    # Two narrower views of the summary (summary.csv holds every column).
    print(format_table(summary.to_dict("records"), list(WALL_COLUMNS), headers=WALL_COLUMNS,
                       title=f"Wall time and steps to validation loss {args.target} (mean, "
                             f"std over seeds {seeds}; gain: vs the better of fixed and "
                             "batch; +pilot: with the pilot run the plan arm needs)",
                       floatfmt=".4g"))
    print(format_table(summary.to_dict("records"), list(MODELLED_COLUMNS),
                       headers=MODELLED_COLUMNS,
                       title="Modelled time to target (each config's steps priced at its "
                             "profiled step time, plus the mean switch cost)",
                       floatfmt=".4g"))
    cost = pilot_cost(pilot, profile)
    per_run = pd.DataFrame([{**{k: r[k] for k in ("name", "arm", "seed", "reached", "time_s",
                                                   "steps", "tokens", "num_switches",
                                                   "switch_s")},
                             "modelled_s": modelled_time(r, profile),
                             "pilot_s": cost["pilot_s"] if r["arm"] == "plan" else 0.0}
                            for r in results])
    print(f"pilot run (needed by the plan arm, charged to it in the +pilot columns): "
          f"{cost['pilot_s']:.1f} s wall, {cost['pilot_modelled_s']:.1f} s modelled")
    print(format_table(per_run.to_dict("records"), title="Runs", floatfmt=".4g"))
    figures = plots(results, pilot, out, args.target)
    summary.to_csv(out / "summary.csv", index=False)
    per_run.to_csv(out / "runs.csv", index=False)
    print(f"experiment wall time: {time.perf_counter() - started:.0f} s")
    if not args.no_mlflow:
        from paratune.tracking import start_script_run

        with start_script_run(__file__, params={
                "model": model.name, "model_spec": model.to_dict(), "target_loss": args.target,
                "lr": args.lr, "lr_rule": args.lr_rule, "lr_base_batch": args.lr_base_batch,
                "gns_every": args.gns_every, "batches": batches, "seeds": seeds,
                "world_sizes": [4],
                "hardware": "cpu", "backend": "gloo",
                "fixed_config": settings["fixed_config"],
                "follow_layout": settings["follow_layout"],
                "best_layout": settings["best_layout"],
                "switch_cost_s": settings["switch_cost_s"],
                "pilot_batch": args.pilot_batch, "pilot_s": cost["pilot_s"]}) as run:
            for row in summary.to_dict("records"):
                run.log_metrics({f"{row['arm']}_{k}": v for k, v in row.items()
                                 if k != "arm"})
            run.log_table(summary, "summary.csv")
            run.log_table(per_run, "runs.csv")
            run.log_table(pd.DataFrame(pilot["gns"]), "b_noise/pilot.csv")
            for r in results:
                run.log_table(pd.DataFrame(r["curve"]), f"curves/{r['name']}.csv")
                if r["gns"]:
                    run.log_table(pd.DataFrame(r["gns"]), f"b_noise/{r['name']}.csv")
            run.log_table(pd.DataFrame(profile["table"]).drop(columns="config"),
                          "step_times.csv")
            run.log_dict(settings, "plan.json")
            for name, figure in figures.items():
                run.log_figure(figure, name)
        print(f"MLflow run {run.run_id}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # Profiled measurements and finished runs are journaled under --out: a rerun resumes.
        print("interrupted; the step times and switch costs measured and the runs already "
              "finished are kept under --out: run the same command again to resume",
              file=sys.stderr)
        sys.exit(130)
