"""The one-call GPU check (experiments/gpu_check.py): its planner, its staging of the
packages from the checkout, and its CPU smoke run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from paratune.datasets import read_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import gpu_check  # from experiments/, put on the path above

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_check.py"


def _flat(recompute: str, micro: int, global_batch: int) -> float:
    return 1.0  # one second per step, whatever the config


def test_a_part_that_does_not_fit_loses_its_largest_batches_first():
    part = gpu_check.Part("p", "none", (1, 4, 16), (8, 16, 32, 64))
    assert len(part.configs()) == 11  # micro 16 does not divide 8
    cost = gpu_check.estimate_part_s(part, _flat, device="cuda", steps=4)
    assert cost == gpu_check.LAUNCH_S["cuda"] + 11 * (gpu_check.BUILD_S["cuda"] + 4)
    assert gpu_check.estimate_part_s(part, _flat, device="cuda", steps=4, pace=2.0) == (
        gpu_check.LAUNCH_S["cuda"] + 2 * 11 * (gpu_check.BUILD_S["cuda"] + 4))
    assert gpu_check.fit_part(part, cost, _flat, device="cuda", steps=4).configs() == \
        part.configs()
    # one second short: the largest global batch goes, then the next, down to two
    fitted = gpu_check.fit_part(part, cost - 1, _flat, device="cuda", steps=4)
    assert fitted.global_batch_sizes == (8, 16, 32) and fitted.micro_batch_sizes == (1, 4, 16)
    assert sorted(fitted.dropped) == sorted(
        f"none mb{m} gb64: left out, it would not finish in the {cost - 1:.0f} s left"
        for m in (1, 4, 16))
    per = gpu_check.BUILD_S["cuda"] + 4
    fitted = gpu_check.fit_part(part, gpu_check.LAUNCH_S["cuda"] + 4 * per, _flat,
                                device="cuda", steps=4)
    assert fitted.global_batch_sizes == (8, 16) and fitted.micro_batch_sizes == (1, 4)
    assert len(fitted.dropped) == 11 - 4 and part.dropped == []  # the original is kept
    nothing = gpu_check.fit_part(part, 1.0, _flat, device="cuda", steps=4)
    assert nothing.configs() == [] and len(nothing.dropped) == 11


def test_the_grid_covers_what_the_check_promises():
    parts = gpu_check.default_parts(tiny=False)
    configs = {(p.recompute, m, g) for p in parts for m, g in p.configs()}
    assert {r for r, _, _ in configs} == {"none", "selective", "full"}
    assert {m for _, m, _ in configs} == {1, 2, 4, 8, 16}
    assert len({g for _, _, g in configs}) >= 4
    assert len(configs) == sum(len(p.configs()) for p in parts)  # no config twice


def test_staged_packages_import_from_the_copy_without_the_heavy_ones(tmp_path):
    stage = gpu_check.stage_packages(ROOT, tmp_path / "src")
    code = ("import sys, paratune, paratune.profiler.campaign, paratune.models.features, "
            "paratune.datasets, paratune.predictor\n"
            "print(paratune.__file__, paratune.profiler.campaign.__file__)\n"
            "print(sorted(m for m in ('xgboost', 'optuna', 'mlflow') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(stage)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    files, heavy = proc.stdout.splitlines()
    core, campaign = files.split()
    assert core == str(stage / "paratune" / "__init__.py")
    assert campaign == str(stage / "paratune" / "profiler" / "campaign" / "__init__.py")
    assert heavy == "[]"
    assert (stage / "tests" / "profiler" / "test_trainer.py").exists()


def _run(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny",
                           "--out", str(out), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    return proc, time.monotonic() - started


@pytest.mark.slow
def test_cpu_smoke_run_writes_the_dataset_and_the_comparison(tmp_path):
    out = tmp_path / "out"
    proc, _ = _run(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(len(p.parts) <= 2 for p in files), files
    ds = read_dataset(out / "dataset")
    frame = ds.frame
    planned = sum(len(p.configs()) for p in gpu_check.default_parts(tiny=True))
    assert len(frame) == planned and (frame["status"] == "ok").all()
    assert set(frame["recompute"]) == {"none", "selective", "full"}
    assert frame["global_batch_size"].nunique() >= 4
    assert set(frame["world_size"]) == {1} and frame["step_times_s"].map(len).eq(2).all()
    machine = ds.card.notes["gpu_check"]["machine"]
    assert machine["torch"] and machine["device"] == "cpu"
    assert ds.card.fingerprint["torch_version"] == machine["torch"]
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == planned
    for column in ("step_time_s", "tokens_per_s", "analytical_step_time_s", "step_time_ratio",
                   "memory_estimate_gb", "memory_ratio", "peak_rss_gb"):
        assert summary[column].gt(0).all(), column
    merged = summary.merge(frame, on=["recompute", "micro_batch_size", "global_batch_size"],
                           suffixes=("", "_ds"))
    assert (merged["step_time_s"] - merged["step_time_s_ds"]).abs().max() < 1e-9
    assert "4 skipped" in (out / "gpu_tests.txt").read_text()  # no CUDA here
    log = (out / "log.txt").read_text()
    assert "heavy packages imported: none" in log
    assert "paratune 0.1.0 from /" in log and "/src/paratune" in log  # the staged copy
    assert "| recompute | mb | gb | status |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_a_run_past_its_deadline_keeps_what_it_measured(tmp_path):
    # A budget the whole grid cannot fit in: every planned config is either measured or
    # listed as left out, and the run ends near its budget. The budget leaves the first part
    # less than its planned time, so that it is trimmed when planned whatever the machine's
    # pace (at a fast pace a budget for most of the grid measured all of it).
    from paratune import get_model
    from paratune.profiler.campaign import detect_hardware

    out = tmp_path / "out"
    step_s = gpu_check._step_estimator(get_model("tiny", seq_len=64), detect_hardware("cpu"),
                                       "cpu")
    first = gpu_check.estimate_part_s(gpu_check.default_parts(tiny=True)[0], step_s,
                                      device="cpu", steps=3)
    budget = gpu_check.RESERVE_S["cpu"] + 0.8 * first
    proc, wall = _run(out, "--budget-s", str(budget), "--skip-tests")
    text = proc.stdout + proc.stderr
    summary_md = (out / "summary.md").read_text()
    left_out = [line for line in summary_md.splitlines() if line.startswith("- ")]
    measured = len(read_dataset(out / "dataset").frame) if (out / "dataset").exists() else 0
    planned = sum(len(p.configs()) for p in gpu_check.default_parts(tiny=True))
    assert measured + len(left_out) == planned, text[-3000:]
    assert left_out and (measured == 0 or proc.returncode == 0), text[-3000:]
    assert wall < budget + 60 + 30, text[-3000:]  # one config's timeout, and start-up
    card = json.loads((out / "dataset" / "card.json").read_text()) if measured else None
    if card is not None:
        assert len(card["notes"]["gpu_check"]["left_out"]) == len(left_out)
