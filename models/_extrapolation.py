"""How far a configuration lies outside what a model was fitted on, and what that costs.

The distance of a row from the training data is the sum, over the axes of :data:`AXES` (model
size in parameters, cluster size, tokens per step, the nodes its tensor- and data-parallel
groups span, its data-parallel regime and its context-parallel degree), of how many doublings
the row lies outside the range its measurement family was fitted on (0 inside). A row of a
family the model has no measurement of is measured against all the training rows and
flagged.

The learned intervals know nothing of that distance: fitted on one corner of the data they
are as narrow far outside it as inside. :func:`calibrate_widening` measures how much wider
they must be by *nested* extrapolation splits of the training data itself (never of the rows
being predicted): fit on part of the training rows, predict the rest of them that lie outside
the part's ranges, and find the log margin per doubling of distance (and for an unmeasured
family) that brings the share of measured runs inside the interval to the target, in each
nested fold (see :func:`covering_margins`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["AXES", "COVERAGE_STEPS", "LINK_AXES", "MAX_COVERAGE_LEVEL", "MEASURED_FAMILY_AXES",
           "axis_values", "calibrate_widening", "covering_margins", "distance", "fit_ranges",
           "nested_folds"]

AXES = ("model_params", "world_size", "tokens_per_step", "tp_nodes", "dp_nodes", "dp_regime",
        "cp")
"""The axes a distance is measured along: parameters, devices, tokens per step, the nodes a
tensor-parallel group spans (a family measured in one node has never seen its products wait
on the network: a group across two is a doubling beyond it), the nodes a data-parallel group
spans (see :data:`LINK_AXES`), the data-parallel regime (1: once per step; 2: every
micro-batch, as ZeRO-3 does, see
:func:`~paratune.models.features.dp_streams_every_microbatch`) and the context-parallel
degree (see :data:`REGIME_AXES`)."""
LINK_AXES = ("tp_nodes", "dp_nodes")
"""The axes of :data:`AXES` whose distance moves the prediction toward the core at their own
rate (:data:`LINK_SHRINK_PER_DOUBLING`), not at the family's: the nodes a group's
collectives cross beyond those its family measured. The learned correction scales the
analytical traffic of a group it never saw leave the node (or leave so many nodes) like the
rest of the step; the calibrated core prices it link by link. For data-parallel groups the
core also knows which reductions hide behind the backward (DDP's, see
:func:`~paratune.models.features.hierarchical_dp_s`), which no row of a smaller cluster
showed the correction: fitted on the Ultra-Scale runs of at most 128 GPUs, it ranked ZeRO-1
layouts on 256 first whose no-sharding twins ran 35% faster there. Counting the
data-parallel group's nodes took the top-1 regret by the expected throughput of the 256-GPU
folds from 4.0% (<= 128 GPUs fitted on) and 26.9% (<= 64) to 0%, and one node -> two from
36.1% to 29.2% (``python experiments/extrapolation.py``)."""
LINK_SHRINK_PER_DOUBLING = float(np.log(2.0))
"""Half of the way from the learned prediction to the calibrated core (in log space) per
doubling of the nodes a group spans beyond those its family measured (:data:`LINK_AXES`).
Fitted on the Ultra-Scale runs of one node and predicting its runs on 2-32 nodes
(``experiments/one_node_extrapolation.py``), the learned correction priced tensor-parallel
groups across nodes 1.6x too slow (it scales the analytical flat ring, every byte at the
network's bandwidth) and the core 1.9x too fast (the hierarchical reduction at a well-tuned
framework's constant); half-way, the median APE of those runs fell from 64% to 45%. A
family's own rate, chosen on nested splits, cannot say this: no nested split of a family
measured in one node takes its groups across nodes."""
MEASURED_FAMILY_AXES = ("dp_nodes",)
"""Axes of :data:`AXES` that count only for a measured family's rows. A family without
measurements is compared with the ranges of all the training rows, and for it the nodes a
data-parallel group spans are no news beside its family margin: counted, they moved its
multi-node rows toward the well-tuned core, which predicts a slower framework faster than it
runs (Ultra-Scale fitted without its rows: risk-aware top-1 regret 9.4% -> 15.4%)."""
REGIME_AXES = ("dp_regime", "cp")
"""The axes of :data:`AXES` beyond whose range the prediction is the calibrated core's,
whatever the family's rate: a data-parallel regime none of the training rows ran in, or a
sequence split over more ranks than any fitted on (ring attention's exchange, shorter
sequences per rank), is not a matter of degree the learned correction can stretch to. The
public sweeps hold DDP and ZeRO-1 only; fitted on them, the learned correction priced
torchtitan's FSDP runs of Llama 2 13B on 64 A100 (``data/published_torchtitan_a100.csv``) at
2.4x their step time, the core within 1% (``experiments/published_runs.py``). The interval
spans both, and widens by the prior margin per doubling."""
MIN_MARGIN_PER_DOUBLING = 0.02
"""The least log margin per doubling of distance the nested splits may set (2%): no
extrapolation is surer than that, whatever a nested split of clean data says. vTrain's
8-GPU runs fitted on its runs of at most 4 are predicted within 1.2% (median APE), and the
nested splits left the interval's slow end a few tenths of a percent short of a fifth of
them: q10-q90 coverage 78.6% over seeds 0-4, with this floor 89.4%."""
MAX_MARGIN_PER_DOUBLING = 1.5
"""The widening's bound: at most this much log margin per doubling of distance (a factor of
4.5 per doubling) or, for an unmeasured family, this much in all."""


def _distinct(values: np.ndarray) -> list[Any]:
    """The distinct values of an object array (hashed: sorting 100,000 strings is slow)."""
    import pandas as pd

    return list(pd.unique(pd.Series(values, dtype=object)))


def axis_values(frame: pd.DataFrame, c: Any = None) -> dict[str, np.ndarray]:
    """Each row's value on every axis of :data:`AXES` (``c``: the frame's
    :class:`~paratune.models.features.Columns` where already built)."""
    from paratune.models._splits import model_params
    from paratune.models.features import (
        Columns,
        dp_nodes,
        dp_streams_every_microbatch,
        tp_crosses_nodes,
    )

    c = Columns(frame) if c is None else c
    with np.errstate(divide="ignore", invalid="ignore"):
        spanned = np.maximum(np.ceil(c.tp / c.per_node), 2.0)
    tp_nodes = np.where(tp_crosses_nodes(c) > 0, spanned, 1.0)
    streamed = dp_streams_every_microbatch(c)
    return {"model_params": model_params(frame, c), "world_size": c.world,
            "tokens_per_step": c.global_batch * c.seq, "tp_nodes": tp_nodes,
            "dp_nodes": dp_nodes(c), "dp_regime": np.where(streamed, 2.0, 1.0),
            "cp": np.asarray(c.cp, dtype=float)}


def fit_ranges(values: dict[str, np.ndarray], families: np.ndarray, rows: np.ndarray
               ) -> dict[str, dict[str, list[float]]]:
    """Smallest and largest value per axis among ``rows``, per family and (``""``) over all.

    Args:
        values: :func:`axis_values` of the frame.
        families: Each row's measurement family.
        rows: Boolean mask of the rows fitted on (with a measured step time).
    """
    out: dict[str, dict[str, list[float]]] = {}
    for family in ["", *sorted({str(f) for f in families[rows]})]:
        sel = rows & ((families == family) if family else True)
        out[family] = {axis: [float(np.nanmin(v[sel])), float(np.nanmax(v[sel]))]
                       for axis, v in values.items() if np.isfinite(v[sel]).any()}
    return out


def distance(values: dict[str, np.ndarray], families: np.ndarray,
             ranges: dict[str, dict[str, list[float]]]
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Doublings outside the training ranges per axis and row, and whether a row's family is
    unmeasured.

    Returns:
        ``(per_axis, unknown_family)``: per axis of :data:`AXES`, ``log2`` of how far each
        row lies beyond its family's range (the overall range for a family not in
        ``ranges``, and 0 on :data:`MEASURED_FAMILY_AXES`; 0 inside), and a boolean per
        row. Their sum over axes is the row's distance.
    """
    n = len(families)
    out = {axis: np.zeros(n) for axis in AXES}
    # a row of no family ("") is measured against all the training rows, and is not flagged
    unknown = ~np.isin(families, [f for f in ranges if f]) & (families != "")
    if not ranges:
        return out, unknown
    for family in _distinct(families):
        rows = families == family
        limits = ranges.get(str(family)) or ranges[""]
        for axis, (lo, hi) in limits.items():
            v = values[axis][rows]
            with np.errstate(divide="ignore", invalid="ignore"):
                beyond = np.maximum(np.log2(v / hi), np.log2(lo / v))
            out[axis][rows] = np.where(np.isfinite(beyond), np.maximum(beyond, 0.0), 0.0)
    for axis in MEASURED_FAMILY_AXES:
        out[axis][unknown] = 0.0
    return out, unknown


def nested_folds(values: dict[str, np.ndarray], families: np.ndarray, timed: np.ndarray,
                 *, max_folds: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    """Extrapolation folds within the training rows: per family, its largest cluster from
    those of at most a quarter of its size (half, where none is that small) and its largest
    model from the others, and, where the rows
    hold several families, each family from the others. The kinds take turns, largest
    families first, up to ``max_folds`` in all. Returns ``(train, test)`` masks."""
    kinds: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"cluster": [], "model": [],
                                                             "family": []}
    names = sorted(set(families[timed]), key=lambda f: (-(families == f).sum(), f))
    params = np.round(values["model_params"], -6)
    world = values["world_size"]
    for family in names:
        own = timed & (families == family)
        if world[own].max() >= 2 * world[own].min():
            test = own & (world == world[own].max())
            # a quarter of the largest, as the larger-cluster split asks, where there is one
            ratio = 4 if world[own].max() >= 4 * world[own].min() else 2
            smaller = own & (world <= world[own].max() / ratio)
            kinds["cluster"].append(((timed & (families != family)) | smaller, test))
        sizes = np.unique(params[own])
        if len(sizes) >= 2 and sizes[-1] >= 1.5 * sizes[0]:
            test = own & (params == sizes[-1])
            kinds["model"].append((timed & ~test, test))
    if len(names) > 1:
        kinds["family"] = [(timed & (families != f), timed & (families == f)) for f in names]
    folds = []
    for i in range(max(map(len, kinds.values()), default=0)):
        folds.extend(kind[i] for kind in kinds.values() if i < len(kind))
    folds = [(tr, te) for tr, te in folds if tr.sum() >= 20 and te.sum() >= 5]
    return folds[:max_folds]


def calibrate_widening(frame: pd.DataFrame, fit_predict: Callable[[Any, Any], Any], *,
                       families: np.ndarray, timed: np.ndarray, step: np.ndarray,
                       coverage: float) -> dict[str, dict[str, float]]:
    """Log margins that widen the interval with distance, from nested splits of ``frame``.

    Args:
        frame: The training rows.
        fit_predict: ``(train_frame, test_frame) -> predictions`` of the interval to widen:
            ``step_lo``, ``step_hi`` (arrays of the step time), the cross-family model's
            ``step_lo_cross``, ``step_hi_cross``, ``unknown_family`` and, per
            axis of :data:`AXES`, ``distance_<axis>`` as the fitted part measures them.
        families: Each row's measurement family.
        timed: Rows with a measured step time.
        step: Measured step times.
        coverage: Target share of runs inside the interval (0.8 for q10-q90).

    Returns:
        Per family (and ``""``: all families pooled): ``hi_<axis>``, ``lo_<axis>`` (log
        margin per doubling beyond the range of that axis, on the slow and the fast side;
        the pooled entry also ``hi_cross_<axis>``, ``lo_cross_<axis>``: those of the
        cross-family model, which predicts a family without measurements on the analytical
        estimate, measured on the same nested rows),
        ``hi_family``, ``lo_family`` (log margin where the family has no measurement) and
        ``nested_rows``. A margin the nested rows do not say (no nested fold of that kind)
        is the pooled one, else the prior :data:`PRIOR_MARGIN_PER_DOUBLING` or
        :data:`PRIOR_FAMILY_MARGIN`. The pooled entry also holds ``coverage_level``, the
        share of the pooled nested rows the margins leave inside (see
        :func:`covering_margins`).
    """
    values = axis_values(frame)
    parts = []
    for train, test in nested_folds(values, families, timed):
        pred = fit_predict(frame[train], frame[test])
        m = step[test]
        per_axis = {a: np.asarray(pred[f"distance_{a}"], dtype=float) for a in AXES}
        d, link, regime = blend_distances(per_axis)
        unknown = np.asarray(pred["unknown_family"], dtype=bool)
        parts.append({**{f"d_{a}": v for a, v in per_axis.items()},
                      "unknown": unknown, "family": families[test], "measured": m,
                      "step": np.asarray(pred["step"], dtype=float),
                      "core": np.asarray(pred["core"], dtype=float),
                      "blendable": np.asarray(pred["blendable"], dtype=bool), "d": d,
                      "link": link, "regime": regime,
                      "hi": np.asarray(pred["step_hi"], dtype=float),
                      "lo": np.asarray(pred["step_lo"], dtype=float),
                      "over_cross": np.log(m / np.asarray(pred["step_hi_cross"], dtype=float)),
                      "under_cross": np.log(np.asarray(pred["step_lo_cross"], dtype=float)
                                            / m)})
    shrink = {"": _shrink(parts, None)}
    for family in sorted({str(f) for f in families[timed]}):
        own = _shrink(parts, family)
        shrink[family] = {k: own.get(k, shrink[""].get(k, PRIOR_SHRINK[k]))
                          for k in PRIOR_SHRINK}
    shrink[""] = {k: shrink[""].get(k, PRIOR_SHRINK[k]) for k in PRIOR_SHRINK}
    for part in parts:
        rate = np.asarray([shrink.get(str(f), shrink[""])["shrink_per_doubling"]
                           for f in part["family"]])
        weight = np.asarray([shrink.get(str(f), shrink[""])["core_weight_family"]
                             for f in part["family"]])
        factor = blend_factor(part["step"], part["core"], part["d"], part["unknown"],
                              part["blendable"], rate=rate, family_weight=weight,
                              link=part["link"], regime=part["regime"])
        # the interval spans the learned prediction and the one moved toward the core
        part["over"] = np.log(part["measured"] / np.maximum(part["hi"] * factor, part["hi"]))
        part["under"] = np.log(np.minimum(part["lo"] * factor, part["lo"]) / part["measured"])
    out, level = covering_margins(parts, sorted({str(f) for f in families[timed]}), coverage)
    out[""]["coverage_level"] = level
    for family, entry in shrink.items():
        out[family].update(entry)
    return out


COVERAGE_STEPS = (0.0, 0.04, 0.08, 0.12, 0.16)
"""How far above the target the share the margins leave inside on the nested rows may be
raised (see :func:`covering_margins`), at most to :data:`MAX_COVERAGE_LEVEL`."""
MAX_COVERAGE_LEVEL = 0.98


def covering_margins(parts: list[dict[str, np.ndarray]], names: list[str], coverage: float
                     ) -> tuple[dict[str, dict[str, float]], float]:
    """Margins under which every nested fold covers at least ``coverage`` of its runs, by
    one standard error of its share.

    The margins are set to leave ``level`` of the pooled nested rows inside the interval,
    ``level`` the lowest of ``coverage`` plus :data:`COVERAGE_STEPS` at which each nested
    fold (``parts``) on its own has at least ``coverage`` inside: the target holds in every
    extrapolation split, not on their average, and a fold that extrapolates worse than the
    others (a cluster where the regimes shift) widens the interval for all.

    A fold's share is measured on a few hundred runs or fewer, and the split the margins are
    for is one more draw of the same kind: margins that leave a fold exactly ``coverage``
    inside leave the split it stands for under the target about as often as over it. Each
    fold must therefore hold the target with one standard error of its share to spare
    (``sqrt(p (1-p) / n)``, 2.5 points for 256 runs at 0.8). Without it, the Ultra-Scale
    <= 128 -> 256 GPUs split read 79.3% on one model seed of five (its nested folds held
    80.0% at the target level); with it, 91.0-96.9%. No point prediction or ranking moved,
    and no other split's coverage fell (``experiments/extrapolation.py --model-seeds 5``).

    Args:
        parts: Per nested fold, its test rows' ``family``, ``unknown``, ``d_<axis>`` and the
            log misses ``over`` and ``under`` of the unwidened interval.
        names: The training rows' families.
        coverage: The target share inside (0.8 for q10-q90).

    Returns:
        ``(margins, level)``: the margins per family as :func:`calibrate_widening` returns
        them (without the shrink entries), and the level they were set at.
    """
    margins, level = {}, coverage
    for step in COVERAGE_STEPS:
        level = min(coverage + step, MAX_COVERAGE_LEVEL)
        margins = _all_margins(parts, names, level)
        if not parts or all(_part_coverage(part, margins) - _sampling_error(part, coverage)
                            >= coverage for part in parts):
            break
    return margins, level


def _all_margins(parts: list[dict[str, np.ndarray]], names: list[str], coverage: float
                 ) -> dict[str, dict[str, float]]:
    """The margins of every family in ``names`` and the pooled ones (``""``) that leave
    ``coverage`` of the nested rows inside."""
    prior = {**{f"{side}_{a}": PRIOR_MARGIN_PER_DOUBLING for side in ("hi", "lo")
                for a in AXES},
             "hi_family": PRIOR_FAMILY_MARGIN, "lo_family": PRIOR_FAMILY_MARGIN}
    pooled = _margins(parts, None, coverage)
    out = {"": {k: pooled.get(k, v) for k, v in prior.items()}}
    # the cross-family model's own margins per doubling, where the nested rows say them,
    # else the other models' (a family without measurements takes the pooled entry)
    for side in ("hi", "lo"):
        for a in AXES:
            out[""][f"{side}_cross_{a}"] = pooled.get(f"{side}_cross_{a}",
                                                      out[""][f"{side}_{a}"])
    out[""]["nested_rows"] = pooled["nested_rows"]
    for family in names:
        own = _margins(parts, family, coverage)
        # a family's own margins where its nested rows say them, else the pooled ones
        # (at least the prior where none of its own says it: another family's nested rows
        # say how that family extrapolates, not how this one does)
        out[family] = {k: own[k] if k in own else max(out[""][k], prior[k]) for k in prior}
        out[family]["nested_rows"] = own["nested_rows"]
    return out


def _sampling_error(part: dict[str, np.ndarray], coverage: float) -> float:
    """One standard error of a share near ``coverage`` measured on a nested fold's runs
    (those with both log misses; 0 for a fold without any, whose share is 1)."""
    n = int(np.sum(np.isfinite(part["over"]) & np.isfinite(part["under"])))
    return float(np.sqrt(coverage * (1.0 - coverage) / n)) if n else 0.0


def _part_coverage(part: dict[str, np.ndarray], margins: dict[str, dict[str, float]]
                   ) -> float:
    """The share of a nested fold's runs inside the interval widened by ``margins``."""
    good = np.isfinite(part["over"]) & np.isfinite(part["under"])
    if not good.any():
        return 1.0
    hi = np.zeros(len(good))
    lo = np.zeros(len(good))
    for family in _distinct(part["family"]):
        rows = part["family"] == family
        entry = margins.get(str(family), margins[""])
        for a in AXES:
            hi[rows] += entry[f"hi_{a}"] * part[f"d_{a}"][rows]
            lo[rows] += entry[f"lo_{a}"] * part[f"d_{a}"][rows]
        hi[rows] += entry["hi_family"] * part["unknown"][rows]
        lo[rows] += entry["lo_family"] * part["unknown"][rows]
    inside = (part["over"] <= hi + 1e-12) & (part["under"] <= lo + 1e-12)
    return float(np.mean(inside[good]))


SHRINK_GRID = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 8.0)
"""Shrink rates per doubling :func:`calibrate_widening` chooses among."""
WEIGHT_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Weights of the calibrated core for a family without measurements it chooses among."""
PRIOR_SHRINK = {"shrink_per_doubling": 0.0, "core_weight_family": 0.0}
"""Where no nested fold says otherwise, the learned correction is kept."""


def blend_distances(per_axis: dict[str, np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's doublings per axis (:data:`AXES`) as :func:`blend_factor` takes them: those
    moved at the family's rate (every axis but the links' and the regimes'), the links'
    (:data:`LINK_AXES`, summed) and the regimes' (:data:`REGIME_AXES`, summed)."""
    d = sum(np.asarray(v, dtype=float) for a, v in per_axis.items()
            if a not in (*LINK_AXES, *REGIME_AXES))
    link = sum(np.asarray(per_axis[a], dtype=float) for a in LINK_AXES)
    regime = sum(np.asarray(per_axis[a], dtype=float) for a in REGIME_AXES if a in per_axis)
    return d, link, regime


def blend_factor(step: np.ndarray, core: np.ndarray, d: np.ndarray, unknown: np.ndarray,
                 blendable: np.ndarray, *, rate: Any, family_weight: Any,
                 link: Any = 0.0, regime: Any = 0.0) -> np.ndarray:
    """The factor that moves ``step`` (the learned prediction) toward ``core`` (the calibrated
    analytical core) in log space by ``1 - exp(-rate * d - LINK_SHRINK_PER_DOUBLING * link)``
    of the way for a row ``d`` doublings beyond the training ranges of model, cluster and
    batch size and ``link`` doublings beyond the nodes its groups spanned (:data:`LINK_AXES`),
    and at least ``family_weight`` of it for a row of a family without measurements; all of
    it for a row beyond the data-parallel regimes or context-parallel degrees fitted on
    (``regime`` > 0, see :data:`REGIME_AXES`); 1 where a row is not ``blendable`` (a point
    prediction in the stalled regime, or no core)."""
    share = 1.0 - np.exp(-np.asarray(rate, dtype=float) * d
                         - LINK_SHRINK_PER_DOUBLING * np.asarray(link, dtype=float))
    share = np.where(unknown, 1.0 - (1.0 - share) * (1.0 - np.asarray(family_weight,
                                                                       dtype=float)), share)
    share = np.where(np.asarray(regime, dtype=float) > 0, 1.0, share)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_gap = np.log(core / step)
    ok = blendable & np.isfinite(log_gap)
    return np.where(ok, np.exp(share * np.where(ok, log_gap, 0.0)), 1.0)


def _shrink(parts: list[dict[str, np.ndarray]], family: str | None) -> dict[str, float]:
    """The shrink rate and unmeasured-family weight that minimise the median absolute
    percentage error of the nested rows of ``family`` (all for ``None``) beyond the ranges;
    a figure they do not say is missing from the result."""
    out: dict[str, float] = {}
    if not parts:
        return out

    def cat(key: str) -> np.ndarray:
        values = np.concatenate([p[key] for p in parts])
        pick = np.concatenate([(p["family"] == family) if family is not None
                               else np.ones(len(p["d"]), dtype=bool) for p in parts])
        return values[pick]

    step, core, m, d = cat("step"), cat("core"), cat("measured"), cat("d")
    unknown, blendable, link = cat("unknown"), cat("blendable"), cat("link")
    regime = cat("regime")
    good = np.isfinite(step) & np.isfinite(m) & blendable & np.isfinite(core)

    def error(sel: np.ndarray, rate: float, weight: float) -> float:
        factor = blend_factor(step[sel], core[sel], d[sel], unknown[sel], blendable[sel],
                              rate=rate, family_weight=weight, link=link[sel],
                              regime=regime[sel])
        return float(np.median(np.abs(step[sel] * factor / m[sel] - 1.0)))

    far = good & ~unknown & (d > 0)
    if far.sum() >= 10:
        out["shrink_per_doubling"] = min(SHRINK_GRID, key=lambda r: (error(far, r, 0.0), r))
    fam = good & unknown
    if fam.sum() >= 10:
        out["core_weight_family"] = min(WEIGHT_GRID, key=lambda w: (error(fam, 0.0, w), w))
    return out


PRIOR_MARGIN_PER_DOUBLING = 0.2
"""Log margin per doubling beyond a range where no nested fold measures one (about 22% per
doubling: the independent check of a 10x larger model, 3.3 doublings, found a median error of
59%, a log error of about 0.9, or 0.27 per doubling, for a model with a narrower interval)."""
PRIOR_FAMILY_MARGIN = float(np.log(2.0))
"""Log margin for a family with no measurement where no nested family fold measures one: its
efficiency within a factor of two of the measured families'."""


def _margins(parts: list[dict[str, np.ndarray]], family: str | None, coverage: float
             ) -> dict[str, float]:
    """The margins of :func:`calibrate_widening` the nested rows of ``family`` (all of them
    for ``None``) say; a margin they do not say is missing from the result."""
    out: dict[str, float] = {"nested_rows": 0.0}
    if not parts:
        return out
    pick = np.concatenate([(p["family"] == family) if family is not None
                           else np.ones(len(p["unknown"]), dtype=bool) for p in parts])
    per_axis = {a: np.concatenate([p[f"d_{a}"] for p in parts])[pick] for a in AXES}
    d = sum(per_axis.values())
    unknown = np.concatenate([p["unknown"] for p in parts])[pick]
    tail = (1.0 - coverage) / 2.0
    for side, key in (("over", "hi"), ("under", "lo"), ("over_cross", "hi_cross"),
                      ("under_cross", "lo_cross")):
        if any(side not in p for p in parts):
            continue
        miss = np.concatenate([p[side] for p in parts])[pick]
        good = np.isfinite(miss)
        # an unmeasured family: the margin that leaves the tail's share of its runs outside
        # (its rows are the cross-family model's already)
        fam = good & unknown
        if fam.any() and not side.endswith("_cross"):
            margin = float(np.quantile(np.maximum(miss[fam], 0.0), 1.0 - tail))
            out[f"{key}_family"] = min(margin, MAX_MARGIN_PER_DOUBLING)
        # a measured family beyond an axis's range: the margin per doubling each run needs
        # (a run beyond several ranges shares its need among them by their doublings)
        for axis, d_axis in per_axis.items():
            far = good & ~unknown & (d_axis > 0)
            if far.any():
                need = np.maximum(miss[far], 0.0) / d[far]
                out[f"{key}_{axis}"] = float(np.clip(np.quantile(need, 1.0 - tail),
                                                     MIN_MARGIN_PER_DOUBLING,
                                                     MAX_MARGIN_PER_DOUBLING))
    out["nested_rows"] = float(pick.sum())
    return out
