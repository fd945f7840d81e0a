"""Loading measurements for fitting: nothing left out without a word, and dataset files
checked like datasets."""

from __future__ import annotations

import logging

import pandas as pd
import pytest

from paratune.datasets import write_dataset
from paratune.errors import DatasetError
from paratune.measurement import Measurement
from paratune.models import load_measurements
from paratune.parallel import ParallelConfig
from paratune.spec import get_model

HEADER = ("source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
          "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,tokens_per_sec,"
          "step_time_s,tokens_per_sec_per_gpu,precision,notes,nodes,grad_accum,gpu_mem_gb,status")
GOOD = ("ultrascale_playbook_nanotron,1B,1,16,2048,32,4096,H100-80GB,8,1,1,8,1,2,256,0,,,0.392,"
        "321200,,40150,bf16,nodes=1;grad_accum=16;gpu_mem_gb=50.2,1,16,50.2,ok")


def test_rows_a_public_csv_cannot_map_are_reported_when_loading(tmp_path, caplog):
    bad = GOOD.replace(",8,1,1,8,1,2,", ",8,2,1,8,1,2,")  # dp*tp*pp = 16 != num_gpus = 8
    path = tmp_path / "public.csv"
    path.write_text("\n".join(["# source: rows", HEADER, GOOD, bad]) + "\n")
    with caplog.at_level(logging.WARNING, logger="paratune.models"):
        frame = load_measurements([path])
    assert len(frame) == 1
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "public.csv: 1 row not used" in warned and "public.csv:4: dp*tp*pp" in warned


def test_a_public_csv_missing_a_config_column_is_told_which(tmp_path):
    names = HEADER.split(",")
    keep = [i for i, name in enumerate(names) if name != "num_gpus"]
    path = tmp_path / "public.csv"
    path.write_text("\n".join(",".join(line.split(",")[i] for i in keep)
                              for line in [HEADER, GOOD]) + "\n")
    with pytest.raises(DatasetError, match=r"missing public column\(s\) num_gpus \(it needs"):
        load_measurements([path])


def _dataset_file(tmp_path):
    records = [Measurement(model=get_model("tiny"),
                           config=ParallelConfig(dp=dp, global_batch_size=8),
                           hardware="cpu", step_times_s=times)
               for dp, times in ((2, [0.1, 0.12]), (4, [0.3, 0.34]))]
    ds = write_dataset(tmp_path / "ds", records)
    return next(ds.path.glob("*.parquet")), ds.frame


def _assert_same_runs(loaded, frame):
    """The loaded rows are the written runs: same layouts, same measured step times."""
    pd.testing.assert_frame_equal(
        loaded[["dp", "step_time_s"]].sort_values("dp").reset_index(drop=True),
        frame[["dp", "step_time_s"]].sort_values("dp").reset_index(drop=True),
        check_dtype=False)


def test_a_dataset_parquet_file_is_checked_like_a_dataset(tmp_path):
    path, frame = _dataset_file(tmp_path)
    assert frame["dp"].tolist() == [2, 4]
    assert frame["step_time_s"].tolist() == pytest.approx([0.11, 0.32])  # medians
    _assert_same_runs(load_measurements([path]), frame)
    # a damaged copy is refused, not read as whatever rows survive
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DatasetError, match=r"damaged\.parquet"):
        load_measurements([damaged])
    # plain measurement rows written by pandas (no card) still load
    plain = tmp_path / "plain.parquet"
    frame.to_parquet(plain)
    _assert_same_runs(load_measurements([plain]), frame)


def test_a_csv_of_measurement_rows_may_start_with_comment_lines(tmp_path, synthetic):
    """'#' lines above the header are comments, as in a public CSV (not the header)."""
    plain = tmp_path / "rows.csv"
    synthetic.to_csv(plain, index=False)
    noted = tmp_path / "noted.csv"
    noted.write_text("# source: our cluster, week 3\n\n" + plain.read_text())
    a = load_measurements([plain]).drop(columns="data_path")
    b = load_measurements([noted]).drop(columns="data_path")
    pd.testing.assert_frame_equal(a, b)
    assert len(b) == len(synthetic)


def test_a_run_two_inputs_hold_counts_once(tmp_path, caplog):
    """A dataset and the public CSV it was imported from hold the same runs: given both, a
    fit counts each once and says so; a run measured again in one file stays twice."""
    from paratune.datasets.importers import import_files

    again = GOOD.replace(",321200,", ",300000,").replace(",40150,", ",37500,")
    path = tmp_path / "public.csv"
    path.write_text("\n".join(["# source: rows", HEADER, GOOD, again]) + "\n")
    other = tmp_path / "other.csv"
    other.write_text("\n".join([HEADER, GOOD.replace(",321200,", ",310000,")
                                .replace(",40150,", ",38750,")]) + "\n")
    dataset = import_files([path], tmp_path / "ds").out_dir
    with caplog.at_level(logging.WARNING, logger="paratune.models"):
        frame = load_measurements([dataset, path, other])
    assert sorted(frame["step_time_s"].round(3)) == [3.265, 3.383, 3.495]
    assert frame["data_path"].tolist().count(str(path)) == 0
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"public.csv: 2 runs already read from {dataset}" in warned
    assert len(load_measurements([path])) == 2


def test_two_campaigns_of_the_same_configurations_both_count(tmp_path, synthetic):
    """Two campaigns over the same configurations are two sets of runs, their failures
    too (each carries its own campaign and time), whatever columns the files have."""
    again = synthetic.assign(step_time_s=synthetic["step_time_s"] * 1.01,
                             timestamp=synthetic["timestamp"] + 3600.0)
    for name, frame in (("a.csv", synthetic), ("b.csv", again)):
        frame.drop(columns="source").to_csv(tmp_path / name, index=False)
    both = load_measurements([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert len(both) == 2 * len(synthetic)
    assert (synthetic["status"] != "ok").any()
    # the same file's copy under another name is the same runs, failures included
    synthetic.drop(columns="source").to_csv(tmp_path / "copy.csv", index=False)
    assert len(load_measurements([tmp_path / "a.csv", tmp_path / "copy.csv"])) == len(synthetic)
