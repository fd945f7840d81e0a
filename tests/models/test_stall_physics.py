"""The stalled-pipeline regime as physics: a fixed cost per micro-batch that matters only
where it is large next to the compute, for models larger than any fitted on."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd

from paratune import ParallelConfig, get_model
from paratune.models import PerformanceModel
from paratune.models import features as F
from paratune.predictor import config_frame


def _deep_pipelines(micro: int, global_batch: int) -> pd.DataFrame:
    """Deep pipelines of a 70B model over 8 H100 nodes (sources the fit has seen)."""
    model = get_model("llama3-70b", seq_len=4096)
    configs = [ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                              global_batch_size=global_batch)
               for tp, pp, dp in ((8, 8, 1), (4, 16, 1), (8, 4, 2))]
    frame = config_frame(model, configs, "H100")
    frame["source"] = "synthetic"
    return frame


def test_a_larger_models_deep_pipeline_with_seconds_of_compute_rarely_stalls(make_synthetic):
    # the truth: a stall costs 1.2 s per micro-batch where the compute per device is small,
    # below a bound that grows with the model (larger models stalled more at the same
    # compute, as in the public sweep); none with a fifth of a second or more stalled
    train = make_synthetic(stalls=True)
    step = train["step_time_s"].to_numpy()
    bound = train["model_name"].map({"llama3.2-1b": 0.02, "llama3.2-3b": 0.06,
                                     "llama3-8b": 0.2}).to_numpy()
    busy = F.stalled_pipeline(train, step) & (F.step_time_at_mfu(train) >= bound)
    normal = (F.analytical_step_time(train)["step_time_s"] * 1.5
              * 1.2 ** np.maximum(np.log2(train["tp"].to_numpy()) - 1, 0))
    train.loc[busy, "step_time_s"] = normal[busy]
    train.loc[busy, "tokens_per_s"] = (train["global_batch_size"] * train["seq_len"]
                                       / train["step_time_s"])[busy]
    stalled = F.stalled_pipeline(train, train["step_time_s"].to_numpy())
    model = PerformanceModel(n_estimators=60, aux_estimators=30, min_stall_rows=20,
                             n_jobs=1).fit(train)
    assert model.num_stall_rows_ == stalled.sum() >= 20
    # the layouts that stalled most in training, on a model 9x larger than any fitted on:
    # several seconds of model FLOPs per device per step, beyond any run that stalled
    deep = _deep_pipelines(micro=1, global_batch=256)
    assert (F.step_time_at_mfu(deep) > 3).all()
    pred = model.predict(deep)
    assert (pred["pred_stall_prob"] < 0.3).all(), pred["pred_stall_prob"].tolist()
    # so its point prediction is the normal regime, well above the stalled one's 10% of peak
    assert (pred["pred_step_time_s"].to_numpy() < F.stall_floor_s(deep)).all()
    # while a small model's deep pipeline over as many nodes still stalls
    small = config_frame(get_model("llama3.2-1b", seq_len=4096),
                         [ParallelConfig(dp=1, tp=4, pp=16, micro_batch_size=1,
                                         global_batch_size=8)], "H100")
    small["source"] = "synthetic"
    assert (model.predict(small)["pred_stall_prob"] > 0.5).all()


def test_compute_per_micro_batch_above_the_stall_cost_is_not_predicted_slower(make_synthetic):
    # every deep pipeline over nodes stalls at 1.2 s per micro-batch in training
    model = PerformanceModel(n_estimators=60, aux_estimators=30, n_jobs=1).fit(
        make_synthetic(stalls=True))
    normal_only = copy.copy(model)
    normal_only.stall_ = normal_only.stall_transfer_ = None  # the normal regime alone
    # a micro-batch of 64 sequences of a 70B model: well over a second of compute each
    big = _deep_pipelines(micro=64, global_batch=512)
    assert (F.step_time_at_mfu(big) / F.num_microbatches(big) > 1.2).all()
    pred, normal = model.predict(big), normal_only.predict(big)
    assert (pred["pred_stall_prob"] == 0).all()
    np.testing.assert_allclose(pred["pred_step_time_s"], normal["pred_step_time_s"],
                               rtol=1e-9)
    np.testing.assert_allclose(pred["pred_tokens_per_sec_per_gpu_expected"],
                               normal["pred_tokens_per_sec_per_gpu_expected"], rtol=1e-9)
    # the same layouts with small micro-batches, whose compute hides no stall, keep the regime
    small = model.predict(_deep_pipelines(micro=1, global_batch=8))
    assert np.isfinite(small["pred_stall_prob"]).all()


def test_deep_pipelines_of_a_model_ten_times_the_sweeps_are_not_called_stalled(public_dir):
    """Fitted on the public H100 sweep (1B-8B, where a third of pipeline runs stalled), an
    80B model's deep pipelines on 64-256 GPUs, with 2-8 s of compute per device per step
    (beyond any run that stalled): the layouts that run best there, at about 30% of peak."""
    from paratune import ModelSpec
    from paratune.hardware import get_hardware
    from paratune.models import load_measurements

    frame = load_measurements([public_dir / "ultrascale_playbook_h100.csv",
                               public_dir / "ultrascale_playbook_h100_failed.csv"])
    model = PerformanceModel(n_jobs=1).fit(frame)
    spec = ModelSpec(name="80B", num_layers=80, hidden_size=8192, num_heads=64,
                     ffn_hidden_size=28672, vocab_size=131072, seq_len=4096)
    rows = []
    for world in (64, 128, 256):
        for tp in (2, 4, 8):
            for pp in (8, 16):
                dp = world // (tp * pp)
                if dp < 1:
                    continue
                for micro in (1, 2):
                    rows.append(F.config_row(spec, ParallelConfig(
                        dp=dp, tp=tp, pp=pp, micro_batch_size=micro, global_batch_size=256),
                        get_hardware("H100")))
    deep = pd.concat(rows, ignore_index=True)
    assert (F.step_time_at_mfu(deep) > 1.5).all() and len(deep) >= 20
    prob = model.predict(deep)["pred_stall_prob"].to_numpy()
    assert np.median(prob) < 0.3 and np.mean(prob > 0.5) < 0.2, np.round(prob, 2).tolist()


def test_a_larger_models_stall_probability_decays_with_its_distance(make_synthetic,
                                                                      monkeypatch):
    """The stalled regime is a learned correction like the step time's: beyond the fitted
    model sizes its probability falls by e per doubling, inside them it is untouched."""
    from paratune.models import _stall_regime

    train = make_synthetic(stalls=True)
    model = PerformanceModel(n_estimators=60, aux_estimators=30, n_jobs=1).fit(train)
    deep = _deep_pipelines(micro=1, global_batch=8)  # a 70B model: beyond the fitted 8B
    seen = train[(train["status"] == "ok") & (train["pp"] > 1)].head(20)
    pred, pred_seen = model.predict(deep), model.predict(seen)
    monkeypatch.setattr(_stall_regime, "STALL_DECAY_PER_DOUBLING", 0.0)
    flat, flat_seen = model.predict(deep), model.predict(seen)
    doublings = pred["pred_extrapolation_doublings"].to_numpy()
    assert (doublings > 2).all() and (flat["pred_stall_prob"] > 0).all()
    # the model-size axis is all of these rows' distance (same cluster, batch and nodes)
    np.testing.assert_allclose(pred["pred_stall_prob"],
                               flat["pred_stall_prob"] * np.exp(-doublings), rtol=1e-6)
    np.testing.assert_allclose(pred_seen["pred_stall_prob"], flat_seen["pred_stall_prob"])
    # the expected throughput follows: less of the stalled regime weighed in
    assert (pred["pred_tokens_per_sec_per_gpu_expected"]
            > flat["pred_tokens_per_sec_per_gpu_expected"]).all()
