"""Training-phase plans: batch size and parallelism that follow the gradient noise scale.

The gradient noise scale grows as the loss falls, so the statistically best batch grows
during training, and with the batch the throughput-optimal parallelism can change. Given a
``B_noise`` trajectory measured on a reference run, a plan splits training into phases
with their own (global batch, parallelism, micro-batch), switching only where the predicted
gain pays for the reconfiguration.

Progress is counted in McCandlish et al.'s "minimal examples" ``E_min``: a stretch of the
reference run that processed ``dE_ref`` sequences at batch ``B_ref`` with noise scale
``B_noise`` holds ``dE_min = dE_ref / (1 + B_ref / B_noise)``; covering it at batch ``B``
takes ``dE_min (1 + B / B_noise) / B`` steps (McCandlish et al. 2018, eq. 2.11-2.12).

Units: the trajectory's ``b_simple`` is in sequences of the run that measured it. The noise
scale is assumed to be a number of tokens (an example is a token), so the reference run's
batch, progress and ``B_noise`` are first taken in tokens (with the measuring run's
``seq_len``) and then expressed in sequences of the planned model's ``seq_len``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.batch import ConfigBatch
from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.predictor import Predictor, throughput_quantile_columns
from paratune.table import format_table
from paratune.tuner._efficiency import lr_scale
from paratune.tuner._objective import Objective
from paratune.tuner._plan_progress import (
    Segment,
    default_batch_range,
    effective_b_noise,
    progress_segments,
    smallest_busy_batch,
)
from paratune.tuner._plan_schedule import (
    DEFAULT_BASE_LR,
    ScheduleOptions,
    check_plan_options,
    follow_critical,
    layout_key,
    optimal_schedule,
)
from paratune.tuner._search import evaluate, rank
from paratune.tuner.gns_trajectory import Trajectory

if TYPE_CHECKING:
    import pandas as pd

    from paratune.tuner._space import SearchSpace


__all__ = [
    "DEFAULT_BASE_LR",
    "ConfigTimes",
    "Plan",
    "ScheduleOptions",
    "Segment",
    "check_plan_options",
    "config_times",
    "default_batch_range",
    "effective_b_noise",
    "plan_phases",
    "predict_configs",
    "progress_segments",
    "smallest_busy_batch",
]


def _interp_loss(trajectory: Trajectory, tokens: float) -> float:
    loss = np.asarray(trajectory.loss, dtype=float)
    known = np.isfinite(loss)
    if not known.any():
        return math.nan
    return float(np.interp(tokens, np.asarray(trajectory.tokens, dtype=float)[known],
                           loss[known]))



@dataclass
class Plan:
    """Phases of training and their predicted time, against two baselines."""

    phases: list[dict[str, Any]]
    """One mapping per phase: start/end tokens of the reference run, ``B_noise`` range (in
    sequences of the planned model), the config, its step time and tokens/s (the tuner's
    ranked throughput: expected, or the objective's risk quantile, without the probability
    of running, which ``tune`` multiplies it by), the phase's predicted
    seconds, and ``segment_range``: the stretches of :attr:`segments` it covers
    (``[first, stop)``)."""
    total_time_s: float
    """Predicted seconds to the target (the reference run's final loss), switches included."""
    num_switches: int
    baselines: dict[str, dict[str, Any]]
    """``fixed``: one batch with its best parallelism for the whole run; ``follow_critical``:
    the batch tracks ``B_noise`` (nearest candidate) with one fixed parallelism, each batch
    change charged ``batch_change_cost_s``. Each has ``time_s`` (switches included),
    ``num_switches`` and ``switch_time_s``."""
    segments: list[Segment] = field(default_factory=list)
    reconfig_cost_s: float = 0.0
    threshold: float = 0.0
    batch_change_cost_s: float = 0.0
    switches: list[dict[str, Any]] = field(default_factory=list)
    """One mapping per switch of the plan: ``at_tokens`` (reference-run tokens where it
    happens), ``at_run_tokens`` (tokens the planned run has processed there), ``from`` and
    ``to`` (config keys), ``kind`` (``"layout"``: the parallelism changes, charged
    ``reconfig_cost_s``; ``"batch"``: the global batch alone changes, charged
    ``batch_change_cost_s``) and ``cost_s``."""
    lr_rule: str = "sqrt"
    """How the learning rate follows the batch (:func:`~paratune.tuner.lr_scale`)."""
    base_lr: float = DEFAULT_BASE_LR
    """Learning rate at ``base_batch``."""
    base_batch: float = 0.0
    """Batch at which ``base_lr`` holds."""
    time_interval_s: tuple[float, float] | None = None
    """Seconds to target of the plan's schedule at the predictor's q10 and q90 throughput
    (slow end first), where the predictor gives those quantiles."""
    source: str = ""
    """Where ``B_noise`` came from (trajectory file or law)."""

    def speedup(self, baseline: str) -> float:
        other = self.baselines[baseline]["time_s"]
        return other / self.total_time_s if self.total_time_s > 0 else math.nan

    def table(self) -> str:
        rows = []
        for i, phase in enumerate(self.phases, 1):
            cfg = phase["config"]
            rows.append({"phase": i, "run_tokens": f"{phase['run_start_tokens']:.3g}-"
                                                   f"{phase['run_end_tokens']:.3g}",
                         "loss": f"{phase['start_loss']:.3f}-{phase['end_loss']:.3f}",
                         "B_noise": f"{phase['b_noise_min']:.4g}-{phase['b_noise_max']:.4g}",
                         "gbs": cfg["global_batch_size"],
                         "dp/tp/pp": f"{cfg['dp']}/{cfg['tp']}/{cfg['pp']}",
                         "mbs": cfg["micro_batch_size"], "schedule": cfg["schedule"],
                         "sharding": cfg["sharding"], "recompute": cfg["recompute"],
                         "lr": phase["lr"], "step_s": phase["step_time_s"],
                         "hours": phase["time_s"] / 3600, "ends_h": phase["end_time_s"] / 3600})
        lines = [format_table(rows, title="Training phases", floatfmt=".4g"), ""]
        interval = ""
        if self.time_interval_s is not None:
            lo, hi = sorted(self.time_interval_s)
            interval = f" (q10-q90 throughput: {lo / 3600:.4g}-{hi / 3600:.4g} h)"
        lines.append(f"plan: {self.total_time_s / 3600:.4g} h to target{interval}, "
                     f"{_describe_switches(self.switches, self.num_switches)}")
        lines.append(f"learning rate: {self.lr_rule} rule, {self.base_lr:.3g} at batch "
                     f"{self.base_batch:g}")
        for name, base in self.baselines.items():
            lines.append(f"{name}: {base['time_s'] / 3600:.4g} h ({base['describe']}); plan "
                         f"is {self.speedup(name):.3f}x faster")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"phases": self.phases, "total_time_s": self.total_time_s,
                "num_switches": self.num_switches, "switches": self.switches,
                "baselines": self.baselines, "reconfig_cost_s": self.reconfig_cost_s,
                "batch_change_cost_s": self.batch_change_cost_s, "threshold": self.threshold,
                "lr_rule": self.lr_rule, "base_lr": self.base_lr,
                "base_batch": self.base_batch, "source": self.source,
                "time_interval_s": (list(self.time_interval_s)
                                    if self.time_interval_s is not None else None),
                "speedup_vs_fixed": self.speedup("fixed"),
                "speedup_vs_follow_critical": self.speedup("follow_critical")}


def _describe_switches(switches: list[dict[str, Any]], num_switches: int) -> str:
    """``"3 switch(es): 1 layout change at 600 s, 2 batch-only changes at 60 s (720 s)"``."""
    if not num_switches:
        return "no switch"
    parts = []
    for kind, words in (("layout", "layout change"), ("batch", "batch-only change")):
        costs = [sw["cost_s"] for sw in switches if sw["kind"] == kind]
        if costs:
            each = f"{costs[0]:.3g} s" if len(set(costs)) == 1 else "varying cost"
            parts.append(f"{len(costs)} {words}{'s' if len(costs) > 1 else ''} at {each}")
    total = sum(sw["cost_s"] for sw in switches)
    return f"{num_switches} switch(es): {', '.join(parts)} ({total:.3g} s in all)"



def predict_configs(predictor: Predictor, space: SearchSpace,
                    objective: Objective | None = None) -> pd.DataFrame:
    """Every valid config of ``space`` predicted once and ranked, the feasible ones kept.

    The frame :func:`plan_phases` times configs from (pass it as ``ranked`` to plan the same
    space several times, e.g. under several ``B_noise`` trajectories).

    Raises:
        ConfigError: no config is predicted feasible.
    """
    base = objective or Objective()
    scoring = Objective(kind="throughput", risk_quantile=base.risk_quantile,
                        min_feasible_prob=base.min_feasible_prob,
                        memory_limit_gb=base.memory_limit_gb,
                        memory_fraction=base.memory_fraction)
    ranked = rank(evaluate(predictor, space, space.enumerate().valid, scoring))
    # time each config by the throughput the tuner ranks it by (the expected throughput
    # where the predictor gives one, or the risk quantile; a time, so not multiplied by the
    # probability of running as tune's objective is), not by its fast regime: a
    # pipeline likely to stall must not win a phase on its point prediction
    throughput = ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
    runs = ranked["feasible"].to_numpy(dtype=bool) & np.isfinite(throughput) & (throughput > 0)
    ranked = ranked[runs].reset_index(drop=True)
    if ranked.empty:
        raise ConfigError("space", space.model.name, "no config is predicted feasible")
    return ranked


@dataclass
class ConfigTimes:
    """Seconds of every predicted config on every stretch of training."""

    configs: list[ParallelConfig]
    layouts: list[tuple]
    """The layout (config without its global batch) of each config."""
    batch: np.ndarray
    throughput: np.ndarray
    """Cluster tokens/s each config is timed by."""
    step: np.ndarray
    """Step time of each config."""
    times: np.ndarray
    """``[stretch, config]`` seconds: ``E_min (1 + B / B_noise) / B * step``."""
    quantile_times: dict[str, np.ndarray]
    """The same at the predictor's ``q10`` and ``q90`` throughput, where it gives them."""


def config_times(ranked: pd.DataFrame, segments: list[Segment], *, seq_len: int
                 ) -> ConfigTimes:
    """:class:`ConfigTimes` of the configs of :func:`predict_configs` on ``segments``."""
    batch = ranked["global_batch_size"].to_numpy(dtype=float)
    throughput = ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
    step = batch * seq_len / throughput
    e_min = np.array([s.e_min for s in segments])[:, None]
    b_noise = np.array([s.b_noise for s in segments])[:, None]
    steps = e_min * (1.0 + batch[None, :] / b_noise) / batch[None, :]
    quantile_times = {}
    # the lowest and highest throughput quantiles the predictor gives (q10, q90 by default)
    quantiles = throughput_quantile_columns(ranked.columns)
    for q, column in zip(("q10", "q90"), (quantiles[0], quantiles[-1])
                         if len(quantiles) > 1 else (), strict=False):
        q_tps = ranked[column].to_numpy(dtype=float) * ranked["world_size"].to_numpy(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            q_step = np.where(q_tps > 0, batch * seq_len / q_tps, np.nan)
        quantile_times[q] = steps * q_step[None, :]
    configs = ConfigBatch.from_frame(ranked).configs()
    return ConfigTimes(configs=configs, layouts=[layout_key(c) for c in configs], batch=batch,
                       throughput=throughput, step=step, times=steps * step[None, :],
                       quantile_times=quantile_times)


def plan_phases(predictor: Predictor, space: SearchSpace, trajectory: Trajectory,
                options: ScheduleOptions | None = None, *, objective: Objective | None = None,
                ranked: pd.DataFrame | None = None, **overrides: Any) -> Plan:
    """Schedule (batch, parallelism) over training from a ``B_noise`` trajectory.

    Every feasible config of ``space`` (all its global batch sizes) is predicted once; the
    time of each config on each stretch follows from its step time and the stretch's
    ``B_noise`` (converted from the measuring run's sequences to ``space.model.seq_len``;
    see :func:`progress_segments`). The step time is that of the throughput
    :func:`~paratune.tuner.tune` ranks by, before ``tune`` multiplies it by the probability
    of running: the expected throughput where the predictor gives one (a pipeline that may
    stall counts at its likely speed), or the objective's ``risk_quantile``. The plan chooses
    by predicted time alone among the configs predicted to run, so where two configs are
    nearly as fast it may take one that ``tune`` ranks lower for its risk of failing. The
    schedule is the exact optimum, by dynamic programming over
    (stretch, config), of the time to target plus the switch costs (nothing to keep a
    config, ``batch_change_cost_s`` to change only the batch, ``reconfig_cost_s`` to
    change the layout), among schedules whose every switch gains more than ``threshold``
    on the stretch where it happens. Keeping one config throughout is always allowed, so
    the plan is never slower than the ``fixed`` baseline.

    Args:
        predictor: Fitted predictor.
        space: Space with several global batch sizes.
        trajectory: ``B_noise`` along a reference run, with the run's ``seq_len`` known.
        options: Switch costs, threshold, resolution and learning-rate rule (see
            :class:`ScheduleOptions`; default: its defaults).
        objective: Feasibility settings (memory limit, probability) and the
            ``risk_quantile`` to time configs by; its kind is ignored.
        ranked: The configs of :func:`predict_configs` for ``space`` (predicted here where
            not given).
        **overrides: Fields of :class:`ScheduleOptions` by name (``reconfig_cost_s=60``), over
            ``options``.

    Returns:
        A :class:`Plan`: per phase its tokens (of the reference run and of the planned
        run), loss, ``B_noise``, config, learning rate, step time and seconds; the
        schedule's time at the predictor's q10/q90 throughput where it gives them.

    Raises:
        ConfigError: a cost is negative or not finite, ``threshold < 0``,
            ``max_segments < 1``, no config is predicted feasible, or the trajectory is
            too short or lacks its ``seq_len``; an override is no field of
            :class:`ScheduleOptions` (field ``plan_options``).
    """
    options = _plan_options(options, overrides)
    reconfig_cost_s, batch_change_cost_s = options.reconfig_cost_s, options.batch_change_cost_s
    threshold, max_segments = options.threshold, options.max_segments
    lr_rule, base_lr, base_batch, spacing = (options.lr_rule, options.base_lr,
                                             options.base_batch, options.spacing)
    # unit problems of the trajectory surface before the (slow) prediction
    segments = progress_segments(trajectory, seq_len=space.model.seq_len,
                                 max_segments=max_segments, spacing=spacing)
    if ranked is None:
        ranked = predict_configs(predictor, space, objective)
    ct = config_times(ranked, segments, seq_len=space.model.seq_len)
    layout_ids = {lay: i for i, lay in enumerate(dict.fromkeys(ct.layouts))}
    choice, total = optimal_schedule(ct.times, np.array([layout_ids[lay] for lay in ct.layouts]),
                                     reconfig_cost_s=reconfig_cost_s,
                                     batch_change_cost_s=batch_change_cost_s,
                                     threshold=threshold)
    phases, switches = _phases(choice, ct, segments, reconfig_cost_s=reconfig_cost_s,
                               batch_change_cost_s=batch_change_cost_s)
    first_batch = phases[0]["config"]["global_batch_size"]
    lr = _LearningRate(rule=lr_rule, base_lr=float(base_lr),
                       base_batch=float(first_batch if base_batch is None else base_batch))
    _follow_the_run(phases, switches, segments, ct.batch, trajectory,
                    seq_len=space.model.seq_len, lr=lr)
    interval = None
    if len(ct.quantile_times) == 2:
        switch_total = sum(sw["cost_s"] for sw in switches)
        interval = tuple(float(sum(ct.quantile_times[q][i, c] for i, c in enumerate(choice))
                               + switch_total) for q in ("q10", "q90"))
    if not math.isclose(total, sum(p["time_s"] for p in phases)
                        + sum(sw["cost_s"] for sw in switches), rel_tol=1e-9):
        raise RuntimeError("the plan's phases and switches do not add up to its total time")
    return Plan(phases=phases, total_time_s=total, num_switches=len(switches),
                baselines=_baselines(ct, segments, batch_change_cost_s=batch_change_cost_s),
                segments=segments, reconfig_cost_s=reconfig_cost_s,
                threshold=threshold, batch_change_cost_s=batch_change_cost_s,
                switches=switches, lr_rule=lr.rule, base_lr=lr.base_lr,
                base_batch=lr.base_batch, time_interval_s=interval, source=trajectory.source)


def _plan_options(options: ScheduleOptions | None, overrides: dict[str, Any]) -> ScheduleOptions:
    """``options`` (default: the defaults) with ``overrides`` by field name."""
    base = options if options is not None else ScheduleOptions()
    if not overrides:
        return base
    names = {f.name for f in dataclasses.fields(ScheduleOptions)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError("plan_options", unknown[0], f"is not one of {', '.join(sorted(names))}")
    return dataclasses.replace(base, **overrides)


@dataclass(frozen=True)
class _LearningRate:
    """How a plan's learning rate follows its batch (:func:`~paratune.tuner.lr_scale`)."""

    rule: str
    base_lr: float
    base_batch: float

    def scale(self, batch: float, b_noise: float) -> float:
        return float(lr_scale([batch], self.base_batch, self.rule, b_noise=b_noise)[0])


def _phases(choice: list[int], ct: ConfigTimes, segments: list[Segment], *,
            reconfig_cost_s: float, batch_change_cost_s: float
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The schedule ``choice`` (a config per stretch) as phases (consecutive stretches of one
    config, each with its ``_index`` and ``_segments``) and the switches between them."""
    phases: list[dict[str, Any]] = []
    switches: list[dict[str, Any]] = []
    for i, c in enumerate(choice):
        if phases and phases[-1]["_index"] == c:
            phase = phases[-1]
            phase["end_tokens"] = segments[i].end_tokens
            phase["b_noise_min"] = min(phase["b_noise_min"], segments[i].b_noise)
            phase["b_noise_max"] = max(phase["b_noise_max"], segments[i].b_noise)
            phase["time_s"] += float(ct.times[i, c])
            phase["_segments"].append(i)
            continue
        if phases:
            prev = phases[-1]["_index"]
            kind = "batch" if ct.layouts[prev] == ct.layouts[c] else "layout"
            switches.append({"at_tokens": segments[i].start_tokens,
                             "from": ct.configs[prev].key(), "to": ct.configs[c].key(),
                             "kind": kind, "cost_s": batch_change_cost_s if kind == "batch"
                             else reconfig_cost_s})
        phases.append({"_index": c, "_segments": [i], "start_tokens": segments[i].start_tokens,
                       "end_tokens": segments[i].end_tokens,
                       "b_noise_min": segments[i].b_noise, "b_noise_max": segments[i].b_noise,
                       "config": ct.configs[c].to_dict(), "step_time_s": float(ct.step[c]),
                       "tokens_per_s": float(ct.throughput[c]),
                       "time_s": float(ct.times[i, c])})
    return phases, switches


def _follow_the_run(phases: list[dict[str, Any]], switches: list[dict[str, Any]],
                    segments: list[Segment], batch: np.ndarray, trajectory: Trajectory, *,
                    seq_len: int, lr: _LearningRate) -> None:
    """Fill in what the planned run itself goes through, phase by phase (in place): its
    tokens (``E = E_min (1 + B / B_noise)`` per stretch), steps, ``B_noise``, loss, learning
    rate and clock, and where each switch happens in the run's tokens."""
    run_tokens = 0.0
    clock = 0.0
    switch_at = {sw["at_tokens"]: sw for sw in switches}
    for phase in phases:
        c = phase.pop("_index")
        indices = phase.pop("_segments")
        stretch = [segments[i] for i in indices]
        phase["segment_range"] = [indices[0], indices[-1] + 1]
        e = sum(sg.e_min for sg in stretch)
        b_eff = e / sum(sg.e_min / sg.b_noise for sg in stretch)
        sequences = sum(sg.e_min * (1.0 + batch[c] / sg.b_noise) for sg in stretch)
        sw = switch_at.get(phase["start_tokens"])
        if sw is not None:
            sw["at_run_tokens"] = run_tokens
            clock += sw["cost_s"]
        phase["run_start_tokens"] = run_tokens
        run_tokens += sequences * seq_len
        phase["run_end_tokens"] = run_tokens
        phase["steps"] = math.ceil(sequences / batch[c])
        phase["b_noise"] = float(b_eff)
        phase["start_loss"] = _interp_loss(trajectory, phase["start_tokens"])
        phase["end_loss"] = _interp_loss(trajectory, phase["end_tokens"])
        scale = lr.scale(batch[c], b_eff)
        phase["lr_scale"] = scale
        phase["lr"] = lr.base_lr * scale
        clock += phase["time_s"]
        phase["end_time_s"] = clock


def _baselines(ct: ConfigTimes, segments: list[Segment], *,
               batch_change_cost_s: float) -> dict[str, dict[str, Any]]:
    """The plan's two baselines: the best fixed config, and ``follow_critical``."""
    fixed_totals = ct.times.sum(axis=0)
    best_fixed = int(np.argmin(fixed_totals))
    return {"fixed": {"time_s": float(fixed_totals[best_fixed]),
                      "config": ct.configs[best_fixed].to_dict(), "num_switches": 0,
                      "switch_time_s": 0.0,
                      "describe": f"fixed {ct.configs[best_fixed].key()}"},
            "follow_critical": follow_critical(ct.times, ct.configs, ct.layouts, segments,
                                               ct.batch, batch_change_cost_s=batch_change_cost_s)}
