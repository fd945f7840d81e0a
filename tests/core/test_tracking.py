from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import paratune
from paratune.tracking import (
    EXPERIMENTS,
    artifact_root,
    default_tracking_uri,
    end_status,
    source_tags,
    start_run,
    start_script_run,
    ui_command,
)

REPO = Path(__file__).resolve().parents[2]


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


def test_a_run_leaves_the_tracking_uri_as_it_found_it(tmp_path, monkeypatch):
    """Each way the URI can be set before a run (nothing, the environment, an explicit
    ``mlflow.set_tracking_uri``) is what ``mlflow.get_tracking_uri()`` and the environment
    say after it: the run's store does not become the next run's default."""
    import mlflow

    store = f"sqlite:///{tmp_path / 'a.db'}"
    before = f"sqlite:///{tmp_path / 'b.db'}"
    explicit = f"sqlite:///{tmp_path / 'c.db'}"
    monkeypatch.chdir(tmp_path)
    try:
        for env, preset in ((None, None), (before, None), (before, explicit), (None, explicit)):
            mlflow.set_tracking_uri(preset)
            if env is None:
                monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
            else:
                monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
            was = mlflow.get_tracking_uri()
            with start_run("paratune-test", tracking_uri=store) as run:
                assert mlflow.get_tracking_uri() == store
            assert mlflow.get_tracking_uri() == was, (env, preset)
            assert os.environ.get("MLFLOW_TRACKING_URI") == env, (env, preset)
            assert mlflow.MlflowClient(store).get_run(run.run_id).info.status == "FINISHED"
        # also when the run fails
        mlflow.set_tracking_uri(None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", before)
        with pytest.raises(RuntimeError), start_run("paratune-test", tracking_uri=store):
            raise RuntimeError("boom")
        assert mlflow.get_tracking_uri() == before
        assert os.environ["MLFLOW_TRACKING_URI"] == before
    finally:
        mlflow.set_tracking_uri(None)
    assert not (tmp_path / "b.db").exists() and not (tmp_path / "c.db").exists()


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


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), SystemExit(143), SystemExit(130)])
def test_run_marked_killed_on_interrupt_or_signal_exit(store, stop):
    import mlflow

    with pytest.raises(type(stop)), start_run("paratune-test") as run:
        raise stop
    got = mlflow.get_run(run.run_id)
    assert got.info.status == "KILLED"
    assert got.info.end_time is not None


def test_end_status_of_each_way_a_run_can_end():
    assert end_status(None) == "FINISHED"
    assert end_status(SystemExit(0)) == end_status(SystemExit()) == "FINISHED"
    assert end_status(KeyboardInterrupt()) == "KILLED"
    assert end_status(SystemExit(128 + signal.SIGTERM)) == "KILLED"
    assert end_status(SystemExit(2)) == end_status(SystemExit("bad")) == "FAILED"
    assert end_status(ValueError("x")) == "FAILED"


def test_new_runs_are_tagged_with_the_version_and_the_git_commit(store):
    import mlflow

    from paratune import tracking

    tracking._git_commit.cache_clear()  # HEAD may have moved since an earlier test read it
    with start_run("paratune-test", tags={"kind": "unit"}) as run:
        pass
    tags = mlflow.get_run(run.run_id).data.tags
    assert tags["paratune.version"] == paratune.__version__
    assert tags["kind"] == "unit"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    if head.returncode == 0 and Path(paratune.__file__).resolve().parents[1] == REPO:
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()
    # a resumed run keeps the tags it was created with
    with start_run("paratune-test", run_id=run.run_id) as again:
        again.set_tags({"more": 1})
    assert mlflow.get_run(run.run_id).data.tags["paratune.version"] == paratune.__version__


def test_source_tags_without_git_installed(monkeypatch):
    from paratune import tracking

    tracking._git_commit.cache_clear()
    monkeypatch.setenv("PATH", "")
    try:
        assert source_tags() == {"paratune.version": paratune.__version__}
    finally:
        monkeypatch.undo()
        tracking._git_commit.cache_clear()


def test_artifact_locations_are_resolved(tmp_path, monkeypatch):
    import mlflow

    (tmp_path / "a").mkdir()
    (tmp_path / "store").mkdir()
    uri = f"sqlite:///{tmp_path / 'a' / '..' / 'store' / 'mlflow.db'}"
    assert artifact_root(uri) == tmp_path.resolve() / "store" / "mlartifacts"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with start_run("paratune-test") as run:
        run.log_text("x", "a.txt")
    location = mlflow.MlflowClient().get_experiment(run.experiment_id).artifact_location
    assert ".." not in location
    assert (tmp_path / "store" / "mlartifacts" / "paratune-test" / run.run_id / "artifacts" /
            "a.txt").exists()


def test_script_runs_share_one_experiment_named_by_script(store):
    import mlflow

    with start_script_run("/somewhere/experiments/search_regret.py", params={"seed": 1}) as run:
        pass
    got = mlflow.get_run(run.run_id)
    assert got.info.run_name == "search_regret"
    assert mlflow.get_experiment(got.info.experiment_id).name == EXPERIMENTS


def _tracking_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None))
            in ("start_run", "start_script_run")]


def test_every_experiment_script_logs_to_one_experiment_under_its_own_name():
    scripts = sorted(p for p in (REPO / "experiments").glob("*.py") if not p.name.startswith("_"))
    tracked = [p for p in scripts if _tracking_calls(p)]
    assert len(tracked) >= 10
    for script in tracked:
        for call in _tracking_calls(script):
            name = call.func.id if isinstance(call.func, ast.Name) else call.func.attr
            assert name == "start_script_run", f"{script.name} calls {name}"
            assert isinstance(call.args[0], ast.Name) and call.args[0].id == "__file__", (
                f"{script.name}: the run name must be the script's own name")


def _workers_of(out: Path, plan: str = "") -> list[int]:
    """Processes of the campaign in ``out`` (workers, and torchrun agents running them), of
    one plan file's world size when ``plan`` names it."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "paratune.profiler._worker" in cmdline and str(out / plan) in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_sigterm_ends_the_cli_run_killed_and_leaves_no_workers(tmp_path, launcher):
    """``kill`` (SIGTERM) on a running ``paratune profile``: its MLflow run ends KILLED, with an
    end time, and none of its worker processes outlive it (the signal comes while world size
    2 has most of its 16 configs left, longer than the wait for the workers to go)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "c"
    grid = tmp_path / "grid.yaml"
    grid.write_text("micro_batch_sizes: [1, 2]\nrecomputes: [none]\n")
    command = [sys.executable, "-m", "paratune", "profile", "--model", "tiny",
               "--world-sizes", "1,2", "--grid", str(grid), "--out", str(out), "--warmup", "1",
               "--steps", "2", "--device", "cpu", "--no-progress", "--launcher", launcher]
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1")
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=env, cwd=tmp_path)
    run_id = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and parent.poll() is None:
            meta = out / "campaign.json"
            if meta.exists():
                run_id = json.loads(meta.read_text()).get("mlflow_run_id")
            if run_id and _workers_of(out, "plan-ws2.json"):
                break
            time.sleep(0.1)
        assert parent.poll() is None and run_id, parent.stderr.read().decode()
        parent.send_signal(signal.SIGTERM)
        code = parent.wait(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert code == 128 + signal.SIGTERM, parent.stderr.read().decode()
    deadline = time.monotonic() + 20
    while _workers_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _workers_of(out)
    for pid in left:  # do not leave them running when the check fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == []
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.info.end_time is not None
    assert run.data.params["model"] == "tiny"


def test_search_regret_logs_the_space_it_searches(monkeypatch, tmp_path):
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    search_regret = importlib.import_module("search_regret")
    args = search_regret.build_parser().parse_args([])
    params = search_regret.tracking_params(args, tmp_path)
    assert params["global_batch_sizes"] == [256, 512, 1024, 2048]
    assert params["space"]["global_batch_sizes"] == [256, 512, 1024, 2048]
    assert params["model"] == "llama3-70b" and params["hardware"] == "H100-80GB"
    assert params["world_sizes"] == [512, 1024] and params["samplers"] == ["tpe", "random"]
    assert params["data"] == [str(tmp_path / "ultrascale_playbook_h100.csv"),
                              str(tmp_path / "ultrascale_playbook_h100_failed.csv")]


_OPEN_AT_ONCE = """
import sys, time
from pathlib import Path
from paratune.tracking import start_run
import mlflow, sqlalchemy  # imported before the start, as a running command has them
uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.002)
with start_run("paratune-tune", tracking_uri=uri) as run:
    run.log_metrics({"x": 1.0})
"""


@pytest.mark.slow
def test_processes_opening_their_first_run_at_once_share_a_new_sqlite_store(tmp_path):
    """Several processes (``paratune tune`` workers sharing one study, each tracked to
    ./mlflow.db) start a run in a store that does not exist yet at the same instant: one of
    them creates the schema, the others wait for it, and every run is in the store."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    ready = [tmp_path / f"ready{i}" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_AT_ONCE, uri, str(r), str(go)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=tmp_path) for r in ready]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs]
            time.sleep(0.01)
        go.touch()  # all imported: they open their runs together
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(errors)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("paratune-tune").experiment_id])
    assert len(runs) == len(procs)
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all(r.data.metrics == {"x": 1.0} for r in runs)


def test_opening_a_sqlite_store_waits_for_its_lock_and_always_lets_go(store, tmp_path,
                                                                      monkeypatch):
    """A process that cannot get the store's lock in time says which store; a run that
    fails to open still lets go of the lock."""
    import mlflow

    from paratune import tracking
    from paratune.errors import ConfigError
    from paratune.fileio import exclusive_lock

    lock = tmp_path / "mlflow.db.lock"
    monkeypatch.setattr(tracking, "_STORE_LOCK_WAIT_S", 0.2)
    with (exclusive_lock(lock, field="f", value="v", what="holding it"),
          pytest.raises(ConfigError, match="tracking_uri=") as info,
          start_run("paratune-test")):
        pass
    assert store in str(info.value) and "waited 0.2 s" in str(info.value)
    with pytest.raises(mlflow.exceptions.MlflowException), start_run("paratune-test",
                                                                     run_id="0" * 32):
        pass
    with exclusive_lock(lock, field="f", value="v", what="holding it"):  # free: no wait
        pass
    with start_run("paratune-test") as run:
        pass
    assert mlflow.get_run(run.run_id).info.status == "FINISHED"
