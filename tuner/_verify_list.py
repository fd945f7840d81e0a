"""Choosing what to verify: the risk-aware ranking, the verification order over layouts and
the short list of configs paratune's trainer can run."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.predictor import throughput_quantile_columns
from paratune.tuner._efficiency import positive_int

if TYPE_CHECKING:
    import pandas as pd

    from paratune.spec import ModelSpec

__all__ = ["LAYOUT_COLUMNS", "LAYOUT_DISCOUNT", "RISK_QUANTILE", "check_num_configs",
           "risk_aware_ranking", "trainer_runnable", "verification_order", "verify_list",
           "verify_positions"]

# the verification's modules log under one name, the one users and their filters know
logger = logging.getLogger("paratune.tuner._verify")


def check_num_configs(k: object) -> int:
    """``k`` when it is a positive number of configs to verify.

    Raises:
        ConfigError: ``k`` is not a positive integer (field ``verify``).
    """
    return positive_int("verify", k, "must be a positive number of configs")


LAYOUT_COLUMNS = ("tp", "pp")
"""What makes two configs of one job different layouts (the data-parallel degree follows from
them on a given device count); micro-batch size, sharding, recomputation and schedule are
variants of a layout."""


LAYOUT_DISCOUNT = 0.95
"""How much less a layout's second config counts than its first in the verification order
(its third config ``0.95**2``, ...). Chosen on the extrapolation splits of the public data
(``experiments/verify_budget.py``): 0.95 needed the fewest verified runs of 0, 0.5, 0.8,
0.9, 0.95 and 1 (no diversity)."""

RISK_QUANTILE = "q10"
"""The lower throughput quantile of the risk-aware ranking (:func:`risk_aware_ranking`) with
the performance model's default quantiles; one fitted with others ranks by its lowest."""


def risk_aware_ranking(ranked: pd.DataFrame, *, quantile: str | None = None
                       ) -> pd.DataFrame:
    """Re-rank by the risk-aware expectation, for a search where the model extrapolates.

    Each config's objective is scaled by ``sqrt(q / t)``, ``t`` its ranked throughput (the
    expected, stall-weighted one) and ``q`` its lower ``quantile``: under the throughput
    objective the geometric mean of the expected throughput and its lower quantile
    (:func:`paratune.models.risk_aware_throughput`), under goodput the same times the
    statistical efficiency; either times the probability of running, which the objective
    carries (:meth:`~paratune.tuner.Objective.score`). A config the model is unsure of (a
    wide interval: a regime or a layout it saw little of) ranks below one predicted nearly
    as fast with confidence;
    where the model is sure the order is the expected one. Safety is bought with at most
    :data:`paratune.models.RISK_AWARE_WITHIN` of the best expected objective: the feasible
    configs within it (``risk_candidate``, :func:`paratune.models.risk_aware_candidates`)
    rank before those further behind. Feasible configs stay first; ``rank`` and ``vs_best``
    are recomputed.

    Args:
        ranked: A ranking with ``objective``, ``ranked_tokens_per_s``, ``world_size``,
            ``feasible`` and the predictor's ``pred_tokens_per_sec_per_gpu_<quantile>``.
        quantile: The lower quantile (``q10``); ``None``: the lowest the predictor gives
            (:data:`RISK_QUANTILE` from a model with the default quantiles).

    Returns:
        The re-ranked frame (unchanged where the predictor gives no such quantile): its
        ``objective``, ``ranked_tokens_per_s`` and ``goodput`` are the risk-aware ones,
        ``objective_expected``, ``expected_tokens_per_s`` and ``goodput_expected`` the ones
        before.
    """
    import numpy as np

    from paratune.models import risk_aware_candidates, risk_aware_throughput
    from paratune.tuner._search import rank

    if quantile is None:
        lowest = throughput_quantile_columns(ranked.columns)[:1]
        column = lowest[0] if lowest else ""
    else:
        column = f"pred_tokens_per_sec_per_gpu_{quantile}"
    if ranked.empty or column not in ranked.columns:
        return ranked
    low = ranked[column].to_numpy(dtype=float) * ranked["world_size"].to_numpy(dtype=float)
    expected = ranked["ranked_tokens_per_s"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = risk_aware_throughput(expected, low) / expected
    # no throughput: the expected objective stands
    factor = np.where(np.isfinite(factor), factor, 1.0)
    objective = ranked["objective"].to_numpy(dtype=float)
    feasible = ranked["feasible"].to_numpy(dtype=bool)
    candidate = risk_aware_candidates(np.where(feasible, objective, np.nan)) & feasible
    out = ranked.drop(columns=["rank", "vs_best"], errors="ignore").assign(
        objective_expected=objective, objective=objective * factor,
        expected_tokens_per_s=expected, ranked_tokens_per_s=expected * factor,
        risk_candidate=candidate)
    if "goodput" in out.columns:  # the ranked throughput's: shown and recorded with it
        goodput = ranked["goodput"].to_numpy(dtype=float)
        out = out.assign(goodput_expected=goodput, goodput=goodput * factor)
    return rank(out)


def verification_order(ranked: pd.DataFrame, *, discount: float = LAYOUT_DISCOUNT
                       ) -> list[int]:
    """The order in which to verify a ranking's configs on the target cluster.

    The ranked quantity (``objective``) of the ``n``-th best config of each layout
    (:data:`LAYOUT_COLUMNS`) is discounted by ``discount**n`` before sorting, feasible configs
    first: a layout whose best config is predicted nearly as good as another layout's second
    is verified before it, so a model that is wrong about a layout (an extrapolation: a
    stalled pipeline it did not see, tensor parallelism across a link it never measured)
    costs one verified run, not one per micro-batch variant of that layout; a layout
    predicted far behind still waits. ``discount=1`` is the rank order itself; ``0`` takes
    the best config of every layout before a second of any. After a risk-aware ranking
    (:func:`risk_aware_ranking`, where the model extrapolates) its rank 1 comes first, the
    config ``tune`` recommends, and the rest go by their expected objective: the risk-aware
    one holds back the layouts the model knows least, where an extrapolation's measured
    best often is (on the extrapolation splits of the public data the verified runs to get
    within 5% of the best fell from a mean of 4.9 to 2.0 for the larger model, the others
    staying between 1.0 and 2.3; ``experiments/verify_budget.py``).

    Args:
        ranked: A ranking (:attr:`paratune.tuner.SearchResult.ranked`, best first), with
            the layout columns and ``objective``.
        discount: In ``[0, 1]``.

    Returns:
        Every position of ``ranked`` (``0`` = rank 1), in verification order.

    Raises:
        ConfigError: ``discount`` is outside ``[0, 1]``.
    """
    import numpy as np

    if not (isinstance(discount, (int, float)) and 0.0 <= discount <= 1.0):
        raise ConfigError("discount", discount, "must be in [0, 1]")
    if ranked.empty or discount == 1.0:
        return list(range(len(ranked)))
    # after a risk-aware ranking's own choice (rank 1), the configs that follow are explored
    # by their expected objective: the risk-aware one ranks first what the model is sure of,
    # which is the right first run, but it pushes back the layouts it knows least, where
    # the measured best of an extrapolation often is
    explore = "objective_expected" if "objective_expected" in ranked.columns else "objective"
    score = np.nan_to_num(ranked[explore].to_numpy(dtype=float), nan=0.0)
    feasible = (ranked["feasible"].to_numpy(dtype=bool) if "feasible" in ranked.columns
                else np.ones(len(ranked), dtype=bool))
    # a layout's n-th config in the order of that score, feasible ones first (the rank
    # order itself where the score is the ranked objective)
    if explore == "objective":
        by_score = np.arange(len(ranked))
    else:
        by_score = np.lexsort((np.arange(len(ranked)), -score, ~feasible))
    layouts = ranked[list(LAYOUT_COLUMNS)].astype(int).astype(str).agg("|".join, axis=1)
    in_order = layouts.iloc[by_score]
    rounds = np.empty(len(ranked), dtype=int)
    rounds[by_score] = in_order.groupby(in_order.to_numpy()).cumcount().to_numpy()
    weight = np.where(rounds == 0, 1.0, float(discount) ** rounds)
    # ties (a discount of 0) go by round, then by rank
    order = sorted(range(len(ranked)),
                   key=lambda i: (not feasible[i], -score[i] * weight[i], rounds[i], i))
    if explore != "objective":
        order.remove(0)
        order.insert(0, 0)
    return order


def verify_list(ranked: pd.DataFrame, k: int, *, discount: float = LAYOUT_DISCOUNT
                ) -> list[int]:
    """The first ``k`` positions of :func:`verification_order`: the short list of configs to
    verify on the target cluster (feasible ones first, as the ranking puts them).

    Raises:
        ConfigError: ``k`` is not a positive integer (field ``verify``).
    """
    k = check_num_configs(k)
    return verification_order(ranked, discount=discount)[:k]


def trainer_runnable(configs: Sequence[ParallelConfig], model: ModelSpec, k: int
                     ) -> list[int]:
    """Positions of the first ``k`` of ``configs`` that paratune's trainer can run (it
    measures them); the ones it skips are logged with the reason, as a warning where it is
    the first (the recommendation), and so is a list shorter than ``k``."""
    out = []
    for position, cfg in enumerate(configs):
        if len(out) == k:
            break
        try:
            cfg.check_trainer(model)
        except ConfigError as exc:
            if position == 0:
                logger.warning("the first of the list, %s, is not verified: paratune's "
                               "trainer does not run it (%s); the next ones are", cfg.key(),
                               exc)
            else:
                logger.info("not verified: %s (%s)", cfg.key(), exc)
            continue
        out.append(position)
    if 0 < len(out) < k:
        logger.warning("%d of the %d configs asked for are verified: paratune's trainer runs "
                       "no more of the %d ranked", len(out), k, len(configs))
    return out


def verify_positions(ranked: pd.DataFrame, configs: list[ParallelConfig], model: ModelSpec,
                     k: int) -> list[int]:
    """The first ``k`` positions of the verification order that paratune's trainer runs.

    Raises:
        ConfigError: none of them can run in paratune's trainer (field ``verify``).
    """
    order = verification_order(ranked)
    runnable = trainer_runnable([configs[i] for i in order], model, k)
    if not runnable:
        raise ConfigError("verify", k, "none of the ranked configs can run in paratune's "
                          "trainer (see ParallelConfig.check_trainer): nothing to measure")
    return [order[j] for j in runnable]
