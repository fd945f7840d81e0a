from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError, get_model
from paratune.batch import ConfigBatch
from paratune.space import ConfigSpace
from paratune.tuner import (
    ScheduleOptions,
    SearchSpace,
    Trajectory,
    effective_b_noise,
    plan_phases,
    time_to_target,
)
from paratune.tuner._objective import Objective
from paratune.tuner._plan import progress_segments
from paratune.tuner._plan_schedule import layout_key, optimal_schedule
from paratune.tuner._search import evaluate, rank

SEQ = get_model("llama3-8b").seq_len


def _trajectory(lo: float = 40.0, hi: float = 4000.0, points: int = 200) -> Trajectory:
    step = np.arange(points, dtype=float) * 100
    tokens = step * 256 * SEQ  # reference run at 256 sequences per step
    b = np.geomspace(lo, hi, points)
    return Trajectory(step=step, tokens=tokens, b_noise=b, loss=np.full(points, np.nan),
                      seq_len=SEQ)


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
                       loss=np.array([np.nan]), seq_len=SEQ)
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


# ----------------------------------------------------------------------------- units


def _measured(seq_len: int, seqs_per_step: int, b_tokens: np.ndarray) -> Trajectory:
    """A run of ``seqs_per_step`` sequences of ``seq_len`` tokens whose noise scale is
    ``b_tokens`` tokens (so ``b_simple = b_tokens / seq_len`` of its sequences)."""
    step = np.arange(1, len(b_tokens) + 1, dtype=float)
    return Trajectory(step=step, tokens=step * seqs_per_step * seq_len,
                      b_noise=b_tokens / seq_len, loss=np.full(len(step), np.nan),
                      seq_len=seq_len)


def test_noise_scale_and_reference_batch_convert_through_tokens():
    # `paratune gns --model tiny` style: 16 sequences of 128 tokens per step
    b_tokens = np.geomspace(8, 64, 200) * 128
    tiny = _measured(128, 16, b_tokens)
    assert tiny.reference_batch() == 16
    at_own = effective_b_noise(tiny, seq_len=128)
    for target in (128, 512, 8192):
        # the noise scale (and the progress) in tokens does not depend on the seq_len planned
        assert effective_b_noise(tiny, seq_len=target) * target == pytest.approx(at_own * 128)
        segs = progress_segments(tiny, seq_len=target, max_segments=4)
        assert sum(s.e_min for s in segs) * target == pytest.approx(
            sum(s.e_min for s in progress_segments(tiny, seq_len=128, max_segments=4)) * 128)
    # E_min with the reference batch of the measuring run (16 sequences, not 2048/8192)
    b_mid = 0.5 * (b_tokens[1:] + b_tokens[:-1])
    e_min_tokens = np.sum(16 * 128 / (1 + 16 * 128 / b_mid))
    segs = progress_segments(tiny, seq_len=8192, max_segments=1)
    assert segs[0].e_min * 8192 == pytest.approx(e_min_tokens)
    # the same run recorded in sequences of another length plans identically
    same = _measured(2048, 1, b_tokens)
    np.testing.assert_allclose(same.b_noise_in(8192), tiny.b_noise_in(8192))
    assert effective_b_noise(same, seq_len=8192) == pytest.approx(
        effective_b_noise(tiny, seq_len=8192))


def test_plan_is_the_same_whatever_seq_len_the_trajectory_was_measured_at(closed_form):
    b_tokens = np.geomspace(40, 4000, 200) * SEQ
    at_target = _measured(SEQ, 256, b_tokens)
    at_short = _measured(1024, 256 * SEQ // 1024, b_tokens)
    plans = [plan_phases(closed_form, _space(), t, reconfig_cost_s=60, threshold=0.02)
             for t in (at_target, at_short)]
    assert plans[0].total_time_s == pytest.approx(plans[1].total_time_s)
    assert [p["config"] for p in plans[0].phases] == [p["config"] for p in plans[1].phases]
    assert plans[0].phases[0]["b_noise_min"] == pytest.approx(plans[1].phases[0]["b_noise_min"])


def test_trajectory_without_seq_len_is_refused_not_guessed(closed_form):
    # 2 sequences of 4096 tokens per step: a whole number of 8192-token sequences would
    # let a guess pass silently
    unknown = Trajectory(step=np.arange(10.0), tokens=np.arange(10.0) * 8192,
                         b_noise=np.full(10, 50.0), loss=np.full(10, np.nan), source="old.csv")
    for call in (lambda: effective_b_noise(unknown, seq_len=SEQ),
                 lambda: plan_phases(closed_form, _space(), unknown)):
        with pytest.raises(ConfigError, match=r"trajectory='old.csv'.*seq_len column or "
                                              r"--trajectory-seq-len"):
            call()
    wrong = Trajectory(step=np.arange(10.0), tokens=np.arange(10.0) * 8192,
                       b_noise=np.full(10, 50.0), loss=np.full(10, np.nan), seq_len=3000)
    with pytest.raises(ConfigError, match=r"seq_len=3000: must divide the 8192 tokens"):
        effective_b_noise(wrong, seq_len=SEQ)


def _uneven_trajectory() -> Trajectory:
    """Points crowded early and sparse late: most cuts of equal tokens hold no point."""
    step = np.array([0.0, 1, 2, 3, 4, 40, 100, 200])
    return Trajectory(step=step, tokens=step * 256 * SEQ,
                      b_noise=np.array([40.0, 60, 80, 120, 160, 800, 2000, 4000]),
                      loss=np.full(len(step), np.nan), seq_len=SEQ)


def test_stretches_are_labelled_with_the_tokens_their_e_min_covers(closed_form):
    traj = _uneven_trajectory()
    segs = progress_segments(traj, seq_len=SEQ, max_segments=5)
    # the labels are trajectory points, one stretch starts where the last one ended, and
    # together they cover the run (cut edges would end the last stretch at 160 steps)
    assert segs[0].start_tokens == traj.tokens[0] and segs[-1].end_tokens == traj.tokens[-1]
    for before, after in itertools.pairwise(segs):
        assert before.end_tokens == after.start_tokens
    # each stretch's E_min and B_noise are those of the points between its labels
    for seg in segs:
        inside = (traj.tokens >= seg.start_tokens) & (traj.tokens <= seg.end_tokens)
        part = Trajectory(step=traj.step[inside], tokens=traj.tokens[inside],
                          b_noise=traj.b_noise[inside], loss=traj.loss[inside], seq_len=SEQ)
        [alone] = progress_segments(part, seq_len=SEQ, max_segments=1)
        assert seg.e_min == pytest.approx(alone.e_min)
        assert seg.b_noise == pytest.approx(alone.b_noise)
    # the plan's phases and switches carry the same labels
    plan = plan_phases(closed_form, _space(), traj, reconfig_cost_s=0, threshold=0.0,
                       max_segments=5)
    assert plan.phases[0]["start_tokens"] == traj.tokens[0]
    assert plan.phases[-1]["end_tokens"] == traj.tokens[-1]
    for before, after in itertools.pairwise(plan.phases):
        assert before["end_tokens"] == after["start_tokens"]
    starts = {s.start_tokens for s in segs}
    assert all(sw["at_tokens"] in starts for sw in plan.switches)


# ----------------------------------------------------------------------------- the schedule


def _path_cost(times, layouts, path, rc, bc):
    total = times[0, path[0]]
    for i in range(1, len(path)):
        a, b = path[i - 1], path[i]
        if a != b:
            total += bc if layouts[a] == layouts[b] else rc
        total += times[i, b]
    return total


def _brute_force(times, layouts, rc, bc, threshold=None):
    n, k = times.shape
    best = math.inf
    for path in itertools.product(range(k), repeat=n):
        if threshold is not None and any(
                path[i] != path[i - 1]
                and not times[i, path[i - 1]] > (1 + threshold) * times[i, path[i]]
                for i in range(1, n)):
            continue
        best = min(best, _path_cost(times, layouts, path, rc, bc))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_schedule_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    times = rng.uniform(1, 10, (n, k))
    layouts = rng.integers(0, 3, k)
    rc, bc = float(rng.uniform(0, 6)), float(rng.uniform(0, 3))
    choice, total = optimal_schedule(times, layouts, reconfig_cost_s=rc, batch_change_cost_s=bc,
                                     threshold=0.0)
    assert total == pytest.approx(_path_cost(times, layouts, choice, rc, bc))
    # threshold 0 with bc <= 2 rc: the unconstrained optimum
    assert total == pytest.approx(_brute_force(times, layouts, rc, bc))
    assert total <= times.sum(axis=0).min() + 1e-9
    # a threshold filters switches: the optimum among plans whose switches all clear it
    thr = float(rng.choice([0.1, 0.5]))
    _, gated = optimal_schedule(times, layouts, reconfig_cost_s=rc, batch_change_cost_s=bc,
                                threshold=thr)
    assert gated == pytest.approx(_brute_force(times, layouts, rc, bc, threshold=thr))
    assert total - 1e-9 <= gated <= times.sum(axis=0).min() + 1e-9


def _step_trajectory() -> Trajectory:
    """B_noise jumps from 20 to 20000 early: a huge batch pays off for most of the run."""
    points = 200
    step = np.arange(points, dtype=float) * 100
    b = np.where(np.arange(points) < 8, 20.0, 20000.0)
    return Trajectory(step=step, tokens=step * 256 * SEQ, b_noise=b,
                      loss=np.full(points, np.nan), seq_len=SEQ)


def _dense_optimum(predictor, space, trajectory, rc, bc, max_segments):
    """Unconstrained optimum by a dense DP over all config pairs."""
    ranked = rank(evaluate(predictor, space, space.enumerate().valid, Objective()))
    tput = ranked["ranked_tokens_per_s"].to_numpy(float)
    ranked = ranked[ranked["feasible"].to_numpy(bool) & np.isfinite(tput)
                    & (tput > 0)].reset_index(drop=True)
    segs = progress_segments(trajectory, seq_len=SEQ, max_segments=max_segments)
    b = ranked["global_batch_size"].to_numpy(float)
    step = b * SEQ / ranked["ranked_tokens_per_s"].to_numpy(float)
    e = np.array([s.e_min for s in segs])[:, None]
    bn = np.array([s.b_noise for s in segs])[:, None]
    times = e * (1 + b[None] / bn) / b[None] * step[None]
    lays = [layout_key(c) for c in ConfigBatch.from_frame(ranked).configs()]
    cost = np.where(np.array([[x == y for y in lays] for x in lays]), bc, rc)
    np.fill_diagonal(cost, 0)
    best = times[0].copy()
    for i in range(1, len(segs)):
        best = (best[:, None] + cost).min(axis=0) + times[i]
    return float(best.min())


@pytest.mark.parametrize("cost", [1e12, 72000.0, 600.0])
def test_plan_is_never_slower_than_the_fixed_baseline(closed_form, cost):
    plan = plan_phases(closed_form, _space(), _step_trajectory(), reconfig_cost_s=cost,
                       batch_change_cost_s=cost, threshold=0.05)
    assert plan.total_time_s <= plan.baselines["fixed"]["time_s"] * (1 + 1e-12)
    assert plan.speedup("fixed") >= 1 - 1e-12


@pytest.mark.parametrize(("rc", "bc"), [(600.0, 0.0), (600.0, 300.0), (3000.0, 0.0),
                                        (72000.0, 72000.0)])
def test_plan_is_the_exact_optimum_at_zero_threshold(closed_form, rc, bc):
    space = _space()
    for trajectory in (_trajectory(100, 3000), _step_trajectory()):
        plan = plan_phases(closed_form, space, trajectory, reconfig_cost_s=rc,
                           batch_change_cost_s=bc, threshold=0.0, max_segments=12)
        assert plan.total_time_s == pytest.approx(
            _dense_optimum(closed_form, space, trajectory, rc, bc, 12), rel=1e-9)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"batch_change_cost_s": -5}, "batch_change_cost_s"),
    ({"reconfig_cost_s": -1}, "reconfig_cost_s"),
    ({"reconfig_cost_s": math.nan}, "reconfig_cost_s"),
    ({"max_segments": 0}, "max_segments"),
    ({"max_segments": -3}, "max_segments"),
    ({"threshold": "0.1"}, "threshold"),
    ({"threshold": math.inf}, "threshold"),
])
def test_each_bad_argument_names_its_own_field(closed_form, kwargs, field):
    with pytest.raises(ConfigError) as info:
        plan_phases(closed_form, _space(), _trajectory(), **kwargs)
    assert info.value.field == field
    assert info.value.value is next(iter(kwargs.values()))
    # the options object refuses them itself, before any prediction
    with pytest.raises(ConfigError) as built:
        ScheduleOptions(**kwargs)
    assert built.value.field == field


def test_plan_options_object_and_keywords_plan_alike(closed_form):
    options = ScheduleOptions(reconfig_cost_s=60, threshold=0.0, max_segments=6, lr_rule="linear")
    by_object = plan_phases(closed_form, _space(), _trajectory(), options)
    by_keywords = plan_phases(closed_form, _space(), _trajectory(), reconfig_cost_s=60,
                              threshold=0.0, max_segments=6, lr_rule="linear")
    assert by_object.total_time_s == by_keywords.total_time_s
    assert [p["config"] for p in by_object.phases] == [p["config"] for p in by_keywords.phases]
    assert by_object.lr_rule == "linear" and by_object.reconfig_cost_s == 60.0
    # a keyword over the object wins; a name that is no option is refused by name
    cheaper = plan_phases(closed_form, _space(), _trajectory(), options, reconfig_cost_s=0)
    assert cheaper.reconfig_cost_s == 0.0 and cheaper.total_time_s <= by_object.total_time_s
    with pytest.raises(ConfigError, match=r"plan_options='reconfig_cost'.*is not one of"):
        plan_phases(closed_form, _space(), _trajectory(), reconfig_cost=60)


def test_progress_segments_needs_at_least_one_segment():
    with pytest.raises(ConfigError, match=r"max_segments=0: must be an integer >= 1"):
        progress_segments(_trajectory(), seq_len=SEQ, max_segments=0)


# ----------------------------------------------------------------------------- switch costs


def test_switches_record_their_kind_and_baselines_pay_batch_changes(closed_form):
    space, trajectory = _space(), _trajectory()
    free = plan_phases(closed_form, space, trajectory, reconfig_cost_s=600,
                       batch_change_cost_s=0, threshold=0.0)
    paid = plan_phases(closed_form, space, trajectory, reconfig_cost_s=600,
                       batch_change_cost_s=100, threshold=0.0)
    follow_free, follow_paid = free.baselines["follow_critical"], paid.baselines[
        "follow_critical"]
    assert follow_free["num_switches"] >= 2
    assert follow_paid["switch_time_s"] == pytest.approx(100 * follow_free["num_switches"])
    assert follow_paid["time_s"] == pytest.approx(
        follow_free["time_s"] + 100 * follow_free["num_switches"])
    for plan in (free, paid):
        assert plan.num_switches == len(plan.switches) == len(plan.phases) - 1
        for sw, before, after in zip(plan.switches, plan.phases, plan.phases[1:]):
            same_layout = all(before["config"][k] == after["config"][k]
                              for k in before["config"] if k != "global_batch_size")
            assert sw["kind"] == ("batch" if same_layout else "layout")
            assert sw["cost_s"] == (plan.batch_change_cost_s if same_layout
                                    else plan.reconfig_cost_s)
            assert sw["at_tokens"] == after["start_tokens"]
        assert plan.total_time_s == pytest.approx(
            sum(p["time_s"] for p in plan.phases) + sum(sw["cost_s"] for sw in plan.switches))
        assert plan.to_dict()["switches"] == plan.switches
    # a batch-only switch is reported at its own cost, not at the reconfiguration cost
    batch_only = [sw for sw in paid.switches if sw["kind"] == "batch"]
    assert batch_only, "the closed form should change only the batch at some point"
    text = paid.table()
    assert "batch-only change" in text and "at 100 s" in text
    # here every switch is batch-only: the summary line charges none at the layout cost
    assert [sw["kind"] for sw in paid.switches] == ["batch", "batch"]
    assert text.split("plan:")[1].splitlines()[0].endswith(
        "2 batch-only changes at 100 s (200 s in all)")
    assert "600 s" not in text.split("plan:")[1].splitlines()[0]


def test_the_batch_range_starts_where_a_layout_keeps_every_device_busy():
    from paratune.tuner import default_batch_range, smallest_busy_batch

    model = get_model("llama3-8b")
    # tp <= 8 (heads, node), pp <= 32 layers: 4,096 devices need dp >= 16
    assert smallest_busy_batch(model, 4096) == 16
    assert smallest_busy_batch(model, 64) == 1
    assert smallest_busy_batch(model, 4096, space=ConfigSpace(micro_batch_sizes=(2, 4))) == 32
    batches = default_batch_range(model, 4096, [100.0, 3000.0])
    assert batches[0] == 16 and batches[-1] >= 6000 and batches[-2] < 6000
    assert all(b == 2 * a for a, b in itertools.pairwise(batches))


def test_phases_state_their_learning_rate_tokens_and_loss(closed_form):
    step = np.arange(200, dtype=float) * 100
    traj = Trajectory(step=step, tokens=step * 256 * SEQ, b_noise=np.geomspace(40, 4000, 200),
                      loss=np.linspace(4.0, 2.0, 200), seq_len=SEQ)
    plan = plan_phases(closed_form, _space(), traj, reconfig_cost_s=60, threshold=0.0,
                       base_lr=2e-4, base_batch=64)
    assert len(plan.phases) >= 2
    for phase in plan.phases:
        batch = phase["config"]["global_batch_size"]
        assert phase["lr"] == pytest.approx(2e-4 * math.sqrt(batch / 64))
        assert phase["start_loss"] >= phase["end_loss"]
    # the run's own tokens: E = E_min (1 + B / B_noise) >= the minimal examples
    assert plan.phases[0]["run_start_tokens"] == 0
    for a, b in itertools.pairwise(plan.phases):
        assert a["run_end_tokens"] == b["run_start_tokens"]
        assert a["end_time_s"] < b["end_time_s"]
    e_min = sum(s.e_min for s in plan.segments) * SEQ
    assert plan.phases[-1]["run_end_tokens"] > e_min
    assert plan.phases[-1]["end_time_s"] == pytest.approx(plan.total_time_s)
    assert "sqrt rule" in plan.table()
    adascale = plan_phases(closed_form, _space(), traj, reconfig_cost_s=60, threshold=0.0,
                           lr_rule="adascale", base_batch=64)
    for phase in adascale.phases:
        batch = phase["config"]["global_batch_size"]
        gain = batch / 64 * (phase["b_noise"] + 64) / (phase["b_noise"] + batch)
        assert phase["lr_scale"] == pytest.approx(gain)
    with pytest.raises(ConfigError, match="lr_rule"):
        plan_phases(closed_form, _space(), traj, lr_rule="cubic")


def test_log_spacing_resolves_early_training():
    tokens = np.geomspace(1e8, 1e11, 300)
    traj = Trajectory(step=tokens / SEQ, tokens=tokens, b_noise=np.geomspace(10, 1000, 300),
                      loss=np.full(300, np.nan), seq_len=SEQ)
    log = progress_segments(traj, seq_len=SEQ, max_segments=10, spacing="auto")
    linear = progress_segments(traj, seq_len=SEQ, max_segments=10, spacing="linear")
    assert log[0].end_tokens < 1e9 < linear[0].end_tokens
    assert sum(s.e_min for s in log) == pytest.approx(sum(s.e_min for s in linear))
