from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError, DatasetError
from paratune.models import cross_validate, load_measurements
from paratune.models._estimators import AnalyticalBaseline
from paratune.models._evaluate import metrics
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


def test_larger_cluster_fits_on_a_quarter_of_the_largest(synthetic):
    (fold,) = extrapolation_split(synthetic, "larger-cluster").folds
    world = synthetic["world_size"].to_numpy()
    assert world[fold.train].max() <= world.max() / 4
    assert (world[fold.test] == world.max()).all()


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


def test_public_splits_are_the_documented_ones(public_dir):
    frame = load_measurements(sorted(public_dir.glob("*.csv")))
    labels = {name: [f.label for f in extrapolation_split(frame, name).folds]
              for name in EXTRAPOLATION_SPLITS}
    assert "ultrascale: 1B -> 8B" in labels["larger-model"]
    assert "ultrascale: <=64 -> 256 GPUs" in labels["larger-cluster"]
    assert "vtrain: <=2 -> 8 GPUs" in labels["larger-cluster"]
    assert labels["family"] == ["without ultrascale -> ultrascale", "without vtrain -> vtrain"]
    assert "vtrain: 2-4 -> 8 GPUs (one node)" in labels["multi-node"]
