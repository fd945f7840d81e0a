"""Optuna storage: several processes share one study; a killed study resumes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from paratune import ConfigError, get_model
from paratune.tuner import Objective, SearchOptions, SearchSpace, optuna_search
from paratune.tuner._search import open_study

HERE = Path(__file__).resolve().parent

WORKER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    from conftest import ClosedFormPredictor
    from paratune import get_model
    from paratune.tuner import Objective, SearchOptions, SearchSpace, optuna_search

    class Slow(ClosedFormPredictor):
        waited = False

        def predict(self, frame):
            if {together} and not Slow.waited:  # each worker holds a trial before either tells
                import os, pathlib
                Slow.waited = True
                folder = pathlib.Path({storage!r}).parent
                (folder / f"inflight-{{os.getpid()}}").touch()
                until = time.monotonic() + 60
                while len(list(folder.glob("inflight-*"))) < 2 and time.monotonic() < until:
                    time.sleep(0.01)
            time.sleep({delay})
            return super().predict(frame)

    space = SearchSpace.build(get_model("llama3-8b"), 64, "H100", global_batch_sizes="128:512")
    if {together}:  # start the search when the test says every worker has imported
        print("READY", flush=True)
        sys.stdin.readline()
    result, study = optuna_search(Slow(), space, Objective(kind="goodput", b_noise=300),
                                  SearchOptions(n_trials={n_trials}, seed={seed},
                                                storage={storage!r}, study_name="shared",
                                                batch_size=1))
    print("TRIALS", result.num_trials)
""")


def _space():
    return SearchSpace.build(get_model("llama3-8b"), 64, "H100", global_batch_sizes="128:512")


def _worker(storage: str, *, n_trials: int, seed: int, delay: float,
            together: bool = False) -> subprocess.Popen:
    """A process searching the study ``shared`` in ``storage``; with ``together`` it prints
    ``READY`` once imported and starts its search on a line from stdin."""
    code = WORKER.format(here=str(HERE), delay=delay, n_trials=n_trials, seed=seed,
                         storage=storage, together=together)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.PIPE if together else subprocess.DEVNULL)


def _finished(storage: str) -> list:
    study = open_study(_space(), Objective(kind="goodput", b_noise=300), storage=storage,
                       study_name="shared")
    return study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))


@pytest.mark.slow
def test_two_processes_share_one_study(tmp_path):
    storage = str(tmp_path / "study.journal")
    workers = [_worker(storage, n_trials=30, seed=seed, delay=0.03, together=True)
               for seed in (0, 1)]
    # One worker runs all 30 trials in about a second: one that imports slower under load
    # used to find the study full and tell none. Both start once both have imported, and
    # each holds its first trial until the other holds one too.
    for w in workers:
        assert w.stdout.readline() == "READY\n", w.communicate(timeout=60)[1]
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    outs = [w.communicate(timeout=120) for w in workers]
    for w, (out, err) in zip(workers, outs):
        assert w.returncode == 0, err
        assert "TRIALS" in out
    trials = _finished(storage)
    # Together they fill the study to its target exactly (--trials is the study's total).
    assert len(trials) == 30
    pids = {w.pid for w in workers}
    told = [int(t.user_attrs["worker"].rsplit(":", 1)[1]) for t in trials
            if "worker" in t.user_attrs]
    assert set(told) == pids  # both processes told trials into the one study


OPENER = textwrap.dedent("""
    import os, sys, time
    from paratune import get_model
    from paratune.tuner import Objective, SearchSpace
    from paratune.tuner._search import open_study

    space = SearchSpace.build(get_model("llama3-8b"), 64, "H100", global_batch_sizes="128:512")
    time.sleep(max(0.0, {start} - time.time()))
    studies = [open_study(space, Objective(kind="goodput", b_noise=300), storage={storage!r},
                          study_name=f"fresh-{{i}}") for i in range({studies})]
    for study in studies:  # then one trial in each study this process opened
        trial = study.ask()
        trial.set_user_attr("worker", os.getpid())
        study.tell(trial, 0.0)
""")


def test_a_study_whose_problem_is_still_being_recorded_is_joined(tmp_path):
    """A worker that joins a new study before its creator has recorded the problem finds
    it unrecorded (or, from an earlier version's two writes, half recorded) and records it
    itself, instead of refusing the study as another problem."""
    import optuna

    from paratune.tuner._search import resolve_storage

    storage = str(tmp_path / "study.journal")
    study = optuna.create_study(storage=resolve_storage(storage, None)[0], study_name="shared",
                                direction="maximize")
    study.set_user_attr("space", _space().to_dict())  # the objective not yet written
    joined = open_study(_space(), Objective(kind="goodput", b_noise=300), storage=storage,
                        study_name="shared")
    assert joined.user_attrs["problem"]["objective"]["b_noise"] == 300


def test_a_study_of_values_before_the_probability_of_running_is_not_resumed(tmp_path):
    """Trials told before the objective counted the probability of running hold values of
    another quantity: a study recorded so is refused by name, and the same command's
    default study name is another one."""
    import optuna

    from paratune.tuner._search import resolve_storage
    from paratune.tuner._study import default_study_name

    objective = Objective(kind="goodput", b_noise=300)
    before = {k: v for k, v in objective.to_dict().items() if k != "weighted_by"}
    storage = str(tmp_path / "study.journal")
    study = optuna.create_study(storage=resolve_storage(storage, None)[0], study_name="old",
                                direction="maximize")
    study.set_user_attr("problem", {"space": _space().to_dict(), "objective": before})
    with pytest.raises(ConfigError, match=r"another problem .*weighted_by"):
        open_study(_space(), objective, storage=storage, study_name="old")

    class Before(Objective):
        def to_dict(self):
            return before

    assert (default_study_name(_space(), objective, "tpe", 0)
            != default_study_name(_space(), Before(kind="goodput", b_noise=300), "tpe", 0))


@pytest.mark.slow
def test_processes_opening_one_new_study_at_once_all_join_it(tmp_path):
    """A worker that joined a study while its creator was still recording the problem used
    to read half of it and refuse the study as "another problem" (the two workers of the
    test above failed so, now and then)."""
    storage = str(tmp_path / "study.journal")
    start = time.time() + 8  # after every process has imported
    env = dict(os.environ, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen(
        [sys.executable, "-c", OPENER.format(start=start, studies=150, storage=storage)],
        stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    for w in workers:
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    # one study of each name, holding a trial of every process and the whole problem, as
    # one process alone records it
    from paratune.tuner._search import resolve_storage

    problem = open_study(_space(), Objective(kind="goodput", b_noise=300),
                         storage=str(tmp_path / "alone.journal"), study_name="alone").user_attrs
    assert problem
    store = resolve_storage(storage, None)[0]
    studies = store.get_all_studies()
    assert sorted(s.study_name for s in studies) == sorted(f"fresh-{i}" for i in range(150))
    pids = sorted(w.pid for w in workers)
    for study in studies:
        assert study.user_attrs == problem, study.study_name
        trials = store.get_all_trials(study._study_id, deepcopy=False)
        assert sorted(t.user_attrs["worker"] for t in trials) == pids, study.study_name


@pytest.mark.slow
def test_killed_study_resumes_without_losing_trials(tmp_path, closed_form):
    storage = str(tmp_path / "study.journal")
    worker = _worker(storage, n_trials=500, seed=0, delay=0.05)
    deadline = time.time() + 60
    done = []
    while time.time() < deadline:
        time.sleep(0.5)
        if Path(storage).exists():
            done = _finished(storage)
            if len(done) >= 8:
                break
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)
    assert len(done) >= 8, worker.stderr.read()
    before = {t.number: t.params for t in _finished(storage)}
    result, study = optuna_search(closed_form, _space(), Objective(kind="goodput", b_noise=300),
                                  SearchOptions(n_trials=len(before) + 10, seed=0, storage=storage,
                                                study_name="shared"))
    after = {t.number: t.params for t in study.get_trials(
        states=(TrialState.COMPLETE, TrialState.PRUNED))}
    assert result.num_trials == len(before) + 10
    assert all(after[n] == p for n, p in before.items())  # nothing measured was lost


@pytest.mark.slow
def test_a_lock_left_by_a_killed_writer_of_a_relative_journal_path_is_released(tmp_path,
                                                                               monkeypatch):
    """A journal given as a relative path (the default output folder is one): the lock is
    a symbolic link to the journal, and one left by a killed process must still be found
    stale (Optuna releases it after its 30 s grace period) rather than spun on for ever."""
    import optuna

    from paratune.tuner._search import resolve_storage

    monkeypatch.chdir(tmp_path)
    storage, _ = resolve_storage("runs/study.journal", None)
    optuna.create_study(study_name="s", storage=storage).enqueue_trial({"x": 1.0})
    # a writer killed while holding the lock: the link stays, its holder is gone
    storage._backend._lock.acquire()
    lock = tmp_path / "runs" / "study.journal.lock"
    assert lock.is_symlink() and lock.exists()  # a link that resolves: its age can be read
    code = ("import optuna; from paratune.tuner._search import resolve_storage; "
            "storage, _ = resolve_storage('runs/study.journal', None); "
            "study = optuna.load_study(study_name='s', storage=storage); "
            "study.tell(study.ask(), 1.0); print(len(study.trials))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1"


def test_a_database_password_is_never_printed_or_logged(tmp_path, saved_model, capsys, caplog):
    from paratune.cli import main
    from paratune.tuner._search import _without_password, resolve_storage

    assert _without_password("postgresql://tuner:s3cret@db.example:5432/studies") == \
        "postgresql://tuner:***@db.example:5432/studies"
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    assert resolve_storage(url, None)[1] == url  # nothing to mask
    # a tracked tune against a database it cannot use (no driver, or no such server): the
    # error names the URL with the password masked, and nothing shown or logged holds the
    # password
    with caplog.at_level(logging.DEBUG):
        code = main(["tune", "--model", "llama3-8b", "--gpus", "32", "--hardware", "H100",
                     "--predictor", str(saved_model), "--global-batch", "256", "--trials", "4",
                     "--storage", "postgresql://tuner:s3cret@db.invalid:5432/studies",
                     "--output", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith(
        "paratune tune: error: --storage='postgresql://tuner:***@db.invalid:5432/studies': ")
    logged = [record.getMessage() for record in caplog.records]
    assert "s3cret" not in captured.out + captured.err + caplog.text + "\n".join(logged)
    # nor any file written (the MLflow store of this test, the output directory)
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert not [path for path in written if b"s3cret" in path.read_bytes()]


def test_a_driver_message_that_quotes_the_url_is_masked_too(monkeypatch):
    """A database driver's import error may quote the URL it was given (the password
    with it)."""
    import optuna

    from paratune.errors import ConfigError
    from paratune.tuner._search import resolve_storage

    def no_driver(url, *args, **kwargs):
        raise ImportError(f"cannot connect to {url}: no module named 'psycopg2'")

    monkeypatch.setattr(optuna.storages, "RDBStorage", no_driver)
    with pytest.raises(ConfigError) as info:
        resolve_storage("postgresql://tuner:s3cret@db.invalid:5432/studies", None)
    assert "s3cret" not in str(info.value)
    assert "cannot connect to postgresql://tuner:***@db.invalid" in str(info.value)


def test_a_study_name_of_another_problem_is_refused(tmp_path, closed_form):
    """Reusing a study name for another job used to join its study: a search on 32 devices
    returned the 16-device winner of the earlier search as its best."""
    storage = str(tmp_path / "study.journal")
    model = get_model("llama3-8b")
    sixteen = SearchSpace.build(model, 16, "H100", global_batch_sizes=[64])
    thirty_two = SearchSpace.build(model, 32, "H100", global_batch_sizes=[64])
    optuna_search(closed_form, sixteen, Objective(),
                  SearchOptions(n_trials=10, storage=storage, study_name="job"))
    with pytest.raises(ConfigError, match=r"study_name.*world_size: 16 -> 32"):
        optuna_search(closed_form, thirty_two, Objective(),
                      SearchOptions(n_trials=10, storage=storage, study_name="job"))
    with pytest.raises(ConfigError, match=r"study_name.*min_feasible_prob"):
        optuna_search(closed_form, sixteen, Objective(min_feasible_prob=0.9),
                      SearchOptions(n_trials=10, storage=storage, study_name="job"))
    # the same problem resumes (another seed joins, as a second worker would)
    again, _ = optuna_search(closed_form, sixteen, Objective(),
                             SearchOptions(n_trials=12, seed=1, storage=storage, study_name="job"))
    assert again.num_trials == 12 and again.best.world_size == 16


def test_a_resumed_study_does_not_replay_its_draws(tmp_path, closed_form):
    """A seeded sampler restarted on a study used to draw the same configs again (8 of 8
    repeated for tpe and random), each counted as a trial."""
    storage = str(tmp_path / "study.journal")
    kwargs = dict(seed=0, storage=storage, study_name="resumed", sampler="random",
                  refine_fraction=0.0, batch_size=4)
    objective = Objective(kind="goodput", b_noise=300)
    optuna_search(closed_form, _space(), objective, SearchOptions(n_trials=8, **kwargs))
    _, study = optuna_search(closed_form, _space(), objective, SearchOptions(n_trials=16, **kwargs))
    params = [t.params for t in study.trials]
    assert len(params) == 16
    assert sum(params[i] == params[i - 8] for i in range(8, 16)) <= 1
    # a fresh study with the same seed still reproduces the first session
    _, fresh = optuna_search(closed_form, _space(), objective,
                             SearchOptions(n_trials=8, **{**kwargs, "study_name": "fresh"}))
    assert [t.params for t in fresh.trials] == params[:8]


def test_a_study_valued_by_another_predictor_is_refused(tmp_path, closed_form):
    """A study resumed after a refit used to keep the old model's values (and, with its
    trials already done, run no new ones); a performance model names its training data in
    ``fingerprint_``."""
    storage = str(tmp_path / "study.journal")
    objective = Objective(kind="goodput", b_noise=300)
    refitted = type(closed_form)()
    closed_form.fingerprint_, refitted.fingerprint_ = "a" * 64, "b" * 64
    optuna_search(closed_form, _space(), objective,
                  SearchOptions(n_trials=6, storage=storage, study_name="s"))
    resumed, _ = optuna_search(closed_form, _space(), objective,
                               SearchOptions(n_trials=8, storage=storage, study_name="s"))
    assert resumed.num_trials == 8
    with pytest.raises(ConfigError, match="another predictor"):
        optuna_search(refitted, _space(), objective,
                      SearchOptions(n_trials=10, storage=storage, study_name="s"))


def test_the_printed_storage_of_a_search_hides_the_password(tmp_path):
    from paratune.tuner._search import storage_text

    assert storage_text("postgresql://tuner:s3cret@db.example/studies", None) == \
        "postgresql://tuner:***@db.example/studies"
    assert storage_text(None, tmp_path) == str(tmp_path / "study.journal")
    assert storage_text(None, None) is None


def test_a_refit_with_other_parameters_is_another_predictor():
    # same training data, other trees: its values differ, so its study must too
    from paratune.models import PerformanceModel
    from paratune.tuner._search import predictor_identity

    a, b, same = (PerformanceModel(n_estimators=n) for n in (100, 200, 100))
    for model in (a, b, same):
        model.fingerprint_ = "f" * 64
    assert predictor_identity(a) != predictor_identity(b)
    assert predictor_identity(a) == predictor_identity(same)
    assert predictor_identity(object()) is None


@pytest.mark.parametrize("url", ["nosuchdb://tuner:s3cret@db.example/studies",
                                 "postgresql+nosuchdriver://tuner:s3cret@db.example/studies"])
def test_a_storage_error_masks_the_password(url):
    from paratune.tuner._search import resolve_storage

    with pytest.raises(ConfigError) as info:
        resolve_storage(url, None)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


def test_a_database_read_that_fails_is_not_preceded_by_optunas_fallback_notice(tmp_path,
                                                                               caplog):
    """Optuna's database storage logs its SQL error ("Caught an error from sqlalchemy ...
    Falling back") before it tries another read; when that fails too (the server stopped),
    paratune's one-line error is what the user reads, not ten lines of SQL ahead of it."""
    import sqlite3
    import warnings

    import optuna

    path = tmp_path / "study.db"
    study = open_study(_space(), Objective(kind="goodput", b_noise=300),
                       storage=f"sqlite:///{path}", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeats are meant for Study.optimize
        study.tell(study.ask(), 1.0)
    with sqlite3.connect(path) as db:  # the table the trials are read from goes away
        db.execute("ALTER TABLE trials RENAME TO gone")
    optuna.logging.enable_propagation()
    try:
        with (caplog.at_level(logging.WARNING, logger="optuna"),
              pytest.raises(optuna.exceptions.StorageInternalError) as raised):
            study.get_trials(deepcopy=False)
    finally:
        optuna.logging.disable_propagation()
    assert "no such table: trials" in str(raised.value.__cause__)
    assert not [r for r in caplog.records if "Falling back" in r.getMessage()]
