"""A tracking server that is not there, or goes away mid-command, costs a bounded wait; the
command finishes its own work and says what was not tracked, and its run is ended FAILED
when the server answers again (by the next command that reaches it). A real ``mlflow
server`` on loopback, stopped and restarted by the tests (see ``tests/servers.py``)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from paratune.cli import main
from tests.servers import free_port


@pytest.fixture(autouse=True)
def _own_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from paratune.models import PerformanceModel
    from tests.models.conftest import synthetic_measurements

    model = PerformanceModel(n_estimators=10, aux_estimators=5, n_jobs=1, random_state=0)
    return model.fit(synthetic_measurements()).save(tmp_path_factory.mktemp("pm") / "model")


def _tune(saved_model):
    return ["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100", "--predictor",
            str(saved_model), "--output", "out", "--trials", "8", "--no-progress"]


def test_no_server_at_the_tracking_uri_costs_seconds_and_the_command_finishes(
        saved_model, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING):
        assert main(_tune(saved_model)) == 0
    captured = capsys.readouterr()
    assert "winner:" in captured.out and "vs_best" in captured.out  # the result table
    assert json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert "Traceback" not in captured.err
    assert "cannot be reached" in caplog.text and "untracked" in caplog.text
    assert "Retrying" not in caplog.text  # urllib3's retries are not shown one by one


def test_opening_a_run_where_no_server_answers_is_a_bounded_wait(monkeypatch, caplog):
    """MLflow's own retries waited minutes (7 retries, 120 s timeouts): here seconds."""
    import mlflow  # imported before the clock starts

    from paratune.tracking import TRACKING_WAIT_S, start_run

    assert mlflow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), start_run("paratune-test", params={"a": 1}) as run:
        run.log_metrics({"m": 1.0})
    elapsed = time.monotonic() - start
    assert run.run_id is None and run.lost is not None
    assert elapsed < 3 * TRACKING_WAIT_S, elapsed
    assert "cannot be reached" in caplog.text


def test_a_server_that_goes_away_mid_run_is_noted_and_its_run_ended_on_its_return(
        mlflow_server, monkeypatch, caplog):
    import mlflow

    from paratune.tracking import start_run, unended_runs_file

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    with caplog.at_level(logging.WARNING), start_run("paratune-test", params={"a": 1}) as run:
        run_id = run.run_id
        mlflow_server.stop()
        start = time.monotonic()
        run.log_metrics({"m": 1.0})  # the server is gone: one bounded wait, then untracked
        run.log_dict({"x": 1}, "x.json")  # no further wait
        run.log_params({"b": 2})
        elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    assert run.lost is not None
    assert "stopped answering" in caplog.text and run_id in caplog.text
    pending = [json.loads(line) for line in unended_runs_file().read_text().splitlines()]
    assert [p["run_id"] for p in pending] == [run_id]
    assert mlflow_server.uri not in unended_runs_file().read_text()  # a digest, not the URI

    mlflow_server.start()
    with start_run("paratune-test") as later:  # the next command ends the one left open
        assert later.lost is None
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    left = client.get_run(run_id)
    assert left.info.status == "FAILED"
    assert "paratune.tracking_lost" in left.data.tags
    assert unended_runs_file().read_text() == ""


def test_tune_whose_server_goes_away_during_the_search_finishes_its_work(
        saved_model, mlflow_server, tmp_path, monkeypatch, caplog):
    from paratune.models import load_model
    from paratune.tuner import tune

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    model = load_model(saved_model)
    stopped = []

    class StopsTheServer:
        """The saved model, whose first prediction stops the tracking server."""

        fingerprint_ = model.fingerprint_

        def predict(self, frame):
            if not stopped:
                mlflow_server.stop()
                stopped.append(time.monotonic())
            return model.predict(frame)

    with caplog.at_level(logging.WARNING):
        result = tune("llama3-8b", 64, "H100", StopsTheServer(), n_trials=8,
                      output_dir=tmp_path / "out")
    assert stopped and time.monotonic() - stopped[0] < 60
    assert result.run_id is None  # nothing to open: the run is incomplete
    assert (tmp_path / "out" / "recommendation.json").exists()
    assert "stopped answering" in caplog.text or "cannot be reached" in caplog.text
