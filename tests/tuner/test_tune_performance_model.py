"""``tune`` end to end with the learned model: fit on synthetic measurements, save, tune from
the saved directory. Needs no public data."""

from __future__ import annotations

import json

import pytest
import yaml
from optuna.trial import TrialState

from paratune import ParallelConfig, get_model
from paratune.space import ConfigSpace
from paratune.tuner import Objective, SearchSpace, exhaustive, tune


def test_tune_with_a_fitted_performance_model(saved_model, tmp_path):
    from paratune.models import load_model

    spec = get_model("llama3-8b", seq_len=4096)  # the shape the synthetic rows were made for
    options = ConfigSpace(micro_batch_sizes=(1, 2, 4), recomputes=("none", "full"))
    out = tmp_path / "out"
    result = tune(spec, 16, "H100", saved_model, objective="throughput",
                  global_batch_sizes=[64], space=options, n_trials=40, seed=0,
                  output_dir=out, top_k=5, track=False)

    # the whole space, predicted by the same model: the search found (near) its best
    space = SearchSpace.build(spec, 16, "H100", space=options, global_batch_sizes=[64])
    full = exhaustive(load_model(saved_model), space, Objective(kind="throughput"))
    assert full.best_feasible and result.search.best_feasible
    best = float(full.ranked["objective"].iloc[0])
    assert float(result.ranked["objective"].iloc[0]) >= 0.95 * best
    winner = full.ranked[full.ranked["feasible"]].reset_index(drop=True)
    position = [config.key() for config in full.configs(len(winner))].index(result.best.key())
    assert position < max(3, len(winner) // 10), (position, len(winner))

    # the recommendation is a valid, predicted-feasible layout of this job
    result.best.validate(spec, 16)
    rec = json.loads((out / "recommendation.json").read_text())
    assert ParallelConfig.from_dict(rec["config"]) == result.best
    assert rec["predicted"]["feasible"] is True
    assert rec["predicted"]["feasible_prob"] >= 0.5
    assert 0 < rec["predicted"]["peak_mem_gb"] <= 80
    assert rec["predicted"]["tokens_per_s"] > 0
    # the winner heads the top configs, by the largest objective of a feasible trial
    feasible = [t for t in result.study.trials if t.state is TrialState.COMPLETE
                and max(t.constraints.values()) <= 0]
    objectives = [c["objective"] for c in rec["top"]]
    assert len(objectives) == 5 and objectives == sorted(objectives, reverse=True)
    assert objectives[0] == pytest.approx(max(t.value for t in feasible))
    assert yaml.safe_load((out / "recommendation.yaml").read_text())["config"] == rec["config"]
    for name in ("torchtitan.toml", "megatron_args.txt"):
        assert (out / name).stat().st_size > 0


def test_tune_run_names_the_predictor_and_its_training_data(saved_model, tmp_path):
    from mlflow.tracking import MlflowClient

    from paratune.models import load_model

    spec = get_model("llama3-8b", seq_len=4096)
    kwargs = dict(global_batch_sizes=[64], search="exhaustive",
                  space=ConfigSpace(micro_batch_sizes=(1, 2), recomputes=("none",)))
    loaded = load_model(saved_model)
    from_dir = tune(spec, 16, "H100", saved_model, **kwargs)
    from_object = tune(spec, 16, "H100", loaded, **kwargs)
    client = MlflowClient()
    params = client.get_run(from_dir.run_id).data.params
    assert params["predictor"] == str(saved_model.resolve())
    assert params["predictor_fingerprint"] == loaded.fingerprint_
    params = client.get_run(from_object.run_id).data.params
    assert params["predictor"] == "PerformanceModel"
    assert params["predictor_fingerprint"] == loaded.fingerprint_


def test_a_model_larger_than_any_fitted_is_ranked_risk_aware(saved_model, tmp_path):
    # fitted on llama3 1B-8B: the 8B job interpolates and ranks by the expected throughput;
    # a 70B job on the same devices is beyond the fitted model sizes, and tune ranks it by
    # the risk-aware expectation (without being told), as the extrapolation splits score it
    options = ConfigSpace(micro_batch_sizes=(1, 2), recomputes=("none", "full"))
    runs = {}
    for name in ("llama3-8b", "llama3-70b"):
        spec = get_model(name, seq_len=4096)
        runs[name] = tune(spec, 16, "H100", saved_model, objective="throughput",
                          global_batch_sizes=[64], space=options, search="exhaustive",
                          output_dir=tmp_path / name, top_k=3, track=False)
    inside = runs["llama3-8b"].search
    beyond = runs["llama3-70b"].search
    assert (inside.ranked["pred_extrapolation_doublings"].fillna(0) == 0).all()
    assert not inside.risk_aware
    assert (beyond.ranked["pred_extrapolation_doublings"] > 0).any()
    assert beyond.risk_aware
