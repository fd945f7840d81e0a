"""``tune(verify=K)``: profile the top configs for real on this machine (gloo), refit, compare."""

from __future__ import annotations

import json
import math

import pytest

from paratune import ConfigError, ParallelConfig, get_model
from paratune.space import ConfigSpace
from paratune.tuner import tune
from paratune.tuner._verify import pinned_space
from paratune.tuner._verify_refit import VerifyRuns


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
def test_verify_profiles_refits_and_reports(closed_form, tmp_path, caplog):
    from paratune.models import PerformanceModel

    with caplog.at_level("INFO", logger="paratune.tuner"):
        result = _small_search(
            predictor=closed_form, output_dir=tmp_path / "out", verify=1,
            verify_options={"measured_steps": 2, "warmup_steps": 1, "timeout_s": 120,
                            "model_factory": lambda: PerformanceModel(n_estimators=10,
                                                                      n_jobs=1)})
    # without a dataset the refit knows the verified run alone, and says so; and it says
    # the ranking shown was the predictor's before the run, and how to rank with the refit
    assert "refitting on the 1 verified runs alone: without --dataset" in caplog.text
    assert f"--predictor {tmp_path / 'out' / 'verify' / 'refit'} ranks with them" in caplog.text
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


def test_a_config_predicted_slow_gets_time_enough_to_be_measured(caplog):
    """A verified config whose predicted steps take longer than half the per-config timeout
    gets twice their time and a minute: killed at the default it would be recorded as a
    timeout, a hung run, and teach the refit nothing. A quick one keeps the timeout."""
    from paratune.tuner._verify import VerifyRuns, _runs_for

    runs = VerifyRuns(warmup_steps=2, measured_steps=5, timeout_s=300.0)
    config = ParallelConfig(dp=2, micro_batch_size=1, global_batch_size=8192)
    with caplog.at_level("WARNING", logger="paratune.tuner._verify"):
        slow = _runs_for(runs, config, 71.4)
    assert slow.timeout_s == math.ceil(2 * 71.4 * 7 + 60)
    assert (slow.warmup_steps, slow.measured_steps) == (2, 5)
    assert "predicted 500 s for its 7 steps" in caplog.text
    assert _runs_for(runs, config, 1.0) is runs
    assert _runs_for(runs, config, math.nan) is runs


def test_verify_here_needs_the_hardware_here(closed_form):
    # (verify_on="auto", the default, verifies such a job on its cluster instead)
    with pytest.raises(ConfigError, match="verify"):
        tune("llama3-8b", 16, "H100", closed_form, search="exhaustive",
             global_batch_sizes=[64], track=False, verify=1, verify_on="here",
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
        own = load_measurements([tmp_path / "out" / "verify" / VerifyRuns.directory_name(
            result.search.space, cfg)])
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
             verify_on="here", output_dir=tmp_path / "out")
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
    monkeypatch.setattr("paratune.profiler.physical_memory_bytes", lambda: 64 << 30)
    with pytest.raises(ConfigError, match=r"^gpus=4: verifying runs all 4 processes .*more "
                                          r"than its 68\.7 GB of memory$"):
        check_verify_here(SearchSpace.build(get_model("llama3-8b"), 4, "cpu"), 1)


# ------------------------------------------------------------------ on the target cluster
def _cluster_job(closed_form, out, k=3, **kwargs):
    return tune("llama3-8b", 16, "H100", closed_form, search="exhaustive",
                global_batch_sizes=[64], track=False, verify=k, output_dir=out,
                space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1, 2)), **kwargs)


def test_verify_on_a_cluster_writes_torchrun_and_slurm_commands_for_exactly_the_list(
        closed_form, tmp_path, monkeypatch):
    from paratune.tuner import verification_order

    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    result = _cluster_job(closed_form, tmp_path / "out")
    plan = result.cluster_verification
    assert result.verification is None and plan.finished == [False] * 3
    # the first three of the verification order that paratune's trainer runs
    ranked, configs = result.search.ranked, result.search.configs()
    def runs(cfg):
        try:
            cfg.check_trainer(result.search.space.model)
        except ConfigError:
            return False
        return True

    expected = [configs[i] for i in verification_order(ranked) if runs(configs[i])][:3]
    assert plan.configs == expected
    assert len({(c.tp, c.pp) for c in plan.configs}) > 1  # not one layout's variants
    for cfg, directory, command, script in zip(plan.configs, plan.directories, plan.torchrun,
                                               plan.sbatch):
        assert directory == (tmp_path / "out" / "verify" / VerifyRuns.directory_name(
            result.search.space, cfg)).resolve() and directory.name.startswith(cfg.key())
        plan_file = directory / "plan-ws16.json"
        assert plan_file.exists() and str(plan_file) in command
        assert command.startswith("torchrun --nnodes=2 --nproc-per-node=8 ")
        text = script.read_text()
        assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
        assert "srun --nodes=2 --ntasks-per-node=1 torchrun" in text and str(plan_file) in text
    assert "sbatch " + str(plan.sbatch[0]) in plan.instructions()
    # a later call names the same configs (kept in verify.json), even when asked for fewer
    again = _cluster_job(closed_form, tmp_path / "out", k=2).cluster_verification
    assert again.configs == plan.configs[:2] and again.directories == plan.directories[:2]


def test_verify_on_a_cluster_of_part_filled_nodes_starts_the_ranks_torchrun_does(
        closed_form, tmp_path, monkeypatch):
    """12 devices of 8-device nodes run as 6 on each of 2, as the exports launch them: the
    verification's commands asked for 8 per node and were refused."""
    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    result = tune("llama3-8b", 12, "H100", closed_form, search="exhaustive",
                  global_batch_sizes=[48], track=False, verify=1, output_dir=tmp_path / "out",
                  space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1,)))
    plan = result.cluster_verification
    # ranked, launched and measured on one placement: 6 ranks on each of 2 nodes
    assert result.search.space.devices_per_node == 6
    assert result.recommendation["launch"]["torchrun"].count("--nproc-per-node=6") == 1
    assert plan.torchrun[0].startswith("torchrun --nnodes=2 --nproc-per-node=6 ")
    assert json.loads((plan.directories[0] / "plan-ws12.json").read_text())[
        "devices_per_node"] == 6
    text = plan.sbatch[0].read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=6" in text


def test_a_later_verification_of_another_batch_or_sequence_picks_its_own_configs(
        closed_form, tmp_path, monkeypatch):
    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    first = _cluster_job(closed_form, tmp_path / "out", k=2).cluster_verification
    assert {c.global_batch_size for c in first.configs} == {64}
    other = tune("llama3-8b", 16, "H100", closed_form, search="exhaustive",
                 global_batch_sizes=[128], track=False, verify=2, output_dir=tmp_path / "out",
                 space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1, 2)))
    assert {c.global_batch_size for c in other.cluster_verification.configs} == {128}
    longer = tune("llama3-8b", 16, "H100", closed_form, search="exhaustive",
                  global_batch_sizes=[128], track=False, verify=2, seq_len=4096,
                  output_dir=tmp_path / "out",
                  space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1, 2)))
    # at another sequence length the same layouts are campaigns of their own
    assert not ({d.name for d in longer.cluster_verification.directories}
                & {d.name for d in other.cluster_verification.directories})


def test_verify_on_a_cluster_needs_an_output_directory(closed_form, monkeypatch):
    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    with pytest.raises(ConfigError, match=r"^verify=1: verifying on the cluster needs an "):
        _cluster_job(closed_form, None, k=1)
    assert closed_form.calls == []  # refused before the search
    with pytest.raises(ConfigError, match=r"^verify_on='moon'"):
        _cluster_job(closed_form, None, k=1, verify_on="moon")


def test_the_tune_command_prints_the_cluster_commands(saved_model, tmp_path, capsys,
                                                      monkeypatch):
    from paratune.cli import main

    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    out = tmp_path / "out"
    assert main(["tune", "--model", "llama3-8b", "--seq-len", "4096", "--gpus", "64",
                 "--hardware", "H100", "--predictor", str(saved_model), "--search",
                 "exhaustive", "--global-batch", "256", "--verify", "2", "--output", str(out),
                 "--no-track", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "verify on the cluster: 2 of 2 configs to run" in printed
    scripts = sorted((out / "verify").glob("*/verify.sbatch"))
    assert len(scripts) == 2 and all(f"sbatch {s.resolve()}" in printed for s in scripts)
    assert printed.count("or on every node: torchrun --nnodes=8 --nproc-per-node=8") == 2


@pytest.mark.slow
def test_a_later_tune_reads_the_verified_runs_and_refits(closed_form, tmp_path):
    """The whole loop on this machine standing in for the cluster: the printed torchrun
    commands run for real (gloo, 2 processes each), then the same tune reads them back."""
    import subprocess
    import sys

    from paratune.models import PerformanceModel, load_measurements

    space = ConfigSpace(global_batch_sizes=(8,), micro_batch_sizes=(2, 4), shardings=("none",),
                        recomputes=("none",), schedules=("1f1b",))
    options = {"measured_steps": 2, "warmup_steps": 1, "timeout_s": 120,
               "model_factory": lambda: PerformanceModel(n_estimators=10, n_jobs=1)}

    def job():
        return tune("tiny", 2, "cpu", closed_form, search="exhaustive", space=space,
                    track=False, verify=2, verify_on="cluster", output_dir=tmp_path / "out",
                    verify_options=options)

    plan = job().cluster_verification
    assert plan.pending == [0, 1]
    for command in plan.torchrun:  # torchrun is torch.distributed.run's console script
        subprocess.run(command.replace("torchrun", f"{sys.executable} -m torch.distributed.run",
                                       1), shell=True, check=True, timeout=300)
    result = job()
    after = result.cluster_verification
    assert after.pending == [] and after.configs == plan.configs
    table = result.verification
    assert list(table["config"]) == [c.key() for c in plan.configs]
    assert (table["status"] == "ok").all() and (table["measured_tokens_per_s"] > 0).all()
    assert table["refit_tokens_per_s"].notna().all()
    assert (after.refit_dir / "model.json").exists()
    # each campaign is now a dataset that `paratune fit` reads
    assert len(load_measurements(after.directories)) == 2
