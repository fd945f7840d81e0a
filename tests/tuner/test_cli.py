"""``paratune tune`` and ``paratune plan`` against a real PerformanceModel fitted on a slice of
the public H100 measurements (skipped where the data is absent); their flags, messages and runs
against a small PerformanceModel fitted on synthetic measurements, loaded from its saved
directory as ``--predictor`` names it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paratune.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, public_data):
    data = public_data
    from paratune.models import PerformanceModel, load_measurements

    frame = load_measurements([data / "ultrascale_playbook_h100.csv",
                               data / "ultrascale_playbook_h100_failed.csv"])
    frame = frame[frame["world_size"] <= 64]
    path = tmp_path_factory.mktemp("model")
    PerformanceModel(n_estimators=60, n_jobs=1).fit(frame).save(path)
    return path


def test_tune_command_prints_ranking_and_writes_launch_files(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["tune", "--model", "llama3-8b", "--gpus", "64", "--gpu", "H100",
                 "--predictor", str(model_dir), "--objective", "goodput", "--gns", "2000",
                 "--global-batch", "128:512", "--trials", "24", "--top-k", "5",
                 "--output", str(out), "--no-track"])
    text = capsys.readouterr().out
    assert code == 0
    assert "vs_best" in text and "torchrun" in text and "--tensor-model-parallel-size" in text
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["world_size"] == 64 and rec["predicted"]["tokens_per_s"] > 0
    # the model learned the stalled-pipeline regime from the public runs: the ranking shows
    # each config's probability of stalling, and the recommendation records it
    assert "p_stall" in text and 0 <= rec["predicted"]["pred_stall_prob"] <= 1
    assert (out / "torchtitan.toml").exists() and (out / "megatron_args.txt").exists()


def _write_trajectory(path, *, seq_len=None, seqs_per_step=256, measured_seq_len=8192):
    """B_noise from 100 to ~2700 sequences of ``measured_seq_len`` tokens; a ``seq_len``
    column (the current format) when ``seq_len`` is given."""
    steps = np.arange(0, 2000, 50)
    head = "step,tokens,loss,b_simple" + (",seq_len" if seq_len else "")
    rows = [head] + [
        f"{s},{s * seqs_per_step * measured_seq_len},{4.0 - s / 1000},"
        f"{100 * np.exp(s / 600):.3f}" + (f",{seq_len}" if seq_len else "") for s in steps]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_plan_command(model_dir, tmp_path, capsys, caplog):
    traj = _write_trajectory(tmp_path / "gns.csv", seq_len=8192)
    code = main(["plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
                 "--predictor", str(model_dir), "--trajectory", str(traj),
                 "--global-batch", "64:2048", "--output", str(tmp_path), "--no-track"])
    text = capsys.readouterr().out
    assert code == 0 and "Training phases" in text and "follow_critical" in text
    # the public runs are all 256 x 4096 tokens per step: up to 2048 x 8192 is 16x beyond
    warned = [r.getMessage() for r in caplog.records if "extrapolations" in r.getMessage()]
    assert len(warned) == 1 and "524288 to 16777216 tokens per step" in warned[0]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["total_time_s"] > 0 and plan["phases"]
    assert plan["total_time_s"] <= plan["baselines"]["fixed"]["time_s"] * (1 + 1e-12)


def test_plan_command_converts_a_trajectory_measured_at_another_seq_len(model_dir, tmp_path,
                                                                         capsys):
    """A run of 1024-token sequences (8x the sequences per step, B_noise 8x in its
    sequences) plans as the 8192-token run with the same tokens."""
    plans = []
    for name, seq_len, per_step, scale in (("long", 8192, 256, 1), ("short", 1024, 2048, 8)):
        traj = tmp_path / f"{name}.csv"
        _write_trajectory(traj, seq_len=seq_len, seqs_per_step=per_step, measured_seq_len=seq_len)
        frame = traj.read_text().splitlines()
        body = [line.split(",") for line in frame[1:]]
        for fields in body:
            fields[3] = f"{float(fields[3]) * scale:.6g}"
        traj.write_text("\n".join([frame[0]] + [",".join(f) for f in body]) + "\n")
        out = tmp_path / f"{name}.json"
        assert main(["plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
                     "--predictor", str(model_dir), "--trajectory", str(traj),
                     "--output", str(out), "--no-track"]) == 0
        plans.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert plans[0]["total_time_s"] == pytest.approx(plans[1]["total_time_s"], rel=1e-4)
    assert [p["config"] for p in plans[0]["phases"]] == [p["config"] for p in plans[1]["phases"]]


def test_plan_command_needs_the_seq_len_of_an_old_trajectory(model_dir, tmp_path, capsys):
    old = _write_trajectory(tmp_path / "old.csv")
    args = ["plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
            "--predictor", str(model_dir), "--trajectory", str(old), "--no-track"]
    assert main([*args, "--global-batch", "64:2048"]) == 2
    assert "--trajectory-seq-len" in capsys.readouterr().err
    assert main(args) == 2  # the default batch range needs it too
    assert "--trajectory-seq-len" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert main([*args, "--trajectory-seq-len", "8192", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["phases"]


def test_bad_input_is_a_named_error(model_dir, capsys):
    code = main(["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
                 "--predictor", str(model_dir), "--objective", "goodput", "--no-track"])
    assert code == 2
    assert "gns" in capsys.readouterr().err


def test_tp_across_nodes_does_not_change_the_batch_searched(model_dir, tmp_path, capsys):
    from paratune import get_model
    from paratune.tuner._tune import default_global_batch

    batches = []
    for flags in ([], ["--tp-across-nodes"]):
        out = tmp_path / ("across" if flags else "within")
        code = main(["tune", "--model", "llama3-8b", "--gpus", "16", "--hardware", "H100",
                     "--predictor", str(model_dir), "--search", "exhaustive", "--top-k", "50",
                     "--output", str(out), "--no-track", *flags])
        assert code == 0
        rec = json.loads((out / "recommendation.json").read_text())
        batches.append({c["global_batch_size"] for c in rec["top"]})
    capsys.readouterr()
    assert batches[0] == batches[1] == {default_global_batch(get_model("llama3-8b"), 16)}


@pytest.fixture
def job(saved_model, tmp_path, monkeypatch):
    """The ``tune`` or ``plan`` command line of llama3-8b on 64 H100s against a saved
    PerformanceModel (fitted on synthetic measurements), loaded from its directory by the
    command, run in ``tmp_path`` (so that messages name relative paths); ``trajectory.csv`` is
    a B_noise trajectory with its seq_len."""
    monkeypatch.chdir(tmp_path)
    _write_trajectory(tmp_path / "trajectory.csv", seq_len=8192)

    def command(name, *flags):
        extra = ["--trajectory", "trajectory.csv"] if name == "plan" else []
        return [name, "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100", "--predictor",
                str(saved_model), "--output", "out", "--no-track", *extra, *flags]

    return command


@pytest.mark.parametrize(("command", "flags", "message"), [
    ("plan", ["--segments", "0"], "--segments=0: must be an integer >= 1"),
    ("plan", ["--trajectory-seq-len", "0"], "--trajectory-seq-len=0: must be a positive integer"),
    ("tune", ["--objective", "goodput", "--gns", "trajectory.csv", "--trajectory-seq-len",
              "4096"], "--trajectory-seq-len=4096: disagrees with the seq_len column"),
    ("tune", ["--trials", "0"], "--trials=0: must be a positive integer"),
    ("tune", ["--risk", "median"], "--risk='median': must name a lower quantile"),
    ("tune", ["--risk", "q90"], "--risk='q90': must name a lower quantile of the predicted "
                                "throughput, such as q10 (or 0.1): a whole percent below "
                                "the median"),
    ("tune", ["--global-batch", "abc"], "--global-batch='abc': must be integers"),
    ("plan", ["--global-batch", "0"], "--global-batch='0': batch sizes must be positive"),
    ("tune", ["--space", "nosuch.yaml"], "--space='nosuch.yaml': no such file"),
    ("plan", ["--model", "config.json"], "--model='config.json': is not valid JSON"),
    ("tune", ["--storage", "nosuchdialect://x"],
     "--storage='nosuchdialect://x': is not a usable database URL"),
    ("tune", ["--framework", "megatron_lm"], "--framework='megatron_lm': must be a name of"),
    ("plan", ["--framework", " "], "--framework=' ': must be a name of"),
    ("tune", ["--framework", "Megatron LM"], "--framework='Megatron LM': must be a name of"),
    ("tune", ["--framework", "megatron-lm", "--verify", "2"],
     "--framework='megatron-lm': cannot be verified with --verify"),
])
def test_errors_name_the_flag_not_the_library_argument(job, tmp_path, capsys, command, flags,
                                                        message):
    (tmp_path / "config.json").write_text("{not json")
    assert main(job(command, *flags)) == 2  # a second --model replaces the first
    err = capsys.readouterr().err
    assert err.startswith(f"paratune {command}: error: {message}")
    assert not (tmp_path / "out").exists()


def test_a_value_not_from_the_flag_keeps_the_library_name(job, closed_form, tmp_path, capsys):
    from paratune.errors import ConfigError
    from paratune.tuner import tune

    rule = ": objective=throughput compares configs at one global batch size"
    assert main(job("tune", "--global-batch", "256:1024")) == 2
    assert capsys.readouterr().err == (
        f"paratune tune: error: --global-batch=[256, 512, 1024]{rule}; use objective=goodput "
        "(with --gns) to search the batch\n")
    # the same batches from a space file: not a value of --global-batch
    (tmp_path / "space.json").write_text(json.dumps({"global_batch_sizes": [256, 512, 1024]}))
    assert main(job("tune", "--space", "space.json")) == 2
    assert capsys.readouterr().err.startswith(
        f"paratune tune: error: global_batch_sizes=[256, 512, 1024]{rule}")
    # the library names its own argument
    with pytest.raises(ConfigError, match=r"^global_batch_sizes=\[256, 512, 1024\]: "):
        tune("llama3-8b", 64, "H100", closed_form, global_batch_sizes="256:1024", track=False)


@pytest.mark.parametrize(("flags", "message"), [
    (["--tokens", "1e9:1e10"], "--tokens='1e9:1e10': only goes with a law"),
    (["--loss-curve", "curve.csv"], "--loss-curve='curve.csv': only goes with a law"),
])
def test_plan_options_of_the_other_trajectory_source_are_refused(job, tmp_path, capsys, flags,
                                                                 message):
    """A law's options beside a trajectory file (and the reverse) changed nothing."""
    assert main(job("plan", *flags)) == 2
    assert capsys.readouterr().err.startswith(f"paratune plan: error: {message}")
    law = [a for a in job("plan") if a not in ("--trajectory", "trajectory.csv")]
    assert main([*law, "--law", "kaplan2020", "--smooth", "5"]) == 2
    assert capsys.readouterr().err.startswith("paratune plan: error: --smooth=5: only goes "
                                              "with a trajectory")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("command", "flag", "value", "minimum"), [
    ("tune", "--top-k", "0", 1),
    ("tune", "--devices-per-node", "0", 1),
    ("plan", "--devices-per-node", "-8", 1),
    ("plan", "--smooth", "0", 1),
])
def test_flags_out_of_range_are_refused_by_the_parser(job, tmp_path, capsys, command, flag,
                                                      value, minimum):
    with pytest.raises(SystemExit) as exit_info:
        main(job(command, "--search", "exhaustive", flag, value) if command == "tune"
             else job(command, "--global-batch", "64:2048", flag, value))
    assert exit_info.value.code == 2
    assert (f"paratune {command}: error: argument {flag}: must be an integer >= {minimum}, "
            f"not '{value}'") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _plan_runs() -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("paratune-plan")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def test_plan_opens_its_run_before_the_work(job, monkeypatch, tmp_path, capsys):
    """As ``tune``: a bad option opens no run; a plan that fails or is interrupted leaves its
    run, ended FAILED or KILLED, with its params; a finished one has its metrics."""
    tracked = [flag for flag in job("plan", "--global-batch", "64:2048") if flag != "--no-track"]
    assert main([*tracked, "--threshold", "-1"]) == 2
    assert capsys.readouterr().err == (
        "paratune plan: error: --threshold=-1.0: must be a finite number >= 0\n")
    assert _plan_runs() == []
    # fails in the work: no config fits in 1 MB
    assert main([*tracked, "--memory-limit-gb", "0.001"]) == 2
    assert "no config is predicted feasible" in capsys.readouterr().err
    (failed,) = _plan_runs()

    class Interrupted:
        def predict(self, frame):
            raise KeyboardInterrupt

    # an interrupt in the middle of the work: no saved model raises one, so the loaded
    # predictor is replaced by one that does (the only stand-in of these command tests)
    with monkeypatch.context() as patch:
        patch.setattr("paratune.tuner._tune.load_predictor", lambda predictor: Interrupted())
        assert main([*tracked, "--reconfig-cost-s", "60"]) == 130
    assert not (tmp_path / "out" / "plan.json").exists()  # neither run wrote a plan
    assert main([*tracked, "--segments", "8"]) == 0
    capsys.readouterr()
    runs = {run.info.status: run for run in _plan_runs()}
    assert set(runs) == {"FAILED", "KILLED", "FINISHED"}
    assert runs["FAILED"].info.run_id == failed.info.run_id
    for run in runs.values():
        params = run.data.params
        assert run.info.end_time is not None and run.info.run_name == "plan-llama3-8b-64xH100-80GB"
        assert params["model"] == "llama3-8b" and params["gpus"] == "64"
        assert params["seq_len"] == "8192"
        assert params["hardware"] == "H100-80GB" and "gpu" not in params
        assert json.loads(params["global_batch_sizes"]) == [64, 128, 256, 512, 1024, 2048]
        assert params["trajectory"] == str(tmp_path / "trajectory.csv")
        assert params["trajectory_seq_len"] == "8192"
    assert float(runs["FAILED"].data.params["memory_limit_gb"]) == 0.001
    assert float(runs["KILLED"].data.params["reconfig_cost_s"]) == 60
    finished = runs["FINISHED"]
    assert finished.data.params["max_segments"] == "8"
    assert finished.data.metrics["total_time_s"] > 0
    assert not runs["FAILED"].data.metrics and not runs["KILLED"].data.metrics


@pytest.mark.parametrize("command", ["tune", "plan"])
def test_hardware_is_the_same_flag_as_gpu(job, tmp_path, capsys, command):
    """``--gpu`` (the documented flag) and ``--hardware`` (as in ``paratune profile``) are one
    flag, neither with a warning, and errors name the spelling typed."""
    extra = (["--search", "exhaustive"] if command == "tune" else ["--global-batch", "64:2048"])
    args = job(command, *extra)
    assert main(args) == 0
    assert capsys.readouterr().err == ""
    old = [("--gpu" if flag == "--hardware" else flag) for flag in args]
    assert main(old) == 0
    assert capsys.readouterr().err == ""
    for flag in ("--hardware", "--gpu"):
        bad = [("TPU-v9" if value == "H100" else value) for value in args]
        bad[bad.index("--hardware")] = flag
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert f"paratune {command}: error: {flag}='TPU-v9': is not a known device" in err
    with pytest.raises(SystemExit):
        main([command, "--help"])
    usage = capsys.readouterr().out
    assert "--gpu NAME" in " ".join(usage.split("\n\n")[0].split())  # the usage line
    assert "--hardware is the same flag" in " ".join(usage.split())


def test_tune_shows_the_progress_of_its_trials(job, capsys):
    """A bar of the trials on stderr (as profile shows its configs); --no-progress: none."""
    assert main(job("tune", "--trials", "16", "--batch-size", "4")) == 0
    captured = capsys.readouterr()
    assert "tuning" in captured.err and "16/16" in captured.err
    assert "best feasible" in captured.err and "tuning" not in captured.out
    assert main(job("tune", "--trials", "16", "--batch-size", "4", "--output", "quiet",
                    "--no-progress")) == 0
    assert capsys.readouterr().err == ""


def _hf_config(path, max_positions=131072):
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "max_position_embeddings": max_positions}))
    return path


@pytest.mark.parametrize("command", ["tune", "plan"])
def test_seq_len_is_a_flag_shown_in_the_output_and_warned_about_for_a_config_json(
        job, tmp_path, capsys, caplog, command):
    """A config.json's max_position_embeddings is not taken silently as the training
    sequence length: a warning names it and --seq-len; --seq-len sets it (presets too), and
    the output says which sequence length was planned for."""
    _hf_config(tmp_path / "config.json")
    extra = ["--search", "exhaustive"] if command == "tune" else ["--global-batch", "64:256"]
    args = job(command, *extra)
    args[args.index("--model") + 1] = "config.json"
    with caplog.at_level("WARNING", logger="paratune.spec"):
        assert main(args) == 0
    assert "(131072 tokens per sequence)" in capsys.readouterr().out
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "paratune.spec"]
    assert "max_position_embeddings=131072" in warning and "--seq-len" in warning
    caplog.clear()
    assert main([*args, "--seq-len", "4096", "--output", "short"]) == 0
    assert "(4096 tokens per sequence)" in capsys.readouterr().out
    assert not [r for r in caplog.records if r.name == "paratune.spec"]
    preset = job(command, *extra, "--seq-len", "2048", "--output", "preset")
    assert main(preset) == 0
    assert "llama3-8b (2048 tokens per sequence)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(job(command, *extra, "--seq-len", "0"))
    assert exit_info.value.code == 2
    assert "argument --seq-len: must be an integer >= 1, not '0'" in capsys.readouterr().err


def test_plan_says_where_it_wrote_and_its_mlflow_run(job, capsys):
    tracked = [flag for flag in job("plan", "--global-batch", "64:2048") if flag != "--no-track"]
    assert main(tracked) == 0
    out = capsys.readouterr().out
    assert "wrote out/plan.json" in out
    run_id = _plan_runs()[0].info.run_id
    assert f"MLflow run {run_id}: " in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--objective goodput" not in usage  # plan has no such flag
    assert "PATH/plan.json" in usage


def test_study_errors_name_the_flags(job, capsys):
    assert main(job("tune", "--study-name", "job", "--trials", "4")) == 0
    capsys.readouterr()
    other = [("32" if value == "64" else value) for value in job("tune", "--study-name", "job",
                                                                 "--trials", "4")]
    assert main(other) == 2
    assert capsys.readouterr().err.startswith("paratune tune: error: --study-name='job': names "
                                              "a study of another problem")
    assert main(job("tune", "--storage", "nosuchdb://tuner:s3cret@db.example/x")) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratune tune: error: --storage=") and "s3cret" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--min-feasible-prob", "2"], "--min-feasible-prob=2.0: must be a probability in [0, 1]"),
    (["--memory-limit-gb", "-1"], "--memory-limit-gb=-1.0: must be a positive number of GB"),
    (["--b0", "0"], "--b0=0.0: the reference batch must be a positive, finite number"),
    (["--gns", "nan"], "--gns=nan: must be a positive, finite number of sequences"),
    (["--sampler", "foo"], "--sampler='foo': must be one of tpe, random"),
])
def test_tune_errors_name_the_flag_typed(tmp_path, saved_model, capsys, flags, message):
    code = main(["tune", "--model", "tiny", "--gpus", "4", "--gpu", "H100", "--predictor",
                 str(saved_model), "--no-track", "--output", str(tmp_path / "out"), *flags])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"paratune tune: error: {message}")


def test_tune_reads_its_dataset_and_verify_count_before_any_work(tmp_path, saved_model, capsys):
    """--dataset is read by the refit after the verified runs: a path it cannot read is
    refused at once, not after the cluster time was spent; --verify 0 is refused as
    --top-k 0 is."""
    (tmp_path / "folder").mkdir()
    base = ["tune", "--model", "tiny", "--gpus", "4", "--gpu", "H100", "--predictor",
            str(saved_model), "--no-track", "--output", str(tmp_path / "out")]
    for dataset, reason in ((tmp_path / "folder", "not a paratune dataset (no card.json)"),
                            (tmp_path / "none.csv", "no such dataset")):
        assert main([*base, "--verify", "2", "--dataset", str(dataset)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"paratune tune: error: --dataset='{dataset}': ") and reason in err
        assert not (tmp_path / "out").exists()
    for count in ("0", "-1"):
        with pytest.raises(SystemExit):
            main([*base, "--verify", count])
        assert (f"argument --verify: must be an integer >= 1, not '{count}'"
                in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_tune_names_gpus_for_a_world_of_none(saved_model, capsys):
    assert main(["tune", "--model", "tiny", "--gpus", "0", "--gpu", "H100", "--predictor",
                 str(saved_model), "--no-track"]) == 2
    assert "paratune tune: error: --gpus=0: must be a positive integer" in capsys.readouterr().err


def test_plan_searches_the_batches_of_its_space_file(job, tmp_path, capsys):
    """A space file's global_batch_sizes are the plan's batches, as they are tune's; without
    them (or with --global-batch) the plan's own choice stands."""
    import re

    (tmp_path / "space.yaml").write_text("global_batch_sizes: [64, 128]\n")
    (tmp_path / "recompute.yaml").write_text("recomputes: [full]\n")

    def searched(*flags):
        capsys.readouterr()
        assert main(job("plan", *flags)) == 0
        return re.search(r"global batch sizes (.*)", capsys.readouterr().out).group(1)

    assert searched("--space", "space.yaml") == "64, 128"
    assert searched("--space", "space.yaml", "--global-batch", "256") == "256"
    default = searched()
    assert default.count(",") >= 2 and searched("--space", "recompute.yaml") == default


@pytest.mark.parametrize(("space", "message"), [
    ('tp_within_node: "false"\ntp_degrees: [8]\n',
     "tp_within_node='false': must be true or false"),
    ("tp_degrees: [3]\n", "tp_degrees=[3]: no value gives a valid layout of 64 devices for "
                          "llama3-8b: tp=3 does not divide 64 devices"),
    ("pp_degrees: [128]\n", "pp_degrees=[128]: no value gives a valid layout of 64 devices "
                            "for llama3-8b: pp=128 does not divide 64 devices"),
    ("tp_degrees: [16]\n", "tp_degrees=[16]: no value gives a valid layout of 64 devices for "
                           "llama3-8b: tp=16 does not divide devices_per_node=8"),
])
def test_a_space_file_that_rules_out_the_job_names_its_field(job, tmp_path, capsys, space,
                                                             message):
    (tmp_path / "space.yaml").write_text(space)
    assert main(job("tune", "--trials", "5", "--space", "space.yaml")) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"paratune tune: error: {message}")
    assert "--gpus" not in captured.err and captured.out == ""
    assert not (tmp_path / "out").exists()


def test_tune_refuses_a_verification_it_cannot_run_before_searching(job, tmp_path, capsys,
                                                                    monkeypatch):
    """--verify --verify-on here on a machine without the job's hardware: refused first,
    nothing written (not after the search printed its ranking and wrote the
    recommendation). Without --verify-on here such a job is verified on its cluster."""
    monkeypatch.setattr("paratune.tuner._verify._local_hardware", lambda: ("cpu", "cpu"))
    assert main(job("tune", "--trials", "5", "--verify", "1", "--verify-on", "here")) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("paratune tune: error: --verify=1: profiling needs the "
                                   "job's hardware here")
    assert captured.out == ""
    assert not (tmp_path / "out").exists()


def test_plan_from_a_published_law_writes_launch_files_per_phase(model_dir, tmp_path, capsys):
    out = tmp_path / "plan"
    code = main(["plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
                 "--predictor", str(model_dir), "--law", "kaplan2020", "--tokens", "2e8:2e10",
                 "--reconfig-cost-s", "0", "--threshold", "0", "--output", str(out),
                 "--no-track"])
    text = capsys.readouterr().out
    assert code == 0 and "Training phases" in text and "sqrt rule" in text
    plan = json.loads((out / "plan.json").read_text())
    assert "kaplan2020" in plan["source"]
    # the default range starts at the smallest batch some layout runs, not at --gpus
    assert "global batch sizes 1, 2," in text
    for i in range(1, len(plan["phases"]) + 1):
        assert (out / f"phase_{i:02d}" / "torchtitan.toml").exists()
        assert (out / f"phase_{i:02d}" / "megatron_args.json").exists()
    assert (out / "megatron_layout_01" / "megatron_args.txt").exists()
    assert "launch files" in text


def test_tune_takes_a_law_for_the_noise_scale(model_dir, tmp_path, capsys):
    from paratune import get_model
    from paratune.tuner._tune import resolve_gns

    model = get_model("llama3-8b")
    b = resolve_gns("kaplan2020", seq_len=model.seq_len, num_params=model.num_params)
    assert 40 < b < 700  # between the law's values at 0.2B and 200B tokens
    with pytest.raises(Exception, match="num_params"):
        resolve_gns("kaplan2020", seq_len=model.seq_len)
