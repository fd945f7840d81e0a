"""Counts beyond any real job (a billion GPUs, a batch of 1e26 sequences) are refused with the
field and the limit, at once: divisors are found in O(sqrt n)."""

from __future__ import annotations

import time

import pandas as pd
import pytest

from paratune import ConfigError, ParallelConfig
from paratune.cli import main
from paratune.parallel import MAX_DEVICES, MAX_GLOBAL_BATCH
from paratune.space import divisors


def test_divisors_of_a_large_number_are_found_in_o_sqrt_n():
    start = time.perf_counter()
    assert divisors(10**12) == sorted(d for d in divisors(10**12))
    assert len(divisors(10**12)) == 169
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(1) == [1] and divisors(97) == [1, 97]
    assert time.perf_counter() - start < 5.0  # O(n) took hours


@pytest.mark.parametrize("argv", [
    ["tune", "--model", "llama3-8b", "--gpus", "1000000000", "--hardware", "H100",
     "--predictor", "nosuch", "--no-track"],
    ["plan", "--model", "llama3-8b", "--gpus", "1000000000", "--hardware", "H100",
     "--predictor", "nosuch", "--trajectory", "nosuch.csv", "--no-track"],
    ["profile", "--model", "tiny", "--world-sizes", "1000000000", "--out", "c", "--no-track"],
])
def test_a_billion_devices_is_refused_naming_the_limit(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 30
    assert len(err.strip().splitlines()) == 1, err
    assert f"at most {MAX_DEVICES}" in err and "1000000000" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_global_batch_beyond_the_plausible_range_is_refused():
    with pytest.raises(ConfigError, match=f"at most {MAX_GLOBAL_BATCH}") as info:
        ParallelConfig(global_batch_size=10**26, micro_batch_size=1)
    assert info.value.field == "global_batch_size"
    from paratune.tuner._space import parse_batch_sizes

    with pytest.raises(ConfigError, match="beyond the plausible range"):
        parse_batch_sizes("1,100000000000000000000000000")


def test_a_predict_row_with_a_global_batch_of_1e26_is_refused_not_predicted(
        tmp_path, capsys, request):
    from paratune.predictor import CONFIG_COLUMNS
    from tests.models.conftest import synthetic_measurements

    model_dir = request.getfixturevalue("saved_model")
    frame = synthetic_measurements(n_per_model=2)[list(CONFIG_COLUMNS)].head(2).copy()
    frame["global_batch_size"] = frame["global_batch_size"].astype(object)
    frame.loc[frame.index[1], "global_batch_size"] = "1e26"
    src = tmp_path / "rows.csv"
    frame.to_csv(src, index=False)
    out = tmp_path / "p.csv"
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    result = pd.read_csv(out, keep_default_na=False, dtype=str)
    assert result["pred_error"].iloc[0] == ""
    assert "beyond the plausible range" in result["pred_error"].iloc[1]
    assert result["pred_step_time_s"].iloc[1] == ""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from paratune.models import PerformanceModel
    from tests.models.conftest import synthetic_measurements

    model = PerformanceModel(n_estimators=10, aux_estimators=5, n_jobs=1, random_state=0)
    return model.fit(synthetic_measurements()).save(tmp_path_factory.mktemp("pm") / "model")
