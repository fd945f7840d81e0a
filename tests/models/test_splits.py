from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError, DatasetError
from paratune.models import cross_validate, load_measurements
from paratune.models._estimators import AnalyticalBaseline
from paratune.models._evaluate import extrapolation_table, metrics
from paratune.models._splits import EXTRAPOLATION_SPLITS, extrapolation_split, model_params


def _two_families(synthetic: pd.DataFrame) -> pd.DataFrame:
    other = synthetic.copy()
    other["source"] = "other_single_node"
    other["hardware"] = "A100-80GB"
    return pd.concat([synthetic, other], ignore_index=True)


def test_larger_model_fits_on_the_smallest_only(synthetic):
    split = extrapolation_split(synthetic, "larger-model")
    (fold,) = split.folds
    params = model_params(synthetic)
    assert params[fold.test].min() >= 4 * params[fold.train].max()
    assert set(synthetic.loc[fold.train, "model_name"]) == {"llama3.2-1b"}
    assert set(synthetic.loc[fold.test, "model_name"]) == {"llama3-8b"}
    assert not (fold.train & fold.test).any()


def test_a_fold_without_a_run_that_ran_to_predict_says_so(synthetic):
    """The larger model's runs all failed: the split names the fold and what it lacks, not
    the models 4x apart that the data has."""
    failed = synthetic.copy()
    large = failed["model_name"] == "llama3-8b"
    failed.loc[large, "status"] = "oom"
    failed.loc[large, "step_time_s"] = float("nan")
    with pytest.raises(DatasetError, match=re.escape(
            "llama3.2-1b -> llama3-8b: no run that ran among the rows to predict")):
        extrapolation_split(failed, "larger-model")


def test_larger_cluster_fits_on_a_quarter_then_half_of_the_largest(synthetic):
    quarter, half = extrapolation_split(synthetic, "larger-cluster").folds
    world = synthetic["world_size"].to_numpy()
    assert world[quarter.train].max() <= world.max() / 4
    assert world[half.train].max() == world.max() / 2
    for fold in (quarter, half):
        assert (world[fold.test] == world.max()).all()
        assert not (fold.train & fold.test).any()
    assert half.label.endswith("(2x)")


def test_family_split_leaves_each_family_out(synthetic):
    frame = _two_families(synthetic)
    split = extrapolation_split(frame, "family")
    assert [f.label for f in split.folds] == ["without other -> other",
                                              "without synthetic -> synthetic"]
    for fold in split.folds:
        assert frame.loc[fold.test, "source"].nunique() == 1
        assert not set(frame.loc[fold.train, "source"]) & set(frame.loc[fold.test, "source"])
    with pytest.raises(DatasetError, match="at least two measurement families"):
        extrapolation_split(synthetic, "family")


def test_multi_node_predicts_two_nodes_from_one(synthetic):
    (fold,) = extrapolation_split(synthetic, "multi-node").folds
    assert (synthetic.loc[fold.train, "world_size"] <= 8).all()
    assert (synthetic.loc[fold.test, "world_size"] == 16).all()


def test_unknown_split_is_refused(synthetic):
    with pytest.raises(ConfigError, match="split"):
        extrapolation_split(synthetic, "bigger")


def test_cross_validate_fits_on_the_train_mask_only(synthetic):
    seen = []

    class Recording(AnalyticalBaseline):
        def fit(self, frame):
            seen.append(set(frame["model_name"]))
            return super().fit(frame)

    result = cross_validate(synthetic, split="larger-model", estimators={"a": Recording})
    assert seen == [{"llama3.2-1b"}]
    assert set(result.predictions["a"]["model_name"]) == {"llama3-8b"}
    (row,) = result.by_fold
    for key in ("mdape", "mape", "spearman_group", "regret_mean", "regret_top5_mean",
                "ratio_median"):
        assert np.isfinite(row[key]), key
    assert "top-5 regret%" in result.table()


def test_top5_regret_and_coverage(synthetic):
    ok = (synthetic.status == "ok").to_numpy()
    tps = (synthetic["global_batch_size"] * synthetic["seq_len"]
           / (synthetic["step_time_s"] * synthetic["world_size"])).to_numpy()
    pred = pd.DataFrame({"pred_step_time_s": synthetic["step_time_s"].to_numpy(),
                         "pred_feasible_prob": np.where(ok, 0.9, 0.1)})
    pred["pred_tokens_per_sec_per_gpu_q10"] = tps * 0.9
    pred["pred_tokens_per_sec_per_gpu_q90"] = np.where(np.arange(len(tps)) % 2, tps * 1.1,
                                                       tps * 0.95)
    figures = metrics(synthetic, pred)
    assert figures["regret_top5_mean"] == pytest.approx(0.0)
    assert figures["ratio_median"] == pytest.approx(1.0)
    # every other measured run lies above its interval
    assert figures["coverage"] == pytest.approx(0.5, abs=0.05)
    # ranking worst first: the top five miss the best, unless a group has five or fewer
    pred["pred_step_time_s"] = 1.0 / pred["pred_step_time_s"]
    assert metrics(synthetic, pred)["regret_top5_mean"] > 0


def test_risk_aware_regret_is_the_tuners_choice(synthetic):
    """The risk-aware regret chooses as ``tune``'s risk-aware ranking does: where the fast
    prediction is unsure (a low q10) it picks the surer config among those predicted
    within RISK_AWARE_WITHIN of the fastest, and regret follows."""
    from paratune.models._evaluate import (
        RISK_AWARE_WITHIN,
        risk_aware_order,
        risk_aware_throughput,
    )
    from paratune.tuner import risk_aware_ranking

    assert 0.0 < RISK_AWARE_WITHIN < 0.5
    expected = np.array([100.0, 90.0, 80.0, 50.0])
    low = np.array([20.0, 85.0, np.nan, 60.0])
    risk = risk_aware_throughput(expected, low)
    # the tuner's ranking of the same configs, each on one device
    ranked = pd.DataFrame({"objective": expected, "ranked_tokens_per_s": expected,
                           "world_size": 1, "feasible": True,
                           "pred_tokens_per_sec_per_gpu_q10": low, "tp": 1, "pp": 1,
                           "config": range(4)})
    reranked = risk_aware_ranking(ranked)
    order = risk_aware_order(expected, low)
    # the sure 50 (risk-aware 50) beats the unsure 100 (44.7) but is 50% behind it
    assert list(order) == [1, 2, 0, 3]
    assert list(reranked["config"]) == list(order)
    np.testing.assert_allclose(reranked["objective"].to_numpy(), risk[order])
    assert list(reranked["risk_candidate"]) == [True, True, True, False]
    # with a wider bound the sure 50 may be chosen over the unsure 100
    assert list(risk_aware_order(expected, low, within=0.6)) == [1, 2, 3, 0]

    ok = (synthetic.status == "ok").to_numpy()
    step = synthetic["step_time_s"].to_numpy(dtype=float)
    tps = (synthetic["global_batch_size"] * synthetic["seq_len"]
           / (step * synthetic["world_size"])).to_numpy()
    pred = pd.DataFrame({"pred_step_time_s": step, "pred_feasible_prob": np.where(ok, 0.9, 0.1),
                         "pred_tokens_per_sec_per_gpu_q10": tps * 0.9,
                         "pred_tokens_per_sec_per_gpu_q90": tps * 1.1})
    figures = metrics(synthetic, pred)
    assert figures["regret_risk_mean"] == pytest.approx(0.0)
    assert figures["regret_risk_top5_mean"] == pytest.approx(0.0)
    # the measured best of each group with a q10 far below: the expected choice keeps it
    # (regret 0); the risk-aware one passes it over where the next is predicted nearly as
    # fast, not where it is predicted twice as fast as the rest
    frame = synthetic[ok].reset_index(drop=True)
    pred = pred[ok].reset_index(drop=True)
    tps = tps[ok]
    best = frame.assign(t=tps).groupby(["model_name", "world_size"])["t"].transform("max")
    top = (tps == best.to_numpy())
    pred.loc[top, "pred_tokens_per_sec_per_gpu_q10"] = tps[top] * 0.01
    figures = metrics(frame, pred)
    assert figures["regret_mean"] == pytest.approx(0.0)
    assert figures["regret_risk_mean"] > 0
    pred.loc[top, "pred_step_time_s"] /= 2.0
    figures = metrics(frame, pred)
    assert figures["regret_mean"] == pytest.approx(0.0)
    assert figures["regret_risk_mean"] == pytest.approx(0.0)
    assert "top-1 risk-aware%" in extrapolation_table([{"estimator": "m", "held_out": "f",
                                                         **figures}], title="t")


def test_public_splits_are_the_documented_ones(public_dir):
    frame = load_measurements(sorted(public_dir.glob("*.csv")))
    labels = {name: [f.label for f in extrapolation_split(frame, name).folds]
              for name in EXTRAPOLATION_SPLITS}
    assert "ultrascale: 1B -> 8B" in labels["larger-model"]
    assert "ultrascale: <=64 -> 256 GPUs" in labels["larger-cluster"]
    assert "vtrain: <=2 -> 8 GPUs" in labels["larger-cluster"]
    assert "ultrascale: <=128 -> 256 GPUs (2x)" in labels["larger-cluster"]
    assert labels["family"] == ["without ultrascale -> ultrascale", "without vtrain -> vtrain"]
    assert "vtrain: 2-4 -> 8 GPUs (one node)" in labels["multi-node"]


def test_error_anatomy_tells_the_stalled_runs_apart(make_synthetic):
    """Stalled runs predicted as normal ones carry the fold's error; the others do not."""
    from paratune.models._evaluate import error_anatomy

    frame = make_synthetic(stalls=True)
    ok = (frame.status == "ok").to_numpy()
    frame = frame[ok].reset_index(drop=True)
    step = frame["step_time_s"].to_numpy(dtype=float)
    from paratune.models import features as F

    stalled = F.stalled_pipeline(frame, step)
    assert stalled.any() and (~stalled).any()
    # a predictor exact on normal runs that calls every run normal (the analytical time)
    pred = np.where(stalled, F.analytical_step_time(frame)["step_time_s"] * 1.5, step)
    predictions = frame.assign(pred_step_time_s=pred, pred_stall_prob=0.1, fold="f")
    rows = {(r["by"], r["group"]): r for r in error_anatomy(predictions)}
    normal = rows[("regime", "normal, called normal")]
    missed = rows[("regime", "stalled, called normal")]
    assert normal["mdape"] == pytest.approx(0.0, abs=0.03)
    assert missed["mdape"] > 1.0 and missed["log_bias"] > 0.5  # predicted far too fast
    assert normal["n"] + missed["n"] == len(frame)
    assert missed["share"] == pytest.approx(stalled.mean())
    # layouts: the runs without a pipeline never stall here
    assert rows[("layout", "no pipeline")]["mdape"] == pytest.approx(0.0, abs=0.03)
    nodes = [r["group"] for r in error_anatomy(predictions) if r["by"] == "nodes"]
    assert nodes == sorted(nodes, key=lambda g: float(g.split()[0]))


def test_an_extrapolation_plot_draws_each_fold_with_its_stalled_runs_apart(make_synthetic,
                                                                           tmp_path,
                                                                           monkeypatch):
    """One panel per fold, in order; the measured stalled runs in a group of their own; each
    panel titled with its fold's median APE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paratune.models import features as F
    from paratune.models._evaluate import EvaluationResult
    from paratune.models._evaluate_report import fold_panels, plot_predictions

    frame = make_synthetic(stalls=True)
    frame = frame[(frame.status == "ok").to_numpy()].reset_index(drop=True)
    step = frame["step_time_s"].to_numpy(dtype=float)
    stalled = F.stalled_pipeline(frame, step)
    tokens = frame["global_batch_size"] * frame["seq_len"] / frame["world_size"]
    measured = (tokens / step).to_numpy()
    # exact on the normal runs, twice too fast on the stalled ones
    predicted = np.where(stalled, 2.0 * measured, measured)
    folds = np.where(frame["world_size"].to_numpy() > 8, "b: larger", "a: small")
    predictions = frame.assign(pred_tokens_per_sec_per_gpu=predicted,
                               pred_tokens_per_sec_per_gpu_q10=0.8 * predicted,
                               pred_tokens_per_sec_per_gpu_q90=1.2 * predicted, fold=folds)
    panels = fold_panels(predictions)
    # in the order the folds' rows come (cross_validate appends fold after fold)
    order = list(dict.fromkeys(folds))
    assert sorted(order) == ["a: small", "b: larger"]
    assert [p["title"].split("\n")[0] for p in panels] == order
    larger = panels[order.index("b: larger")]
    in_b = folds == "b: larger"
    assert len(larger["measured"]) == in_b.sum()
    assert larger["groups"]["stalled pipelines (measured)"].sum() == stalled[in_b].sum() > 0
    mdape = np.median(np.abs(predicted[in_b] / measured[in_b] - 1.0))
    assert f"median APE {100 * mdape:.1f}%" in larger["title"]
    assert larger["bars"] and np.allclose(larger["lo"], 0.8 * larger["predicted"])

    closed = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (closed.append(fig), close(fig)))
    path = plot_predictions(EvaluationResult("larger-cluster", {"pm": predictions}),
                            tmp_path / "folds.png")
    assert path.stat().st_size > 1000
    (fig,) = closed
    assert sum(ax.get_visible() for ax in fig.axes) == 2


def test_extrapolation_table_prints_percentages_to_a_tenth_and_ratios_to_a_thousandth():
    row = {"estimator": "m", "held_out": "f", "n": 12, "mdape": 0.2071, "mape": 2.44,
           "spearman_group": 0.66812, "regret_mean": 0.125, "regret_top5_mean": 0.0,
           "regret_risk_mean": 0.000404, "regret_risk_top5_mean": np.nan,
           "coverage": 0.985, "ratio_median": 1.1396, "feasibility_accuracy": 0.908}
    table = extrapolation_table([row], title="t")
    cells = table.splitlines()[-1].split()
    assert cells == ["m", "f", "12", "20.7", "244.0", "0.668", "12.5", "0.0", "0.0",
                     "98.5", "1.140", "90.8"]


def _slowest_predicted_fastest(synthetic, speedup: float):
    """The synthetic runs that ran, their predictions (every run at its measured time,
    probability of running 0.9) and each larger group's slowest run (a mask), predicted
    ``speedup`` times as fast as its group's best."""
    frame = synthetic[synthetic["status"] == "ok"].reset_index(drop=True)
    step = frame["step_time_s"].to_numpy(dtype=float)
    tps = (frame["global_batch_size"] * frame["seq_len"] / (step * frame["world_size"])
           ).to_numpy()
    pred = pd.DataFrame({"pred_step_time_s": step, "pred_feasible_prob": 0.9,
                         "pred_tokens_per_sec_per_gpu_q10": tps * 0.9,
                         "pred_tokens_per_sec_per_gpu_q90": tps * 1.1})
    group = frame.assign(t=tps).groupby(["model_name", "world_size"])["t"]
    slowest = (tps == group.transform("min").to_numpy()) & (group.transform("size") > 5)
    fast = speedup * group.transform("max").to_numpy()[slowest]
    pred.loc[slowest, "pred_step_time_s"] = step[slowest] * tps[slowest] / fast
    pred.loc[slowest, "pred_tokens_per_sec_per_gpu_q10"] = 0.9 * fast
    return frame, pred, slowest, tps


def test_the_choice_is_among_configs_predicted_to_run_as_tune_ranks(synthetic):
    """A group's fastest prediction that the model says will not run (probability of
    running under MIN_FEASIBLE_PROB) is not what `tune` recommends: the top-1 and top-5
    regret, by the expectation and risk-aware, are of the configs predicted to run."""
    from paratune.predictor import MIN_FEASIBLE_PROB

    # the slowest run of each group predicted twice as fast as the best
    frame, pred, slowest, _ = _slowest_predicted_fastest(synthetic, 2.0)
    assert metrics(frame, pred)["regret_mean"] > 0.1  # chosen where it may run
    # not expected to run: a probability under the threshold, none at all (a failed
    # prediction), or a peak memory over 95% of the device's
    for prob, memory in ((MIN_FEASIBLE_PROB / 2, 10.0), (np.nan, 10.0), (0.9, 79.0)):
        pred.loc[slowest, "pred_feasible_prob"] = prob
        pred["pred_peak_mem_gb"] = np.where(slowest, memory, 10.0)
        figures = metrics(frame, pred)
        for name in ("regret_mean", "regret_top5_mean", "regret_risk_mean",
                     "regret_risk_top5_mean", "regret_q10_mean"):
            assert figures[name] == pytest.approx(0.0), (name, prob, memory)


def test_the_choice_counts_what_a_launch_delivers(synthetic):
    """A config predicted to run but only just (probability 0.6) counts 0.6 of its
    throughput, as `tune` ranks it: predicted 30% faster than the group's best, it is not
    chosen over the best at a probability of 0.9."""
    from paratune.models import choice_throughputs

    frame, pred, slowest, tps = _slowest_predicted_fastest(synthetic, 1.3)
    pred.loc[slowest, "pred_feasible_prob"] = 0.99
    assert metrics(frame, pred)["regret_mean"] > 0.1  # a sure run is chosen for its speed
    pred.loc[slowest, "pred_feasible_prob"] = 0.6
    figures = metrics(frame, pred)
    for name in ("regret_mean", "regret_risk_mean", "regret_q10_mean"):
        assert figures[name] == pytest.approx(0.0), name
    expected, chosen, lower = choice_throughputs(pred, tps)
    assert np.allclose(chosen, expected * pred["pred_feasible_prob"])
    assert np.allclose(lower, pred["pred_tokens_per_sec_per_gpu_q10"]
                       * pred["pred_feasible_prob"])


def test_tune_ranks_the_configs_predicted_to_run_first_then_the_others():
    from paratune.models import choice_orders

    expected = np.array([60.0, 50.0, 100.0, 90.0, 80.0, 70.0])
    lower = expected * 0.9
    runs = np.array([True, True, False, False, False, False])
    orders = choice_orders(expected, lower, runs)
    assert list(orders["expected"]) == [0, 1, 2, 3, 4, 5]
    assert list(orders["lower"]) == [0, 1, 2, 3, 4, 5]
    # the risk-aware ranking keeps the others after the two, in their own order
    assert list(orders["risk-aware"]) == [0, 1, 2, 3, 4, 5]
