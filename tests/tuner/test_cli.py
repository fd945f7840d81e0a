"""``paratune tune`` and ``paratune plan`` against a real PerformanceModel fitted on a slice of
the public H100 measurements (skipped where the data is absent)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paratune.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, public_data):
    data = public_data
    from paratune.models import PerformanceModel, load_measurements

    frame = load_measurements([data / "ultrascale_playbook_h100.csv",
                               data / "ultrascale_playbook_h100_failed.csv"])
    frame = frame[frame["world_size"] <= 64]
    path = tmp_path_factory.mktemp("model")
    PerformanceModel(n_estimators=60, n_jobs=1).fit(frame).save(path)
    return path


def test_tune_command_prints_ranking_and_writes_launch_files(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["tune", "--model", "llama3-8b", "--gpus", "64", "--gpu", "H100",
                 "--predictor", str(model_dir), "--objective", "goodput", "--gns", "2000",
                 "--global-batch", "128:512", "--trials", "24", "--top-k", "5",
                 "--output", str(out), "--no-track"])
    text = capsys.readouterr().out
    assert code == 0
    assert "vs_best" in text and "torchrun" in text and "--tensor-model-parallel-size" in text
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["world_size"] == 64 and rec["predicted"]["tokens_per_s"] > 0
    # the model learned the stalled-pipeline regime from the public runs: the ranking shows
    # each config's probability of stalling, and the recommendation records it
    assert "p_stall" in text and 0 <= rec["predicted"]["pred_stall_prob"] <= 1
    assert (out / "torchtitan.toml").exists() and (out / "megatron_args.txt").exists()


def test_plan_command(model_dir, tmp_path, capsys):
    steps = np.arange(0, 2000, 50)
    traj = tmp_path / "gns.csv"
    rows = ["step,tokens,loss,b_simple"] + [
        f"{s},{s * 256 * 8192},{4.0 - s / 1000},{100 * np.exp(s / 600):.3f}" for s in steps]
    traj.write_text("\n".join(rows) + "\n")
    code = main(["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "H100",
                 "--predictor", str(model_dir), "--trajectory", str(traj),
                 "--global-batch", "64:2048", "--output", str(tmp_path), "--no-track"])
    text = capsys.readouterr().out
    assert code == 0 and "Training phases" in text and "follow_critical" in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["total_time_s"] > 0 and plan["phases"]


def test_bad_input_is_a_named_error(model_dir, capsys):
    code = main(["tune", "--model", "llama3-8b", "--gpus", "64", "--gpu", "H100",
                 "--predictor", str(model_dir), "--objective", "goodput", "--no-track"])
    assert code == 2
    assert "gns" in capsys.readouterr().err


def test_tp_across_nodes_does_not_change_the_batch_searched(model_dir, tmp_path, capsys):
    from paratune import get_model
    from paratune.tuner._tune import default_global_batch

    batches = []
    for flags in ([], ["--tp-across-nodes"]):
        out = tmp_path / ("across" if flags else "within")
        code = main(["tune", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100",
                     "--predictor", str(model_dir), "--search", "exhaustive", "--top-k", "50",
                     "--output", str(out), "--no-track", *flags])
        assert code == 0
        rec = json.loads((out / "recommendation.json").read_text())
        batches.append({c["global_batch_size"] for c in rec["top"]})
    capsys.readouterr()
    assert batches[0] == batches[1] == {default_global_batch(get_model("llama3-8b"), 16)}
