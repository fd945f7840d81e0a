"""Where the model extrapolates: the risk-aware ranking and the short, diverse list of
configs to verify on the target cluster."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError
from paratune.tuner import verification_order, verify_list
from paratune.tuner._search import rank
from paratune.tuner._verify import risk_aware_ranking


def _ranked(rows):
    frame = pd.DataFrame(rows, columns=["tp", "pp", "micro_batch_size", "objective", "feasible"])
    return rank(frame.assign(world_size=8, ranked_tokens_per_s=frame["objective"]))


def test_a_layout_nearly_as_good_is_verified_before_a_second_micro_batch_variant():
    ranked = _ranked([(1, 1, 1, 100.0, True), (1, 1, 2, 99.0, True), (2, 1, 1, 97.0, True),
                      (1, 2, 1, 60.0, True), (1, 1, 4, 98.0, True)])
    # rank order: tp1 pp1 (100, 99, 98), tp2 (97), pp2 (60)
    assert list(ranked["objective"]) == [100, 99, 98, 97, 60]
    order = verification_order(ranked)
    # 99 * 0.95 < 97: the tp2 layout before the second tp1 variant; pp2, far behind, last
    assert [ranked["objective"].iloc[i] for i in order] == [100, 97, 99, 98, 60]
    assert verification_order(ranked, discount=1.0) == [0, 1, 2, 3, 4]
    # no discount at all: every layout's best first, in rank order
    assert [ranked["objective"].iloc[i] for i in verification_order(ranked, discount=0.0)] \
        == [100, 97, 60, 99, 98]


def test_verify_list_takes_feasible_configs_first_and_exactly_k():
    ranked = _ranked([(1, 1, 1, 100.0, True), (2, 1, 1, 150.0, False), (4, 1, 1, 90.0, True)])
    assert [ranked["tp"].iloc[i] for i in verify_list(ranked, 2)] == [1, 4]
    assert len(verify_list(ranked, 10)) == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"^verify="):
            verify_list(ranked, bad)
    with pytest.raises(ConfigError, match=r"^discount=2"):
        verification_order(ranked, discount=2)


def test_risk_aware_ranking_puts_an_uncertain_config_below_a_sure_one():
    ranked = _ranked([(1, 1, 1, 100.0, True), (2, 1, 1, 90.0, True)])
    # the first is predicted faster but its 10th percentile is far lower
    ranked["pred_tokens_per_sec_per_gpu_q10"] = [30.0 / 8, 80.0 / 8]
    out = risk_aware_ranking(ranked)
    assert list(out["tp"]) == [2, 1]
    assert out["objective"].tolist() == pytest.approx([(90 * 80) ** 0.5, (100 * 30) ** 0.5])
    assert out["objective_expected"].tolist() == [90.0, 100.0]
    assert list(out["rank"]) == [1, 2] and out["vs_best"].iloc[0] == 1.0
    # under the goodput objective its column follows the ranked throughput, so the table
    # and the recommendation show what was ranked
    halved = risk_aware_ranking(ranked.assign(goodput=ranked["objective"] * 0.5,
                                              objective=ranked["objective"] * 0.5))
    assert halved["goodput"].tolist() == pytest.approx(halved["objective"].tolist())
    assert halved["goodput_expected"].tolist() == [45.0, 50.0]
    # a predictor without the quantile: the ranking stands
    assert risk_aware_ranking(ranked.drop(columns="pred_tokens_per_sec_per_gpu_q10")) is not None
    assert list(risk_aware_ranking(ranked.drop(
        columns="pred_tokens_per_sec_per_gpu_q10"))["tp"]) == [1, 2]


def test_the_risk_aware_ranking_buys_safety_with_at_most_a_bounded_share_of_throughput():
    from paratune.models import RISK_AWARE_WITHIN

    # a deep pipeline whose slow end holds a stall (300 expected, q10 30), a shallower one
    # (250, q10 60) and tensor parallelism across nodes, slow but sure (130, q10 125)
    ranked = _ranked([(4, 8, 1, 300.0, True), (8, 4, 1, 250.0, True),
                      (32, 1, 1, 130.0, True), (2, 8, 1, 400.0, False)])
    ranked["pred_tokens_per_sec_per_gpu_q10"] = [30.0 / 8, 60.0 / 8, 125.0 / 8, 1.0]
    out = risk_aware_ranking(ranked)
    assert 250.0 >= (1 - RISK_AWARE_WITHIN) * 300.0 > 130.0
    # the surest of those within the bound of the best feasible first, then the rest of
    # them; the sure layout far behind after them although its risk-aware figure is highest
    assert list(out["tp"]) == [8, 4, 32, 2]
    assert list(out["risk_candidate"]) == [True, True, False, False]
    assert out["objective"].iloc[2] > out["objective"].iloc[0]
    # the infeasible 400 does not set the bound (it would leave the 300 alone within it)
    assert out["feasible"].tolist() == [True, True, True, False]


def test_after_the_risk_aware_choice_the_list_explores_by_the_expected_objective():
    # tp1 is sure (q10 close), tp2 and tp4 unsure but expected faster
    ranked = _ranked([(1, 1, 1, 100.0, True), (2, 1, 1, 130.0, True), (4, 1, 1, 120.0, True),
                      (1, 1, 2, 95.0, True)])
    assert list(ranked["objective"]) == [130, 120, 100, 95]
    ranked["pred_tokens_per_sec_per_gpu_q10"] = [50.0 / 8, 60.0 / 8, 90.0 / 8, 85.0 / 8]
    out = risk_aware_ranking(ranked)
    assert list(out["tp"])[:1] == [1]  # the risk-aware choice: the sure layout
    order = [(out["tp"].iloc[i], out["micro_batch_size"].iloc[i])
             for i in verification_order(out)]
    # then the layouts by what they are expected to deliver, not by their slow ends
    assert order == [(1, 1), (2, 1), (4, 1), (1, 2)]
    # ranked by the expected objective alone, the order is the plain diverse one
    assert [(ranked["tp"].iloc[i], ranked["micro_batch_size"].iloc[i])
            for i in verification_order(ranked)] == [(2, 1), (4, 1), (1, 1), (1, 2)]


class _UnsureOfTensorParallelism:
    """The closed-form predictor with a 10th percentile: sure of tp=1 layouts (q10 = the
    prediction), unsure of the others (q10 a tenth of it), and fitted on 1-2 devices only."""

    def __init__(self, inner):
        self.inner = inner
        self.training_ranges_ = {"H100-80GB": {"world_size": [1, 2]}}

    def predict(self, frame):
        out = self.inner.predict(frame)
        point = out["pred_tokens_per_sec_per_gpu"].to_numpy()
        out["pred_tokens_per_sec_per_gpu_q10"] = point * (frame["tp"].to_numpy() == 1) * 0.9 \
            + point * (frame["tp"].to_numpy() > 1) * 0.1
        return out


def test_tune_ranks_by_the_risk_aware_expectation_where_the_model_extrapolates(closed_form):
    from paratune.space import ConfigSpace
    from paratune.tuner import tune

    def job(**kwargs):
        return tune("llama3-8b", 16, "H100", _UnsureOfTensorParallelism(closed_form),
                    search="exhaustive", global_batch_sizes=[64], track=False,
                    space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1, 2)),
                    **kwargs)

    plain = job(risk_aware=False)
    assert not plain.search.risk_aware and plain.best.tp > 1  # the closed form's best
    risky = job()  # 16 devices, fitted on 1-2: extrapolating, so risk-aware
    assert risky.search.risk_aware and risky.best.tp == 1
    assert "risk tok/s" in risky.table(3)
    # where the expected throughput is not the point's, it is shown: it decides which
    # configs rank first (within RISK_AWARE_WITHIN of its best)
    assert "exp tok/s" not in risky.table(3)

    class Stalling(_UnsureOfTensorParallelism):
        def predict(self, frame):
            out = super().predict(frame)
            point = out["pred_tokens_per_sec_per_gpu"].to_numpy()
            out["pred_tokens_per_sec_per_gpu_expected"] = np.where(
                frame["pp"].to_numpy() >= 2, point / 2, point)
            return out

    stalling = tune("llama3-8b", 16, "H100", Stalling(closed_form), search="exhaustive",
                    global_batch_sizes=[64], track=False,
                    space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1, 2)))
    header = stalling.table(20).splitlines()[1].split("  ")
    names = [h.strip() for h in header if h.strip()]
    assert names.index("tok/s") < names.index("exp tok/s") < names.index("risk tok/s")
    ranked = risky.ranked
    assert ranked["objective"].is_monotonic_decreasing or not ranked["feasible"].all()
    # a quantile asked for by name is the ranking, not the risk-aware one
    assert not job(risk_quantile="q10").search.risk_aware


def test_tune_and_evaluate_order_by_the_same_risk_aware_expectation():
    """`tune`'s risk-aware re-ranking (over its objective, the throughput times the
    probability of running) and the order `evaluate` scores its choices by
    (:func:`paratune.models.choice_orders` over :func:`~paratune.models.choice_throughputs`)
    are one order, where the probability of running moves it."""
    from paratune.models import choice_orders, choice_throughputs

    rng = np.random.default_rng(0)
    n = 60
    expected = rng.uniform(500.0, 1000.0, n)
    q10 = expected * rng.uniform(0.2, 1.0, n)
    prob = rng.uniform(0.8, 1.0, n)
    # the first risk-aware choice without the weight is barely likely to run
    first = choice_orders(expected, q10, np.ones(n, dtype=bool))["risk-aware"][0]
    prob[first] = 0.5
    scored = pd.DataFrame({"config": np.arange(n), "objective": expected * prob,
                           "ranked_tokens_per_s": expected, "world_size": 1, "feasible": True,
                           "feasible_prob": prob, "pred_tokens_per_sec_per_gpu_q10": q10})
    tuned = risk_aware_ranking(rank(scored))["config"].to_numpy()
    predictions = pd.DataFrame({"pred_tokens_per_sec_per_gpu_expected": expected,
                                "pred_feasible_prob": prob,
                                "pred_tokens_per_sec_per_gpu_q10": q10})
    _, chosen, lower = choice_throughputs(predictions, expected)
    orders = choice_orders(chosen, lower, np.ones(n, dtype=bool))
    np.testing.assert_array_equal(tuned, orders["risk-aware"])
    np.testing.assert_array_equal(rank(scored)["config"].to_numpy(), orders["expected"])
    # the probability of running moves the order: that choice is no longer first
    assert orders["risk-aware"][0] != first and tuned[0] != first
