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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune._table import format_table
from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.predictor import Predictor
from paratune.tuner._objective import Objective
from paratune.tuner._search import config_from_row, evaluate, rank
from paratune.tuner.gns_trajectory import Trajectory

if TYPE_CHECKING:
    from paratune.tuner._space import SearchSpace

__all__ = ["Plan", "effective_b_noise", "plan_phases", "progress_segments"]


@dataclass
class Segment:
    """A stretch of training with one ``B_noise``."""

    start_tokens: float
    end_tokens: float
    b_noise: float
    e_min: float
    """Minimal-batch sequences this stretch is worth."""


def progress_segments(trajectory: Trajectory, *, seq_len: int,
                      max_segments: int = 32) -> list[Segment]:
    """Cut the reference run into at most ``max_segments`` stretches of equal tokens.

    Each interval between trajectory points takes the mean ``B_noise`` of its ends; a
    stretch aggregates its intervals with the ``E_min``-weighted harmonic mean (the value
    that leaves the time of any fixed config unchanged).
    """
    if len(trajectory) < 2:
        raise ConfigError("trajectory", trajectory.source, "needs at least two points")
    b_ref = trajectory.reference_batch_tokens() / seq_len
    tokens = trajectory.tokens
    b_mid = 0.5 * (trajectory.b_noise[1:] + trajectory.b_noise[:-1])
    d_ref = np.diff(tokens) / seq_len
    d_min = d_ref / (1.0 + b_ref / b_mid)
    edges = np.linspace(tokens[0], tokens[-1], min(max_segments, len(d_ref)) + 1)
    which = np.clip(np.searchsorted(edges, 0.5 * (tokens[1:] + tokens[:-1])) - 1, 0,
                    len(edges) - 2)
    segments = []
    for k in range(len(edges) - 1):
        mask = which == k
        if not mask.any() or d_min[mask].sum() <= 0:
            continue
        e_min = float(d_min[mask].sum())
        b_noise = e_min / float((d_min[mask] / b_mid[mask]).sum())
        segments.append(Segment(float(edges[k]), float(edges[k + 1]), b_noise, e_min))
    return segments


def effective_b_noise(trajectory: Trajectory, *, seq_len: int) -> float:
    """The single ``B_noise`` that ranks fixed configs as the whole trajectory does."""
    segs = progress_segments(trajectory, seq_len=seq_len, max_segments=10**9)
    return sum(s.e_min for s in segs) / sum(s.e_min / s.b_noise for s in segs)


@dataclass
class Plan:
    """Phases of training and their predicted time, against two baselines."""

    phases: list[dict[str, Any]]
    """One mapping per phase: start/end tokens of the reference run, ``B_noise`` range,
    the config, its step time and tokens/s (as the tuner ranks configs: expected, or the
    objective's risk quantile) and the phase's predicted seconds."""
    total_time_s: float
    """Predicted seconds to the target (the reference run's final loss), switches included."""
    num_switches: int
    baselines: dict[str, dict[str, Any]]
    """``fixed``: one batch with its best parallelism for the whole run; ``follow_critical``:
    the batch tracks ``B_noise`` (nearest candidate) with one fixed parallelism."""
    segments: list[Segment] = field(default_factory=list)
    reconfig_cost_s: float = 0.0
    threshold: float = 0.0

    def speedup(self, baseline: str) -> float:
        other = self.baselines[baseline]["time_s"]
        return other / self.total_time_s if self.total_time_s > 0 else math.nan

    def table(self) -> str:
        rows = []
        for i, phase in enumerate(self.phases, 1):
            cfg = phase["config"]
            rows.append({"phase": i, "from_tokens": phase["start_tokens"],
                         "to_tokens": phase["end_tokens"],
                         "B_noise": f"{phase['b_noise_min']:.4g}-{phase['b_noise_max']:.4g}",
                         "gbs": cfg["global_batch_size"],
                         "dp/tp/pp": f"{cfg['dp']}/{cfg['tp']}/{cfg['pp']}",
                         "mbs": cfg["micro_batch_size"], "schedule": cfg["schedule"],
                         "sharding": cfg["sharding"], "recompute": cfg["recompute"],
                         "step_s": phase["step_time_s"], "hours": phase["time_s"] / 3600})
        lines = [format_table(rows, title="Training phases", floatfmt=".4g"), ""]
        lines.append(f"plan: {self.total_time_s / 3600:.4g} h to target, "
                     f"{self.num_switches} switch(es) at {self.reconfig_cost_s:.0f} s each")
        for name, base in self.baselines.items():
            lines.append(f"{name}: {base['time_s'] / 3600:.4g} h ({base['describe']}); plan "
                         f"is {self.speedup(name):.3f}x faster")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"phases": self.phases, "total_time_s": self.total_time_s,
                "num_switches": self.num_switches, "baselines": self.baselines,
                "reconfig_cost_s": self.reconfig_cost_s, "threshold": self.threshold,
                "speedup_vs_fixed": self.speedup("fixed"),
                "speedup_vs_follow_critical": self.speedup("follow_critical")}


def _layout_key(cfg: ParallelConfig) -> tuple:
    d = cfg.to_dict()
    d.pop("global_batch_size")
    return tuple(sorted(d.items()))


def plan_phases(predictor: Predictor, space: SearchSpace, trajectory: Trajectory, *,
                reconfig_cost_s: float = 600.0, batch_change_cost_s: float = 0.0,
                threshold: float = 0.05, max_segments: int = 32,
                objective: Objective | None = None) -> Plan:
    """Schedule (batch, parallelism) over training from a ``B_noise`` trajectory.

    Every feasible config of ``space`` (all its global batch sizes) is predicted once; the
    time of each config on each stretch follows from its step time and the stretch's
    ``B_noise``. The step time is that of the throughput :func:`~paratune.tuner.tune` ranks
    by: the expected throughput where the predictor gives one (a pipeline that may stall
    counts at its likely speed), or the objective's ``risk_quantile``. The plan starts with
    the fastest config of the first stretch and switches to a stretch's fastest config only
    when that config's goodput there beats the current one's by more than ``threshold`` and
    the time it saves, until the current one becomes better again, exceeds the switch cost.

    Args:
        predictor: Fitted predictor.
        space: Space with several global batch sizes.
        trajectory: ``B_noise`` along a reference run.
        reconfig_cost_s: Seconds lost to a change of parallelism (checkpoint, reshard,
            restart).
        batch_change_cost_s: Seconds lost to a change of the batch size alone.
        threshold: Smallest relative goodput gain worth a switch.
        max_segments: Resolution of the plan along training.
        objective: Feasibility settings (memory limit, probability) and the
            ``risk_quantile`` to time configs by; its kind is ignored.

    Returns:
        A :class:`Plan`.
    """
    if reconfig_cost_s < 0 or batch_change_cost_s < 0:
        raise ConfigError("reconfig_cost_s", reconfig_cost_s, "costs must be >= 0")
    if threshold < 0:
        raise ConfigError("threshold", threshold, "must be >= 0")
    base = objective or Objective()
    scoring = Objective(kind="throughput", risk_quantile=base.risk_quantile,
                        min_feasible_prob=base.min_feasible_prob,
                        memory_limit_gb=base.memory_limit_gb,
                        memory_fraction=base.memory_fraction)
    ranked = rank(evaluate(predictor, space, space.enumerate().valid, scoring))
    # time each config by the throughput the tuner ranks it by (the expected throughput
    # where the predictor gives one, or the risk quantile), not by its fast regime: a
    # pipeline likely to stall must not win a phase on its point prediction
    throughput = ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
    runs = ranked["feasible"].to_numpy(dtype=bool) & np.isfinite(throughput) & (throughput > 0)
    ranked = ranked[runs].reset_index(drop=True)
    if ranked.empty:
        raise ConfigError("space", space.model.name, "no config is predicted feasible")
    segments = progress_segments(trajectory, seq_len=space.model.seq_len,
                                 max_segments=max_segments)
    batch = ranked["global_batch_size"].to_numpy(dtype=float)
    throughput = ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
    step = batch * space.model.seq_len / throughput
    e_min = np.array([s.e_min for s in segments])[:, None]
    b_noise = np.array([s.b_noise for s in segments])[:, None]
    times = e_min * (1.0 + batch[None, :] / b_noise) / batch[None, :] * step[None, :]
    configs = [config_from_row(row) for _, row in ranked.iterrows()]
    layouts = [_layout_key(c) for c in configs]

    def cost(a: int, b: int) -> float:
        if a == b:
            return 0.0
        return batch_change_cost_s if layouts[a] == layouts[b] else reconfig_cost_s

    n = len(segments)
    choice = [int(np.argmin(times[0]))]
    total = float(times[0, choice[0]])
    switches = 0
    for i in range(1, n):
        cur = choice[-1]
        cand = int(np.argmin(times[i]))
        if cand != cur and times[i, cur] / times[i, cand] - 1.0 > threshold:
            j, saved = i, 0.0
            while j < n and times[j, cand] < times[j, cur]:
                saved += times[j, cur] - times[j, cand]
                j += 1
            if saved > cost(cur, cand):
                total += cost(cur, cand)
                switches += 1
                cur = cand
        choice.append(cur)
        total += float(times[i, cur])

    phases: list[dict[str, Any]] = []
    for i, c in enumerate(choice):
        if phases and phases[-1]["_index"] == c:
            phase = phases[-1]
            phase["end_tokens"] = segments[i].end_tokens
            phase["b_noise_min"] = min(phase["b_noise_min"], segments[i].b_noise)
            phase["b_noise_max"] = max(phase["b_noise_max"], segments[i].b_noise)
            phase["time_s"] += float(times[i, c])
            continue
        phases.append({"_index": c, "start_tokens": segments[i].start_tokens,
                       "end_tokens": segments[i].end_tokens,
                       "b_noise_min": segments[i].b_noise, "b_noise_max": segments[i].b_noise,
                       "config": configs[c].to_dict(), "step_time_s": float(step[c]),
                       "tokens_per_s": float(throughput[c]),
                       "time_s": float(times[i, c])})
    for phase in phases:
        phase.pop("_index")

    fixed_totals = times.sum(axis=0)
    best_fixed = int(np.argmin(fixed_totals))
    baselines = {"fixed": {"time_s": float(fixed_totals[best_fixed]),
                           "config": configs[best_fixed].to_dict(),
                           "describe": f"fixed {configs[best_fixed].key()}"}}
    baselines["follow_critical"] = _follow_critical(times, configs, layouts, segments, batch)
    return Plan(phases=phases, total_time_s=total, num_switches=switches, baselines=baselines,
                segments=segments, reconfig_cost_s=reconfig_cost_s, threshold=threshold)


def _follow_critical(times: np.ndarray, configs: list[ParallelConfig], layouts: list[tuple],
                     segments: list[Segment], batch: np.ndarray) -> dict[str, Any]:
    """Batch = candidate nearest (in log) to ``B_noise`` per stretch; one fixed layout."""
    candidates = np.unique(batch)
    wanted = [float(candidates[np.argmin(np.abs(np.log(candidates) - math.log(s.b_noise)))])
              for s in segments]
    index: dict[tuple, dict[float, int]] = {}
    for k, (lay, b) in enumerate(zip(layouts, batch)):
        index.setdefault(lay, {})[float(b)] = k
    best_time, best_layout = math.inf, None
    for lay, by_batch in index.items():
        if not all(w in by_batch for w in wanted):
            continue
        t = sum(float(times[i, by_batch[w]]) for i, w in enumerate(wanted))
        if t < best_time:
            best_time, best_layout = t, lay
    if best_layout is None:
        return {"time_s": math.nan, "config": None, "batches": wanted,
                "describe": "no single layout is valid and feasible at every critical batch"}
    first = configs[index[best_layout][wanted[0]]]
    layout = {k: v for k, v in first.to_dict().items() if k != "global_batch_size"}
    return {"time_s": best_time, "config": layout, "batches": wanted,
            "describe": (f"batch {int(min(wanted))}->{int(max(wanted))} following B_noise, "
                         f"layout dp{layout['dp']}-tp{layout['tp']}-pp{layout['pp']}-mb"
                         f"{layout['micro_batch_size']}-{layout['schedule']}-"
                         f"{layout['sharding']}-{layout['recompute']}")}
