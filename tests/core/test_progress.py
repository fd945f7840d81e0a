from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np
import pandas as pd
import pytest
from tqdm.std import tqdm

from paratune.progress import LineProgress, ProgressOutput, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plain_lines(text: str) -> list[str]:
    assert "\r" not in text and "\x1b" not in text
    assert text.endswith("\n")
    return text.splitlines()


def test_a_log_gets_a_line_at_the_start_every_interval_and_at_the_end():
    out, clock = io.StringIO(), _Clock()
    bar = progress_bar(total=40, desc="profiling", unit="config", enabled=True,
                       output=ProgressOutput(stream=out, clock=clock))
    assert isinstance(bar, LineProgress)
    bar.set_description("profiling ws=8")  # nothing done yet: no line of its own
    clock.now += 10
    bar.update()
    clock.now += 21  # 31 s since the first line
    bar.update()
    clock.now += 9
    bar.update(10)
    bar.set_postfix(OrderedDict(ok=11, failed=1), refresh=False)
    bar.refresh()  # 9 s since the last line
    clock.now += 85
    with bar:
        pass
    bar.close()  # a second close writes nothing
    assert _plain_lines(out.getvalue()) == [
        "profiling: 0/40 [0%, 0s elapsed]",
        "profiling ws=8: 2/40 [5%, 31s elapsed, ~9m49s left, 15.5 s/config]",
        "profiling ws=8: 12/40 [30%, 2m05s elapsed, ~4m52s left, 10.4 s/config] ok=11, failed=1",
    ]
    assert (bar.n, bar.total) == (12, 40)


def test_a_zero_interval_writes_every_update_and_no_repeated_last_line():
    out, clock = io.StringIO(), _Clock()
    with progress_bar(total=4, initial=1, desc="tuning", unit="trial", enabled=True,
                      output=ProgressOutput(stream=out, interval_s=0.0, clock=clock)) as bar:
        clock.now += 0.5
        bar.set_postfix_str("resumed", refresh=False)
        bar.update(1)
        bar.set_description("tuning again")  # nothing done since the last line
        clock.now += 3725
        bar.update(2)
    assert _plain_lines(out.getvalue()) == [
        "tuning: 1/4 [25%, 0s elapsed]",
        "tuning: 2/4 [50%, 0s elapsed, ~1s left, 2 trial/s] resumed",
        "tuning again: 4/4 [100%, 1h02m06s elapsed, 1242 s/trial] resumed",
    ]


def test_a_new_description_after_some_work_is_a_line_at_once():
    out, clock = io.StringIO(), _Clock()
    bar = progress_bar(total=10, desc="profiling ws=1", unit="config", enabled=True,
                       output=ProgressOutput(stream=out, clock=clock))
    clock.now += 4
    bar.update(4)
    bar.set_description("profiling ws=2")
    bar.set_description("profiling ws=2")  # unchanged: no line
    assert _plain_lines(out.getvalue())[1:] == [
        "profiling ws=2: 4/10 [40%, 4s elapsed, ~6s left, 1 config/s]"]


def test_a_terminal_gets_the_live_bar():
    for enabled in (True, None):
        term = _Terminal()
        bar = progress_bar(total=3, desc="profiling", unit="config", enabled=enabled,
                           output=ProgressOutput(stream=term))
        assert isinstance(bar, tqdm)
        bar.set_postfix(OrderedDict(ok=1, failed=0), refresh=False)
        bar.update()
        bar.close()
        assert "\r" in term.getvalue() and "profiling: " in term.getvalue()
        assert "1/3 [" in term.getvalue()


def test_disabled_or_by_default_off_a_terminal_nothing_is_written():
    for enabled, stream in ((False, _Terminal()), (False, io.StringIO()),
                            (None, io.StringIO())):
        with progress_bar(total=3, desc="x", unit="fit", enabled=enabled,
                          output=ProgressOutput(stream=stream, interval_s=0)) as bar:
            bar.set_postfix_str("a")
            bar.update(3)
        assert stream.getvalue() == ""
        assert bar.n == 3


def test_the_interval_must_be_a_number_at_least_zero():
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=r"interval_s=.*must be a number >= 0"):
            progress_bar(total=1, desc="x", unit="fit",
                         output=ProgressOutput(stream=io.StringIO(), interval_s=bad))


class _Throughput:
    """A small predictor: throughput falls with the pipeline depth, every config fits."""

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        gbs, seq = frame["global_batch_size"].to_numpy(float), frame["seq_len"].to_numpy(float)
        step = gbs * seq / 1e5 * (1 + 0.1 * frame["pp"].to_numpy(float))
        return pd.DataFrame({"pred_step_time_s": step,
                             "pred_tokens_per_sec_per_gpu": gbs * seq / step
                             / frame["world_size"].to_numpy(float),
                             "pred_feasible_prob": np.ones(len(frame)),
                             "pred_peak_mem_gb": np.full(len(frame), 10.0)})


def test_the_tuner_progress_in_a_log_is_plain_lines(capfd, tmp_path, monkeypatch):
    from paratune import get_model
    from paratune.tuner import Objective, SearchOptions, SearchSpace, optuna_search

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    space = SearchSpace.build(get_model("llama3-8b"), 16, "H100", global_batch_sizes=[64])
    optuna_search(_Throughput(), space, Objective(), SearchOptions(n_trials=12, seed=0),
                  progress=True)
    lines = _plain_lines(capfd.readouterr().err)
    assert lines[0].startswith("tuning: 0/12 [0%, ")
    assert lines[-1].startswith("tuning: 12/12 [100%, ") and "best feasible" in lines[-1]
    # a resumed study says so from its first line (the search's own postfix follows)
    storage = str(tmp_path / "study.journal")
    for n_trials in (6, 12):
        optuna_search(_Throughput(), space, Objective(),
                      SearchOptions(n_trials=n_trials, seed=0, storage=storage, study_name="s"),
                      progress=True)
    lines = _plain_lines(capfd.readouterr().err)
    assert lines[-2].startswith("tuning: 6/12 [50%, ") and "resumed s at 6 trials" in lines[-2]
