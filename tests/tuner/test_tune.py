from __future__ import annotations

import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from paratune import ConfigError, Recompute, get_model
from paratune.space import ConfigSpace
from paratune.tuner import SearchSpace, tune
from tests.tuner.conftest import run_with_trajectory


def test_tune_end_to_end_writes_winner_and_tracks_the_run(closed_form, tmp_path):
    out = tmp_path / "out"
    result = tune("llama3-8b", 64, "H100", closed_form, objective="goodput", gns=600,
                  global_batch_sizes="128:1024", n_trials=24, seed=0, output_dir=out, top_k=5)
    best = result.best
    best.validate(result.search.space.model, 64)
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["config"] == best.to_dict()
    # the winner is the feasible trial of the study with the largest objective
    feasible = [t for t in result.study.trials if t.state is TrialState.COMPLETE
                and max(t.constraints.values()) <= 0]
    top_value = max(t.value for t in feasible)
    assert best.to_dict() in [t.user_attrs["config"] for t in feasible if t.value == top_value]
    objectives = [c["objective"] for c in rec["top"]]
    assert len(objectives) == 5 and objectives[0] == pytest.approx(top_value)
    assert objectives == sorted(objectives, reverse=True)
    assert (out / "study.journal").exists()
    table = result.table(5)
    assert "vs_best" in table and "goodput" in table

    client = MlflowClient()
    run = client.get_run(result.run_id)
    assert run.data.params["objective"] == "goodput"
    assert float(run.data.params["b_noise"]) == 600
    assert run.data.metrics["num_trials"] == 24
    names = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"space.json", "trials.csv", "best_configs.csv", "recommendation.json",
            "plots", "recommendation"} <= names
    plots = {a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert "plots/optimization_history.png" in plots


def test_rerun_resumes_the_same_study_in_an_rdb_storage(closed_form, tmp_path):
    kwargs = dict(global_batch_sizes=[256], seed=1, output_dir=tmp_path, track=False,
                  storage=f"sqlite:///{tmp_path / 'study.db'}")
    first = tune("llama3-8b", 32, "H100", closed_form, n_trials=16, **kwargs)
    told = [(t.number, t.state, t.params, t.value, t.datetime_start)
            for t in first.study.trials]
    assert len(told) == 16
    calls = len(closed_form.calls)
    again = tune("llama3-8b", 32, "H100", closed_form, n_trials=24, **kwargs)
    assert first.search.study_name == again.search.study_name
    assert again.search.num_trials == 24
    assert len(again.study.trials) == 24  # 16 kept, 8 new
    # the first run's trials, as told then (a study made afresh would tell them anew)
    kept = [(t.number, t.state, t.params, t.value, t.datetime_start)
            for t in again.study.trials[:16]]
    assert kept == told
    assert len(closed_form.calls) > calls


def test_exhaustive_mode_and_bad_arguments(closed_form, tmp_path):
    result = tune("llama3-8b", 16, "H100", closed_form, search="exhaustive",
                  global_batch_sizes=[64], track=False,
                  space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1, 2)))
    assert result.search.mode == "exhaustive" and result.study is None
    assert result.search.num_trials == len(result.ranked)
    with pytest.raises(ConfigError, match="search"):
        tune("llama3-8b", 16, "H100", closed_form, search="grid", track=False)
    with pytest.raises(ConfigError, match="gns"):
        tune("llama3-8b", 16, "H100", closed_form, objective="goodput", track=False)
    with pytest.raises(ConfigError, match="gpu"):
        tune("llama3-8b", 16, "TPU9", closed_form, track=False)


@pytest.mark.parametrize("gpus", [0, -8, 2.5, True])
def test_gpus_must_be_a_positive_integer(closed_form, gpus):
    with pytest.raises(ConfigError, match=r"gpus=.*: must be a positive integer"):
        tune("llama3-8b", gpus, "H100", closed_form, n_trials=5, track=False)
    with pytest.raises(ConfigError, match=r"gpus=.*: must be a positive integer"):
        SearchSpace.build(get_model("llama3-8b"), gpus, "H100")


def test_goodput_without_batches_searches_around_b_noise(closed_form, caplog):
    from paratune.tuner._tune import default_global_batch, goodput_global_batches

    model = get_model("llama3-8b")
    assert default_global_batch(model, 64) == 128
    assert goodput_global_batches(model, 64, 2000) == [32, 64, 128, 256, 512, 1024, 2048,
                                                       4096]
    result = tune(model, 64, "H100", closed_form, objective="goodput", gns=2000,
                  search="exhaustive", track=False)
    searched = result.search.space.global_batch_sizes
    assert searched == (32, 64, 128, 256, 512, 1024, 2048, 4096)
    # the range holds the best batch: the one with the highest goodput over a far wider
    # range, inside the searched one (not at its edge)
    with np.errstate(over="ignore"):  # the largest batches need far more than 80 GB
        wide = tune(model, 64, "H100", closed_form, objective="goodput", gns=2000,
                    global_batch_sizes="8:16384", search="exhaustive", track=False)
    assert result.best.global_batch_size == wide.best.global_batch_size
    assert searched[0] < result.best.global_batch_size < searched[-1]
    # the throughput objective keeps one batch of about 2**20 tokens
    with caplog.at_level("WARNING", logger="paratune.tuner._tune"):
        plain = tune(model, 64, "H100", closed_form, gns=2000, b0=64, search="exhaustive",
                     track=False)
    assert plain.search.space.global_batch_sizes == (128,)
    assert "--gns) weighs nothing under the throughput objective" in caplog.text
    assert "--b0) weighs nothing under the throughput objective" in caplog.text
    with pytest.raises(ConfigError, match=r"gns=-1: must be a positive number"):
        goodput_global_batches(model, 64, -1)


def test_a_space_file_that_leaves_out_the_batches_searches_the_default_ones(closed_form,
                                                                             tmp_path):
    from paratune.tuner._tune import goodput_global_batches

    model = get_model("llama3-8b")
    recompute_only = tmp_path / "recompute.yaml"
    recompute_only.write_text("recomputes: [full]\n")
    one_batch = tmp_path / "one.yaml"
    one_batch.write_text("recomputes: [full]\nglobal_batch_sizes: [256]\n")
    batches = tmp_path / "batches.toml"
    batches.write_text('recomputes = ["full"]\nglobal_batch_sizes = [64, 256]\n')

    def searched(space, **kwargs):
        result = tune(model, 64, "H100", closed_form, space=space, search="exhaustive",
                      track=False, **kwargs)
        if space is not None:
            assert result.search.space.space.recomputes == (Recompute.FULL,)
        return result.search.space.global_batch_sizes

    # a file (as the CLI reads it, or its path) that only restricts recompute: the batch
    # searched without any space, not the space's default of 8
    default = searched(None)
    assert default == (128,)
    for space in (recompute_only, str(recompute_only), ConfigSpace.from_file(recompute_only)):
        assert searched(space) == default
        assert searched(space, objective="goodput", gns=2000) == tuple(
            goodput_global_batches(model, 64, 2000))
    # a file that gives the batches keeps them; an explicit batch wins over both
    goodput = {"objective": "goodput", "gns": 2000}
    for path, kwargs, given in ((one_batch, {}, (256,)), (batches, goodput, (64, 256))):
        assert searched(path, **kwargs) == given
        assert searched(ConfigSpace.from_file(path), **kwargs) == given
        assert searched(recompute_only, global_batch_sizes=[512], **kwargs) == (512,)
        assert searched(path, global_batch_sizes="512", **kwargs) == (512,)


def test_gpus_may_be_a_numpy_integer():
    assert SearchSpace.build(get_model("llama3-8b"), np.int64(16), "H100").world_size == 16


@pytest.mark.parametrize("command", ["tune", "plan"])
@pytest.mark.parametrize("gpus", ["0", "-8"])
def test_cli_names_gpus_when_it_is_not_positive(closed_form, tmp_path, capsys, command, gpus):
    from paratune.cli import main

    extra = (["--trials", "5"] if command == "tune"
             else ["--trajectory", str(tmp_path / "gns.csv")])
    code = main([command, "--model", "llama3-8b", "--gpus", gpus, "--hardware", "H100",
                 "--predictor", str(tmp_path / "no-model"), "--output", str(tmp_path / "o"),
                 "--no-track", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"paratune {command}: error: --gpus={int(gpus)}: must be a positive integer\n"


@pytest.mark.parametrize("command", ["tune", "plan"])
def test_cli_names_the_missing_trajectory_seq_len(tmp_path, capsys, command):
    traj = tmp_path / "old.csv"
    traj.write_text("step,tokens,loss,b_simple\n" + "".join(
        f"{s},{s * 2 * 4096},3.0,{50 + s}\n" for s in range(1, 30)))
    code, flag = run_with_trajectory(command, traj, tmp_path)
    err = capsys.readouterr().err
    assert code == 2
    assert f"paratune {command}: error: {flag}=" in err
    assert "needs a seq_len column or --trajectory-seq-len" in err


def _tune_runs() -> list:
    client = MlflowClient()
    experiment = client.get_experiment_by_name("paratune-tune")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


@pytest.mark.parametrize(("error", "status"), [(RuntimeError("predictor broke"), "FAILED"),
                                               (KeyboardInterrupt(), "KILLED")])
def test_a_tune_that_fails_or_is_interrupted_leaves_its_run_and_params(tmp_path, error, status):
    class Broken:
        def predict(self, frame):
            raise error

    with pytest.raises(type(error)):
        tune("llama3-8b", 32, "H100", Broken(), objective="goodput", gns=600,
             global_batch_sizes="256:1024", n_trials=8, seed=2, output_dir=tmp_path)
    (run,) = _tune_runs()
    assert run.info.status == status and run.info.end_time is not None
    params = run.data.params
    assert params["model"] == "llama3-8b" and params["gpus"] == "32"
    assert params["hardware"] == "H100-80GB" and params["predictor"] == "Broken"
    assert json.loads(params["global_batch_sizes"]) == [256, 512, 1024]
    assert params["seed"] == "2"


def test_a_study_journal_is_logged_by_its_absolute_path(closed_form, tmp_path, monkeypatch):
    """As the predictor and data are: two tunings from different folders with the default
    (relative) output folder keep different studies, and the runs say which."""
    logged = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        result = tune("llama3-8b", 32, "H100", closed_form, n_trials=4, output_dir="out")
        logged.append(MlflowClient().get_run(result.run_id).data.params["storage"])
    assert logged == [str(tmp_path / f / "out" / "study.journal") for f in ("a", "b")]


def test_tune_run_records_its_inputs_and_whether_the_study_resumed(closed_form, tmp_path):
    kwargs = dict(objective="goodput", gns=600, global_batch_sizes="256:1024", seed=3,
                  sampler="random", output_dir=tmp_path, min_feasible_prob=0.7,
                  memory_limit_gb=60.0)
    first = tune("llama3-8b", 32, "H100", closed_form, n_trials=8, **kwargs)
    again = tune("llama3-8b", 32, "H100", closed_form, n_trials=12, **kwargs)
    client = MlflowClient()
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert {"gpu"}.isdisjoint(params)  # the device kind is "hardware" in every command
    assert params["hardware"] == "H100-80GB" and params["gpus"] == "32"
    assert params["predictor"] == "ClosedFormPredictor"
    assert float(params["min_feasible_prob"]) == 0.7
    assert float(params["memory_limit_gb"]) == 60.0
    assert json.loads(params["global_batch_sizes"]) == [256, 512, 1024]
    assert params["objective"] == "goodput" and params["sampler"] == "random"
    assert params["seed"] == "3" and params["verify"] == "0"
    assert params["study_name"] == first.search.study_name
    assert params["storage"] == str(tmp_path / "study.journal")
    assert run.data.tags["paratune.resumed"] == "false"
    resumed = client.get_run(again.run_id).data.tags
    assert resumed["paratune.resumed"] == "true" and resumed["paratune.prior_trials"] == "8"
    exhaustive_run = tune("llama3-8b", 32, "H100", closed_form, search="exhaustive",
                          global_batch_sizes=[256])
    params = client.get_run(exhaustive_run.run_id).data.params
    assert params["search"] == "exhaustive" and params["sampler"] == ""
    assert params["seq_len"] == "8192"
    assert float(params["memory_limit_gb"]) == pytest.approx(0.95 * 80, rel=0.01)


@pytest.mark.parametrize(("flags", "message"), [
    (["--trials", "0"], "--trials=0: must be a positive integer"),
    (["--batch-size", "0"], "--batch-size=0: must be a positive integer"),
])
def test_a_bad_search_option_is_refused_before_a_run_or_a_study_opens(tmp_path, capsys, flags,
                                                                       message):
    from paratune.cli import main

    out = tmp_path / "o"
    before = [r.info.run_id for r in _tune_runs()]
    capsys.readouterr()  # MLflow's own lines where listing the runs created its store
    code = main(["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
                 "--predictor", str(tmp_path / "no-model"), "--output", str(out), *flags])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"paratune tune: error: {message}")
    assert [r.info.run_id for r in _tune_runs()] == before  # no run was opened
    assert not out.exists()


def test_on_ranked_sees_the_result_and_a_bad_verify_is_refused_first(closed_form):
    seen = []
    result = tune("llama3-8b", 32, "H100", closed_form, search="exhaustive",
                  global_batch_sizes=[256], track=False, on_ranked=seen.append)
    assert seen == [result] and result.verification is None
    calls = len(closed_form.calls)
    with pytest.raises(ConfigError, match=r"^verify=-1: must be a number of configs >= 0"):
        tune("llama3-8b", 32, "H100", closed_form, search="exhaustive",
             global_batch_sizes=[256], verify=-1)
    assert len(closed_form.calls) == calls  # nothing was predicted
    assert _tune_runs() == []  # and no run was opened


def test_a_huge_b_noise_does_not_send_the_search_to_absurd_batches():
    from paratune.tuner._tune import default_global_batch, goodput_global_batches

    model = get_model("llama3-8b")
    center = default_global_batch(model, 64)
    for b_noise in (1e12, 1e300):
        batches = goodput_global_batches(model, 64, b_noise)
        assert 1 <= len(batches) <= 12 and max(batches) <= center * 2**12


def test_a_refitted_predictor_starts_a_new_study_in_the_same_output(closed_form, tmp_path):
    # the same command after a refit: the trials valued by the old model are not resumed,
    # and the rerun neither fails nor mixes them in
    kwargs = dict(global_batch_sizes=[256], seed=1, output_dir=tmp_path, n_trials=8)
    closed_form.fingerprint_ = "a" * 64
    first = tune("llama3-8b", 32, "H100", closed_form, track=False, **kwargs)
    closed_form.fingerprint_ = "b" * 64
    refit = tune("llama3-8b", 32, "H100", closed_form, tracking_uri=f"sqlite:///{tmp_path}/m.db",
                 **kwargs)
    assert refit.search.study_name != first.search.study_name
    assert len(refit.study.trials) == 8
    params = MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(refit.run_id).data.params
    assert params["study_name"] == refit.search.study_name
    # the same predictor again resumes its study
    again = tune("llama3-8b", 32, "H100", closed_form, track=False, **kwargs)
    assert again.search.study_name == refit.search.study_name


def test_a_search_beyond_the_model_training_runs_is_warned_about(closed_form, caplog):
    import logging

    from paratune.tuner._tune import extrapolation_warnings

    model = get_model("llama3-8b")  # seq_len 8192
    closed_form.training_ranges_ = {"H100-80GB": {"world_size": [8, 64],
                                                  "global_batch_size": [256, 256],
                                                  "tokens_per_step": [2**20, 2**21]}}
    inside = SearchSpace.build(model, 64, "H100", global_batch_sizes=[128, 256])
    assert extrapolation_warnings(closed_form, inside) == []
    larger = SearchSpace.build(model, 512, "H100", global_batch_sizes=[4096])
    warned = extrapolation_warnings(closed_form, larger)
    assert len(warned) == 2
    assert "512 devices on H100-80GB" in warned[0] and "8 to 64" in warned[0]
    assert "33554432 tokens per step" in warned[1] and "--global-batch" in warned[1]
    other = SearchSpace.build(model, 64, "A100", global_batch_sizes=[256])
    assert "no measured runs on A100-80GB" in extrapolation_warnings(closed_form, other)[0]
    with caplog.at_level(logging.WARNING, logger="paratune.tuner"):
        tune(model, 512, "H100", closed_form, global_batch_sizes=[4096], search="exhaustive",
             track=False)
    assert sum("extrapolations" in r.getMessage() for r in caplog.records) == 2
