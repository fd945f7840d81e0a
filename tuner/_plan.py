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

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune._table import format_table
from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.predictor import PRED_TOKENS_PER_SEC_PER_GPU, Predictor
from paratune.tuner._efficiency import LR_RULES, lr_scale
from paratune.tuner._objective import Objective
from paratune.tuner._search import config_from_row, evaluate, rank
from paratune.tuner.gns_trajectory import Trajectory

if TYPE_CHECKING:
    import pandas as pd

    from paratune.space import ConfigSpace
    from paratune.spec import ModelSpec
    from paratune.tuner._space import SearchSpace

MAX_BATCH_SIZES = 64
"""Most global batch sizes :func:`default_batch_range` returns (as ``--global-batch``)."""

DEFAULT_BASE_LR = 3e-4
"""Learning rate at the base batch where none is given (Llama 3 8B's peak learning rate)."""

__all__ = [
    "ConfigTimes",
    "Plan",
    "config_times",
    "default_batch_range",
    "effective_b_noise",
    "plan_phases",
    "predict_configs",
    "progress_segments",
    "smallest_busy_batch",
]


@dataclass
class Segment:
    """A stretch of training with one ``B_noise``."""

    start_tokens: float
    """Reference-run tokens where the stretch starts: the trajectory point that opens its
    first interval."""
    end_tokens: float
    """Reference-run tokens where it ends: the point that closes its last interval."""
    b_noise: float
    """``B_noise`` in sequences of the planned model (``seq_len`` given to
    :func:`progress_segments`)."""
    e_min: float
    """Minimal-batch sequences (of the planned model) this stretch is worth."""


def _check_max_segments(max_segments: Any) -> int:
    if (isinstance(max_segments, bool) or not isinstance(max_segments, (int, np.integer))
            or max_segments < 1):
        raise ConfigError("max_segments", max_segments, "must be an integer >= 1")
    return int(max_segments)


def progress_segments(trajectory: Trajectory, *, seq_len: int,
                      max_segments: int = 32, spacing: str = "auto") -> list[Segment]:
    """Cut the reference run into at most ``max_segments`` stretches of about equal tokens.

    Each interval between trajectory points takes the mean ``B_noise`` of its ends and goes
    whole to the stretch, of ``max_segments`` equal cuts of the run's tokens, that holds its
    midpoint; a stretch aggregates its intervals with the ``E_min``-weighted harmonic mean
    (the value that leaves the time of any fixed config unchanged). A stretch's
    ``start_tokens`` and ``end_tokens`` are the trajectory points that bound its intervals,
    the tokens its ``E_min`` covers (with unevenly spaced points, not the cut's edges), so
    the stretches follow one another without gap and cover the whole run.

    The trajectory's ``B_noise`` is in sequences of the measuring run; the noise scale is
    assumed to be a number of tokens, so it, the reference batch (the measuring run's tokens
    per step) and the progress are taken in tokens and returned in sequences of ``seq_len``
    tokens: ``B_noise = b_simple * seq_len_measured / seq_len``.

    Args:
        trajectory: ``B_noise`` along the reference run, with its ``seq_len`` known.
        seq_len: Tokens per sequence of the planned model.
        max_segments: Most stretches returned (>= 1).
        spacing: ``"linear"``: cuts of equal tokens; ``"log"``: cuts of equal ratio of
            tokens (a run that spans decades, such as a law's curve from 0.2B to 200B
            tokens, keeps its early training, where ``B_noise`` moves fastest, resolved);
            ``"auto"``: ``log`` where the trajectory starts above 0 tokens and spans at
            least a factor of 100, else ``linear``.

    Returns:
        The stretches, in order, in sequences of ``seq_len`` tokens.

    Raises:
        ConfigError: ``max_segments`` or ``seq_len`` is not a positive integer, the
            trajectory has fewer than two points, or its ``seq_len`` is unknown or does not
            divide its tokens per step.
    """
    max_segments = _check_max_segments(max_segments)
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "must be a positive integer")
    if len(trajectory) < 2:
        raise ConfigError("trajectory", trajectory.source, "needs at least two points")
    # in tokens, with the measuring run's own seq_len
    b_ref = trajectory.reference_batch() * trajectory.measured_seq_len()
    b_tok = trajectory.b_noise_tokens()
    tokens = trajectory.tokens
    b_mid_tok = 0.5 * (b_tok[1:] + b_tok[:-1])
    d_min_tok = np.diff(tokens) / (1.0 + b_ref / b_mid_tok)
    # in sequences of the planned model
    b_mid = b_mid_tok / seq_len
    d_min = d_min_tok / seq_len
    if spacing not in ("auto", "linear", "log"):
        raise ConfigError("spacing", spacing, "must be auto, linear or log")
    if spacing == "auto":
        spacing = "log" if tokens[0] > 0 and tokens[-1] >= 100 * tokens[0] else "linear"
    count = min(max_segments, len(d_min)) + 1
    if spacing == "log":
        if tokens[0] <= 0:
            raise ConfigError("spacing", spacing, "log spacing needs a trajectory that starts "
                              "above 0 tokens")
        edges = np.geomspace(tokens[0], tokens[-1], count)
        mids = np.sqrt(tokens[1:] * tokens[:-1])
    else:
        edges = np.linspace(tokens[0], tokens[-1], count)
        mids = 0.5 * (tokens[1:] + tokens[:-1])
    which = np.clip(np.searchsorted(edges, mids) - 1, 0, len(edges) - 2)
    segments = []
    for k in range(len(edges) - 1):
        # the midpoints increase, so a stretch's intervals are consecutive
        inside = np.flatnonzero(which == k)
        if not len(inside) or d_min[inside].sum() <= 0:
            continue
        e_min = float(d_min[inside].sum())
        b_noise = e_min / float((d_min[inside] / b_mid[inside]).sum())
        segments.append(Segment(float(tokens[inside[0]]), float(tokens[inside[-1] + 1]),
                                b_noise, e_min))
    return segments


def effective_b_noise(trajectory: Trajectory, *, seq_len: int) -> float:
    """The single ``B_noise`` that ranks fixed configs as the whole trajectory does.

    Args:
        trajectory: ``B_noise`` along the reference run, with its ``seq_len`` known.
        seq_len: Tokens per sequence of the planned model.

    Returns:
        ``B_noise`` in sequences of ``seq_len`` tokens (the noise scale is assumed to be a
        number of tokens; see :func:`progress_segments`).
    """
    segs = progress_segments(trajectory, seq_len=seq_len, max_segments=10**9)
    return sum(s.e_min for s in segs) / sum(s.e_min / s.b_noise for s in segs)


def smallest_busy_batch(model: ModelSpec, gpus: int, *, space: ConfigSpace | None = None,
                        devices_per_node: int = 8) -> int:
    """The smallest global batch with which some layout keeps every device busy.

    A layout ``(dp, tp, pp)`` runs at least one micro-batch on each data-parallel replica, so
    its smallest batch is ``dp * min(micro_batch_sizes)``; the smallest over the layouts the
    space allows (tp dividing the heads and the node, pp fitting the layers) is the batch
    range's floor. It is not the device count: on 4,096 devices a tp=8, pp=32 layout runs
    batch 16.

    Raises:
        ConfigError: ``gpus`` is not a positive integer, or no layout is valid.
    """
    from paratune.space import ConfigSpace
    from paratune.tuner._space import check_gpus

    gpus = check_gpus(gpus)
    options = space or ConfigSpace()
    mbs = min(options.micro_batch_sizes)
    best = None
    for (dp, tp, pp), reason in options.degrees(gpus, devices_per_node=devices_per_node):
        if reason is not None:
            continue
        probe = ParallelConfig(dp=dp, tp=tp, pp=pp, global_batch_size=dp * mbs,
                               micro_batch_size=mbs, schedule="gpipe")
        if probe.is_valid(model, gpus) and (best is None or dp * mbs < best):
            best = dp * mbs
    if best is None:
        raise ConfigError("gpus", gpus, f"no (dp, tp, pp) layout of {gpus} devices is valid for "
                          f"{model.name}")
    return int(best)


def default_batch_range(model: ModelSpec, gpus: int, b_noise: Any, *,
                        space: ConfigSpace | None = None, devices_per_node: int = 8
                        ) -> list[int]:
    """Global batch sizes of a plan that names none.

    From :func:`smallest_busy_batch` upwards in factors of two, to the first size at or above
    twice the largest ``B_noise`` (at most :data:`MAX_BATCH_SIZES` sizes): every batch the
    noise scale may ask for, down to the small batches of high tensor and pipeline
    parallelism.

    Args:
        model: The planned model.
        gpus: Devices in the job.
        b_noise: ``B_noise`` along training, in sequences of ``model.seq_len``.
        space: Options (micro-batch sizes, degree lists) of the search.
        devices_per_node: Node size (tensor parallelism stays inside a node).
    """
    low = smallest_busy_batch(model, gpus, space=space, devices_per_node=devices_per_node)
    top = 2.0 * float(np.max(np.asarray(b_noise, dtype=float)))
    batches = [low]
    while batches[-1] < top and len(batches) < MAX_BATCH_SIZES:
        batches.append(batches[-1] * 2)
    return batches


def _interp_loss(trajectory: Trajectory, tokens: float) -> float:
    loss = np.asarray(trajectory.loss, dtype=float)
    known = np.isfinite(loss)
    if not known.any():
        return math.nan
    return float(np.interp(tokens, trajectory.tokens[known], loss[known]))


@dataclass
class Plan:
    """Phases of training and their predicted time, against two baselines."""

    phases: list[dict[str, Any]]
    """One mapping per phase: start/end tokens of the reference run, ``B_noise`` range (in
    sequences of the planned model), the config, its step time and tokens/s (as the tuner
    ranks configs: expected, or the objective's risk quantile), the phase's predicted
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


def _layout_key(cfg: ParallelConfig) -> tuple:
    d = cfg.to_dict()
    d.pop("global_batch_size")
    return tuple(sorted(d.items()))


def _check_cost(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not (math.isfinite(value) and value >= 0):
        raise ConfigError(name, value, "must be a finite number of seconds >= 0")
    return float(value)


def _schedule(times: np.ndarray, layouts: np.ndarray, *, reconfig_cost_s: float,
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
        # another layout: suffix minima, over configs sorted by time, of the best and of
        # the best with a different layout from it
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
        other_v = np.where(l1[start] != layouts, v1[start], v2[start]) + reconfig_cost_s
        other_i = np.where(l1[start] != layouts, i1[start], i2[start])
        take = other_v < new
        new[take], src[take] = other_v[take], other_i[take]
        # same layout, another batch
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
            cand[inside] = suffix[at[inside]] + batch_change_cost_s
            better = cand < new[idx]
            new[idx[better]] = cand[better]
            src[idx[better]] = arg[at[better]]
        best = new + t
        parent[i] = src
    last = int(np.argmin(best))
    choice = [last]
    for i in range(n - 1, 0, -1):
        choice.append(int(parent[i, choice[-1]]))
    return choice[::-1], float(best[last])


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
    if (isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.number))
            or not (threshold >= 0 and math.isfinite(threshold))):
        raise ConfigError("threshold", threshold, "must be a finite number >= 0")
    return reconfig_cost_s, batch_change_cost_s, float(threshold), \
        _check_max_segments(max_segments)


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
    # where the predictor gives one, or the risk quantile), not by its fast regime: a
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
    for q in ("q10", "q90"):
        column = f"{PRED_TOKENS_PER_SEC_PER_GPU}_{q}"
        if column in ranked.columns:
            q_tps = ranked[column].to_numpy(dtype=float) * ranked["world_size"].to_numpy(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                q_step = np.where(q_tps > 0, batch * seq_len / q_tps, np.nan)
            quantile_times[q] = steps * q_step[None, :]
    columns = ["dp", "tp", "pp", "micro_batch_size", "global_batch_size", "schedule",
               "virtual_stages", "sharding", "recompute"]
    # records of the config columns only: iterrows over the whole prediction frame is slow
    configs = [config_from_row(row) for row in ranked[columns].to_dict("records")]
    return ConfigTimes(configs=configs, layouts=[_layout_key(c) for c in configs], batch=batch,
                       throughput=throughput, step=step, times=steps * step[None, :],
                       quantile_times=quantile_times)


def plan_phases(predictor: Predictor, space: SearchSpace, trajectory: Trajectory, *,
                reconfig_cost_s: float = 600.0, batch_change_cost_s: float = 0.0,
                threshold: float = 0.05, max_segments: int = 32,
                objective: Objective | None = None, lr_rule: str = "sqrt",
                base_lr: float = DEFAULT_BASE_LR, base_batch: float | None = None,
                spacing: str = "auto", ranked: pd.DataFrame | None = None) -> Plan:
    """Schedule (batch, parallelism) over training from a ``B_noise`` trajectory.

    Every feasible config of ``space`` (all its global batch sizes) is predicted once; the
    time of each config on each stretch follows from its step time and the stretch's
    ``B_noise`` (converted from the measuring run's sequences to ``space.model.seq_len``;
    see :func:`progress_segments`). The step time is that of the throughput
    :func:`~paratune.tuner.tune` ranks by: the expected throughput where the predictor
    gives one (a pipeline that may stall counts at its likely speed), or the objective's
    ``risk_quantile``. The schedule is the exact optimum, by dynamic programming over
    (stretch, config), of the time to target plus the switch costs (nothing to keep a
    config, ``batch_change_cost_s`` to change only the batch, ``reconfig_cost_s`` to
    change the layout), among schedules whose every switch gains more than ``threshold``
    on the stretch where it happens. Keeping one config throughout is always allowed, so
    the plan is never slower than the ``fixed`` baseline.

    Args:
        predictor: Fitted predictor.
        space: Space with several global batch sizes.
        trajectory: ``B_noise`` along a reference run, with the run's ``seq_len`` known.
        reconfig_cost_s: Seconds lost to a change of parallelism (checkpoint, reshard,
            restart).
        batch_change_cost_s: Seconds lost to a change of the batch size alone.
        threshold: Smallest relative goodput gain, on the stretch where it happens, that
            allows a switch (``0``: any gain).
        max_segments: Resolution of the plan along training (>= 1).
        objective: Feasibility settings (memory limit, probability) and the
            ``risk_quantile`` to time configs by; its kind is ignored.
        lr_rule: How the learning rate follows the batch (one of
            :data:`~paratune.tuner.LR_RULES`; ``adascale`` takes each phase's ``B_noise``).
        base_lr: Learning rate at ``base_batch``.
        base_batch: Batch at which ``base_lr`` holds (default: the first phase's).
        spacing: How training is cut into stretches (see :func:`progress_segments`).
        ranked: The configs of :func:`predict_configs` for ``space`` (predicted here where
            not given).

    Returns:
        A :class:`Plan`: per phase its tokens (of the reference run and of the planned
        run), loss, ``B_noise``, config, learning rate, step time and seconds; the
        schedule's time at the predictor's q10/q90 throughput where it gives them.

    Raises:
        ConfigError: a cost is negative or not finite, ``threshold < 0``,
            ``max_segments < 1``, no config is predicted feasible, or the trajectory is
            too short or lacks its ``seq_len``.
    """
    reconfig_cost_s, batch_change_cost_s, threshold, max_segments = check_plan_options(
        reconfig_cost_s=reconfig_cost_s, batch_change_cost_s=batch_change_cost_s,
        threshold=threshold, max_segments=max_segments)
    if lr_rule not in LR_RULES:
        raise ConfigError("lr_rule", lr_rule, f"must be one of {', '.join(LR_RULES)}")
    if (isinstance(base_lr, bool) or not isinstance(base_lr, (int, float, np.floating))
            or not (math.isfinite(base_lr) and base_lr > 0)):
        raise ConfigError("base_lr", base_lr, "must be a positive, finite learning rate")
    # unit problems of the trajectory surface before the (slow) prediction
    segments = progress_segments(trajectory, seq_len=space.model.seq_len,
                                 max_segments=max_segments, spacing=spacing)
    if ranked is None:
        ranked = predict_configs(predictor, space, objective)
    ct = config_times(ranked, segments, seq_len=space.model.seq_len)
    batch, throughput, step, times = ct.batch, ct.throughput, ct.step, ct.times
    quantile_times, configs, layouts = ct.quantile_times, ct.configs, ct.layouts
    layout_ids = {lay: i for i, lay in enumerate(dict.fromkeys(layouts))}
    choice, total = _schedule(times, np.array([layout_ids[lay] for lay in layouts]),
                              reconfig_cost_s=reconfig_cost_s,
                              batch_change_cost_s=batch_change_cost_s, threshold=threshold)

    phases: list[dict[str, Any]] = []
    switches: list[dict[str, Any]] = []
    for i, c in enumerate(choice):
        if phases and phases[-1]["_index"] == c:
            phase = phases[-1]
            phase["end_tokens"] = segments[i].end_tokens
            phase["b_noise_min"] = min(phase["b_noise_min"], segments[i].b_noise)
            phase["b_noise_max"] = max(phase["b_noise_max"], segments[i].b_noise)
            phase["time_s"] += float(times[i, c])
            phase["_segments"].append(i)
            continue
        if phases:
            prev = phases[-1]["_index"]
            kind = "batch" if layouts[prev] == layouts[c] else "layout"
            switches.append({"at_tokens": segments[i].start_tokens,
                             "from": configs[prev].key(), "to": configs[c].key(),
                             "kind": kind, "cost_s": batch_change_cost_s if kind == "batch"
                             else reconfig_cost_s})
        phases.append({"_index": c, "_segments": [i], "start_tokens": segments[i].start_tokens,
                       "end_tokens": segments[i].end_tokens,
                       "b_noise_min": segments[i].b_noise, "b_noise_max": segments[i].b_noise,
                       "config": configs[c].to_dict(), "step_time_s": float(step[c]),
                       "tokens_per_s": float(throughput[c]),
                       "time_s": float(times[i, c])})
    # what the planned run itself processes: E = E_min (1 + B / B_noise) per stretch
    seq = space.model.seq_len
    run_tokens = 0.0
    clock = 0.0
    switch_at = {}
    for sw in switches:
        switch_at[sw["at_tokens"]] = sw
    first_batch = phases[0]["config"]["global_batch_size"]
    base = float(first_batch if base_batch is None else base_batch)
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
        run_tokens += sequences * seq
        phase["run_end_tokens"] = run_tokens
        phase["steps"] = math.ceil(sequences / batch[c])
        phase["b_noise"] = float(b_eff)
        phase["start_loss"] = _interp_loss(trajectory, phase["start_tokens"])
        phase["end_loss"] = _interp_loss(trajectory, phase["end_tokens"])
        scale = float(lr_scale([batch[c]], base, lr_rule, b_noise=b_eff)[0])
        phase["lr_scale"] = scale
        phase["lr"] = float(base_lr) * scale
        clock += phase["time_s"]
        phase["end_time_s"] = clock
    interval = None
    if len(quantile_times) == 2:
        switch_total = sum(sw["cost_s"] for sw in switches)
        interval = tuple(float(sum(quantile_times[q][i, c] for i, c in enumerate(choice))
                               + switch_total) for q in ("q10", "q90"))
    assert math.isclose(total, sum(p["time_s"] for p in phases)
                        + sum(sw["cost_s"] for sw in switches), rel_tol=1e-9)

    fixed_totals = times.sum(axis=0)
    best_fixed = int(np.argmin(fixed_totals))
    baselines = {"fixed": {"time_s": float(fixed_totals[best_fixed]),
                           "config": configs[best_fixed].to_dict(), "num_switches": 0,
                           "switch_time_s": 0.0,
                           "describe": f"fixed {configs[best_fixed].key()}"}}
    baselines["follow_critical"] = _follow_critical(times, configs, layouts, segments, batch,
                                                    batch_change_cost_s=batch_change_cost_s)
    return Plan(phases=phases, total_time_s=total, num_switches=len(switches),
                baselines=baselines, segments=segments, reconfig_cost_s=reconfig_cost_s,
                threshold=threshold, batch_change_cost_s=batch_change_cost_s,
                switches=switches, lr_rule=lr_rule, base_lr=float(base_lr), base_batch=base,
                time_interval_s=interval, source=trajectory.source)


def _follow_critical(times: np.ndarray, configs: list[ParallelConfig], layouts: list[tuple],
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
    layout = {k: v for k, v in first.to_dict().items() if k != "global_batch_size"}
    return {"time_s": best_time + switch_time, "config": layout, "batches": wanted,
            "num_switches": num_switches, "switch_time_s": switch_time,
            "describe": (f"batch {int(min(wanted))}->{int(max(wanted))} following B_noise, "
                         f"{num_switches} batch change(s) at {batch_change_cost_s:.3g} s, "
                         f"layout dp{layout['dp']}-tp{layout['tp']}-pp{layout['pp']}-mb"
                         f"{layout['micro_batch_size']}-{layout['schedule']}-"
                         f"{layout['sharding']}-{layout['recompute']}")}
