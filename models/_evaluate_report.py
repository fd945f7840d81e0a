"""Rendering of cross-validation results: the aligned text tables and the predicted-vs-measured
scatter plot (:mod:`paratune.models._evaluate` computes them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from paratune.models._data import measured_step_time
from paratune.models._splits import EXTRAPOLATION_SPLITS

if TYPE_CHECKING:
    import pandas as pd

    from paratune.models._evaluate import EvaluationResult

__all__ = ["EXTRAPOLATION_COLUMNS", "extrapolation_table", "fold_panels", "plot_panels",
           "plot_predictions", "summary_table"]


def _family(frame: pd.DataFrame) -> pd.Series:
    """The measurement source of each row (hardware when no source is recorded)."""
    if "source" in frame.columns:
        return frame["source"].astype(str)
    return frame["hardware"].astype(str)


EXTRAPOLATION_COLUMNS = {
    "n": "n", "mdape": "MdAPE%", "mape": "MAPE%", "spearman_group": "Spearman(group)",
    "regret_mean": "top-1 regret%", "regret_top5_mean": "top-5 regret%",
    "regret_risk_mean": "top-1 risk-aware%", "regret_risk_top5_mean": "top-5 risk-aware%",
    "coverage": "q10-q90 cover%", "ratio_median": "pred/meas", "feasibility_accuracy":
    "feasible acc%"}
"""The figures of an extrapolation fold, in the order (and with the headers) they print."""
_FRACTIONS = ("mdape", "mape", "regret_mean", "regret_top5_mean", "regret_risk_mean",
              "regret_risk_top5_mean", "coverage", "feasibility_accuracy")


def extrapolation_table(rows: list[dict[str, Any]], *, title: str) -> str:
    """Rows with ``estimator``, ``held_out`` (and optionally ``split``) and the figures of
    :func:`~paratune.models._evaluate.metrics` as an aligned table of
    :data:`EXTRAPOLATION_COLUMNS` (percentages)."""
    from paratune.table import format_table

    shown = []
    for row in rows:
        item = {k: row[k] for k in ("split", "estimator", "held_out") if k in row}
        for key in EXTRAPOLATION_COLUMNS:
            value = row.get(key, np.nan)
            item[key] = int(value) if key == "n" else (
                100.0 * value if key in _FRACTIONS else value)
        shown.append(item)
    columns = [k for k in ("split", "estimator", "held_out") if any(k in r for r in rows)]
    # percentages to a tenth of a point, ratios to three decimals: "0.0404" beside "0" read
    # as different precisions of the same figure
    formats = {key: ".1f" if key in _FRACTIONS else ".3f" for key in EXTRAPOLATION_COLUMNS}
    return format_table(shown, [*columns, *EXTRAPOLATION_COLUMNS],
                        headers=dict(EXTRAPOLATION_COLUMNS), floatfmt=formats, title=title)


def summary_table(result: EvaluationResult) -> str:
    """A cross-validation summary as an aligned text table (percentages): the
    extrapolation table for the extrapolation splits, else the figures per source and
    held-out group."""
    from paratune.table import format_table

    if result.split in EXTRAPOLATION_SPLITS:
        return extrapolation_table(result.by_fold, title=f"split={result.split}: tokens/s per "
                                   "device vs measured, per fold")
    rows = []
    for row in result.summary + result.by_fold:
        shown = {k: row[k] for k in ("estimator", "source", "held_out") if k in row}
        for key in ("mape", "mdape", "mape_step", "regret_mean", "regret_median",
                    "regret_q10_mean", "feasibility_accuracy", "stall_accuracy",
                    "mdape_mem"):
            shown[key] = 100.0 * row.get(key, np.nan)
        shown["spearman"] = row["spearman"]
        shown["n"] = int(row["n"])
        rows.append(shown)
    headers = {"mape": "MAPE%", "mdape": "MdAPE%", "mape_step": "MAPE(step)%",
               "regret_mean": "regret%", "regret_median": "regret median%",
               "regret_q10_mean": "regret(q10)%",
               "feasibility_accuracy": "feasible acc%",
               "stall_accuracy": "stall acc%", "mdape_mem": "memory MdAPE%",
               "spearman": "Spearman"}
    columns = ["estimator", "source", "held_out", "n", "mape", "mdape", "mape_step",
               "spearman", "regret_mean", "regret_median", "regret_q10_mean",
               "feasibility_accuracy", "stall_accuracy", "mdape_mem"]
    return format_table(rows, columns, headers=headers, floatfmt=".3g",
                        title=f"split={result.split}: tokens/s per device vs measured")


def plot_predictions(result: EvaluationResult, path: str | Path, *,
                     estimator: str | None = None) -> Path:
    """Scatter of predicted vs measured tokens/s per device (log-log).

    A cross-validation split draws one panel, a colour per source. An extrapolation split
    (:data:`~paratune.models._splits.EXTRAPOLATION_SPLITS`) draws a panel per fold, each
    titled with the fold's median APE, the runs that stalled (measured) apart from the
    others and each run's predicted q10-q90 as a vertical bar: where a fold's error comes
    from is seen at a glance.

    Args:
        result: A cross-validation result.
        path: PNG file to write.
        estimator: Which estimator's predictions; defaults to the first.

    Returns:
        The written path.
    """
    name = estimator or next(iter(result.predictions))
    oof = result.predictions[name]
    if result.split in EXTRAPOLATION_SPLITS:
        return plot_panels(fold_panels(oof), path, title=f"{name}, split={result.split}: "
                           "predicted vs measured, q10-q90 bars")
    return plot_panels([_panel(f"{name}, split={result.split} (out of fold)", oof,
                               by_source=True, figures=False)], path)


def plot_panels(panels: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Draw ``panels`` (of :func:`fold_panels`) side by side, three to a row, predicted vs
    measured tokens/s per device on log-log axes with the diagonal, and write them to
    ``path`` (PNG); ``title`` over them all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        measured, predicted = panel["measured"], panel["predicted"]
        if panel["bars"]:
            ax.vlines(measured, panel["lo"], panel["hi"], color="0.8", linewidth=0.6,
                      zorder=1)
        for label, sel in panel["groups"].items():
            if sel.any():
                ax.scatter(measured[sel], predicted[sel], s=6, alpha=0.6, label=label,
                           zorder=2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        finite = np.concatenate([measured, predicted])
        finite = finite[np.isfinite(finite) & (finite > 0)]
        if finite.size:
            lo, hi = _square_limits(finite)
            ax.plot([lo, hi], [lo, hi], color="black", linewidth=1)
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            ax.set_aspect("equal", adjustable="box")
            for axis in (ax.xaxis, ax.yaxis):
                # a panel of under two decades gets its ticks at 1, 2 and 5 (a decade's
                # ticks alone may miss it) in plain numbers; no minor tick is labelled,
                # whose labels would be written over each other
                if hi / lo < 100:
                    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("measured tokens/s per device")
        ax.set_ylabel("predicted tokens/s per device")
        ax.set_title(panel["title"], fontsize=9)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _square_limits(values: np.ndarray, *, pad: float = 1.3, span: float = 4.0
                   ) -> tuple[float, float]:
    """The same limits for both log axes of a panel: its points' range widened by ``pad``
    either side and to at least ``span`` (a ratio) around its geometric middle, so that the
    diagonal runs corner to corner and a source of three runs is as readable as one of 191."""
    lo, hi = float(values.min()) / pad, float(values.max()) * pad
    if hi / lo < span:
        middle = np.sqrt(lo * hi)
        lo, hi = middle / np.sqrt(span), middle * np.sqrt(span)
    return lo, hi


def fold_panels(predictions: pd.DataFrame, by: str = "fold") -> list[dict[str, Any]]:
    """One panel of :func:`plot_panels` per value of column ``by`` of ``predictions`` (a
    fold, or a ``source``), in order of appearance: the measured and predicted tokens/s per
    device of its timed runs, their q10 and q90, the runs measured stalled and the others,
    and a title with the value, the runs and their median APE."""
    values = predictions[by].astype(str).to_numpy()
    return [_panel(value, predictions[values == value], by_source=False)
            for value in dict.fromkeys(values)]


def _panel(title: str, rows: pd.DataFrame, *, by_source: bool,
           figures: bool = True) -> dict[str, Any]:
    from paratune.models import features as F

    step = measured_step_time(rows)
    tokens = rows["global_batch_size"].to_numpy(float) * rows["seq_len"].to_numpy(float)
    measured = tokens / (step * rows["world_size"].to_numpy(float))
    predicted = rows["pred_tokens_per_sec_per_gpu"].to_numpy(float)
    ok = np.isfinite(measured) & np.isfinite(predicted)
    part = rows[ok]
    measured, predicted = measured[ok], predicted[ok]
    lo, hi = (part[f"pred_tokens_per_sec_per_gpu_{q}"].to_numpy(float)
              if f"pred_tokens_per_sec_per_gpu_{q}" in part.columns
              else np.full(len(part), np.nan) for q in ("q10", "q90"))
    if by_source:
        family = _family(part).to_numpy()
        groups = {str(f): family == f for f in np.unique(family)}
    else:
        stalled = F.stalled_pipeline(part, step[ok])
        groups = {"normal runs": ~stalled, "stalled pipelines (measured)": stalled}
    if figures:
        mdape = float(np.median(np.abs(predicted / measured - 1.0))) if len(part) else np.nan
        title = f"{title}\n{len(part)} runs, median APE {100 * mdape:.1f}%"
    return {"title": title, "measured": measured, "predicted": predicted, "lo": lo, "hi": hi,
            "groups": groups, "bars": not by_source and bool(np.isfinite(lo).any())}
