"""The time-to-target experiment (experiments/time_to_target.py): what it prices runs by,
what it charges the plan arm, and which runs it reuses. Unit level: the experiment itself
takes hours."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from paratune.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import time_to_target as ttt  # from experiments/, put on the path above


def _model():
    from paratune import get_model

    return get_model("tiny").replace(name="tiny-text", num_layers=2, hidden_size=64,
                                     num_heads=4, num_kv_heads=2, ffn_hidden_size=176,
                                     seq_len=64)


def _profile(rows):
    """rows: (layout, batch, measure, step_time_s)."""
    from _ttt_worker import config_for, measured_config_for

    table = []
    for layout, batch, measure, seconds in rows:
        config = (measured_config_for(_model(), layout, batch) if measure
                  else config_for(layout, batch))
        table.append({"layout": layout, "batch": batch, "measure": measure,
                      "key": config.key(), "config": config.to_dict(),
                      "step_time_s": seconds})
    return {"table": table, "switch_costs": [{"total_s": 1.0}]}


def test_measuring_configs_differ_from_the_plain_ones_where_they_accumulate():
    from _ttt_worker import config_for, measured_config_for

    # dp-mode measurement runs the plain config; accumulate mode halves the micro-batch.
    assert measured_config_for(_model(), "dp4", 16) == config_for("dp4", 16)
    plain, measuring = config_for("dp2-tp2", 16), measured_config_for(_model(), "dp2-tp2", 16)
    assert measuring.micro_batch_size == plain.micro_batch_size // 2
    assert measuring.key() != plain.key()


def test_coadapt_chooses_layouts_by_the_timings_of_the_configs_it_runs():
    # Plain steps favour dp2-tp2, noise-measuring steps (what coadapt runs) favour dp4.
    profile = _profile([("dp4", 16, False, 0.20), ("dp2-tp2", 16, False, 0.10),
                        ("dp4", 16, True, 0.15), ("dp2-tp2", 16, True, 0.30),
                        ("dp4", 8, True, 0.10)])
    times = ttt.measuring_times(profile, _model(), [8, 16])
    assert times == {("dp4", 16): 0.15, ("dp2-tp2", 16): 0.30, ("dp4", 8): 0.10}
    assert ttt.best_layouts(times, [8, 16]) == {8: "dp4", 16: "dp4"}


def test_the_plan_predictor_answers_from_plain_steps_only():
    """The plan and fixed arms run without measuring: a measuring row of the same (or only)
    key must not price them."""
    from paratune.predictor import PARALLEL_COLUMNS, PRED_FEASIBLE_PROB, PRED_STEP_TIME_S

    profile = _profile([("dp4", 16, False, 0.20), ("dp4", 16, True, 0.35),
                        ("dp2-tp2", 16, True, 0.30)])
    predictor = ttt.MeasuredPredictor(profile["table"], 64)
    frame = pd.DataFrame([{k: r["config"][k] for k in PARALLEL_COLUMNS}
                          for r in profile["table"]])
    got = predictor.predict(frame)
    assert got[PRED_STEP_TIME_S].iloc[0] == 0.20
    assert got[PRED_STEP_TIME_S].iloc[1] == 0.20  # same config, measured plainly
    assert math.isnan(got[PRED_STEP_TIME_S].iloc[2])  # only measured while measuring
    assert got[PRED_FEASIBLE_PROB].iloc[2] == 0.0


def _run(arm, curve, *, switches=0, reached=True, seed=0):
    return {"name": f"{arm}-{seed}", "arm": arm, "seed": seed, "reached": reached,
            "time_s": curve[-1]["time_s"] if reached else math.nan,
            "steps": curve[-1]["step"] if reached else math.nan, "tokens": 0,
            "num_switches": switches, "switch_s": 0.0, "curve": curve, "gns": []}


def _point(step, time_s, layout, batch, measure):
    from _ttt_worker import config_for, measured_config_for

    config = (measured_config_for(_model(), layout, batch) if measure
              else config_for(layout, batch))
    return {"step": step, "time_s": time_s, "val_loss": 1.0, "tokens": step,
            "batch": batch, "layout": layout, "config": config.key(), "measure": measure}


def test_modelled_time_prices_each_stretch_at_the_config_it_ran():
    profile = _profile([("dp2-tp2", 16, False, 0.10), ("dp2-tp2", 16, True, 0.30),
                        ("dp2-tp2", 32, True, 0.50)])
    measuring = _run("coadapt", [_point(0, 0, "dp2-tp2", 16, True),
                                 _point(10, 1, "dp2-tp2", 16, True),
                                 _point(14, 2, "dp2-tp2", 32, True)], switches=1)
    assert ttt.modelled_time(measuring, profile) == pytest.approx(10 * 0.30 + 4 * 0.50 + 1.0)
    plain = _run("fixed", [_point(0, 0, "dp2-tp2", 16, False),
                           _point(10, 1, "dp2-tp2", 16, False)])
    assert ttt.modelled_time(plain, profile) == pytest.approx(10 * 0.10)


def test_the_plan_arm_is_charged_the_pilot_it_needs():
    profile = _profile([("dp4", 16, False, 0.20), ("dp4", 16, True, 0.25)])
    fixed = [_point(0, 0, "dp4", 16, False), _point(10, 3.0, "dp4", 16, False)]
    measured = [_point(0, 0, "dp4", 16, True), _point(10, 4.0, "dp4", 16, True)]
    results = [_run("fixed", fixed), _run("batch", measured), _run("coadapt", measured),
               _run("plan", [_point(0, 0, "dp4", 16, False), _point(5, 1.0, "dp4", 16, False)])]
    pilot = _run("pilot", [_point(0, 0, "dp4", 16, True), _point(8, 2.5, "dp4", 16, True),
                           _point(12, 3.5, "dp4", 16, True)], reached=False)
    assert ttt.pilot_cost(pilot, profile) == {"pilot_s": 3.5,
                                              "pilot_modelled_s": pytest.approx(12 * 0.25)}
    summary = ttt.summarise(results, profile, pilot).set_index("arm")
    assert summary.loc["plan", "pilot_s"] == 3.5
    assert summary.loc["plan", "time_mean_s"] == 1.0
    assert summary.loc["plan", "time_with_pilot_mean_s"] == pytest.approx(4.5)
    assert summary.loc["plan", "modelled_with_pilot_mean_s"] == pytest.approx(5 * 0.2 + 3.0)
    # The fastest baseline (fixed, 3.0 s) beats plan + pilot (4.5 s): reported as a loss.
    assert summary.loc["plan", "gain_with_pilot_pct"] == pytest.approx(-50.0)
    assert summary.loc["plan", "gain_vs_best_baseline_pct"] == pytest.approx(100 * (1 - 1 / 3))
    assert summary.loc["fixed", "pilot_s"] == 0.0
    assert summary.loc["fixed", "time_with_pilot_mean_s"] == 3.0


def _settings(**changes):
    import argparse

    args = argparse.Namespace(target=2.0, lr=2e-3, pilot_batch=16, eval_every_tokens=4096,
                              max_tokens=3_000_000, corpus_mb=4.0)
    for name, value in changes.items():
        setattr(args, name, value)
    batches = changes.pop("batches", [4, 8, 16])
    return ttt.experiment_settings(args, _model(), batches, {"gns_beta": 0.9})


def test_runs_measured_with_other_settings_are_not_reused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # Until something is measured, the latest settings are recorded: a run that ended before
    # measuring anything (a worker refused its config) binds the directory to nothing.
    ttt.check_settings(out, _settings(target=3.0))
    assert json.loads((out / "settings.json").read_text())["target"] == 3.0
    ttt.check_settings(out, _settings())
    assert json.loads((out / "settings.json").read_text())["target"] == 2.0
    (out / "profile.jsonl").write_text('{"id": "step dp4 measure=0"}\n')
    ttt.check_settings(out, _settings())  # same settings: continue
    for changes, field, mine, theirs in [
            (dict(target=1.5), "target", "1.5", "2.0"),
            (dict(lr=1e-3), "lr", "0.001", "0.002"),
            (dict(batches=[4, 8]), "batches", "[4, 8]", "[4, 8, 16]"),
            (dict(pilot_batch=8), "pilot_batch", "8", "16")]:
        with pytest.raises(ConfigError) as info:
            ttt.check_settings(out, _settings(**changes))
        assert info.value.field == field
        assert mine in str(info.value) and theirs in str(info.value)
    # A directory from before settings were recorded cannot be matched: refused.
    old = tmp_path / "old"
    old.mkdir()
    (old / "runs.jsonl").write_text('{"name": "pilot"}\n')
    with pytest.raises(ConfigError, match="before their settings were recorded") as info:
        ttt.check_settings(old, _settings())
    assert info.value.field == "out" and not (old / "settings.json").exists()
    # Likewise a partial profile (the measurement journal of a killed profiling).
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "profile.jsonl").write_text('{"id": "step dp4 measure=0"}\n')
    with pytest.raises(ConfigError, match=r"holds profile\.jsonl measured before") as info:
        ttt.check_settings(partial, _settings())
    assert info.value.field == "out" and not (partial / "settings.json").exists()


def test_the_script_refuses_other_settings_before_starting_any_process(tmp_path, monkeypatch,
                                                                        capsys):
    out = tmp_path / "out"
    out.mkdir()
    ttt.check_settings(out, _settings())
    (out / "runs.jsonl").write_text('{"name": "pilot"}\n')

    def no_spawn(job):
        raise AssertionError("started processes")

    monkeypatch.setattr(ttt, "_spawn", no_spawn)
    # Defaults but another target: refused, exit status 2, the setting named.
    with pytest.raises(SystemExit) as info:
        ttt.main(["--out", str(out), "--target", "1.5", "--batches", "4,8,16",
                  "--corpus-mb", "4", "--no-mlflow"])
    assert info.value.code == 2
    assert "target=1.5" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--batches", "0,4"], "argument --batches: must be comma-separated integers >= 1"),
    (["--batches", "2,4"], "argument --batches: 2 cannot run on the dp4 layout"),
    (["--pilot-batch", "6"], "argument --pilot-batch: 6 cannot run on the dp4 layout"),
    (["--lr", "-1"], "argument --lr: must be a finite number"),
])
def test_the_script_refuses_bad_values_before_touching_out(tmp_path, monkeypatch, capsys,
                                                           flags, message):
    """A value no run can use is refused up front, naming the flag: not by a worker's
    traceback after --out was created and bound to it."""
    out = tmp_path / "out"
    monkeypatch.setattr(ttt, "_spawn", lambda job: pytest.fail("started processes"))
    with pytest.raises(SystemExit) as info:
        ttt.main(["--out", str(out), *flags, "--no-mlflow"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_script_refuses_an_out_another_experiment_is_using(tmp_path, monkeypatch, capsys):
    """Two experiments into one --out would measure the same things twice and interleave
    their journals: the second is refused while the first holds the folder."""
    from paratune.fileio import exclusive_lock

    out = tmp_path / "out"
    monkeypatch.setattr(ttt, "_spawn", lambda job: pytest.fail("started processes"))
    with (exclusive_lock(out / "experiment.lock", field="out", value=str(out), what="running"),
          pytest.raises(SystemExit) as info):
        ttt.main(["--out", str(out), "--no-mlflow"])
    assert info.value.code == 2
    assert "is in use: another process" in capsys.readouterr().err
    assert not (out / "settings.json").exists()


@pytest.mark.slow
def test_measuring_steps_are_timed_with_the_meter(tmp_path, monkeypatch):
    """time_measuring_steps runs NoiseScaleMeter steps (accumulate mode under tp) in a real
    gloo group and returns one slowest-rank time per profiled step: the same on every rank,
    the longer of the ranks' own step times (rank 1 idles after each of its steps, where
    rank 0 does not wait for it), not their sum."""
    from paratune.profiler.gns import spawn

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on a two-core machine
    spawn(_measuring_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"times-{rank}.json").read_text()) for rank in (0, 1)]
    assert [got["mode"] for got in ranks] == ["accumulate"] * 2
    times = ranks[0]["times"]
    assert len(times) == 3 and ranks[1]["times"] == times
    own = [got["own"][-3:] for got in ranks]  # the meter's steps, the warm-up step left out
    for step, (time_s, own_0, own_1) in enumerate(zip(times, *own, strict=True)):
        # rank 1's own time holds its idling (rank 0's too, where rank 1 started late)
        assert own_1 >= _IDLE_S, step
        assert max(own_0, own_1) <= time_s < own_0 + own_1, step


_IDLE_S = 0.2


def _measuring_worker(rank, world_size, port, out):
    from _ttt_worker import Job, time_measuring_steps

    from paratune import ParallelConfig
    from paratune.profiler import gns
    from paratune.profiler.gns import init_worker
    from paratune.profiler.mesh import closing_process_group

    # Each rank's own duration of every meter step; rank 1 idles after its step's last
    # collective, so its own time is the longer one.
    own: list[float] = []
    real_step = gns.NoiseScaleMeter.step

    def step(self, *args, **kwargs):
        begin = time.perf_counter()
        result = real_step(self, *args, **kwargs)
        if rank == 1:
            time.sleep(_IDLE_S)
        own.append(time.perf_counter() - begin)
        return result

    gns.NoiseScaleMeter.step = step
    device = init_worker(rank, world_size, port, "cpu")
    with closing_process_group():
        job = Job(model=_model(), out_dir=out, target_loss=1.0, lr=1e-3, corpus_bytes=0,
                  val_seqs=1, eval_every_tokens=1, max_tokens=1, batches=[8], gns_beta=0.9,
                  profile_steps=3)
        times, mode = time_measuring_steps(
            job, ParallelConfig(tp=2, micro_batch_size=2, global_batch_size=8), device,
            warmup_steps=1)
        Path(out, f"times-{rank}.json").write_text(
            json.dumps({"times": times, "mode": mode, "own": own}))


_PROFILE_ONLY = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import time_to_target as ttt
from _ttt_worker import Job
from paratune import get_model
model = get_model("tiny").replace(name="tiny-text", num_layers=2, hidden_size=64, num_heads=4,
                                  num_kv_heads=2, ffn_hidden_size=176, seq_len=64)
ttt._spawn(Job(model=model, out_dir=sys.argv[2], target_loss=1.0, lr=1e-3, corpus_bytes=0,
               val_seqs=1, eval_every_tokens=1, max_tokens=1, batches=[4], gns_beta=0.9,
               profile=True, profile_steps=1))
"""


@pytest.mark.slow
def test_a_killed_profiling_keeps_its_measurements_and_resumes(tmp_path):
    """The experiment's profiling (its real worker, 4 gloo ranks) is killed with SIGKILL, all
    its processes, right after it measured its first switch cost: what it measured is kept as
    journaled (values and times) and the rerun measures only the rest, then writes the whole
    profile. To keep this short, an earlier killed profiling has already journaled all step
    times but the last (so the one killed here measures one step time, then switches)."""
    from _ttt_worker import LAYOUTS, PROFILE_JOURNAL, Job, profile_items, read_profile_journal

    from paratune.fileio import append_jsonl, read_jsonl

    out = tmp_path / "out"
    job = Job(model=_model(), out_dir=str(out), target_loss=1.0, lr=1e-3, corpus_bytes=0,
              val_seqs=1, eval_every_tokens=1, max_tokens=1, batches=[4], gns_beta=0.9)
    items = profile_items(job, 4)
    journal = out / PROFILE_JOURNAL
    for n, (measurement_id, layout, batch, measure, config) in enumerate(items[:-1]):
        append_jsonl(journal, {"id": measurement_id, "measured_at": 1.0 + n, "layout": layout,
                               "batch": batch, "measure": measure, "mode": "",
                               "key": config.key(), "config": config.to_dict(),
                               "step_time_s": 100.0 + n, "peak_rss_gb": 0.0})
    command = [sys.executable, "-c", _PROFILE_ONLY, str(Path(ttt.__file__).parent), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (first.poll() is None and time.monotonic() < deadline
               and not any(i.startswith("switch ") for i in read_profile_journal(journal))):
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read().decode()
    finally:
        with contextlib.suppress(ProcessLookupError):  # (gone already: the assert says why)
            os.killpg(first.pid, signal.SIGKILL)  # the parent and its workers
        first.wait()
    kept_text = journal.read_text()
    kept = read_profile_journal(journal)
    assert items[-1][0] in kept and any(i.startswith("switch 0 ") for i in kept), list(kept)
    assert not (out / "profile.json").exists()
    assert len(kept) < len(items) + 3  # not all switches measured: the rerun has work left

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert journal.read_text().startswith(kept_text)  # kept as it was: values and times
    ids = [r["id"] for r in read_jsonl(journal)]
    assert len(ids) == len(set(ids)) == len(items) + 3  # nothing measured twice
    profile = json.loads((out / "profile.json").read_text())
    # The whole profile in the shape the experiment reads, built from the kept measurements.
    assert [r["key"] for r in profile["table"]] == [item[4].key() for item in items]
    assert {r["layout"] for r in profile["table"]} == set(LAYOUTS)
    assert all(set(r) == {"layout", "batch", "measure", "mode", "key", "config",
                          "step_time_s", "peak_rss_gb"} for r in profile["table"])
    assert [r["step_time_s"] for r in profile["table"]] == [
        *(100.0 + n for n in range(len(items) - 1)), kept[items[-1][0]]["step_time_s"]]
    switch_0 = next(r for i, r in kept.items() if i.startswith("switch 0 "))
    assert profile["switch_costs"][0] == {k: v for k, v in switch_0.items()
                                          if k not in ("id", "measured_at")}
    assert len(profile["switch_costs"]) == 3
    assert all(c["total_s"] > 0 for c in profile["switch_costs"])
