"""``tune(verify=K)``: profile the top configs for real on this machine (gloo), refit, compare."""

from __future__ import annotations

import math

import pytest

from paratune import ConfigError, ParallelConfig, get_model
from paratune.space import ConfigSpace
from paratune.tuner import tune
from paratune.tuner._verify import pinned_space


def test_pinned_space_holds_exactly_the_config():
    model = get_model("tiny")
    for cfg in (ParallelConfig(dp=2, tp=1, pp=2, micro_batch_size=2, global_batch_size=8,
                               schedule="interleaved_1f1b", virtual_stages=2, sharding="zero2",
                               recompute="full"),
                ParallelConfig(dp=1, tp=2, pp=1, micro_batch_size=1, global_batch_size=4)):
        assert pinned_space(cfg).enumerate(model, cfg.world_size).valid == [cfg]


def _small_search(**kwargs):
    space = ConfigSpace(global_batch_sizes=(8,), micro_batch_sizes=(4,), shardings=("none",),
                        recomputes=("none",), schedules=("1f1b",))
    return tune("tiny", 2, "cpu", kwargs.pop("predictor"), search="exhaustive", space=space,
                track=False, **kwargs)


@pytest.mark.slow
def test_verify_profiles_refits_and_reports(closed_form, tmp_path):
    from paratune.models import PerformanceModel

    result = _small_search(predictor=closed_form, output_dir=tmp_path / "out", verify=1,
                           verify_options={"measured_steps": 2, "warmup_steps": 1, "timeout_s": 120,
                                           "model_factory": lambda: PerformanceModel(
                                               n_estimators=10, n_jobs=1)})
    table = result.verification
    assert list(table["config"]) == [result.best.key()]
    row = table.iloc[0]
    assert row["status"] == "ok"
    assert row["measured_tokens_per_s"] > 0 and math.isfinite(row["error_pct"])
    assert math.isfinite(row["refit_tokens_per_s"])
    # the refit learned from the measurement: fitted on it alone (no dataset given), it
    # predicts it back. (The closed form's own error says nothing here: it assumes 1e12
    # FLOP/s on a CPU, so it is off by a large factor; the measured time itself varies with
    # machine load, which this bound does not depend on.)
    assert abs(row["refit_error_pct"]) < 5
    assert (tmp_path / "out" / "verify" / "refit").is_dir()


def test_verify_needs_the_hardware_here(closed_form):
    with pytest.raises(ConfigError, match="verify"):
        tune("llama3-8b", 16, "H100", closed_form, search="exhaustive",
             global_batch_sizes=[64], track=False, verify=1,
             space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1,)))


@pytest.mark.slow
def test_each_verified_config_gets_its_own_measurement(closed_form, tmp_path):
    """Two top configs with the same degrees and batch sizes, differing only in sharding:
    each row of the verification reports the measurement of its own config."""
    from paratune.models import PerformanceModel, load_measurements

    space = ConfigSpace(global_batch_sizes=(8,), micro_batch_sizes=(4,),
                        shardings=("none", "zero3"), recomputes=("none",), schedules=("1f1b",),
                        tp_degrees=(1,), pp_degrees=(1,))
    result = tune("tiny", 2, "cpu", closed_form, search="exhaustive", space=space,
                  track=False, output_dir=tmp_path / "out", verify=2,
                  verify_options={"measured_steps": 2, "warmup_steps": 1, "timeout_s": 120,
                                  "model_factory": lambda: PerformanceModel(
                                      n_estimators=10, n_jobs=1)})
    configs = result.search.configs(2)
    assert {c.sharding.value for c in configs} == {"none", "zero3"}
    table = result.verification
    assert list(table["config"]) == [c.key() for c in configs]
    for cfg, (_, row) in zip(configs, table.iterrows()):
        own = load_measurements([tmp_path / "out" / "verify" / cfg.key()])
        own = own[own["sharding"] == cfg.sharding.value]
        assert len(own) == 1 and row["status"] == own["status"].iloc[0] == "ok"
        assert row["measured_tokens_per_s"] == pytest.approx(float(own["tokens_per_s"].iloc[0]))
    assert table["measured_tokens_per_s"].iloc[0] != table["measured_tokens_per_s"].iloc[1]


@pytest.mark.slow
def test_verify_is_logged_in_the_tune_run(closed_form, tmp_path):
    from mlflow.tracking import MlflowClient

    from paratune.models import PerformanceModel

    space = ConfigSpace(global_batch_sizes=(8,), micro_batch_sizes=(4,), shardings=("none",),
                        recomputes=("none",), schedules=("1f1b",))
    result = tune("tiny", 2, "cpu", closed_form, search="exhaustive", space=space,
                  output_dir=tmp_path / "out", verify=1,
                  verify_options={"measured_steps": 2, "warmup_steps": 1, "timeout_s": 120,
                                  "model_factory": lambda: PerformanceModel(n_estimators=10,
                                                                            n_jobs=1)})
    client = MlflowClient()
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["verify"] == "1"
    assert "verification.csv" in {a.path for a in client.list_artifacts(result.run_id)}


def test_verify_is_refused_before_the_search(closed_form, tmp_path, monkeypatch):
    """A verification this machine cannot run is refused up front: no prediction, no file
    (not after the search wrote the recommendation)."""
    # a machine without the job's H100s, whatever this one has
    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    with pytest.raises(ConfigError, match=r"^verify=1: profiling needs the job's hardware"):
        tune("llama3-8b", 64, "H100", closed_form, n_trials=5, track=False, verify=1,
             output_dir=tmp_path / "out")
    assert closed_form.calls == []
    assert not (tmp_path / "out").exists()


def test_verify_on_the_cpu_refuses_more_processes_than_the_machine_runs(
        closed_form, tmp_path, monkeypatch, caplog):
    """Every rank of a CPU verification is a process here: beyond two per core (or beyond
    the machine's memory) the job is refused, naming gpus, before the search starts."""
    import os

    from paratune.tuner import SearchSpace
    from paratune.tuner._verify import RANKS_PER_CORE, check_verify_here

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # this machine's device is the CPU, as on a GPU machine verifying a CPU job it is not
    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    too_many = 2 * RANKS_PER_CORE + 1
    with pytest.raises(ConfigError, match=rf"^gpus={too_many}: .* at most {RANKS_PER_CORE} "
                                          r"per core: 4 on its 2 cores"):
        tune("tiny", too_many, "cpu", closed_form, n_trials=5, track=False, verify=1,
             global_batch_sizes=[too_many], output_dir=tmp_path / "out")
    assert closed_form.calls == [] and not (tmp_path / "out").exists()
    # two per core still verify (the quickstart's 4 ranks on 2 cores), with a warning
    with caplog.at_level("WARNING", logger="paratune.tuner._verify"):
        assert check_verify_here(SearchSpace.build(get_model("tiny"), 4, "cpu"), 1) == "cpu"
    assert "4 processes share this machine's 2 cores" in caplog.text
    # the machine's memory: llama3-8b needs about 128 GB of state whatever the layout
    monkeypatch.setattr("paratune.profiler._memory.physical_memory_bytes", lambda: 64 << 30)
    with pytest.raises(ConfigError, match=r"^gpus=4: verifying runs all 4 processes .*more "
                                          r"than its 68\.7 GB of memory$"):
        check_verify_here(SearchSpace.build(get_model("llama3-8b"), 4, "cpu"), 1)
