from __future__ import annotations

import csv
import json
import re

import numpy as np
import pandas as pd
import pytest

from paratune.cli import main
from paratune.predictor import CONFIG_COLUMNS

PUBLIC_HEADER = ("source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
                 "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,"
                 "tokens_per_sec,step_time_s,tokens_per_sec_per_gpu,precision,notes")
PUBLIC_ROWS = [
    "ultrascale_playbook_nanotron,8B,8,32,4096,32,4096,H100-80GB,16,2,1,8,1,1,256,1,,,,,,,bf16,",
    # contradictory degrees: 2*1*4 != 16
    "ultrascale_playbook_nanotron,8B,8,32,4096,32,4096,H100-80GB,16,2,1,4,1,1,256,1,,,,,,,bf16,",
    "ultrascale_playbook_nanotron,80B,80,80,8192,64,4096,H100-80GB,64,8,4,2,1,1,256,1,,,,,,,bf16,",
    "ultrascale_playbook_nanotron,8B,8,32,4096,32,4096,TPU-v9,16,2,1,8,1,1,256,1,,,,,,,bf16,",
    "vtrain_ground_truth_multi_node,GPT,,24,2048,16,1024,A100,32,2,2,8,1,4,128,,full,,,,,,,",
]


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_fit_logs_to_mlflow(tmp_path, make_synthetic, mlflow_uri, capsys):
    import mlflow

    data = tmp_path / "data.csv"
    make_synthetic(stalls=True).to_csv(data, index=False)
    model_dir = tmp_path / "model"
    assert main(["fit", str(data), "--out", str(model_dir), "--n-estimators", "10"]) == 0
    out = capsys.readouterr().out
    assert "MLflow run" in out and "stalled pipelines learned as their own regime" in out

    runs = mlflow.search_runs(experiment_names=["paratune-fit"])  # the store of the env
    assert len(runs) == 1
    assert runs["params.n_estimators"].iloc[0] == "10"
    assert json.loads(runs["params.data"].iloc[0]) == [str(data.resolve())]
    assert runs["params.seed"].iloc[0] == "0" and len(runs["params.fingerprint"].iloc[0]) == 64
    assert json.loads(runs["params.stall_free_families"].iloc[0]) == []  # its one family stalls
    assert runs["metrics.num_time_rows"].iloc[0] > runs["metrics.num_stall_rows"].iloc[0] > 0
    client = mlflow.tracking.MlflowClient()
    names = [a.path for a in client.list_artifacts(runs["run_id"].iloc[0], "model")]
    assert "model/model.json" in names and "model/throughput.json" in names
    assert not [name for name in names if "/." in name]  # no lock, no temporaries


def test_predict_public_csv_keeps_every_row_in_order(model_dir, tmp_path, capsys):
    src = tmp_path / "in.csv"
    src.write_text("# source: test\n" + PUBLIC_HEADER + "\n" + "\n".join(PUBLIC_ROWS) + "\n")
    out = tmp_path / "out.csv"
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    assert "3 of 5 rows" in capsys.readouterr().out
    result = pd.read_csv(out, keep_default_na=False)
    assert len(result) == 5
    assert list(result.columns[:24]) == PUBLIC_HEADER.split(",")
    assert result["dp"].tolist() == [8, 4, 2, 8, 8]
    errors = result["pred_error"].tolist()
    assert errors[0] == errors[2] == errors[4] == ""
    assert "contradicts num_gpus=16" in errors[1]
    assert "TPU-v9" in errors[3]
    for i in (1, 3):
        assert result["pred_step_time_s"].iloc[i] == ""
    for i in (0, 2, 4):
        assert float(result["pred_tokens_per_sec_per_gpu"].iloc[i]) > 0
        assert 0 <= float(result["pred_feasible_prob"].iloc[i]) <= 1
        assert float(result["pred_peak_mem_gb"].iloc[i]) > 0


def _predict_frame(model_dir, frame: pd.DataFrame, tmp_path) -> pd.DataFrame:
    """``paratune predict`` of ``frame`` written as an own-format CSV; the output, as text."""
    src = tmp_path / "configs.csv"
    frame.to_csv(src, index=False)
    out = tmp_path / "out.csv"
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    return pd.read_csv(out, keep_default_na=False)


def test_predict_own_config_format(model_dir, synthetic, tmp_path):
    frame = synthetic[list(CONFIG_COLUMNS)].head(4).astype(object)
    frame.loc[frame.index[2], "tp"] = "x"
    result = _predict_frame(model_dir, frame, tmp_path)
    assert len(result) == 4
    assert "tp='x'" in result["pred_error"].iloc[2]
    good = [0, 1, 3]
    assert (result["pred_error"].iloc[good] == "").all()
    assert np.all(result["pred_step_time_s"].iloc[good].astype(float) > 0)


def test_predict_own_format_with_only_the_required_columns(model_dir, synthetic, tmp_path):
    from paratune.models._predict_io import _OWN_REQUIRED

    frame = synthetic[list(_OWN_REQUIRED)].head(3)
    result = _predict_frame(model_dir, frame, tmp_path)
    assert (result["pred_error"] == "").all()
    assert np.all(result["pred_step_time_s"].astype(float) > 0)


@pytest.mark.parametrize(("column", "value", "message"), [
    ("tp", 1.5, "tp='1.5' must be a positive integer"),
    ("micro_batch_size", 2.5, "micro_batch_size='2.5' must be a positive integer"),
    ("virtual_stages", -3, "virtual_stages='-3' must be a positive integer"),
    ("virtual_stages", 4, "virtual_stages=4: must be 1 unless schedule=interleaved_1f1b"),
    ("schedule", "interleaved_1f1b", "interleaved_1f1b needs pp >= 2"),
    ("hardware", "", "hardware is missing"),
    ("global_batch_size", 1001, "global_batch_size=1001 is not a multiple of "
                                "dp*micro_batch_size = "),
])
def test_predict_own_format_checks_each_layout(model_dir, synthetic, tmp_path, column, value,
                                               message):
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).astype(object)
    frame.loc[frame.index[1], column] = value
    result = _predict_frame(model_dir, frame, tmp_path)
    assert message in result["pred_error"].iloc[1]
    assert result["pred_step_time_s"].iloc[1] == ""
    assert (result["pred_error"].iloc[[0, 2]] == "").all()


def test_predict_own_format_checks_the_model_shape(model_dir, synthetic, tmp_path):
    frame = synthetic[list(CONFIG_COLUMNS)].head(2).astype(object)
    # 8 heads cannot be split over tp=16 (dp adjusted so the world size still holds)
    row = frame.index[0]
    frame.loc[row, ["num_heads", "num_kv_heads"]] = [8, 8]
    frame.loc[row, "dp"] = frame.loc[row, "dp"] * frame.loc[row, "tp"] // 16 or 1
    frame.loc[row, "tp"] = 16
    frame.loc[row, "world_size"] = frame.loc[row, "dp"] * 16 * frame.loc[row, "pp"]
    frame.loc[row, "global_batch_size"] = frame.loc[row, "dp"] * frame.loc[
        row, "micro_batch_size"]
    frame.loc[row, "num_microbatches"] = 1
    result = _predict_frame(model_dir, frame, tmp_path)
    assert result["pred_error"].iloc[0] == "tp=16: must divide num_heads=8"
    assert result["pred_error"].iloc[1] == ""


def test_predict_rejects_unknown_format(model_dir, tmp_path, capsys):
    src = tmp_path / "x.csv"
    with open(src, "w", newline="") as handle:
        csv.writer(handle).writerows([["a", "b"], ["1", "2"]])
    assert main(["predict", "--model", str(model_dir), str(src), "--out",
                 str(tmp_path / "o.csv")]) == 2
    assert "missing" in capsys.readouterr().err


def test_predict_refuses_a_mismatched_model(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.json").write_text('{"kind": "paratune.PerformanceModel", '
                                               '"schema_version": 0}')
    assert main(["predict", "--model", str(tmp_path / "m"), "in.csv", "--out", "o.csv"]) == 2
    assert "schema_version=0" in capsys.readouterr().err


def test_evaluate_prints_figures_and_writes_plot(tmp_path, synthetic, capsys):
    data = tmp_path / "data.csv"
    synthetic.to_csv(data, index=False)
    plot = tmp_path / "pvm.png"
    assert main(["evaluate", str(data), "--split", "model", "--n-estimators", "10",
                 "--baselines", "--plot", str(plot), "--no-mlflow"]) == 0
    out = capsys.readouterr().out
    for header in ("MAPE%", "MdAPE%", "Spearman", "regret%", "feasible acc%"):
        assert header in out
    assert "xgb_raw_config" in out and "hist_gradient_boosting" in out
    assert plot.exists()
    rows = _table_rows(out)
    estimators = ("performance_model", "analytical", "xgb_raw_config", "hist_gradient_boosting")
    held_out = {f"synthetic:{m}" for m in synthetic["model_name"].unique()}
    # a row over all runs and a row per held-out model for each estimator
    assert sorted((r["estimator"], r["held_out"]) for r in rows) == sorted(
        (e, h) for e in estimators for h in held_out | {""})
    for r in rows:
        for column in ("n", "MAPE%", "MdAPE%", "Spearman", "regret%", "feasible acc%"):
            assert r[column] and np.isfinite(float(r[column])), (r["estimator"], r["held_out"],
                                                                  column)
    (overall,) = (r for r in rows if r["estimator"] == "performance_model" and not r["held_out"])
    assert int(overall["n"]) == (synthetic["status"] == "ok").sum()
    # about 6% median error and 1% regret on this data; a constant step time per held-out
    # model scores about 50% and 60%
    assert float(overall["MdAPE%"]) < 25
    assert float(overall["Spearman"]) > 0.9
    assert float(overall["regret%"]) < 10
    assert 50 < float(overall["feasible acc%"]) <= 100


def _table_rows(out: str) -> list[dict[str, str]]:
    """The rows of the figures table ``paratune evaluate`` prints, as header -> cell text
    (an empty cell for a figure that is not a number)."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    headers = [lines[rule - 1][a:b].strip() for a, b in spans]
    rows = []
    for line in lines[rule + 1:]:
        if not line.strip() or line.startswith("plot:"):
            break
        rows.append({h: line[a:b].strip() for h, (a, b) in zip(headers, spans)})
    return rows


def test_predict_names_a_missing_or_undecodable_input(model_dir, tmp_path, capsys,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "--model", str(model_dir), "nosuch.csv", "--out", "o.csv"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "paratune predict: error: nosuch.csv: no such file\n"
    assert not (tmp_path / "o.csv").exists()
    (tmp_path / "latin.csv").write_bytes(f"{PUBLIC_HEADER}\n".encode()
                                         + PUBLIC_ROWS[0].replace("bf16", "caf\xe9")
                                         .encode("latin-1") + b"\n")
    assert main(["predict", "--model", str(model_dir), "latin.csv", "--out", "o.csv"]) == 2
    assert capsys.readouterr().err == ("paratune predict: error: latin.csv: line 2 is not "
                                       "UTF-8 text (byte 0xe9); save the file as UTF-8\n")


def test_fit_refuses_an_out_that_is_a_file_before_fitting(tmp_path, synthetic, capsys):
    data = tmp_path / "data.csv"
    synthetic.to_csv(data, index=False)
    (tmp_path / "m").write_text("notes")
    assert main(["fit", str(data), "--out", str(tmp_path / "m"), "--no-mlflow"]) == 2
    assert capsys.readouterr().err == (f"paratune fit: error: --out='{tmp_path / 'm'}': is a "
                                       "file; the model is written as a directory\n")
    assert (tmp_path / "m").read_text() == "notes"


def test_fit_names_both_formats_for_a_csv_in_neither(tmp_path, capsys):
    src = tmp_path / "x.csv"
    src.write_text("a,b\n1,2\n")
    assert main(["fit", str(src), "--out", str(tmp_path / "m"), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert "neither the public measurement format" in err
    assert "missing status, step_time_s, model_name, num_layers, hidden_size and" in err


def test_fit_says_why_a_public_csv_gives_no_row(tmp_path, capsys):
    header_only = tmp_path / "empty.csv"
    header_only.write_text("# source: test\n" + PUBLIC_HEADER + "\n")
    assert main(["fit", str(header_only), "--out", str(tmp_path / "m"), "--no-mlflow"]) == 2
    assert capsys.readouterr().err == (f"paratune fit: error: {header_only}: no usable row "
                                       "(nothing below its header)\n")
    # configurations without a measurement or a failure: each left out, with its reason
    unmeasured = tmp_path / "configs.csv"
    unmeasured.write_text(PUBLIC_HEADER + "\n" + PUBLIC_ROWS[0] + "\n")
    assert main(["fit", str(unmeasured), "--out", str(tmp_path / "m"), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"paratune fit: error: {unmeasured}: no usable row (each was left "
                          f"out: {unmeasured}:2: no status and no step_time_s")
    assert "neither the public measurement format" not in err


def test_predict_own_format_takes_empty_optional_cells_and_any_case(model_dir, synthetic,
                                                                   tmp_path):
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).astype(object)
    frame.loc[frame.index[0], "rope_theta"] = ""
    frame.loc[frame.index[1], "schedule"] = "1F1B"
    frame.loc[frame.index[2], "sharding"] = "ZERO1"
    result = _predict_frame(model_dir, frame, tmp_path)
    assert (result["pred_error"] == "").all()
    assert np.all(result["pred_step_time_s"].astype(float) > 0)


@pytest.mark.parametrize(("flags", "message"), [
    (["fit", "data.csv", "--out", "m", "--n-estimators", "0"],
     "paratune fit: error: argument --n-estimators: must be an integer >= 1, not '0'"),
    (["evaluate", "data.csv", "--n-estimators", "-5"],
     "paratune evaluate: error: argument --n-estimators: must be an integer >= 1, not '-5'"),
    (["evaluate", "data.csv", "--folds", "1"],
     "paratune evaluate: error: argument --folds: must be an integer >= 2, not '1'"),
    (["evaluate", "data.csv", "--model-seed", "-1"],
     "paratune evaluate: error: argument --model-seed: must be an integer >= 0, not '-1'"),
])
def test_flags_out_of_range_are_refused_by_the_parser(tmp_path, synthetic, capsys, monkeypatch,
                                                      flags, message):
    monkeypatch.chdir(tmp_path)
    synthetic.to_csv("data.csv", index=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--no-mlflow"])
    assert exit_info.value.code == 2
    assert f"{message}\n" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv"]


def _runs(uri: str, experiment: str) -> list:
    import mlflow

    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def test_a_failing_fit_or_evaluate_leaves_a_failed_run_with_its_params(tmp_path, mlflow_uri):
    data = tmp_path / "broken.csv"
    data.write_text("not,a,measurement\n1,2,3\n")
    assert main(["fit", str(data), "--out", str(tmp_path / "model")]) == 2
    assert main(["evaluate", str(data), "--plot", str(tmp_path / "p.png")]) == 2
    for experiment, name in (("paratune-fit", "fit"), ("paratune-evaluate", "evaluate-random")):
        (run,) = _runs(mlflow_uri, experiment)
        assert run.info.status == "FAILED" and run.info.run_name == name
        assert json.loads(run.data.params["data"]) == [str(data.resolve())]


def test_evaluate_prints_its_run_and_logs_its_inputs(tmp_path, synthetic, mlflow_uri, capsys):
    data = tmp_path / "data.csv"
    synthetic.to_csv(data, index=False)
    assert main(["evaluate", str(data), "--folds", "2", "--n-estimators", "10",
                 "--plot", str(tmp_path / "p.png")]) == 0
    (run,) = _runs(mlflow_uri, "paratune-evaluate")
    assert f"MLflow run {run.info.run_id}: mlflow ui" in capsys.readouterr().out
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["folds"] == "2" and params["seed"] == "0" and params["split"] == "random"
    assert json.loads(params["data"]) == [str(data.resolve())]
    assert params["n_estimators"] == "10" and "max_depth" in params
    assert params["random_state"] == "0"  # the model's seed, as a fit logs it
    # the default trees are logged as the number a fit logs (not the flag's None), and the
    # random split's folds and seed only where they apply
    assert main(["evaluate", str(data), "--split", "model", "--plot",
                 str(tmp_path / "q.png")]) == 0
    assert main(["fit", str(data), "--out", str(tmp_path / "m"), "--n-estimators", "10"]) == 0
    fitted = _runs(mlflow_uri, "paratune-fit")[0].data.params
    by_split = {r.info.run_name: r.data.params for r in _runs(mlflow_uri, "paratune-evaluate")}
    model_split = by_split["evaluate-model"]
    assert "folds" not in model_split and "seed" not in model_split
    assert main(["evaluate", str(data), "--split", "model", "--model-seed", "3",
                 "--n-estimators", "10", "--plot", str(tmp_path / "r.png")]) == 0
    seeded = [r for r in _runs(mlflow_uri, "paratune-evaluate")
              if r.data.params.get("random_state") == "3"]
    assert len(seeded) == 1 and seeded[0].info.run_name == "evaluate-model"
    from paratune.models._estimators import estimator_factories

    default_trees = estimator_factories()["performance_model"]().get_params()["n_estimators"]
    assert model_split["n_estimators"] == str(default_trees) != "None"
    assert {k: fitted[k] for k in ("max_depth", "learning_rate")} == {
        k: model_split[k] for k in ("max_depth", "learning_rate")}


@pytest.mark.parametrize("flag", ["--no-track", "--no-mlflow"])
def test_fit_and_evaluate_take_no_track(tmp_path, synthetic, mlflow_uri, flag, capsys):
    data = tmp_path / "data.csv"
    synthetic.head(80).to_csv(data, index=False)
    assert main(["fit", str(data), "--out", str(tmp_path / "m"), "--n-estimators", "5",
                 flag]) == 0
    assert main(["evaluate", str(data), "--folds", "2", "--n-estimators", "5",
                 "--plot", str(tmp_path / "p.png"), flag]) == 0
    assert "MLflow run" not in capsys.readouterr().out
    assert _runs(mlflow_uri, "paratune-fit") == _runs(mlflow_uri, "paratune-evaluate") == []


def test_fit_refuses_a_used_out_unless_it_holds_a_model_and_force_is_given(
        tmp_path, synthetic, mlflow_uri, capsys):
    """Checked before the MLflow run opens: a refused fit leaves no run."""
    data = tmp_path / "data.csv"
    synthetic.head(80).to_csv(data, index=False)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    for flags in ([], ["--force"]):
        assert main(["fit", str(data), "--out", str(other), *flags]) == 2
        assert capsys.readouterr().err == (
            f"paratune fit: error: --out='{other}': is a directory with other files in it, "
            "not a saved model; give a new or empty directory\n")
    assert sorted(p.name for p in other.iterdir()) == ["todo.txt"]
    model = tmp_path / "model"
    fit = ["fit", str(data), "--out", str(model), "--n-estimators", "5"]
    assert main([*fit, "--no-track"]) == 0
    before = (model / "model.json").read_bytes()
    assert _runs(mlflow_uri, "paratune-fit") == []
    assert main(fit) == 2
    assert "already holds a saved model; give --force to replace it" in capsys.readouterr().err
    assert (model / "model.json").read_bytes() == before
    assert _runs(mlflow_uri, "paratune-fit") == []
    (tmp_path / "empty").mkdir()
    assert main([*fit[:3], str(tmp_path / "empty"), *fit[4:], "--no-track"]) == 0
    (model / ".throughput.0badcafe.tmp.json").write_text("{")  # a save killed mid-write
    assert main([*fit, "--force"]) == 0
    import mlflow

    (run,) = _runs(mlflow_uri, "paratune-fit")
    logged = [a.path for a in mlflow.MlflowClient(mlflow_uri).list_artifacts(run.info.run_id,
                                                                            "model")]
    assert "model/throughput.json" in logged and not [p for p in logged if "/." in p]
    # a save killed before its first file leaves only the directory's lock: a model's place
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / ".model.lock").write_text("")
    assert main([*fit[:3], str(killed), *fit[4:], "--no-track"]) == 2
    assert "already holds a saved model" in capsys.readouterr().err
    assert main([*fit[:3], str(killed), *fit[4:], "--no-track", "--force"]) == 0
    (run,) = _runs(mlflow_uri, "paratune-fit")
    assert run.info.status == "FINISHED"


def test_missing_data_is_refused_before_a_run_opens(tmp_path, mlflow_uri, capsys,
                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "nosuch", "--out", "m"]) == 2
    assert capsys.readouterr().err == "paratune fit: error: nosuch: no such file\n"
    assert main(["evaluate", "nosuch.csv"]) == 2
    assert capsys.readouterr().err == "paratune evaluate: error: nosuch.csv: no such file\n"
    assert _runs(mlflow_uri, "paratune-fit") == _runs(mlflow_uri, "paratune-evaluate") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_evaluate_prints_the_plot_it_writes(tmp_path, synthetic, capsys):
    """Without an extension the plot gets .png; a directory gets the default name inside."""
    data = tmp_path / "data.csv"
    synthetic.head(80).to_csv(data, index=False)
    (tmp_path / "plots").mkdir()
    common = ["evaluate", str(data), "--folds", "2", "--n-estimators", "5", "--no-track"]
    for plot, written in ((tmp_path / "pvm", tmp_path / "pvm.png"),
                          (tmp_path / "plots", tmp_path / "plots" / "predicted_vs_measured.png")):
        assert main([*common, "--plot", str(plot)]) == 0
        assert f"plot: {written}\n" in capsys.readouterr().out
        assert written.is_file()
    assert not (tmp_path / "pvm").exists() and not (tmp_path / "plots.png").exists()
    assert main([*common, "--plot", str(tmp_path / "pvm.txt")]) == 2
    assert capsys.readouterr().err.startswith(
        f"paratune evaluate: error: --plot='{tmp_path / 'pvm.txt'}': must end in .png or "
        "another image format")


def test_path_errors_are_one_line_naming_the_path_and_flag(model_dir, synthetic, tmp_path,
                                                         capsys, monkeypatch):
    """A directory where a file belongs (and the reverse) is a named error, not a traceback."""
    monkeypatch.chdir(tmp_path)
    synthetic[list(CONFIG_COLUMNS)].head(3).to_csv("in.csv", index=False)
    (tmp_path / "outdir").mkdir()
    assert main(["predict", "--model", str(model_dir), "in.csv", "--out", "outdir"]) == 2
    assert capsys.readouterr().err == ("paratune predict: error: --out outdir: is a directory, "
                                       "not a file\n")
    (tmp_path / "file").write_text("x")
    assert main(["predict", "--model", str(model_dir), "in.csv", "--out", "file/p.csv"]) == 2
    assert capsys.readouterr().err == ("paratune predict: error: --out file/p.csv: file is a "
                                       "file, not a directory\n")
    assert main(["predict", "--model", "file", "in.csv", "--out", "p.csv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratune predict: error: ") and len(err.splitlines()) == 1


def test_evaluate_no_progress_turns_the_terminal_bar_off(tmp_path, synthetic, capsys,
                                                         monkeypatch):
    import sys

    data = tmp_path / "data.csv"
    synthetic.to_csv(data, index=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # as on a terminal
    args = ["evaluate", str(data), "--split", "model", "--n-estimators", "5", "--plot",
            str(tmp_path / "p.png"), "--no-mlflow"]
    assert main(args) == 0
    assert "cross-validating" in capsys.readouterr().err
    assert main([*args, "--no-progress"]) == 0
    assert "cross-validating" not in capsys.readouterr().err


def _predict_public(model_dir, tmp_path, header: str, rows: list[str]) -> pd.DataFrame:
    """``paratune predict`` of a public-format CSV; the output, as text."""
    src = tmp_path / "public.csv"
    src.write_text(header + "\n" + "\n".join(rows) + "\n")
    out = tmp_path / "public_out.csv"
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    return pd.read_csv(out, keep_default_na=False, dtype=str)


def test_predict_keeps_an_all_empty_row_in_its_place(model_dir, synthetic, tmp_path):
    """A row of empty cells is a row of the input (a blank line is not)."""
    result = _predict_public(model_dir, tmp_path, PUBLIC_HEADER,
                             [PUBLIC_ROWS[0], "," * 23, "", PUBLIC_ROWS[4]])
    assert len(result) == 3 and result["dp"].tolist() == ["8", "", "8"]
    assert result["pred_error"].tolist() == ["", "empty row: every cell is empty", ""]
    assert result["pred_step_time_s"].iloc[1] == ""
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).astype(object)
    frame.iloc[1] = ""
    own = _predict_frame(model_dir, frame, tmp_path)
    assert own["pred_error"].tolist() == ["", "empty row: every cell is empty", ""]
    assert own["pred_step_time_s"].iloc[1] == ""


def test_predict_refuses_a_row_with_more_cells_than_the_header(model_dir, tmp_path):
    result = _predict_public(model_dir, tmp_path, PUBLIC_HEADER,
                             [PUBLIC_ROWS[0] + ",extra", PUBLIC_ROWS[4]])
    assert result["pred_error"].tolist() == ["has 25 cells but the header has 24 columns", ""]
    assert result["pred_step_time_s"].iloc[0] == "" and float(result["pred_step_time_s"][1]) > 0
    assert ",".join(result.iloc[0, :24]) == PUBLIC_ROWS[0]


def test_predict_takes_a_trailing_separator_and_a_quoted_comment_line(model_dir, tmp_path):
    src = tmp_path / "sheet.csv"
    src.write_text('"# source: a sweep, its table 3"\n' + PUBLIC_HEADER + ",\n"
                   + PUBLIC_ROWS[0] + ",\n" + PUBLIC_ROWS[4] + ",,\n")
    out = tmp_path / "out.csv"
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    result = pd.read_csv(out, keep_default_na=False, dtype=str)
    plain = _predict_public(model_dir, tmp_path, PUBLIC_HEADER, [PUBLIC_ROWS[0], PUBLIC_ROWS[4]])
    assert result["pred_error"].tolist() == ["", ""]
    assert result["pred_step_time_s"].tolist() == plain["pred_step_time_s"].tolist()


def test_predict_says_where_nodes_contradict_num_gpus(model_dir, tmp_path):
    rows = [PUBLIC_ROWS[0] + ",2", PUBLIC_ROWS[0] + ",4", PUBLIC_ROWS[0] + ","]  # 16 GPUs
    result = _predict_public(model_dir, tmp_path, PUBLIC_HEADER + ",nodes", rows)
    assert result["pred_error"].tolist() == [
        "", "nodes=4 contradicts num_gpus=16 on 8-GPU nodes", ""]
    assert result["pred_step_time_s"].iloc[1] == ""
    assert result["pred_step_time_s"].iloc[0] == result["pred_step_time_s"].iloc[2] != ""


def test_predict_own_format_takes_layouts_other_frameworks_run(model_dir, synthetic, tmp_path):
    """Layouts measured elsewhere are predicted: a vocabulary tp does not divide (Megatron-LM
    pads it), more pipeline stages than layers (nanotron's embedding and head stages)."""
    frame = synthetic[list(CONFIG_COLUMNS)].head(2).astype(object)
    first, second = frame.index
    frame.loc[first, ["vocab_size", "tp", "dp", "pp"]] = [128257, 2, 1, 1]
    frame.loc[second, ["num_layers", "tp", "dp", "pp"]] = [2, 1, 1, 4]
    for row in (first, second):
        frame.loc[row, "world_size"] = frame.loc[row, "tp"] * frame.loc[row, "pp"]
        frame.loc[row, "global_batch_size"] = 4 * frame.loc[row, "micro_batch_size"]
        frame.loc[row, "num_microbatches"] = 4
    result = _predict_frame(model_dir, frame, tmp_path)
    assert result["pred_error"].tolist() == ["", ""]
    assert (result["pred_step_time_s"].astype(float) > 0).all()


@pytest.mark.parametrize("dropped", [("num_gpus",), ("micro_batch", "global_batch")])
def test_predict_names_the_missing_public_columns(model_dir, tmp_path, capsys, dropped):
    names = PUBLIC_HEADER.split(",")
    keep = [i for i, name in enumerate(names) if name not in dropped]
    src = tmp_path / "in.csv"
    src.write_text("\n".join(",".join(line.split(",")[i] for i in keep)
                             for line in [PUBLIC_HEADER, PUBLIC_ROWS[0]]) + "\n")
    assert main(["predict", "--model", str(model_dir), str(src), "--out",
                 str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert f"missing public column(s) {', '.join(dropped)}" in err
    assert "num_layers" not in err


def _public_without(columns: tuple[str, ...], path) -> None:
    names = PUBLIC_HEADER.split(",")
    keep = [i for i, name in enumerate(names) if name not in columns]
    path.write_text("\n".join(",".join(line.split(",")[i] for i in keep)
                              for line in [PUBLIC_HEADER, *PUBLIC_ROWS[:2]]) + "\n")


def test_predict_refuses_a_public_file_without_a_column_every_row_needs(model_dir, tmp_path,
                                                                       capsys):
    """A public file without ``heads`` (or ``seq_len``, ``gpu``...) has no row to predict:
    the file is refused with the columns named, as import and fit refuse it, not written as
    every row's ``pred_error`` with exit 0. Without the model's name, which no prediction
    needs, every row is predicted."""
    src, out = tmp_path / "in.csv", tmp_path / "o.csv"
    _public_without(("heads", "seq_len"), src)
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 2
    assert "without columns heads, seq_len" in capsys.readouterr().err
    assert not out.exists()
    _public_without(("model",), src)
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    # the second row's degrees contradict its GPU count: that row's own problem
    assert "predicted 1 of 2 rows" in capsys.readouterr().out


def test_predict_reads_vendor_gpu_names_and_names_the_gpu_column(model_dir, tmp_path):
    def with_gpu(name: str) -> str:
        return PUBLIC_ROWS[0].replace(",H100-80GB,", f",{name},")

    result = _predict_public(model_dir, tmp_path, PUBLIC_HEADER, [
        with_gpu("NVIDIA H100 80GB HBM3"), with_gpu("H100 SXM"), with_gpu("H100 PCIe"),
        with_gpu("TPU-v9")])
    errors = result["pred_error"].tolist()
    assert errors[:2] == ["", ""]
    assert result["pred_step_time_s"].iloc[0] == result["pred_step_time_s"].iloc[1] != ""
    for i, name in ((2, "H100 PCIe"), (3, "TPU-v9")):
        assert errors[i].startswith(f"gpu={name!r} is not a known device (")
        assert result["pred_step_time_s"].iloc[i] == ""


def test_predict_replaces_the_prediction_columns_of_its_input(model_dir, tmp_path, capsys,
                                                              caplog):
    first = _predict_public(model_dir, tmp_path, PUBLIC_HEADER, PUBLIC_ROWS[:2])
    capsys.readouterr()
    stale = first.copy()
    stale["pred_step_time_s"] = "999"
    stale["pred_error"] = "stale"
    src = tmp_path / "again.csv"
    stale.to_csv(src, index=False)
    out = tmp_path / "again_out.csv"
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    assert "predicted 1 of 2 rows" in capsys.readouterr().out
    assert "replaced the input's prediction columns pred_step_time_s" in caplog.text
    again = pd.read_csv(out, keep_default_na=False, dtype=str)
    assert list(again.columns) == list(first.columns)
    pd.testing.assert_frame_equal(again, first)


def test_calibrate_moves_a_saved_model_toward_a_new_familys_runs(model_dir, synthetic,
                                                                    tmp_path, capsys):
    import shutil

    from paratune.cli import main
    from paratune.models import load_model

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)  # calibrated in place: not the shared fixture's
    ok = synthetic[synthetic["status"] == "ok"]
    # another framework on the same hardware, twice as slow as the fitted family
    other = ok.assign(source="otherfw_runs", step_time_s=ok["step_time_s"] * 2.0)
    shots = tmp_path / "shots.csv"
    one_node = other[other["world_size"] <= 8].iloc[:8]  # one node's campaign
    one_node.to_csv(shots, index=False)
    rest = other.drop(index=one_node.index)

    def mdape() -> float:
        pred = load_model(model).predict(rest)["pred_step_time_s"].to_numpy()
        return float(np.median(np.abs(pred / rest["step_time_s"].to_numpy() - 1)))

    before = mdape()
    assert main(["calibrate", str(shots), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert "otherfw: 8 runs -> its own constants" in out and "ms per layer pass" in out
    assert mdape() < 0.2 < before
    # none of its pipelines crossed nodes: said, and held until one has
    assert "no pipeline across nodes among its runs" in out
    assert "otherfw" not in load_model(model).node_pipeline_families_
    across = other[(other["pp"] > 1) & (other["world_size"] > 8)]
    more = tmp_path / "more.csv"
    pd.concat([one_node, across.head(3)]).to_csv(more, index=False)
    assert main(["calibrate", str(more), "--model", str(model)]) == 0
    assert "no pipeline across nodes" not in capsys.readouterr().out
    assert "otherfw" in load_model(model).node_pipeline_families_
    # fitted with the measured family's runs, the same eight are calibrated on and said so
    data = tmp_path / "data.csv"
    synthetic.to_csv(data, index=False)
    assert main(["fit", str(data), str(shots), "--out", str(tmp_path / "refit"),
                 "--no-mlflow"]) == 0
    out = capsys.readouterr().out
    assert ("calibrated on, too few runs to fit on (fewer than 20): otherfw: 8 runs -> "
            "its own constants") in out, out
    # a model directory without a model is refused with its path
    assert main(["calibrate", str(shots), "--model", str(tmp_path / "none")]) == 2
    assert str(tmp_path / "none") in capsys.readouterr().err


def test_calibrate_warns_of_a_run_out_of_memory_far_under_its_prediction(model_dir, synthetic,
                                                                         tmp_path, capsys):
    """One run out of memory at a predicted few percent of device memory does not move the
    family's threshold; calibrate names it, and a file of nothing else is refused."""
    import shutil

    from paratune.cli import main
    from paratune.models import load_model

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    ok = synthetic[synthetic["status"] == "ok"].assign(source="otherfw_runs")
    share = (load_model(model).predict(ok)["pred_peak_mem_gb"] / 80.0).to_numpy()
    low = ok[share < 0.1]
    oom = low.iloc[5:6].assign(status="oom", error="CUDA out of memory", step_time_s=np.nan,
                               tokens_per_s=np.nan)
    shots = tmp_path / "shots.csv"
    pd.concat([low.iloc[:5], oom]).to_csv(shots, index=False)
    assert main(["calibrate", str(shots), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert "warning: otherfw: 1 run(s) out of memory at " in out and "under 24%" in out
    assert "otherfw" not in load_model(model).memory_thresholds_
    # fitted with the measured family's runs, the same run is left out and named too
    data = tmp_path / "data.csv"
    synthetic.to_csv(data, index=False)
    assert main(["fit", str(data), str(shots), "--out", str(tmp_path / "refit"),
                 "--no-mlflow"]) == 0
    assert "warning: otherfw: 1 run(s) out of memory at " in capsys.readouterr().out
    alone = tmp_path / "oom.csv"
    oom.to_csv(alone, index=False)
    # fitted with that run alone beside the measured family's: fitted, and the run named
    assert main(["fit", str(data), str(alone), "--out", str(tmp_path / "refit2"),
                 "--no-mlflow"]) == 0
    assert "warning: otherfw: 1 run(s) out of memory at " in capsys.readouterr().out
    assert "otherfw" not in load_model(tmp_path / "refit2").memory_thresholds_
    assert main(["calibrate", str(alone), "--model", str(model)]) == 2
    assert "at 24% of device memory or more as predicted" in capsys.readouterr().err
