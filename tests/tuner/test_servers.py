"""``paratune tune`` against real servers started by the tests: a PostgreSQL study storage and
an MLflow tracking server on loopback (see ``tests/servers.py``; skipped with the reason
where PostgreSQL is not installed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from paratune.cli import main

HERE = Path(__file__).resolve().parent

SECRET = "S3cr3tPlanted"


def _tune(saved_model, *flags):
    return ["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100", "--predictor",
            str(saved_model), "--output", "out", "--trials", "12", "--batch-size", "4",
            "--no-progress", *flags]


def _everything_logged(uri: str) -> list[str]:
    """Every param, tag and metric key and value of every run in the store at ``uri``."""
    import mlflow

    from paratune.dburl import with_installed_driver

    client = mlflow.MlflowClient(tracking_uri=with_installed_driver(uri))
    texts = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            texts += [f"{k}={v}" for k, v in run.data.params.items()]
            texts += [f"{k}={v}" for k, v in run.data.tags.items()]
            texts += [run.info.run_name or ""]
    return texts


def _check_no_secret(capsys, tmp_path, uri):
    captured = capsys.readouterr()
    assert SECRET not in captured.out and SECRET not in captured.err
    logged = _everything_logged(uri)
    assert logged, "the run was not tracked"
    assert not [text for text in logged if SECRET in text]
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml", ".txt", ".toml", ".sh"):
            assert SECRET not in path.read_text(), path
    return captured


def test_secrets_in_a_sqlite_storage_and_a_tracking_url_are_masked(
        saved_model, tmp_path, monkeypatch, capsys, mlflow_server):
    """A password in the study storage's query and in the tracking URI's userinfo appears
    nowhere: not on stdout or stderr, not in the closing ``mlflow ui`` hint, not in any MLflow
    param or tag of the run."""
    monkeypatch.chdir(tmp_path)
    authed = mlflow_server.uri.replace("http://", f"http://paratune:{SECRET}@")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", authed)
    storage = f"sqlite:///{tmp_path / 'study.db'}?password={SECRET}"
    assert main(_tune(saved_model, "--storage", storage)) == 0
    captured = _check_no_secret(capsys, tmp_path, mlflow_server.uri)
    assert "password=***" in captured.out  # the study's storage, shown masked
    assert "http://paratune:***@127.0.0.1" in captured.out  # the closing hint
    # a refusal quoting the storage masks it too
    bad = f"nosuchdialect://u:{SECRET}@h/db?password={SECRET}"
    assert main(_tune(saved_model, "--storage", bad, "--no-track")) == 2
    captured = capsys.readouterr()
    assert SECRET not in captured.err and "--storage" in captured.err


def test_secrets_in_a_postgresql_storage_and_a_db_tracking_uri_are_masked(
        saved_model, tmp_path, monkeypatch, capsys, postgres_url):
    """``postgresql://u@h/db?password=SECRET`` as the storage and a DB-backed tracking URI
    ``postgresql://u:SECRET@h/db`` (trust authentication: the password is sent, not needed)."""
    monkeypatch.chdir(tmp_path)
    database = postgres_url.rsplit("/", 1)[0]
    tracking = database.replace("paratune@", f"paratune:{SECRET}@") + "/tracking"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    storage = f"{postgres_url}?password={SECRET}"
    assert main(_tune(saved_model, "--storage", storage, "--study-name", "secrets")) == 0
    captured = _check_no_secret(capsys, tmp_path, tracking)
    assert f"{database}/paratune?password=***" in captured.out
    assert "paratune:***@127.0.0.1" in captured.out
    assert json.loads((tmp_path / "out" / "recommendation.json").read_text())


def test_a_storage_whose_driver_is_missing_names_the_module_to_install(saved_model, tmp_path,
                                                                      monkeypatch, capsys):
    """SQLAlchemy's "Failed to import DB access module" named no driver: the refusal names
    the module and the package that provides it, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    assert main(_tune(saved_model, "--storage", "mysql://u@127.0.0.1/db", "--no-track")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--storage" in err and "MySQLdb" in err and "pip install 'mysqlclient'" in err
    assert not (tmp_path / "out").exists()


def test_a_plain_postgresql_url_uses_whichever_driver_is_installed():
    """``postgresql://`` means psycopg 3 to SQLAlchemy 2.1; with only psycopg2 installed
    the URL is given that driver (and left alone where psycopg is there)."""
    from importlib.util import find_spec

    from paratune.dburl import with_installed_driver

    url = with_installed_driver("postgresql://u@h/db")
    if find_spec("psycopg") is not None:
        assert url == "postgresql://u@h/db"
    elif find_spec("psycopg2") is not None:
        assert url == "postgresql+psycopg2://u@h/db"
    assert with_installed_driver("postgresql+pg8000://u@h/db") == "postgresql+pg8000://u@h/db"
    assert with_installed_driver("sqlite:///x.db") == "sqlite:///x.db"


# ------------------------------------------------------------------ studies on PostgreSQL
STUDY_WORKER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    from conftest import ClosedFormPredictor
    from paratune import ConfigError, get_model
    from paratune.cli import sigterm_as_exit
    from paratune.tuner import Objective, SearchOptions, SearchSpace, optuna_search

    class Slow(ClosedFormPredictor):
        calls = 0

        def predict(self, frame):
            Slow.calls += 1
            if Slow.calls == {hang_at}:  # a batch's trials are in flight: say so, and stay
                open({hanging!r}, "w").close()
                time.sleep(3600)
            time.sleep({delay})
            return super().predict(frame)

    space = SearchSpace.build(get_model("llama3-8b"), 64, "H100", global_batch_sizes="128:512")
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        with sigterm_as_exit():
            result, study = optuna_search(Slow(), space, Objective(kind="goodput", b_noise=300),
                                          SearchOptions(n_trials={n_trials}, seed={seed},
                                                        storage={storage!r}, study_name="shared",
                                                        batch_size={batch_size}))
    except ConfigError as exc:
        print(f"error: {{exc}}", file=sys.stderr)
        sys.exit(2)
    print("TRIALS", result.num_trials)
""")


def _study_worker(storage: str, *, n_trials: int, seed: int, delay: float,
                  batch_size: int = 2, hang_at: int = 0, hanging: str = "") -> subprocess.Popen:
    """A process searching the study ``shared`` once told to go; with ``hang_at``, its
    predictor's call of that number creates the file ``hanging`` and never returns."""
    code = STUDY_WORKER.format(here=str(HERE), delay=delay, n_trials=n_trials, seed=seed,
                               storage=storage, batch_size=batch_size, hang_at=hang_at,
                               hanging=hanging)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert worker.stdout.readline() == "READY\n", worker.communicate(timeout=60)[1]
    return worker


def _go(*workers):
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()


def _trials(storage: str) -> list:
    import optuna

    from paratune.dburl import with_installed_driver

    study = optuna.load_study(study_name="shared", storage=with_installed_driver(storage))
    return study.get_trials(deepcopy=False)


def _states(storage: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trial in _trials(storage):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_four_workers_on_one_postgresql_study_stop_at_its_total(postgres_cluster):
    """``--trials`` is the study's total under concurrency: four workers asked for 40 leave
    exactly 40 finished trials (they used to overshoot by up to a batch each)."""
    storage = postgres_cluster.url
    workers = [_study_worker(storage, n_trials=40, seed=seed, delay=0.02, batch_size=4)
               for seed in range(4)]
    _go(*workers)
    for worker in workers:
        _, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err
    states = _states(storage)
    assert states.get("COMPLETE", 0) + states.get("PRUNED", 0) == 40, states
    assert states.get("RUNNING", 0) == 0, states


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_workers_trials_do_not_stay_running(postgres_cluster, tmp_path, how):
    """SIGTERM: the worker fails its in-flight trials as it exits. kill -9: the next worker
    on this machine fails them (their process is gone) before it searches. The signal comes
    while the worker predicts its third batch, whose trials are in flight."""
    storage = postgres_cluster.url
    hanging = tmp_path / "hanging"
    worker = _study_worker(storage, n_trials=10_000, seed=0, delay=0.0, batch_size=4,
                           hang_at=3, hanging=str(hanging))
    _go(worker)
    assert _wait(hanging.exists, 120), worker.poll()
    states = _states(storage)
    assert states.get("RUNNING", 0) > 0 and states.get("COMPLETE", 0) > 0, states
    worker.send_signal(getattr(signal, how))
    worker.communicate(timeout=60)
    if how == "SIGTERM":
        assert worker.returncode == 128 + signal.SIGTERM
        assert _states(storage).get("RUNNING", 0) == 0, _states(storage)
        return
    assert _states(storage).get("RUNNING", 0) > 0  # left by the killed process
    finished = sum(_states(storage).get(s, 0) for s in ("COMPLETE", "PRUNED"))
    follower = _study_worker(storage, n_trials=finished + 2, seed=1, delay=0.0)
    _go(follower)
    try:  # at worst the killed worker's heartbeats run out (HEARTBEAT_GRACE_S) first
        _, err = follower.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        follower.kill()
        _, err = follower.communicate()
        pytest.fail(f"the next worker did not finish in 300 s: {err[-2000:]}")
    assert follower.returncode == 0, err
    states = _states(storage)
    assert states.get("RUNNING", 0) == 0 and states.get("FAIL", 0) > 0, states


@pytest.mark.slow
def test_a_database_stopped_mid_search_is_one_line_and_keeps_the_trials(postgres_cluster):
    storage = postgres_cluster.url
    worker = _study_worker(storage, n_trials=10_000, seed=0, delay=0.2, batch_size=2)
    _go(worker)
    assert _wait(lambda: _states(storage).get("COMPLETE", 0) >= 4, 60)
    started = time.monotonic()
    postgres_cluster.stop()
    _, err = worker.communicate(timeout=120)
    waited = time.monotonic() - started
    assert worker.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "storage=" in err and "stopped answering" in err and "rerun" in err
    assert waited < 60, waited  # a bounded wait, not minutes
    postgres_cluster.start()  # what was told before is still there
    assert _states(storage).get("COMPLETE", 0) >= 4


@pytest.mark.slow
def test_a_tune_whose_database_stops_mid_search_finishes_its_own_work(saved_model, tmp_path,
                                                                      postgres_cluster):
    """``paratune tune --storage PG`` whose server stops mid-search: one error line naming
    the storage, what failed and what to do, exit 2; before it the command ranks the configs
    it evaluated, prints the table (saying the study was not fully recorded) and writes the
    recommendation and launch files; its MLflow run ends FAILED."""
    import mlflow

    storage = postgres_cluster.url
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=tracking)
    command = [sys.executable, "-m", "paratune",
               *_tune(saved_model, "--storage", storage, "--study-name", "shared",
                      "--trials", "100000", "--batch-size", "2")]
    tuning = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: _states(storage).get("COMPLETE", 0) >= 6, 120), _states(storage)
        postgres_cluster.stop()
        out, err = tuning.communicate(timeout=120)
    finally:
        if tuning.poll() is None:
            tuning.kill()
    assert tuning.returncode == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("paratune tune: error:")]
    assert len(errors) == 1, err
    assert "--storage=" in errors[0] and "stopped answering" in errors[0]
    assert "not fully recorded" in errors[0] and "start the database again" in errors[0]
    assert "recommendation.json" in errors[0]
    assert "winner:" in out and "vs_best" in out and "not fully recorded" in out
    written = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert written["config"] and (tmp_path / "out" / "recommendation.yaml").is_file()
    client = mlflow.MlflowClient(tracking_uri=tracking)
    runs = client.search_runs([client.get_experiment_by_name("paratune-tune").experiment_id])
    assert [run.info.status for run in runs] == ["FAILED"]
    postgres_cluster.start()  # what was told before is still there
    assert _states(storage).get("COMPLETE", 0) >= 6
