"""The library functions behind ``paratune fit``, ``paratune calibrate`` and
``paratune evaluate``."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from paratune.errors import ConfigError
from paratune.models._base import MEMORY_OOM_FLOOR, MEMORY_RULE_THRESHOLD, source_family
from paratune.models._calibration import MIN_ROWS
from paratune.models._data import check_distinct, load_measurements, measured_step_time
from paratune.models._estimators import PerformanceModel, _few_shot_rows, estimator_factories
from paratune.models._evaluate import EvaluationResult, cross_validate, plot_predictions
from paratune.models._feature_columns import hardware_columns
from paratune.models._persistence import _LOCK_FILE, _MANIFEST

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EvaluationSpec", "calibrate_model", "evaluate_model", "fit_model", "plot_path"]


def fit_model(data: Sequence[str | Path], out: str | Path, *, n_estimators: int | None = None,
              experiment: str | None = "paratune-fit", force: bool = False
              ) -> tuple[PerformanceModel, str]:
    """Fit a :class:`PerformanceModel` on measurements, save it, and log the run to MLflow.

    Args:
        data: Dataset directories or public CSVs.
        out: Model directory to write.
        n_estimators: Trees of the step-time model (its auxiliary boosters get a quarter,
            10 to 100; ``None``: the defaults).
        experiment: MLflow experiment; ``None`` skips tracking.
        force: Replace the model already saved in ``out``.

    Returns:
        The fitted model and a short text summary.

    Raises:
        ConfigError: ``out`` is a file, a directory with other files in it, or holds a model
            (without ``force``); checked before the MLflow run opens.
        FileNotFoundError, PermissionError: a ``data`` path is missing or unreadable
            (before the MLflow run opens).
        DatasetError: a ``data`` path is given twice (before the MLflow run opens).
    """
    _check_out(Path(out), force=force)
    _check_readable(data)
    model = estimator_factories(n_estimators=n_estimators)["performance_model"]()
    with contextlib.ExitStack() as stack:
        run = None
        if experiment:  # opened before the work: a failure or an interrupt leaves its record
            from paratune.tracking import run_note, start_run

            run = stack.enter_context(start_run(experiment, run_name="fit", params={
                **model.get_params(), "seed": model.get_params()["random_state"],
                "data": _paths(data), "out": str(Path(out).resolve())}))
        frame = load_measurements(data)
        model.fit(frame)
        model.save(out)
        if run is not None:
            run.log_params({"fingerprint": model.fingerprint_, "sources": model.sources_,
                            "stall_free_families": model.stall_free_families_})
        pred = model.predict(frame)
        step = measured_step_time(frame)
        ok = np.isfinite(step) & np.isfinite(pred["pred_step_time_s"].to_numpy(float))
        ape = np.abs(step[ok] / pred["pred_step_time_s"].to_numpy(float)[ok] - 1)
        fit_metrics = {"train_mdape": float(np.median(ape)) if ok.any() else np.nan,
                       "train_mape": float(ape.mean()) if ok.any() else np.nan,
                       "num_rows": float(len(frame)),
                       "num_time_rows": float(model.num_time_rows_),
                       "num_memory_rows": float(model.num_memory_rows_),
                       "num_stall_rows": float(model.num_stall_rows_),
                       "num_feasibility_configs": float(model.num_feasibility_rows_)}
        stalls = (f", {model.num_stall_rows_} of them stalled pipelines learned as their own "
                  "regime" if model.num_stall_rows_ else "")
        if model.stall_free_families_:
            stalls += (f", not applied to {', '.join(model.stall_free_families_)}, whose "
                       "pipeline runs never stalled")
        summary = (f"fitted on {len(frame)} rows ({model.num_time_rows_} timed{stalls}, "
                   f"{model.num_memory_rows_} with memory, {model.num_feasibility_rows_} "
                   f"configurations for feasibility) -> {out}\n"
                   f"in-sample median APE {100 * fit_metrics['train_mdape']:.1f}% "
                   f"(cross-validate with `paratune evaluate`)\n"
                   f"training-data fingerprint {model.fingerprint_[:16]}")
        calibrated = sorted({*model.family_offsets_, *model.memory_thresholds_})
        if calibrated:
            # families with a handful of runs beside measured ones: calibrated on
            summary += "".join(
                f"\ncalibrated on, too few runs to fit on (fewer than {MIN_ROWS}): {line}"
                for line in _calibrations(model, calibrated))
        # the handful of a family's runs calibrated on: those it left out, named
        few = _few_shot_rows(source_family(frame), np.isfinite(measured_step_time(frame)))
        summary += "".join(f"\n{line}" for line in _left_out(model, frame[few]))
        if run is not None:
            run.log_metrics(fit_metrics)
            # the model's files: not its lock, nor temporaries of a save killed there before
            manifest = json.loads((Path(out) / _MANIFEST).read_text())
            for name in [_MANIFEST, *sorted(manifest["components"].values())]:
                run.log_artifact(Path(out) / name, artifact_path="model")
            summary += (f"\nMLflow run {run.run_id} (experiment {experiment})"
                        if run.lost is None else f"\n{run_note(run)}")
    return model, summary


def calibrate_model(data: Sequence[str | Path], model_dir: str | Path) -> str:
    """Few-shot calibration of a saved model on a handful of runs (see
    :meth:`PerformanceModel.calibrate`), saved back in place.

    Args:
        data: Dataset directories or public CSVs with the runs (one node's campaign of a
            framework or cluster is enough).
        model_dir: The saved model (the ``--out`` of ``paratune fit``).

    Returns:
        One line per family calibrated: its runs and what they set.

    Raises:
        ModelFormatError: ``model_dir`` holds no model this paratune reads.
        FileNotFoundError, PermissionError: a ``data`` path is missing or unreadable.
        DatasetError: no run has a measured step time and a prediction, nor ran out of
            memory at :data:`~paratune.models._base.MEMORY_OOM_FLOOR` of device memory or
            more as predicted.
    """
    from paratune.models._estimators import load_model

    _check_readable(data)
    model = load_model(model_dir)
    frame = load_measurements(data)
    model.calibrate(frame)
    model.save(model_dir)
    families = sorted(set(model._families(frame))
                      & {*model.family_offsets_, *model.memory_thresholds_})
    lines = [f"{line} -> {model_dir}" for line in _calibrations(model, families)]
    return "\n".join([*lines, *_left_out(model, frame)])


def _left_out(model: PerformanceModel, frame: pd.DataFrame) -> list[str]:
    """A warning per family of ``frame`` with runs out of memory that calibration left out
    of its memory threshold (see :meth:`PerformanceModel.out_of_memory_left_out`)."""
    return [f"warning: {family or 'runs of no known family'}: {len(shares)} run(s) out of "
            f"memory at {_percentages(shares)} of device memory as predicted, under "
            f"{100 * MEMORY_OOM_FLOOR:.0f}%, left out of its memory threshold (the prediction "
            "would have to be over four times too low): check their status and device"
            for family, shares in model.out_of_memory_left_out(frame).items()]


def _percentages(shares: Sequence[float]) -> str:
    """``[0.05, 0.1]`` as ``5%, 10%`` (the first three, then how many more)."""
    text = ", ".join(f"{100 * v:.0f}%" for v in shares[:3])
    return text + (f" and {len(shares) - 3} more" if len(shares) > 3 else "")


def _calibrations(model: PerformanceModel, families: Sequence[str]) -> list[str]:
    """One line per calibrated family of ``families``: its runs and what they set (its step
    time, its memory threshold or both)."""
    lines = []
    for family in families:
        said = []
        entry = model.family_offsets_.get(family)
        if entry is not None:
            if "efficiency" in entry:
                what = (f"its own constants: {entry['efficiency']:.3g}x the analytical step "
                        f"time + {1e3 * entry['layer_pass_s']:.3g} ms per layer pass")
            else:
                what = f"a factor of {np.exp(entry['log_factor']):.3g} on the step time"
            said.append(f"{entry['rows']} runs -> {what}; interval margin "
                        f"+/-{100 * (np.exp(entry['margin']) - 1):.0f}%")
            if family not in model.node_pipeline_families_ and hardware_columns(
                    model.calibrated_hardware_.get(family, []))["accelerator"].any():
                said.append("no pipeline across nodes among its runs -> such pipelines keep "
                            "the stall threshold in their interval's slow end")
        threshold = model.memory_thresholds_.get(family)
        if threshold is not None:
            said.append(f"runs out of memory -> out of memory from {100 * threshold:.0f}% of "
                        f"device memory as predicted (else {100 * MEMORY_RULE_THRESHOLD:.0f}%)")
        lines.append(f"{family or 'runs of no known family'}: {'; '.join(said)}")
    return lines


def _check_out(out: Path, *, force: bool) -> None:
    """Refuse an ``out`` that is a file, that holds other files, or that holds a model
    (unless ``force``): a fit never mixes its files with others or replaces a model unasked."""
    if out.exists() and not out.is_dir():
        raise ConfigError("out", str(out), "is a file; the model is written as a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    # model.json, or the lock or first booster of a save that died before its manifest
    if not any((out / name).is_file() for name in (_MANIFEST, "throughput.json", _LOCK_FILE)):
        raise ConfigError("out", str(out), "is a directory with other files in it, not a "
                          "saved model; give a new or empty directory")
    if not force:
        raise ConfigError("out", str(out), "already holds a saved model; give --force to "
                          "replace it, or another directory")


def _check_readable(data: Sequence[str | Path]) -> None:
    """Refuse a missing or unreadable input, or one given twice, before any work (and any
    MLflow run) starts."""
    import errno
    import os

    check_distinct(data)
    for path in map(Path, data):
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        if path.is_dir():
            os.listdir(path)  # PermissionError naming the directory
        else:
            with open(path, "rb"):
                pass


def plot_path(plot: str | Path) -> Path:
    """The file ``evaluate --plot`` writes: ``plot`` itself, with ``.png`` added where it has
    no extension, or ``predicted_vs_measured.png`` inside it where it is a directory.

    Raises:
        ConfigError: the extension is not an image format matplotlib writes.
    """
    path = Path(plot)
    if path.is_dir():
        return path / "predicted_vs_measured.png"
    if not path.suffix:
        return path.with_name(path.name + ".png")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ConfigError("plot", str(plot), f"must end in .png or another image format "
                          f"({', '.join(sorted(formats))})")
    return path


def _paths(data: Sequence[str | Path]) -> list[str]:
    """The ``data`` param of a run: every input path, absolute."""
    return [str(Path(d).resolve()) for d in data]


@dataclass(frozen=True)
class EvaluationSpec:
    """What ``paratune evaluate`` cross-validates, and how."""

    split: str = "random"
    """``random``, ``cluster``, ``model`` or an extrapolation split
    (:data:`paratune.models._splits.EXTRAPOLATION_SPLITS`)."""
    baselines: bool = False
    """Include the analytical, raw-config XGBoost and HistGradientBoosting baselines."""
    n_estimators: int | None = None
    """Trees per booster for every learned estimator (``None``: each one's default)."""
    folds: int = 5
    """Folds of the random split."""
    seed: int = 0
    """Seed of the random split."""
    model_seed: int = 0
    """Seed of every learned estimator's row and feature subsampling. On a fold beyond the
    data a few trees decide how a regime it never saw is priced, and a fold's figures move
    with it (``experiments/extrapolation.py --model-seeds`` gives the spread)."""


def evaluate_model(data: Sequence[str | Path], spec: EvaluationSpec | None = None, *,
                   plot: str | Path | None = None, experiment: str | None = "paratune-evaluate",
                   progress: bool | None = None) -> tuple[EvaluationResult, str | None]:
    """Cross-validate the performance model (and optionally the baselines) on measurements.

    Args:
        data: Dataset directories or public CSVs.
        spec: The split, the estimators and their size (``None``: the defaults of
            :class:`EvaluationSpec`).
        plot: PNG of predicted vs measured to write (``None``: none; see :func:`plot_path`).
        experiment: MLflow experiment; ``None`` skips tracking.
        progress: Show a progress bar of the fits on stderr (``None``: where stderr is a
            terminal).

    Returns:
        The :class:`EvaluationResult` and the MLflow run id (``None`` without tracking).

    Raises:
        FileNotFoundError, PermissionError: a ``data`` path is missing or unreadable
            (before the MLflow run opens).
        DatasetError: a ``data`` path is given twice (before the MLflow run opens).
        ConfigError: ``plot`` is not an image file name (see :func:`plot_path`).
    """
    spec = spec or EvaluationSpec()
    split, folds, seed = spec.split, spec.folds, spec.seed
    _check_readable(data)
    plot = plot_path(plot) if plot else None
    factories = estimator_factories(n_estimators=spec.n_estimators,
                                    random_state=spec.model_seed)
    if not spec.baselines:
        factories = {"performance_model": factories["performance_model"]}
    with contextlib.ExitStack() as stack:
        run = None
        if experiment:  # opened before the work: a failure or an interrupt leaves its record
            from paratune.tracking import start_run

            # the performance model's settings as fit logs them (the trees resolved, not the
            # flag's None), so that a fit and an evaluation of one setting share its keys;
            # folds and seed only where they apply (the random split)
            params = {**factories["performance_model"]().get_params(), "split": split,
                      "data": _paths(data), "estimators": list(factories)}
            if split == "random":
                params.update(folds=folds, seed=seed)
            run = stack.enter_context(start_run(experiment, run_name=f"evaluate-{split}",
                                                params=params))
        frame = load_measurements(data)
        result = cross_validate(frame, split=split, estimators=factories, n_splits=folds,
                                random_state=seed, progress=progress)
        if plot:
            plot_predictions(result, plot)
        if run is not None:
            import pandas as pd

            for row in result.summary + result.by_fold:
                prefix = "_".join(str(row[k]) for k in ("estimator", "source", "held_out")
                                  if row.get(k))
                # a fold's label (``ultrascale: <=64 -> 256 GPUs``) as an MLflow key allows it
                prefix = re.sub(r"[^A-Za-z0-9_.\-/]+", "_", prefix).strip("_")
                run.log_metrics({f"{prefix}.{k}": v for k, v in row.items()
                                 if k not in ("estimator", "source", "held_out")})
            run.log_table(pd.DataFrame(result.summary + result.by_fold), "metrics.csv")
            if plot:
                run.log_artifact(plot)
    return result, run.run_id if run is not None and run.lost is None else None
