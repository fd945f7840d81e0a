from __future__ import annotations

import pandas as pd
import pytest

from paratune.tracking import artifact_root, default_tracking_uri, start_run, ui_command


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_run_logs_params_metrics_and_artifacts(store, tmp_path):
    import mlflow

    with start_run("paratune-test", run_name="r1", params={"grid": {"mbs": [1, 2]}, "n": 3},
                   tags={"kind": "unit"}) as run:
        run.log_metrics({"ok": 5, "nan": float("nan"), "text": "x"})
        run.log_table(pd.DataFrame({"a": [1, 2]}), "tables/trials.csv")
        (tmp_path / "f.txt").write_text("hello")
        run.log_artifact(tmp_path / "f.txt")
    got = mlflow.get_run(run.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params == {"grid": '{"mbs": [1, 2]}', "n": "3"}
    assert got.data.metrics == {"ok": 5.0}
    assert got.data.tags["kind"] == "unit"
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.run_id)}
    assert {"tables", "f.txt"} <= names


def test_run_marked_failed_on_exception(store):
    import mlflow

    with pytest.raises(RuntimeError), start_run("paratune-test") as run:
        raise RuntimeError("boom")
    assert mlflow.get_run(run.run_id).info.status == "FAILED"


def test_default_uri_is_local_sqlite(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert "mlflow ui --backend-store-uri sqlite:///" in ui_command()


def test_artifacts_of_a_local_sqlite_store_go_to_mlartifacts_beside_it(tmp_path, monkeypatch):
    import mlflow

    store_dir, cwd = tmp_path / "store", tmp_path / "elsewhere"
    store_dir.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    uri = f"sqlite:///{store_dir / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    (tmp_path / "f.txt").write_text("hello")
    with start_run("paratune-fit") as run:
        run.log_artifact(tmp_path / "f.txt", "model")
    with start_run("paratune-fit") as again:  # the experiment exists now
        again.log_text("second", "note.txt")
    for done in (run, again):
        assert mlflow.get_run(done.run_id).info.status == "FINISHED"
    assert (store_dir / "mlartifacts" / "paratune-fit" / run.run_id / "artifacts" / "model" /
            "f.txt").read_text() == "hello"
    assert (store_dir / "mlartifacts" / "paratune-fit" / again.run_id / "artifacts" /
            "note.txt").exists()
    assert not (cwd / "mlruns").exists() and not (store_dir / "mlruns").exists()
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.run_id, "model")}
    assert names == {"model/f.txt"}


def test_default_store_keeps_artifacts_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert artifact_root() == tmp_path / "mlartifacts"
    with start_run("paratune-test") as run:
        run.log_text("x", "a.txt")
    assert (tmp_path / "mlartifacts" / "paratune-test" / run.run_id / "artifacts" /
            "a.txt").exists()
    assert not (tmp_path / "mlruns").exists()
    assert artifact_root("http://localhost:5000") is None
    assert artifact_root("postgresql://db/mlflow") is None
