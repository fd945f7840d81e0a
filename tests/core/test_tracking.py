from __future__ import annotations

import pandas as pd
import pytest

from paratune.tracking import default_tracking_uri, start_run, ui_command


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
