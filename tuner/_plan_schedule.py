"""The planner's dynamic programme: the config per stretch of training that minimises the
time to target plus the switch costs, and the ``follow_critical`` baseline it is weighed
against."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from paratune.parallel import ParallelConfig
from paratune.tuner._efficiency import _positive, check_lr_rule
from paratune.tuner._plan_progress import Segment, check_max_segments

__all__ = ["DEFAULT_BASE_LR", "ScheduleOptions", "check_plan_options", "follow_critical",
           "layout_key", "layout_of", "optimal_schedule"]


def layout_of(config: dict[str, Any]) -> dict[str, Any]:
    """The layout of a config (as :meth:`~paratune.ParallelConfig.to_dict` gives it):
    everything but its global batch, which a batch-only switch changes."""
    return {k: v for k, v in config.items() if k != "global_batch_size"}


def layout_key(cfg: ParallelConfig) -> tuple:
    """The layout of ``cfg`` (:func:`layout_of`) as a hashable key."""
    return tuple(sorted(layout_of(cfg.to_dict()).items()))


def _check_cost(name: str, value: float) -> float:
    return _positive(name, value, "must be a finite number of seconds >= 0", zero=True)


def optimal_schedule(times: np.ndarray, layouts: np.ndarray, *, reconfig_cost_s: float,
                     batch_change_cost_s: float, threshold: float) -> tuple[list[int], float]:
    """The config per stretch that minimises time plus switch costs (exact DP).

    Switching from config ``a`` to ``b`` costs nothing if ``a == b``,
    ``batch_change_cost_s`` if they share a layout and ``reconfig_cost_s`` otherwise. A
    switch into ``b`` at stretch ``i`` is allowed only where ``b`` is faster than ``a`` on
    that stretch by more than ``threshold`` (``times[i, a] > (1 + threshold) times[i, b]``):
    the plan is the fastest among plans whose every switch clears the threshold. Staying
    is always allowed, so the result is never slower than the best fixed config. With
    ``threshold = 0`` and ``batch_change_cost_s <= 2 reconfig_cost_s`` the filter loses
    nothing: a switch to a config that is not faster where it happens can be postponed at no
    cost.

    Runs in ``O(n K log K)`` for ``n`` stretches and ``K`` configs: the best predecessor of
    ``b`` is itself, the best allowed one of its layout, or the best allowed one of another
    layout, found from suffix minima over the configs sorted by their time on the stretch.

    Args:
        times: ``[n, K]`` seconds of each config on each stretch.
        layouts: ``[K]`` integer layout id of each config.
        reconfig_cost_s: Cost of a layout change.
        batch_change_cost_s: Cost of a batch-only change.
        threshold: Smallest relative gain that allows a switch.

    Returns:
        The config index per stretch and the total seconds (switches included).
    """

    n, k = times.shape
    best = times[0].astype(float).copy()
    parent = np.zeros((n, k), dtype=np.int64)
    parent[0] = np.arange(k)
    members = {int(lay): np.flatnonzero(layouts == lay) for lay in np.unique(layouts)}
    for i in range(1, n):
        t = times[i]
        bar = (1.0 + threshold) * t
        new = best.copy()  # stay
        src = np.arange(k)
        _from_another_layout(new, src, best, t, bar, layouts, reconfig_cost_s)
        _from_another_batch(new, src, best, t, bar, members, batch_change_cost_s)
        best = new + t
        parent[i] = src
    last = int(np.argmin(best))
    choice = [last]
    for i in range(n - 1, 0, -1):
        choice.append(int(parent[i, choice[-1]]))
    return choice[::-1], float(best[last])


def _from_another_layout(new: np.ndarray, src: np.ndarray, best: np.ndarray, t: np.ndarray,
                         bar: np.ndarray, layouts: np.ndarray, cost: float) -> None:
    """Improve ``new``/``src`` (in place) by a switch from another layout: suffix minima,
    over the configs sorted by their time ``t`` on the stretch, of the best ``best`` and of
    the best with a different layout from it, taken where the time clears ``bar``."""
    order = np.argsort(t, kind="stable")
    t_sorted = t[order]
    rows = []  # (v1, i1, l1, v2, i2) of each suffix, from the shortest one
    a1, b1, c1, a2, b2 = math.inf, -1, -1, math.inf, -1
    for p, v, lay in zip(order[::-1].tolist(), best[order][::-1].tolist(),
                         layouts[order][::-1].tolist()):
        if v < a1:
            if lay != c1:
                a2, b2 = a1, b1
            a1, b1, c1 = v, p, lay
        elif lay != c1 and v < a2:
            a2, b2 = v, p
        rows.append((a1, b1, c1, a2, b2))
    rows = rows[::-1] + [(math.inf, -1, -1, math.inf, -1)]  # index = sorted position
    v1, i1, l1, v2, i2 = (np.array(col) for col in zip(*rows))
    start = np.searchsorted(t_sorted, bar, side="right")
    other_v = np.where(l1[start] != layouts, v1[start], v2[start]) + cost
    other_i = np.where(l1[start] != layouts, i1[start], i2[start])
    take = other_v < new
    new[take], src[take] = other_v[take], other_i[take]


def _from_another_batch(new: np.ndarray, src: np.ndarray, best: np.ndarray, t: np.ndarray,
                        bar: np.ndarray, members: dict[int, np.ndarray], cost: float) -> None:
    """Improve ``new``/``src`` (in place) by a batch-only switch: within each layout
    (``members``: its configs), the best ``best`` among the configs whose time clears
    ``bar``."""
    for idx in members.values():
        if len(idx) < 2:
            continue
        sub = idx[np.argsort(t[idx], kind="stable")]
        f_sub = best[sub]
        suffix = np.minimum.accumulate(f_sub[::-1])[::-1]
        arg = np.empty(len(sub), dtype=np.int64)
        run = len(sub) - 1
        for p in range(len(sub) - 1, -1, -1):
            if f_sub[p] <= f_sub[run]:
                run = p
            arg[p] = sub[run]
        at = np.searchsorted(t[sub], bar[idx], side="right")
        inside = at < len(sub)
        cand = np.full(len(idx), math.inf)
        cand[inside] = suffix[at[inside]] + cost
        better = cand < new[idx]
        new[idx[better]] = cand[better]
        src[idx[better]] = arg[at[better]]


def check_plan_options(*, reconfig_cost_s: float, batch_change_cost_s: float,
                       threshold: float, max_segments: int) -> tuple[float, float, float, int]:
    """The settings of :func:`plan_phases`, checked (as it checks them) and normalised, so
    that a caller can refuse them before doing anything else.

    Returns:
        ``(reconfig_cost_s, batch_change_cost_s, threshold, max_segments)``.

    Raises:
        ConfigError: a cost is negative or not finite, ``threshold`` is negative or not
            finite, or ``max_segments`` is not an integer >= 1.
    """
    reconfig_cost_s = _check_cost("reconfig_cost_s", reconfig_cost_s)
    batch_change_cost_s = _check_cost("batch_change_cost_s", batch_change_cost_s)
    threshold = _positive("threshold", threshold, "must be a finite number >= 0", zero=True)
    return reconfig_cost_s, batch_change_cost_s, threshold, check_max_segments(max_segments)



DEFAULT_BASE_LR = 3e-4
"""Learning rate at the base batch where none is given (Llama 3 8B's peak learning rate)."""


@dataclass(frozen=True)
class ScheduleOptions:
    """The costs, switch threshold, resolution and learning-rate rule of a phase plan
    (:func:`~paratune.tuner.plan_phases`), checked when built: a bad one names its field."""

    reconfig_cost_s: float = 600.0
    """Seconds lost to a change of parallelism (checkpoint, reshard, restart)."""
    batch_change_cost_s: float = 0.0
    """Seconds lost to a change of the batch size alone."""
    threshold: float = 0.05
    """Smallest relative goodput gain, on the stretch where it happens, that allows a switch
    (``0``: any gain)."""
    max_segments: int = 32
    """Resolution of the plan along training (>= 1)."""
    lr_rule: str = "sqrt"
    """How the learning rate follows the batch (one of :data:`~paratune.tuner.LR_RULES`;
    ``adascale`` takes each phase's ``B_noise``)."""
    base_lr: float = DEFAULT_BASE_LR
    """Learning rate at ``base_batch``."""
    base_batch: float | None = None
    """Batch at which ``base_lr`` holds (``None``: the first phase's)."""
    spacing: str = "auto"
    """How training is cut into stretches (see :func:`progress_segments`)."""

    def __post_init__(self) -> None:
        reconfig, batch_change, threshold, max_segments = check_plan_options(
            reconfig_cost_s=self.reconfig_cost_s, batch_change_cost_s=self.batch_change_cost_s,
            threshold=self.threshold, max_segments=self.max_segments)
        check_lr_rule(self.lr_rule)
        _positive("base_lr", self.base_lr, "must be a positive, finite learning rate")
        for name, value in (("reconfig_cost_s", reconfig), ("batch_change_cost_s", batch_change),
                            ("threshold", threshold), ("max_segments", max_segments)):
            object.__setattr__(self, name, value)


def follow_critical(times: np.ndarray, configs: list[ParallelConfig], layouts: list[tuple],
                    segments: list[Segment], batch: np.ndarray, *,
                    batch_change_cost_s: float) -> dict[str, Any]:
    """Batch = candidate nearest (in log) to ``B_noise`` per stretch; one fixed layout.

    Each change of the batch is charged ``batch_change_cost_s``, as in the plan.
    """
    candidates = np.unique(batch)
    wanted = [float(candidates[np.argmin(np.abs(np.log(candidates) - math.log(s.b_noise)))])
              for s in segments]
    num_switches = sum(1 for a, b in pairwise(wanted) if a != b)
    switch_time = num_switches * batch_change_cost_s
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
                "num_switches": num_switches, "switch_time_s": switch_time,
                "describe": "no single layout is valid and feasible at every critical batch"}
    first = configs[index[best_layout][wanted[0]]]
    layout = layout_of(first.to_dict())
    return {"time_s": best_time + switch_time, "config": layout, "batches": wanted,
            "num_switches": num_switches, "switch_time_s": switch_time,
            "describe": (f"batch {int(min(wanted))}->{int(max(wanted))} following B_noise, "
                         f"{num_switches} batch change(s) at {batch_change_cost_s:.3g} s, "
                         f"layout dp{layout['dp']}-tp{layout['tp']}-pp{layout['pp']}-mb"
                         f"{layout['micro_batch_size']}-{layout['schedule']}-"
                         f"{layout['sharding']}-{layout['recompute']}")}
