"""Searches sharing a study: a storage that stops recording mid-search, and workers that do
not predict again what another worker finished (real journal and SQLite storages; the
other worker is a real process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paratune import get_model
from paratune.tuner import (
    Objective,
    SearchOptions,
    SearchSpace,
    StudyNotRecorded,
    optuna_search,
    tune,
)
from tests.tuner.conftest import ClosedFormPredictor

HERE = Path(__file__).resolve().parent


def _space(gpus: int = 8, batch: str = "128") -> SearchSpace:
    return SearchSpace.build(get_model("llama3-8b"), gpus, "H100", global_batch_sizes=batch)


class _BreaksTheStore(ClosedFormPredictor):
    """Predicts, and on its ``at``-th call makes the study's storage unusable: the folder of
    the journal (or SQLite file) is moved away and a plain file put in its place, as a
    mount that goes away looks to the search."""

    def __init__(self, folder: Path, *, at: int) -> None:
        super().__init__()
        self.folder, self.at = folder, at
        self.seen: list = []

    def predict(self, frame):
        if len(self.calls) + 1 == self.at:
            shutil.move(self.folder, self.folder.with_name(self.folder.name + "-moved"))
            self.folder.write_text("not a folder\n")
        self.seen += [tuple(row) for row in frame[["dp", "tp", "pp", "micro_batch_size",
                                                  "sharding", "recompute", "schedule",
                                                  "virtual_stages"]].itertuples(index=False)]
        return super().predict(frame)


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_storage_that_stops_recording_mid_search_still_ranks_and_writes(tmp_path, kind,
                                                                          capsys):
    """The search ends with one error naming the storage, what to do and that the study was
    not fully recorded; before it, ``tune`` ranks every config it evaluated and writes the
    recommendation and launch files, and its MLflow run ends FAILED."""
    import mlflow

    store = tmp_path / "store"
    store.mkdir()
    storage = (str(store / "study.journal") if kind == "journal"
               else f"sqlite:///{store / 'study.db'}")
    predictor = _BreaksTheStore(store, at=4)
    shown = []
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(StudyNotRecorded) as caught:
        tune("llama3-8b", 64, "H100", predictor, n_trials=200, batch_size=4, storage=storage,
             output_dir=tmp_path / "out", tracking_uri=tracking, global_batch_sizes=[512],
             on_ranked=lambda result: shown.append(result.table(5)))
    exc = caught.value
    message = str(exc)
    assert "\n" not in message and message.startswith("storage=")
    assert "not fully recorded" in message and "rerun the same command" in message
    assert ("journal file writable" if kind == "journal" else "database file writable") in message
    assert "recommendation.json" in message
    out = exc.result
    # ranked: every config the search predicted (three batches, the fourth predicted too)
    assert len(out.ranked) == len(set(predictor.seen)) > 0
    assert out.search.storage_lost is not None
    assert shown and "not fully recorded" in shown[0]
    written = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert written["config"] == out.best.to_dict()
    assert {"json", "yaml"} < set(out.outputs)  # the launch files too
    assert all(path.is_file() for path in out.outputs.values())
    runs = mlflow.MlflowClient(tracking_uri=tracking).search_runs(
        [mlflow.MlflowClient(tracking_uri=tracking).get_experiment_by_name(
            "paratune-tune").experiment_id])
    assert [run.info.status for run in runs] == ["FAILED"]
    # what was told before is still in the storage that was moved away
    moved = tmp_path / "store-moved"
    assert (moved / ("study.journal" if kind == "journal" else "study.db")).stat().st_size > 0


# ------------------------------------------------------------ two workers on one study
OTHER_WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tests.tuner.conftest import ClosedFormPredictor
    from paratune import get_model
    from paratune.tuner import Objective, SearchOptions, SearchSpace, optuna_search

    from paratune.space import ConfigSpace
    options = ConfigSpace(shardings=("none", "zero1"), recomputes=("none",), schedules=("1f1b",))
    space = SearchSpace.build(get_model("llama3-8b"), 8, "H100", space=options,
                              global_batch_sizes="128")
    # the first worker's batch in flight counts towards n_trials: once the rest is done this
    # worker waits for it, until its timeout
    optuna_search(ClosedFormPredictor(), space, Objective(),
                  SearchOptions(n_trials={n_trials}, seed=7, storage={storage!r},
                                study_name="shared", batch_size=4, refine_fraction=0, timeout_s=30))
""")


def _small_space() -> SearchSpace:
    """48 configs: a sampler drawing 100 of them draws some twice."""
    from paratune.space import ConfigSpace

    options = ConfigSpace(shardings=("none", "zero1"), recomputes=("none",),
                          schedules=("1f1b",))
    return SearchSpace.build(get_model("llama3-8b"), 8, "H100", space=options,
                             global_batch_sizes="128")


class _Recording(ClosedFormPredictor):
    """Records the configs of each call; on its ``at``-th call, while this worker has trials
    in flight, another worker (a process of its own) searches the same study for ``extra``
    trials and finishes them."""

    def __init__(self, storage: str, *, at: int, extra: int) -> None:
        super().__init__()
        self.storage, self.at, self.extra = storage, at, extra
        self.asked: list[list] = []
        self.other: set | None = None

    def predict(self, frame):
        if len(self.calls) + 1 == self.at:
            before = _study_configs(self.storage)
            running = _running(self.storage)
            code = OTHER_WORKER.format(root=str(HERE.parents[1]), storage=self.storage,
                                       n_trials=len(before[1]) + running + self.extra)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300,
                                  check=False)
            assert done.returncode == 0, done.stderr[-2000:]
            after = _study_configs(self.storage)
            self.other = set(after[0]) - set(before[0])
        self.asked.append([_key(row) for _, row in frame.iterrows()])
        if self.other is not None and len(self.asked) == self.at:
            # what the other finished while this worker predicted it too is not a repeat
            self.other -= {key for call in self.asked for key in call}
        return super().predict(frame)


def _key(row) -> tuple:
    return (int(row["dp"]), int(row["tp"]), int(row["pp"]), int(row["micro_batch_size"]),
            str(row["sharding"]), str(row["recompute"]), str(row["schedule"]),
            int(row["virtual_stages"]))


def _config_key(cfg) -> tuple:
    return (cfg.dp, cfg.tp, cfg.pp, cfg.micro_batch_size, str(cfg.sharding),
            str(cfg.recompute), str(cfg.schedule), cfg.virtual_stages)


def _study(storage: str):
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return optuna.load_study(study_name="shared",
                             storage=JournalStorage(JournalFileBackend(storage)))


def _study_configs(storage: str) -> tuple[list[tuple], list]:
    """The distinct configs of the study's complete trials and its finished trials."""
    from optuna.trial import TrialState

    from paratune.parallel import ParallelConfig

    trials = _study(storage).get_trials(deepcopy=False)
    configs = []
    for trial in trials:
        if trial.state is TrialState.COMPLETE:
            configs.append(_config_key(ParallelConfig.from_dict(trial.user_attrs["config"])))
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    return list(dict.fromkeys(configs)), finished


def _running(storage: str) -> int:
    from optuna.trial import TrialState

    return len(_study(storage).get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


@pytest.mark.slow
def test_a_worker_does_not_predict_again_what_another_worker_finished(tmp_path):
    """Two workers on one journal study of 48 configs, interleaved deterministically: while
    this worker has a batch in flight, another process finishes 40 trials of the same study.
    From then on this worker's sampler draws configs the other finished; it scores them from
    what the other told, never asking its predictor again; each config it ranks is
    predicted once (the other's in one call at the end, to rank them)."""
    storage = str(tmp_path / "study.journal")
    predictor = _Recording(storage, at=3, extra=40)
    result, study = optuna_search(predictor, _small_space(), Objective(),
                                  SearchOptions(n_trials=100, seed=0, storage=storage,
                                                study_name="shared", batch_size=4))
    assert predictor.other, "the other worker finished no config of its own"
    during, ranking = predictor.asked[:-1], predictor.asked[-1]
    searched = [key for call in during for key in call]
    # the sampler did draw the other's configs again (else this test shows nothing) ...
    configs = _study_configs(storage)[0]
    mine = {(t.user_attrs["worker"], _key_of(t)) for t in study.get_trials(deepcopy=False)
            if t.state.name == "COMPLETE"}
    drawn_again = {key for worker, key in mine if worker.endswith(f":{os.getpid()}")
                   and key in predictor.other}
    assert drawn_again, "no trial of this worker drew a config the other had finished"
    # ... but its predictor was never asked for one during the search
    assert not set(searched) & predictor.other, sorted(set(searched) & predictor.other)
    # every config is predicted once: searched ones are not predicted again to rank them
    every = searched + ranking
    assert len(every) == len(set(every))
    assert set(every) == set(configs) and len(result.ranked) == len(configs)


def _key_of(trial) -> tuple:
    from paratune.parallel import ParallelConfig

    return _config_key(ParallelConfig.from_dict(trial.user_attrs["config"]))


def test_a_signal_that_another_thread_receives_waits_for_the_held_block():
    """The kernel gives a process's SIGTERM to any thread that does not block it (the
    heartbeat's, a database driver's): it still waits until the trial being asked is
    recorded as in flight, and then reaches the handler that was installed."""
    import signal
    import threading

    from paratune.tuner._workers import _interrupts_held

    events: list[str] = []

    class Stopped(Exception):
        pass

    def handler(signum: int, _frame: object) -> None:
        events.append(f"handled {signal.Signals(signum).name}")
        raise Stopped

    def signal_from_another_thread() -> None:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    installed = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Stopped), _interrupts_held():
            other = threading.Thread(target=signal_from_another_thread)
            other.start()
            other.join()
            for _ in range(10_000):  # bytecodes at which Python runs pending handlers
                pass
            events.append("asked and recorded")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, installed)
    assert events == ["asked and recorded", "handled SIGTERM"]


def test_a_trial_asked_past_a_waiting_one_counts_it_ahead(tmp_path):
    """The study's total under concurrency counts trials a worker enqueued and none has asked
    yet: they run next. A worker whose ask passed such a trial while it waited (the asks
    raced) fails its own trial if it would be the one over the total, and the waiting one,
    asked later, is kept; otherwise both were kept and the study finished one trial too
    many."""
    import optuna
    from optuna.trial import TrialState, create_trial

    from paratune.tuner._workers import _ask, _beyond_budget

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="shared", storage=storage)
    x = optuna.distributions.IntDistribution(0, 9)
    study.add_trial(create_trial(params={"x": 0}, distributions={"x": x}, value=1.0))
    study.enqueue_trial({"x": 1})  # another worker's probe, waiting to be asked
    # a third worker's trial, created while the probe waited
    study.add_trial(create_trial(state=TrialState.RUNNING, params={"x": 2},
                                 distributions={"x": x}))
    finished, waiting, passed = study.get_trials(deepcopy=False)
    assert [t.state for t in (finished, waiting, passed)] == [
        TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING]
    # a study of two: the waiting probe is the second, the trial asked past it the third
    assert _beyond_budget(study, [waiting, passed], 2) == [False, True]
    assert _beyond_budget(study, [passed], 3) == [False]
    # the probe's own ask keeps it
    inflight: dict = {}
    (asked,) = _ask(study, 1, "w", inflight, 2)
    assert asked.number == waiting.number and set(inflight) == {waiting.number}
