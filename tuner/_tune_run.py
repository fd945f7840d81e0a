"""The MLflow run of a tuning: opened with every input that decides the answer, before the
work; the outcome (metrics, tables, plots, the recommendation's files) logged after it."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.tuner._objective import Objective

if TYPE_CHECKING:
    import optuna

    from paratune.tuner._requests import OutputOptions, SearchOptions
    from paratune.tuner._space import SearchSpace
    from paratune.tuner._tune import TuneResult

__all__ = ["log_outcome", "open_run"]

logger = logging.getLogger("paratune.tuner._tune")


def open_run(stack: contextlib.ExitStack, space: SearchSpace, objective: Objective,
             predictor: dict[str, Any], *, search: SearchOptions, output: OutputOptions,
             study: optuna.Study | None, tracking_uri: str | None) -> Any:
    """Open the ``paratune-tune`` run with every input that decides the answer.

    The job's params are those of the resolved space and objective; the search's and the
    output's come from their fields (:meth:`SearchOptions.params`). For an Optuna search,
    the ``study`` already opened gives its name and storage, and the tag
    ``paratune.resumed`` says whether it already held finished trials (a rerun, or another
    worker's), counted in ``paratune.prior_trials``.
    """
    from paratune.tracking import start_run
    from paratune.tuner._study import _finished, storage_text

    params = {"model": space.model.name, "seq_len": space.model.seq_len,
              "gpus": space.world_size,
              "hardware": space.hardware.name, "devices_per_node": space.devices_per_node,
              "framework": space.framework, **predictor,
              "objective": objective.kind.value, "b_noise": objective.b_noise,
              "b0": objective.reference_batch(space), "risk_quantile": objective.risk_quantile,
              "min_feasible_prob": objective.min_feasible_prob,
              "memory_limit_gb": objective.memory_limit(space),
              "global_batch_sizes": list(space.global_batch_sizes),
              **search.params(), **output.params(), "space": space.space.to_dict()}
    gns = search.gns
    if isinstance(gns, (str, Path)) and not _is_number(gns):
        params["gns_trajectory"] = str(Path(gns).resolve())
    tags: dict[str, Any] = {}
    if study is not None:
        prior = len(_finished(study))
        params["study_name"] = study.study_name
        where = storage_text(search.storage, output.output_dir)
        # a journal file by its absolute path, as predictor and data are logged: two tunings
        # started from different folders keep different studies
        params["storage"] = (where if where is None or "://" in where
                             else str(Path(where).resolve()))
        tags = {"paratune.resumed": str(prior > 0).lower(), "paratune.prior_trials": prior}
    name = f"tune-{space.model.name}-{space.world_size}x{space.hardware.name}"
    return stack.enter_context(start_run("paratune-tune", run_name=name, params=params,
                                         tags=tags, tracking_uri=tracking_uri))


def _is_number(text: Any) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def log_outcome(run: Any, out: TuneResult, space: SearchSpace, objective: Objective, *,
                 top_k: int) -> None:
    """The search's metrics and artifacts on the run :func:`_open_run` opened."""
    result = out.search
    best = result.best_row
    run.log_metrics({
        "best_objective": best["objective"], "best_tokens_per_s": best["tokens_per_s"],
        "best_step_time_s": best["step_time_s"], "best_goodput": best["goodput"],
        "best_feasible": float(bool(best["feasible"])),
        "num_trials": result.num_trials, "num_pruned": result.num_pruned,
        "num_configs": len(result.ranked), "search_wall_time_s": result.wall_time_s,
        "risk_aware": float(result.risk_aware)})
    run.log_dict(space.to_dict(), "space.json")
    run.log_dict(objective.to_dict(), "objective.json")
    run.log_dict(out.recommendation, "recommendation.json")
    run.log_table(result.top(top_k), "best_configs.csv")
    if out.study is not None:
        run.log_table(out.study.trials_dataframe(), "trials.csv")
        for title, fig in _study_figures(out.study):
            run.log_figure(fig, f"plots/{title}.png")
    else:
        run.log_table(result.ranked, "trials.csv")
    for path in out.outputs.values():
        run.log_artifact(path, "recommendation")


def _study_figures(study: optuna.Study) -> list[tuple[str, Any]]:
    """Optuna's optimisation history and parameter importances (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import warnings

    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    figures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # PED-ANOVA: importances in milliseconds where fANOVA's forest takes seconds.
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        for title, draw in (("optimization_history", ovm.plot_optimization_history),
                            ("param_importances", lambda s: ovm.plot_param_importances(
                                s, evaluator=evaluator))):
            try:
                ax = draw(study)
            except (ValueError, RuntimeError, ZeroDivisionError,
                    optuna.exceptions.OptunaError) as exc:
                logger.info("skipping the %s plot: %s", title, exc)
                continue
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            figures.append((title, fig))
    for _, fig in figures:
        plt.close(fig)
    return figures
