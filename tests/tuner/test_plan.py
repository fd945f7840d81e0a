from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError, get_model
from paratune.space import ConfigSpace
from paratune.tuner import SearchSpace, Trajectory, effective_b_noise, plan_phases, time_to_target
from paratune.tuner._objective import Objective
from paratune.tuner._plan import progress_segments
from paratune.tuner._search import evaluate

SEQ = get_model("llama3-8b").seq_len


def _trajectory(lo: float = 40.0, hi: float = 4000.0, points: int = 200) -> Trajectory:
    step = np.arange(points, dtype=float) * 100
    tokens = step * 256 * SEQ  # reference run at 256 sequences per step
    b = np.geomspace(lo, hi, points)
    return Trajectory(step=step, tokens=tokens, b_noise=b, loss=np.full(points, np.nan))


def _space():
    options = ConfigSpace(micro_batch_sizes=(1, 2), shardings=("none", "zero1"),
                          recomputes=("none",), schedules=("1f1b",))
    return SearchSpace.build(get_model("llama3-8b"), 64, "H100", space=options,
                             global_batch_sizes="64:4096")


def test_plan_follows_the_noise_scale_and_beats_both_baselines(closed_form):
    plan = plan_phases(closed_form, _space(), _trajectory(), reconfig_cost_s=60,
                       threshold=0.02)
    batches = [p["config"]["global_batch_size"] for p in plan.phases]
    assert len(plan.phases) >= 2
    assert batches == sorted(batches) and batches[0] < batches[-1]
    assert plan.total_time_s <= plan.baselines["fixed"]["time_s"]
    assert plan.total_time_s <= plan.baselines["follow_critical"]["time_s"]
    assert plan.speedup("fixed") > 1.0
    phase_time = sum(p["time_s"] for p in plan.phases)
    switch_time = plan.total_time_s - phase_time
    assert switch_time >= 0 and switch_time <= plan.num_switches * 60 + 1e-6
    text = plan.table()
    assert "fixed" in text and "follow_critical" in text


def test_switch_costs_and_threshold_hold_the_plan_still(closed_form):
    plan = plan_phases(closed_form, _space(), _trajectory(), reconfig_cost_s=1e12,
                       batch_change_cost_s=1e12)
    assert plan.num_switches == 0 and len(plan.phases) == 1
    strict = plan_phases(closed_form, _space(), _trajectory(), reconfig_cost_s=0,
                         threshold=10.0)
    assert strict.num_switches == 0


def test_effective_noise_scale_reproduces_the_whole_run_time(closed_form):
    traj = _trajectory()
    segments = progress_segments(traj, seq_len=SEQ, max_segments=10**9)
    b_eff = effective_b_noise(traj, seq_len=SEQ)
    e_total = sum(s.e_min for s in segments)
    space = _space()
    configs = space.enumerate().valid[:50]
    scored = evaluate(closed_form, space, configs, Objective())
    batch = scored["global_batch_size"].to_numpy(float)
    step = scored["step_time_s"].to_numpy(float)
    per_segment = sum(time_to_target(batch, step, s.b_noise, s.e_min) for s in segments)
    np.testing.assert_allclose(per_segment, time_to_target(batch, step, b_eff, e_total),
                               rtol=1e-9)


def test_bad_plan_arguments(closed_form):
    with pytest.raises(ConfigError, match="threshold"):
        plan_phases(closed_form, _space(), _trajectory(), threshold=-1)
    short = Trajectory(step=np.array([0.0]), tokens=np.array([0.0]), b_noise=np.array([5.0]),
                       loss=np.array([np.nan]))
    with pytest.raises(ConfigError, match="trajectory"):
        plan_phases(closed_form, _space(), short)


def test_plan_times_configs_by_the_throughput_the_tuner_ranks_by(closed_form):
    space, trajectory = _space(), _trajectory()
    plain = plan_phases(closed_form, space, trajectory, reconfig_cost_s=60, threshold=0.02)
    chosen = {(p["config"]["dp"], p["config"]["tp"], p["config"]["pp"]) for p in plain.phases}

    class StallRisk:
        """The closed form, with the layouts of the plain plan likely to stall (expected
        throughput a tenth of the point prediction)."""

        def predict(self, frame):
            out = closed_form.predict(frame)
            layouts = zip(frame["dp"], frame["tp"], frame["pp"])
            risky = np.array([layout in chosen for layout in layouts])
            point = out["pred_tokens_per_sec_per_gpu"].to_numpy()
            out["pred_tokens_per_sec_per_gpu_expected"] = np.where(risky, point / 10, point)
            return out

    plan = plan_phases(StallRisk(), space, trajectory, reconfig_cost_s=60, threshold=0.02)
    picked = {(p["config"]["dp"], p["config"]["tp"], p["config"]["pp"]) for p in plan.phases}
    assert not picked & chosen
    scored = evaluate(StallRisk(), space, space.enumerate().valid, Objective())
    for phase in plan.phases:
        cfg = phase["config"]
        row = scored[(scored[list(cfg)] == pd.Series(cfg)).all(axis=1)].iloc[0]
        assert phase["tokens_per_s"] == pytest.approx(row["ranked_tokens_per_s"])
        assert phase["step_time_s"] == pytest.approx(
            cfg["global_batch_size"] * SEQ / row["ranked_tokens_per_s"])
    # a risk quantile of the objective is what the plan times configs by, as in tune
    cautious = plan_phases(closed_form, space, trajectory, objective=Objective(
        risk_quantile="q10"))
    q10 = evaluate(closed_form, space, space.enumerate().valid, Objective(risk_quantile="q10"))
    for phase in cautious.phases:
        cfg = phase["config"]
        row = q10[(q10[list(cfg)] == pd.Series(cfg)).all(axis=1)].iloc[0]
        assert phase["tokens_per_s"] == pytest.approx(
            row["pred_tokens_per_sec_per_gpu_q10"] * row["world_size"])
