from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from paratune import ModelFormatError
from paratune.hardware import get_hardware
from paratune.measurement import family_of
from paratune.models import PerformanceModel, load_model
from paratune.models._estimators import (
    OUTPUT_COLUMNS,
    PRED_TOKENS_Q10,
    PRED_TOKENS_Q90,
    SCHEMA_VERSION,
    estimator_factories,
)
from paratune.predictor import CONFIG_COLUMNS, PREDICTION_COLUMNS, Predictor

SMALL = {"n_estimators": 40}


@pytest.fixture(scope="module")
def fitted(synthetic):
    return PerformanceModel(**SMALL, n_jobs=1).fit(synthetic)


def test_learns_the_hidden_ratio_and_keeps_row_order(fitted, make_synthetic):
    test = make_synthetic(seed=1, n_per_model=60)
    pred = fitted.predict(test[list(CONFIG_COLUMNS)])
    assert list(pred.index) == list(test.index)
    ok = (test.status == "ok").to_numpy()
    ape = np.abs(pred["pred_step_time_s"].to_numpy()[ok] / test["step_time_s"].to_numpy()[ok] - 1)
    assert np.median(ape) < 0.05
    assert (pred[PRED_TOKENS_Q10] <= pred["pred_tokens_per_sec_per_gpu"] + 1e-9).all()
    assert (pred[PRED_TOKENS_Q90] >= pred["pred_tokens_per_sec_per_gpu"] - 1e-9).all()
    prob = pred["pred_feasible_prob"].to_numpy()
    # per class: about one config in ten runs out of memory, so a classifier that calls
    # every config feasible would still be right 90% of the time overall
    assert (~ok).sum() >= 10
    assert (prob[~ok] < 0.5).mean() >= 0.8
    assert (prob[ok] >= 0.5).mean() >= 0.9


def test_the_same_rows_in_another_order_fit_the_same_model(fitted, synthetic):
    """Boosters sample rows by position: without a canonical order, the same data listed in
    other files or another order (the same training fingerprint) fitted another model."""
    shuffled = synthetic.sample(frac=1.0, random_state=3)
    again = PerformanceModel(**SMALL, n_jobs=1).fit(shuffled)
    assert again.fingerprint_ == fitted.fingerprint_
    pd.testing.assert_frame_equal(again.predict(synthetic), fitted.predict(synthetic))


@pytest.fixture(scope="module")
def public_fitted(public_dir):
    """The performance model fitted on the Ultra-Scale sweep (successful and failed runs)."""
    from paratune.models import load_measurements

    frame = load_measurements([public_dir / "ultrascale_playbook_h100.csv",
                               public_dir / "ultrascale_playbook_h100_failed.csv"])
    return PerformanceModel(n_jobs=1).fit(frame)


def _h100_grid(*worlds: int) -> pd.DataFrame:
    """An 8B and an 80B Llama-style model on each of ``worlds`` H100s, every tp x pp x
    micro-batch x sharding (global batch 256), far from and near the measured layouts."""
    from paratune import ModelSpec, ParallelConfig
    from paratune.models import features as F

    shapes = [ModelSpec(name="80B", num_layers=80, hidden_size=8192, num_heads=64,
                        ffn_hidden_size=28672, vocab_size=131072, seq_len=4096),
              ModelSpec(name="8B", num_layers=32, hidden_size=4096, num_heads=32,
                        ffn_hidden_size=14336, vocab_size=131072, seq_len=4096)]
    rows = []
    for spec, world in itertools.product(shapes, worlds):
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4, 8, 16, 32):
                if tp * pp > world:
                    continue
                dp = world // (tp * pp)
                for micro in (1, 2, 4, 8, 16):
                    if (256 // dp) % micro:
                        continue
                    for zero in ("none", "zero1"):
                        config = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                                                global_batch_size=256, sharding=zero)
                        rows.append(F.config_row(spec, config, get_hardware("H100")))
    return pd.concat(rows, ignore_index=True)


def test_no_throughput_quantile_exceeds_the_device_peak(public_fitted):
    """The learned lower time bound is a ratio with no physics of its own: on layouts far
    from the measurements (an 80B model on 8 GPUs) it read up to twice the H100's peak."""
    from paratune.models import features as F

    rows = _h100_grid(8)
    pred = public_fitted.predict(rows)
    # the fastest step time the upper throughput quantile implies, against the one at 100%
    fastest = rows["global_batch_size"] * rows["seq_len"] / (
        pred[PRED_TOKENS_Q90] * rows["world_size"])
    mfu = F.step_time_at_mfu(rows) / fastest
    assert (mfu <= 1.0 + 1e-9).all(), mfu.max()


def test_memory_grows_with_the_micro_batch_and_shrinks_with_zero1(public_fitted):
    """A correction learned on all features fell faster with the micro-batch than the
    estimate it corrects rose (a larger micro-batch predicted to need less memory), and put
    ZeRO-1 above no sharding on some layouts."""
    rows = _h100_grid(64, 256)
    rows["memory"] = public_fitted.predict(rows)["pred_peak_mem_gb"].to_numpy()
    layout = ["model_name", "world_size", "dp", "tp", "pp", "sharding"]
    # the absolute-error objective refits leaf values after each constrained split, and the
    # (unconstrained) memory fraction moves with the micro-batch: a few percent either way is
    # that, not a layout needing less memory (up to 11% before)
    slack = 0.03
    for _, group in rows.sort_values("micro_batch_size").groupby(layout):
        memory = group["memory"].to_numpy()
        assert (np.diff(memory) >= -slack * memory[:-1]).all(), group[
            [*layout, "micro_batch_size", "memory"]]
    both = rows[rows["dp"] > 1].pivot_table(
        index=["model_name", "world_size", "dp", "tp", "pp", "micro_batch_size"],
        columns="sharding", values="memory")
    assert (both["zero1"] <= both["none"] * (1 + slack)).all()


def test_save_load_roundtrip_is_json_and_identical(fitted, synthetic, tmp_path):
    fitted.save(tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").iterdir() if p.name != ".model.lock")
    assert "model.json" in files and all(f.endswith(".json") for f in files)
    manifest = json.loads((tmp_path / "m" / "model.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["feature_names"]
    assert len(manifest["training"]["fingerprint_sha256"]) == 64
    back = load_model(tmp_path / "m")
    a = fitted.predict(synthetic)
    b = back.predict(synthetic)
    np.testing.assert_allclose(a[list(PREDICTION_COLUMNS)].to_numpy(dtype=float),
                               b[list(PREDICTION_COLUMNS)].to_numpy(dtype=float), rtol=1e-6)


def test_mismatched_schema_fails_clearly(fitted, tmp_path):
    fitted.save(tmp_path / "m")
    manifest_path = tmp_path / "m" / "model.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["schema_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ModelFormatError, match="schema_version=99"):
        load_model(tmp_path / "m")
    with pytest.raises(ModelFormatError, match=r"no model\.json"):
        load_model(tmp_path)


def test_unknown_hardware_row_gets_error_not_crash(fitted, synthetic):
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).copy()
    frame.loc[frame.index[1], "hardware"] = "TPU-v9"
    pred = fitted.predict(frame)
    assert "TPU-v9" in pred["pred_error"].iloc[1]
    assert np.isnan(pred["pred_step_time_s"].iloc[1])
    assert pred["pred_error"].iloc[0] == "" and np.isfinite(pred["pred_step_time_s"].iloc[0])


@pytest.mark.parametrize("name", sorted(estimator_factories()))
def test_every_predictor_meets_the_contract(name, synthetic):
    estimator = estimator_factories(n_estimators=20)[name]()
    assert estimator.fit(synthetic) is estimator
    assert isinstance(estimator, Predictor)
    pred = estimator.predict(synthetic)
    assert list(pred.columns) == list(OUTPUT_COLUMNS)
    assert len(pred) == len(synthetic)
    ok = pred["pred_error"] == ""
    assert (pred.loc[ok, "pred_step_time_s"] > 0).all()
    assert pred.loc[ok, "pred_feasible_prob"].between(0, 1).all()


def test_unfitted_predict_raises(synthetic):
    with pytest.raises(ModelFormatError, match="not fitted"):
        PerformanceModel().predict(synthetic)


def test_each_measurement_family_gets_its_own_step_time_model(synthetic, tmp_path):
    from paratune.models import features as F

    other = synthetic.copy()
    other["hardware"] = "A100-80GB"
    other["source"] = "otherlab_cluster"
    ok = other["status"] == "ok"
    other.loc[ok, "step_time_s"] = F.analytical_step_time(other)["step_time_s"][ok.to_numpy()] * 4
    both = pd.concat([synthetic, other], ignore_index=True)
    model = PerformanceModel(n_estimators=40, aux_estimators=10, min_family_rows=50,
                             n_jobs=1).fit(both)
    assert sorted(model.families_) == ["otherlab", "synthetic"]
    assert model.hardware_family_ == {"A100-80GB": "otherlab", "H100-80GB": "synthetic"}
    pred = model.predict(both[both["status"] == "ok"])
    ratio = pred["pred_step_time_s"] / pred["analytical_step_time_s"]
    a100 = (both.loc[both["status"] == "ok", "hardware"] == "A100-80GB").to_numpy()
    assert np.median(ratio[a100]) == pytest.approx(4, rel=0.05)
    assert np.median(ratio[~a100]) < 2.5
    # without a source column the hardware picks the family
    configs = both.loc[both["status"] == "ok", list(CONFIG_COLUMNS)]
    np.testing.assert_allclose(model.predict(configs)["pred_step_time_s"].to_numpy(),
                               pred["pred_step_time_s"].to_numpy(), rtol=1e-6)
    # families survive a save / load
    back = load_model(model.save(tmp_path / "m"))
    np.testing.assert_allclose(back.predict(configs)["pred_step_time_s"].to_numpy(),
                               pred["pred_step_time_s"].to_numpy(), rtol=1e-6)


def test_the_feasibility_classifier_decides_only_for_families_that_showed_both_outcomes(
        synthetic, tmp_path):
    """A family's first failed runs (two verification runs that crashed) are too few to
    teach the classifier its boundary: trained on them beside another family's many
    failures, it could call every configuration of the new family's hardware infeasible.
    Its rows take the memory threshold until it has shown five configurations of each
    outcome; the family with its own failures keeps the classifier, also after a save."""
    from paratune.models._base import _memory_rule

    ok = synthetic[synthetic["status"] == "ok"]
    lab = ok.drop_duplicates(list(CONFIG_COLUMNS)).head(30).assign(
        hardware="A100-80GB", source="otherlab_cluster")
    crashed = lab.index[:2]
    lab.loc[crashed, ["status", "error"]] = ["error", "NCCL watchdog timeout"]
    lab.loc[crashed, ["step_time_s", "tokens_per_s"]] = np.nan
    model = PerformanceModel(n_estimators=40, aux_estimators=10, n_jobs=1).fit(
        pd.concat([synthetic, lab], ignore_index=True))
    assert model.feasibility_families_ == ["synthetic"]
    pred = model.predict(lab)
    capacity = np.full(len(lab), 80.0)
    np.testing.assert_allclose(pred["pred_feasible_prob"],
                               _memory_rule(pred["pred_peak_mem_gb"].to_numpy(), capacity))
    # the same configurations as the measured family's: the classifier's
    classifier = model.feasibility_.predict_proba(model._feasibility_matrix(synthetic))
    mine = model.predict(synthetic)["pred_feasible_prob"].to_numpy()
    np.testing.assert_allclose(mine, classifier, rtol=1e-6)
    back = load_model(model.save(tmp_path / "m"))
    assert back.feasibility_families_ == ["synthetic"]
    # five of each outcome, and the classifier decides for the family too
    more = lab.copy()
    failed = more.index[:5]
    more.loc[failed, ["status", "error"]] = ["error", "NCCL watchdog timeout"]
    more.loc[failed, ["step_time_s", "tokens_per_s"]] = np.nan
    model = PerformanceModel(n_estimators=40, aux_estimators=10, n_jobs=1).fit(
        pd.concat([synthetic, more], ignore_index=True))
    assert model.feasibility_families_ == ["otherlab", "synthetic"]


def _core(model: PerformanceModel, frame: pd.DataFrame) -> np.ndarray:
    """The calibrated core's step time per row: what the model's learned ratio multiplies
    for a row of a measured family."""
    from paratune.models import features as F

    c = F.Columns(frame)
    return model._core_step(frame, c, F.compute_features(c)[1])


def test_a_family_is_named_fit_for_files_and_rows_without_a_source_go_by_hardware(
        synthetic, tmp_path):
    """A source may hold any text; a row whose source is empty is of no known family (not of
    paratune's own measurements); a family's full-feature model is for the models it
    measured, another family's shape gets its transfer model."""
    from paratune.models import features as F

    ok = (synthetic["status"] == "ok").to_numpy()
    deeper = synthetic[ok].assign(num_layers=synthetic.loc[ok, "num_layers"] * 2,
                                  hardware="A100-80GB", source="Other Lab/run 3_a100")
    deeper["step_time_s"] = F.analytical_step_time(deeper)["step_time_s"] * 4
    own = synthetic[ok].assign(hardware="cpu", source="paratune")
    own["step_time_s"] = F.analytical_step_time(own)["step_time_s"] * 900
    both = pd.concat([synthetic, deeper, own], ignore_index=True)
    model = PerformanceModel(n_estimators=40, aux_estimators=10, min_family_rows=50,
                             n_jobs=1).fit(both)
    assert sorted(model.families_) == ["other-lab-run-3", "paratune", "synthetic"]
    back = load_model(model.save(tmp_path / "m"))  # the family's name makes file names
    h100 = synthetic.loc[ok, list(CONFIG_COLUMNS)]
    named = back.predict(h100.assign(source="synthetic"))
    for unnamed in (h100.assign(source=""), h100.assign(source=np.nan), h100):
        np.testing.assert_allclose(back.predict(unnamed)["pred_step_time_s"],
                                   named["pred_step_time_s"], rtol=1e-6)
    # the deeper model, measured only on the A100s, is another model to the H100s' family
    shape = deeper[list(CONFIG_COLUMNS)].assign(hardware="H100-80GB", source="synthetic")
    pred = back.predict(shape)
    X, _ = F.compute_features(shape)
    transfer = X[:, [F.FEATURE_NAMES.index(n) for n in F.TRANSFER_FEATURE_NAMES]]
    median, refine, _ = back.family_transfer_["synthetic"]
    # where the shape lies inside the family's fitted sizes (beyond them the prediction
    # moves toward the calibrated core)
    inside = (pred["pred_extrapolation_doublings"] == 0).to_numpy()
    assert inside.sum() > len(inside) / 2
    np.testing.assert_allclose((pred["pred_step_time_s"] / _core(back, shape))[inside],
                               np.exp(median.predict(transfer) + refine.predict(transfer))[inside],
                               rtol=1e-5)


def test_a_model_not_in_the_training_data_uses_the_transfer_features(fitted, synthetic,
                                                                     tmp_path):
    from paratune.models import features as F

    configs = synthetic.loc[synthetic["status"] == "ok", list(CONFIG_COLUMNS)]
    bigger = configs.assign(model_name="twice-as-deep", num_layers=configs["num_layers"] * 2)
    pred = fitted.predict(bigger)
    ratio = (pred["pred_step_time_s"] / _core(fitted, bigger)).to_numpy()
    X, _ = F.compute_features(bigger)
    transfer = X[:, [F.FEATURE_NAMES.index(n) for n in F.TRANSFER_FEATURE_NAMES]]
    median, refine, _ = fitted.transfer_
    # inside the fitted sizes (beyond them the prediction moves toward the calibrated core)
    inside = (pred["pred_extrapolation_doublings"] == 0).to_numpy()
    assert inside.sum() > len(inside) / 2
    np.testing.assert_allclose(ratio[inside], np.exp(median.predict(transfer)
                                                     + refine.predict(transfer))[inside],
                               rtol=1e-5)
    assert not set(F.MODEL_SIZE_FEATURES) & set(F.TRANSFER_FEATURE_NAMES)
    # a trained-on architecture under another name is a seen model: all features
    seen = fitted.predict(configs)
    X, _ = F.compute_features(configs)
    full = np.exp(fitted.throughput_.predict(X) + fitted.refine_.predict(X))
    np.testing.assert_allclose((seen["pred_step_time_s"] / _core(fitted, configs)).to_numpy(),
                               full, rtol=1e-5)
    renamed = fitted.predict(configs.assign(model_name="another-name"))
    np.testing.assert_allclose(renamed["pred_step_time_s"], seen["pred_step_time_s"])
    # the transfer models and the list of seen models survive a save / load
    back = load_model(fitted.save(tmp_path / "m"))
    np.testing.assert_allclose(back.predict(bigger)["pred_step_time_s"],
                               pred["pred_step_time_s"], rtol=1e-6)
    np.testing.assert_allclose(back.predict(configs)["pred_step_time_s"],
                               seen["pred_step_time_s"], rtol=1e-6)


def test_stalled_pipelines_are_learned_as_a_regime_of_their_own(make_synthetic, tmp_path):
    from paratune.models import features as F
    from paratune.models._estimators import PRED_STALL_PROB, PRED_TOKENS_EXPECTED

    train = make_synthetic(stalls=True)
    model = PerformanceModel(n_estimators=60, aux_estimators=30, n_jobs=1).fit(train)
    assert model.num_stall_rows_ >= model.min_stall_rows
    test = make_synthetic(seed=1, n_per_model=40, stalls=True)
    test = test[test["status"] == "ok"].reset_index(drop=True)
    stalled = F.stalled_pipeline(test, test["step_time_s"].to_numpy())
    assert 10 < stalled.sum() < len(test) - 10
    pred = model.predict(test[list(CONFIG_COLUMNS)])
    prob = pred[PRED_STALL_PROB].to_numpy()
    # the classifier tells the regimes apart on configurations it has not seen
    assert np.mean((prob > 0.5) == stalled) > 0.9
    assert (prob[test["pp"].to_numpy() == 1] == 0).all()
    # each regime's time: the stalled one is a cost per micro-batch, the other the ratio
    ape = np.abs(pred["pred_step_time_s"] / test["step_time_s"] - 1).to_numpy()
    assert np.median(ape[stalled]) < 0.1 and np.median(ape[~stalled]) < 0.1
    # the expected throughput lies between the regimes' and is the point one without a pipeline
    tps = pred["pred_tokens_per_sec_per_gpu"].to_numpy()
    expected = pred[PRED_TOKENS_EXPECTED].to_numpy()
    flat = test["pp"].to_numpy() == 1
    np.testing.assert_allclose(expected[flat], tps[flat], rtol=1e-6)
    likely = prob > 0.5
    assert (expected[likely] >= tps[likely] * (1 - 1e-6)).all()
    assert (expected[~likely] <= tps[~likely] * (1 + 1e-6)).all()
    # a stall likelier than the upper quantile's tail puts the 10th-percentile throughput in it
    q10 = pred[PRED_TOKENS_Q10].to_numpy()
    assert (q10 <= tps * (1 + 1e-6)).all()
    risky = prob > 1 - model.quantiles[-1]
    assert risky.any() and (q10[risky] <= expected[risky] * (1 + 1e-6)).all()
    # a stalled run is no faster than the regime's definition or than not stalling
    X, analytical = F.compute_features(test)
    stalled_rows = prob > 0.5
    point = pred["pred_step_time_s"].to_numpy()
    assert (point[stalled_rows] >= F.stall_floor_s(test)[stalled_rows] * (1 - 1e-9)).all()
    # the step-time model learned from the other runs only: it does not average the regimes
    X, analytical = F.compute_features(test)
    normal = analytical["step_time_s"] * np.exp(model.throughput_.predict(X)
                                                 + model.refine_.predict(X))
    assert np.median(np.abs(normal[stalled] / test["step_time_s"].to_numpy()[stalled] - 1)) > 0.5
    # the regime survives a save / load
    back = load_model(model.save(tmp_path / "m"))
    again = back.predict(test[list(CONFIG_COLUMNS)])
    for column in ("pred_step_time_s", PRED_STALL_PROB, PRED_TOKENS_EXPECTED, PRED_TOKENS_Q10):
        np.testing.assert_allclose(again[column], pred[column], rtol=1e-6)
    # too few stalled runs to learn the regime from: they train the step-time model like any
    few = PerformanceModel(n_estimators=20, aux_estimators=10, min_stall_rows=10_000,
                           n_jobs=1).fit(train)
    assert few.stall_ is None and few.num_stall_rows_ == 0
    few_pred = few.predict(test)
    # it cannot say how likely stalling is (NaN, not a claimed 0), and its expected
    # throughput is its point prediction
    assert few_pred[PRED_STALL_PROB].isna().all()
    np.testing.assert_allclose(few_pred[PRED_TOKENS_EXPECTED],
                               few_pred["pred_tokens_per_sec_per_gpu"])
    # every pipeline run stalled: nothing to tell the regimes apart, so no stall classifier
    # (and no crash); the stalled runs train the step-time model
    all_stalled = train[(train["pp"] == 1) | F.stalled_pipeline(
        train, train["step_time_s"].to_numpy())].reset_index(drop=True)
    none_apart = PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1).fit(all_stalled)
    assert none_apart.stall_ is None and none_apart.num_time_rows_ == int(
        all_stalled["step_time_s"].notna().sum())


def test_a_family_whose_pipelines_never_stalled_is_not_given_the_stalled_regime(
        make_synthetic, tmp_path):
    from paratune.models import features as F
    from paratune.models._estimators import PRED_STALL_PROB

    stalling = make_synthetic(stalls=True)
    # another framework's cluster, measured on one node only: many pipelines, none stalled
    calm = make_synthetic(seed=2, n_per_model=120)
    calm = calm[calm["world_size"] <= 8].assign(hardware="A100-80GB",
                                                source="otherlab_cluster")
    model = PerformanceModel(n_estimators=40, aux_estimators=20, min_family_rows=50,
                             min_stall_rows=20, n_jobs=1).fit(
        pd.concat([stalling, calm], ignore_index=True))
    runs, stalls = model.pipeline_runs_["otherlab"]
    assert runs >= model.min_stall_rows and stalls == 0
    assert model.pipeline_runs_["synthetic"][1] == model.num_stall_rows_ > 0
    assert model.stall_free_families_ == ["otherlab"]
    assert model.stall_free_hardware_ == ["A100-80GB"]
    # deep pipelines over many nodes, the layouts that stall in the other family
    deep = make_synthetic(seed=3, n_per_model=80)
    deep = deep[(deep["pp"] >= 4) & (deep["world_size"] > 8)
                & (deep["status"] == "ok")][list(CONFIG_COLUMNS)].reset_index(drop=True)
    assert len(deep) >= 10
    there = model.predict(deep.assign(source="synthetic"))
    assert (there[PRED_STALL_PROB] > 0.5).mean() > 0.8
    here = model.predict(deep.assign(hardware="A100-80GB", source="otherlab_cluster"))
    assert (here[PRED_STALL_PROB] == 0).all()
    # the normal regime's time: near the family's ratio to the analytical estimate where
    # its data-parallel groups stay in a node as they did in its runs (across nodes the
    # prediction moves toward the calibrated core), far below the stalled regime's; its
    # pipelines now cross nodes, a link its one-node runs never priced, which the core
    # prices at the default constant (up to 1.6x the ratio here)
    calm_ok = calm[calm["status"] == "ok"]
    learned = np.median(calm_ok["step_time_s"]
                        / F.analytical_step_time(calm_ok)["step_time_s"])
    ratio = here["pred_step_time_s"] / here["analytical_step_time_s"]
    in_node = F.dp_nodes(deep) == 1
    assert in_node.sum() >= 5
    assert ratio[in_node].between(learned / 1.5, learned * 2).all()
    a100 = deep.assign(hardware="A100-80GB")
    assert (here["pred_step_time_s"] < F.stall_floor_s(a100)).all()
    np.testing.assert_allclose(here["pred_tokens_per_sec_per_gpu_expected"],
                               here["pred_tokens_per_sec_per_gpu"], rtol=1e-9)
    # without a source, the hardware tells the family
    np.testing.assert_array_equal(
        model.predict(deep.assign(hardware="A100-80GB"))[PRED_STALL_PROB], 0.0)
    # a family with no measurement on the stalling family's hardware is a well-tuned
    # framework there: no stall in its point or its expectation (the stalling family's own
    # runs of the same layouts are stalled, see above)
    unknown = model.predict(deep.assign(source="newlab_cluster"))
    assert (unknown[PRED_STALL_PROB] == 0).all()
    assert (unknown["pred_step_time_s"] < F.stall_floor_s(deep)).all()
    np.testing.assert_allclose(unknown["pred_tokens_per_sec_per_gpu_expected"],
                               unknown["pred_tokens_per_sec_per_gpu"], rtol=1e-9)
    # a known source decides over the hardware: the stalling family's runs on an A100
    assert (model.predict(deep.assign(hardware="A100-80GB", source="synthetic"))[
        PRED_STALL_PROB] > 0).any()
    # it survives a save / load
    back = load_model(model.save(tmp_path / "m"))
    assert back.stall_free_families_ == ["otherlab"]
    assert back.pipeline_runs_ == model.pipeline_runs_
    np.testing.assert_allclose(
        back.predict(deep.assign(hardware="A100-80GB"))["pred_step_time_s"],
        model.predict(deep.assign(hardware="A100-80GB"))["pred_step_time_s"], rtol=1e-6)
    # too few pipeline runs to tell: the family keeps the learned probability
    cautious = PerformanceModel(n_estimators=20, aux_estimators=10, min_family_rows=50,
                                min_stall_rows=runs + 1, n_jobs=1)
    cautious.fit(pd.concat([stalling, calm], ignore_index=True))
    assert cautious.stall_ is not None and cautious.stall_free_families_ == []
    assert (cautious.predict(deep.assign(hardware="A100-80GB"))[PRED_STALL_PROB] > 0).any()


def test_pipelines_across_nodes_a_family_never_ran_keep_the_stall_in_their_slow_end(
        make_synthetic, tmp_path):
    """Fitted on one node's runs, a pipeline whose stages sit in two nodes may stall, which
    nothing measured says: its interval's slow end holds the stall threshold, its point and
    expected time stay the normal regime's; the rows of a family that ran pipelines across
    nodes, the layouts in one node and a family without measurements are untouched."""
    from paratune.models import features as F

    frame = make_synthetic(seed=4, n_per_model=90)
    one_node = frame[frame["world_size"] <= 8]
    model = PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1).fit(one_node)
    assert model.stall_ is None and model.node_pipeline_families_ == []
    rows = make_synthetic(seed=5, n_per_model=60)
    rows = rows[rows["world_size"] > 8][list(CONFIG_COLUMNS)].reset_index(drop=True)
    crossing = ((rows["pp"] > 1) & (F.pp_crosses_nodes(rows) > 0)).to_numpy()
    assert crossing.sum() >= 5 and (~crossing).sum() >= 5
    new = model.predict(rows.assign(source="synthetic"))
    told = PerformanceModel.load(model.save(tmp_path / "m"))
    assert told.node_pipeline_families_ == []
    told.node_pipeline_families_ = ["synthetic"]  # as if its pipelines had crossed nodes
    known = told.predict(rows.assign(source="synthetic"))
    for column in ("pred_step_time_s", "pred_tokens_per_sec_per_gpu_expected",
                   "pred_tokens_per_sec_per_gpu_q90"):
        np.testing.assert_allclose(new[column], known[column], rtol=1e-6)
    q10 = "pred_tokens_per_sec_per_gpu_q10"
    np.testing.assert_allclose(new[q10][~crossing], known[q10][~crossing], rtol=1e-6)
    floor = F.stall_floor_s(rows)
    tokens = rows["global_batch_size"] * rows["seq_len"] / rows["world_size"]
    assert (new[q10][crossing] <= tokens[crossing] / floor[crossing] * (1 + 1e-6)).all()
    assert (new[q10][crossing] < known[q10][crossing]).mean() > 0.5
    # a framework without measurements is predicted as a well-tuned one, which does not stall
    np.testing.assert_allclose(model.predict(rows.assign(source="newlab_cluster"))[q10],
                               told.predict(rows.assign(source="newlab_cluster"))[q10],
                               rtol=1e-6)
    # fitted on pipelines across nodes, or calibrated on them, the family has measured them
    assert PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1).fit(
        frame).node_pipeline_families_ == ["synthetic"]
    ran = make_synthetic(seed=6, n_per_model=40)
    ran = ran[(ran["status"] == "ok") & (ran["pp"] > 1) & (F.pp_crosses_nodes(ran) > 0)]
    model.calibrate(ran.head(3))
    assert model.node_pipeline_families_ == ["synthetic"]
    calibrated = model.predict(rows.assign(source="synthetic"))[q10]
    model.node_pipeline_families_ = []
    unsure = model.predict(rows.assign(source="synthetic"))[q10]
    assert (unsure[crossing] < calibrated[crossing]).mean() > 0.5
    # a family without measurements, calibrated on runs of its own in one node, has them now:
    # its pipelines across nodes keep the stall threshold in their slow end; once its
    # calibration holds a pipeline across nodes that ran, they do not
    own = frame[(frame["world_size"] <= 8) & (frame["status"] == "ok")].head(12)
    newlab = rows.assign(source="newlab_cluster")
    shot = PerformanceModel.load(model.save(tmp_path / "shot"))
    shot.node_pipeline_families_ = []
    shot.calibrate(own.assign(source="newlab_cluster"))
    assert "efficiency" in shot.family_offsets_[family_of("newlab_cluster")]
    assert shot.node_pipeline_families_ == []
    unsure = shot.predict(newlab)[q10]
    assert (unsure[crossing] <= tokens[crossing] / floor[crossing] * (1 + 1e-6)).all()
    shot.calibrate(pd.concat([own, ran.head(3)]).assign(source="newlab_cluster"))
    assert family_of("newlab_cluster") in shot.node_pipeline_families_
    ran_across = shot.predict(newlab)[q10]
    assert (unsure[crossing] < ran_across[crossing]).mean() > 0.5


def test_unknown_option_value_gets_error_naming_the_field(fitted, synthetic):
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).copy()
    frame.loc[frame.index[0], "sharding"] = "zero-1"
    frame.loc[frame.index[2], "schedule"] = "one_f_one_b"
    pred = fitted.predict(frame)
    assert pred["pred_error"].iloc[0] == ("sharding='zero-1' must be one of none, zero1, "
                                          "zero2, zero3")
    assert pred["pred_error"].iloc[2].startswith("schedule='one_f_one_b' must be one of")
    assert np.isnan(pred["pred_step_time_s"].iloc[[0, 2]]).all()
    assert pred["pred_error"].iloc[1] == "" and np.isfinite(pred["pred_step_time_s"].iloc[1])


def test_hardware_alias_routes_like_its_catalogue_name(synthetic):
    other = synthetic.assign(hardware="A100-80GB", source="otherlab_cluster")
    model = PerformanceModel(n_estimators=20, aux_estimators=10, min_family_rows=50,
                             n_jobs=1).fit(pd.concat([synthetic, other], ignore_index=True))
    configs = synthetic[list(CONFIG_COLUMNS)]
    named = model.predict(configs)["pred_step_time_s"].to_numpy()
    for alias in ("h100", "H100", "h100-80gb"):
        np.testing.assert_array_equal(
            model.predict(configs.assign(hardware=alias))["pred_step_time_s"].to_numpy(), named)


def test_saving_over_another_model_never_loads_a_mixture(fitted, synthetic, tmp_path):
    other = PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1).fit(
        synthetic.head(120))
    other.save(tmp_path / "m")
    # a save over it that dies after its first booster: the directory does not load
    broken = PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1).fit(synthetic)
    broken.memory_ = object()  # no save_model: the save fails part-way
    with pytest.raises(AttributeError):
        broken.save(tmp_path / "m")
    with pytest.raises(ModelFormatError, match=r"no model\.json"):
        load_model(tmp_path / "m")
    # a complete save over it loads as the new model
    fitted.save(tmp_path / "m")
    assert load_model(tmp_path / "m").num_train_rows_ == fitted.num_train_rows_


@pytest.mark.parametrize("damage", ["training", "params", "components"])
def test_corrupt_manifest_fails_clearly(fitted, tmp_path, damage):
    fitted.save(tmp_path / "m")
    manifest_path = tmp_path / "m" / "model.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest[damage]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ModelFormatError, match=f"corrupt manifest.*{damage}"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("text", ["[1, 2]", "null", "7"])
def test_manifest_that_is_not_an_object_fails_clearly(fitted, tmp_path, text):
    fitted.save(tmp_path / "m")
    (tmp_path / "m" / "model.json").write_text(text)
    with pytest.raises(ModelFormatError, match=r"corrupt manifest \(a JSON .*, not an object"):
        load_model(tmp_path / "m")


def test_no_memory_limit_is_known_on_the_cpu(fitted, synthetic):
    # the feasibility classifier learned H100 memory; the CPU has no catalogued memory size
    cpu = synthetic[list(CONFIG_COLUMNS)].assign(hardware="cpu").head(20)
    assert (fitted.predict(cpu)["pred_feasible_prob"] == 1.0).all()


def test_quantile_columns_follow_the_quantiles(synthetic):
    from paratune import ConfigError

    model = PerformanceModel(n_estimators=20, aux_estimators=10, quantiles=(0.05, 0.95),
                             n_jobs=1).fit(synthetic)
    pred = model.predict(synthetic[list(CONFIG_COLUMNS)])
    low, high = "pred_tokens_per_sec_per_gpu_q05", "pred_tokens_per_sec_per_gpu_q95"
    assert {low, high} <= set(pred.columns) and PRED_TOKENS_Q10 not in pred.columns
    assert (pred[low] <= pred["pred_tokens_per_sec_per_gpu"] * (1 + 1e-9)).all()
    assert (pred[high] >= pred["pred_tokens_per_sec_per_gpu"] * (1 - 1e-9)).all()
    with pytest.raises(ConfigError, match=r"quantiles=\(0.9, 0.1\).*lower < 0.5 < upper"):
        PerformanceModel(quantiles=(0.9, 0.1)).fit(synthetic)


def test_fits_cpu_runs_together_with_failed_gpu_runs(synthetic):
    # own CPU campaigns (no catalogued memory size) beside a GPU sweep with failed runs: the
    # feasibility classifier's memory fraction is missing for the CPU rows, not infinite
    cpu = synthetic[synthetic["status"] == "ok"].assign(hardware="cpu", source="paratune")
    both = pd.concat([synthetic, cpu], ignore_index=True)
    model = PerformanceModel(n_estimators=20, aux_estimators=10, n_jobs=1).fit(both)
    assert model.feasibility_ is not None
    pred = model.predict(both[list(CONFIG_COLUMNS)])
    assert (pred["pred_error"] == "").all() and np.isfinite(pred["pred_step_time_s"]).all()
    feasible = pred["pred_feasible_prob"].to_numpy()
    on_cpu = (both["hardware"] == "cpu").to_numpy()
    oom = (both["status"] != "ok").to_numpy()
    assert np.isfinite(feasible).all()
    assert (feasible[on_cpu] == 1.0).all()  # no memory limit is known for the CPU
    assert (feasible[oom] < 0.5).mean() >= 0.8


@pytest.mark.parametrize("damage", ["missing", "truncated", "not json", "a regressor"])
def test_a_damaged_booster_file_is_named_without_a_stack_trace(fitted, tmp_path, damage):
    """The message names the booster file (not model.json) in one line, with no C++ trace."""
    fitted.save(tmp_path / "m")
    booster = tmp_path / "m" / ("throughput.json" if damage == "missing" else "feasibility.json")
    if damage == "missing":
        booster.unlink()
    elif damage == "truncated":
        booster.write_text(booster.read_text()[:1000])
    elif damage == "not json":
        booster.write_text("{garbage")
    else:
        booster.write_bytes((tmp_path / "m" / "memory.json").read_bytes())
    with pytest.raises(ModelFormatError) as info:
        load_model(tmp_path / "m")
    message = str(info.value)
    assert message.startswith(f"{booster}: ")
    assert "missing" in message if damage == "missing" else "corrupt" in message
    assert "\n" not in message and "Stack trace" not in message and "model.json:" not in message


def test_the_training_ranges_are_recorded_and_saved(fitted, synthetic, tmp_path):
    from paratune.models._data import measured_step_time

    timed = synthetic[np.isfinite(measured_step_time(synthetic))]
    ranges = fitted.training_ranges_
    assert set(ranges) == set(timed["hardware"].map(lambda h: get_hardware(h).name))
    for name, seen in ranges.items():
        rows = timed[timed["hardware"].map(lambda h: get_hardware(h).name) == name]
        assert seen["world_size"] == [int(rows["world_size"].min()),
                                      int(rows["world_size"].max())]
        tokens = rows["global_batch_size"] * rows["seq_len"]
        assert seen["tokens_per_step"] == [int(tokens.min()), int(tokens.max())]
    assert load_model(fitted.save(tmp_path / "m")).training_ranges_ == ranges


# ------------------------------------------------------------- saves and loads side by side
_SAVER = """
import sys, time
from pathlib import Path
from paratune.models import load_model

models = [load_model(src) for src in sys.argv[1].split(",")]
ready, others, rounds = Path(sys.argv[3]), sys.argv[4].split(","), int(sys.argv[5])
pause_s = float(sys.argv[6])
stop = Path(sys.argv[7]) if len(sys.argv) > 7 else None  # else: rounds saves
ready.touch()
while not all(Path(other).exists() for other in others):  # start together
    time.sleep(0.001)
i = 0
while i < rounds if stop is None else not stop.exists() and i < rounds:
    for j, out in enumerate(sys.argv[2].split(",")):
        models[(i + j) % len(models)].save(out)
        time.sleep(pause_s)
    i += 1
print(i, flush=True)
"""


def _start_saver(sources, outs, ready, others, rounds, pause_s=0.0, stop=None):
    """A process that loads the models saved in ``sources``, waits for ``others`` to exist
    (after creating ``ready``), then saves them into each of ``outs`` in turn, ``rounds``
    times (or, given ``stop``, until that file exists, ``rounds`` at most), ``pause_s``
    apart; it prints the rounds it saved."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _SAVER, ",".join(map(str, sources)),
                             ",".join(map(str, outs)), str(ready),
                             ",".join(map(str, others)), str(rounds), str(pause_s),
                             *([str(stop)] if stop is not None else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def two_models(fitted, synthetic, tmp_path_factory):
    """Two different fitted models saved in directories of their own, and what each predicts:
    the second has per-family boosters the first lacks."""
    other = synthetic.assign(hardware="A100-80GB", source="otherlab_cluster")
    second = PerformanceModel(n_estimators=20, aux_estimators=10, min_family_rows=50,
                              n_jobs=1).fit(pd.concat([synthetic, other], ignore_index=True))
    configs = synthetic[list(CONFIG_COLUMNS)]
    check = pd.concat([configs.head(4),
                       configs.head(2).assign(model_name="twice-as-deep",
                                              num_layers=configs["num_layers"].head(2) * 2),
                       configs.head(2).assign(hardware="A100-80GB")], ignore_index=True)
    root = tmp_path_factory.mktemp("two")
    models = {"first": fitted, "second": second}
    return {name: (model.save(root / name), model.num_train_rows_,
                   _signature(model, check)) for name, model in models.items()}, check


def _signature(model, check):
    return model.predict(check)[list(PREDICTION_COLUMNS)].to_numpy(dtype=float)


def _which(path, two_models):
    """The name of the saved model that ``path`` loads as, exactly (AssertionError: neither)."""
    saved, check = two_models
    model = load_model(path)
    got = _signature(model, check)
    for name, (_, rows, expected) in saved.items():
        if model.num_train_rows_ == rows and np.allclose(got, expected, rtol=1e-6,
                                                         equal_nan=True):
            return name
    raise AssertionError(f"{path} loads as a mixture of two models")


@pytest.mark.slow
def test_concurrent_saves_into_one_directory_leave_one_complete_model(two_models, tmp_path):
    saved, _ = two_models
    sources = [saved["first"][0], saved["second"][0]]
    outs = [tmp_path / f"m{i}" for i in range(4)]
    ready = [tmp_path / "ready0", tmp_path / "ready1"]
    # both processes save into the same directories at the same moments, in opposite orders
    savers = [_start_saver(sources, outs, ready[0], [ready[1]], 5),
              _start_saver(sources[::-1], outs, ready[1], [ready[0]], 5)]
    errors = [saver.communicate(timeout=120)[1] for saver in savers]
    assert [saver.returncode for saver in savers] == [0, 0], "\n".join(errors)
    for out in outs:
        _which(out, two_models)
        manifest = json.loads((out / "model.json").read_text())
        visible = {p.name for p in out.iterdir() if not p.name.startswith(".")}
        assert visible == {"model.json", *manifest["components"].values()}
        assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_a_load_during_saves_gets_one_whole_model(two_models, tmp_path):
    saved, _ = two_models
    out = tmp_path / "m"
    PerformanceModel.load(saved["first"][0]).save(out)
    ready, go, stop = tmp_path / "ready", tmp_path / "go", tmp_path / "stop"
    # The writer saves until the loads are done, pausing longer than a waiting lock's retry
    # (50 ms) so that a load gets its turn whatever the machine's speed; the loads come at
    # random moments, never in step with the saves.
    writer = _start_saver([saved["first"][0], saved["second"][0]], [out], ready, [go], 2000,
                          pause_s=0.1, stop=stop)
    while not ready.exists() and writer.poll() is None:
        time.sleep(0.01)
    go.touch()
    seen, deadline, jitter = [], time.monotonic() + 120, np.random.default_rng(0)
    while writer.poll() is None and time.monotonic() < deadline and not (
            len(seen) >= 10 and set(seen) == {"first", "second"}):
        seen.append(_which(out, two_models))
        time.sleep(jitter.uniform(0.0, 0.05))
    stop.touch()
    rounds, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert int(rounds) >= 2  # the loads raced a stream of saves
    assert len(seen) >= 10 and set(seen) == {"first", "second"}, seen


def test_a_booster_file_of_another_save_is_detected(two_models, tmp_path):
    saved, _ = two_models
    out = PerformanceModel.load(saved["first"][0]).save(tmp_path / "m")
    (out / "throughput.json").write_bytes((saved["second"][0] / "throughput.json").read_bytes())
    with pytest.raises(ModelFormatError, match=rf"^{re.escape(str(out / 'throughput.json'))}: "
                                               r"corrupt.*differs"):
        load_model(out)


@pytest.mark.slow
def test_a_read_only_model_directory_still_loads(two_models):
    import shutil
    import tempfile

    saved, _ = two_models
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        root.chmod(0o755)  # the unprivileged user below reads it
        saved_dir = PerformanceModel.load(saved["first"][0]).save(root / "saved")
        copied = root / "copied"  # the model files alone, as a copy of the *.json files
        copied.mkdir()
        for file in saved_dir.glob("*.json"):
            shutil.copy(file, copied / file.name)
        private = root / "private"  # its lock file another user's, unreadable by the loader
        shutil.copytree(saved_dir, private)
        dirs = [saved_dir, copied, private]
        before = {directory: sorted(directory.iterdir()) for directory in dirs}
        for directory in dirs:
            for file in directory.iterdir():
                file.chmod(0o444)
            directory.chmod(0o555)
        (private / ".model.lock").chmod(0o600)
        try:
            for directory in dirs:
                assert _load_unprivileged(directory, two_models) == "first"
                assert sorted(directory.iterdir()) == before[directory]
        finally:
            for directory in dirs:
                directory.chmod(0o755)


UNPRIVILEGED_LOAD = """
import json, os, sys
import pandas as pd
from paratune.models import load_model
from paratune.predictor import PREDICTION_COLUMNS

warm, target, check_csv = sys.argv[1:4]
check = pd.read_csv(check_csv)
load_model(warm).predict(check)  # every lazy import done before the privileges go
os.setgid(65534)
os.setuid(65534)
assert not os.access(target, os.W_OK), "the directory is writable"
pred = load_model(target).predict(check)[list(PREDICTION_COLUMNS)].to_numpy(dtype=float)
print(json.dumps({"rows": load_model(target).num_train_rows_, "pred": pred.tolist()}))
"""


def _load_unprivileged(directory, two_models):
    """:func:`_which` of ``directory`` by a user who cannot write there. Root cannot be kept
    out by permissions: a fresh interpreter imports what it needs, then drops to ``nobody``
    (a forked child of this process could deadlock on the thread pools it inherits)."""
    import os
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0:
        assert not os.access(directory, os.W_OK)
        return _which(directory, two_models)
    saved, check = two_models
    with tempfile.TemporaryDirectory() as scratch:
        check_csv = Path(scratch) / "check.csv"
        check.to_csv(check_csv, index=False)
        done = subprocess.run(
            [sys.executable, "-c", UNPRIVILEGED_LOAD, str(saved["second"][0]), str(directory),
             str(check_csv)], capture_output=True, text=True, timeout=120,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    got = np.asarray(said["pred"], dtype=float)
    for name, (_, rows, expected) in saved.items():
        if said["rows"] == rows and np.allclose(got, expected, rtol=1e-6, equal_nan=True):
            return name
    raise AssertionError(f"{directory} loads as a mixture of two models")
