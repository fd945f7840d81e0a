"""``paratune tune`` against real servers started by the tests: a PostgreSQL study storage and
an MLflow tracking server on loopback (see ``tests/servers.py``; skipped with the reason
where PostgreSQL is not installed)."""

from __future__ import annotations

import json

from paratune.cli import main

SECRET = "S3cr3tPlanted"


def _tune(saved_model, *flags):
    return ["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100", "--predictor",
            str(saved_model), "--output", "out", "--trials", "12", "--batch-size", "4",
            "--no-progress", *flags]


def _everything_logged(uri: str) -> list[str]:
    """Every param, tag and metric key and value of every run in the store at ``uri``."""
    import mlflow

    from paratune._dburl import with_installed_driver

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

    from paratune._dburl import with_installed_driver

    url = with_installed_driver("postgresql://u@h/db")
    if find_spec("psycopg") is not None:
        assert url == "postgresql://u@h/db"
    elif find_spec("psycopg2") is not None:
        assert url == "postgresql+psycopg2://u@h/db"
    assert with_installed_driver("postgresql+pg8000://u@h/db") == "postgresql+pg8000://u@h/db"
    assert with_installed_driver("sqlite:///x.db") == "sqlite:///x.db"
