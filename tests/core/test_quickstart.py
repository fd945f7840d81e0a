from __future__ import annotations

import json
import logging

import pytest

from paratune._quickstart import QuickstartOptions, quickstart
from paratune.errors import ConfigError


@pytest.mark.slow
def test_quickstart_runs_the_whole_loop_and_resumes(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = tmp_path / "qs"
    lines: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    verify_log = logging.getLogger("paratune.tuner._verify")
    handler, level = Recorder(), verify_log.level
    verify_log.addHandler(handler)
    verify_log.setLevel(logging.INFO)
    try:
        result = quickstart(out, QuickstartOptions(world_sizes=(1, 2), gpus=2, warmup_steps=1,
                                                   measured_steps=2, verify=1),
                            progress=False, log=lines.append)
    finally:
        verify_log.removeHandler(handler)
        verify_log.setLevel(level)
    # read top to bottom: the tuning table, then the verification stage and what it logs
    step3 = next(i for i, line in enumerate(lines) if line.startswith("[3/4]"))
    step4 = next(i for i, line in enumerate(lines) if line.startswith("[4/4]"))
    verified = next(i for i, line in enumerate(lines)
                    if line.startswith("measured 1 config: 1 ran; refitted model saved"))
    assert step3 + 1 < step4 < verified and "vs_best" in lines[step3 + 1]
    measured = result.campaign.dataset.frame
    assert (measured["status"] == "ok").all() and len(measured) >= 10
    assert (result.model_dir / "model.json").exists()
    rec = json.loads(result.tuning.outputs["json"].read_text())
    assert rec["config"]["dp"] * rec["config"]["tp"] * rec["config"]["pp"] == 2
    assert result.tuning.outputs["torchrun"].read_text().strip()
    verified = result.verification
    assert verified is not None and verified["status"].tolist() == ["ok"]
    assert verified["measured_tokens_per_s"].iloc[0] > 0
    experiments = {e.name for e in mlflow.search_experiments()}
    assert {"paratune-profile", "paratune-fit"} <= experiments
    # the verification is the tune run's own, and its params say so (as tune --verify 1)
    tune_run = mlflow.MlflowClient().get_run(result.tuning.run_id)
    assert tune_run.info.status == "FINISHED" and tune_run.data.params["verify"] == "1"
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result.tuning.run_id)}
    assert "verification.csv" in artifacts
    # the goodput stage: profiled at more batches, B_noise measured, goodput over the three
    # batch sizes, and a phase plan along the measured trajectory
    assert set(result.timings_s) == {"profile", "fit", "tune", "verify", "goodput_measure",
                                     "goodput"}
    assert any(line.startswith("[goodput 3/3]") for line in lines)
    searched = set(result.goodput.ranked["global_batch_size"])
    assert searched == {8, 16, 32} and result.goodput.best.global_batch_size in searched
    goodput_rec = json.loads(result.goodput.outputs["json"].read_text())
    assert goodput_rec["objective"]["kind"] == "goodput"
    assert goodput_rec["objective"]["b_noise"] > 0
    assert result.plan.phases and result.plan.total_time_s <= (
        result.plan.baselines["fixed"]["time_s"] * (1 + 1e-12))
    assert (result.out / "gns.csv").exists()

    # A second run resumes: nothing is measured again.
    again = quickstart(out, QuickstartOptions(world_sizes=(1, 2), gpus=2, warmup_steps=1,
                                              measured_steps=2, verify=0, goodput=False),
                       track=False, progress=False, log=lines.append)
    assert again.campaign.num_measured == 0
    assert again.campaign.footer().startswith(
        f"nothing new to measure: {len(measured)} configs already measured")
    assert any("\nnothing new to measure: " in line for line in lines)  # the summary's footer
    assert not any("nan s per config" in line for line in lines)
    assert len(again.campaign.dataset.frame) == len(measured)


def test_quickstart_rejects_unverifiable_job(tmp_path):
    with pytest.raises(ConfigError, match="gpus=8"):
        quickstart(tmp_path, QuickstartOptions(world_sizes=(1, 2), gpus=8, verify=1),
                   track=False)


def test_a_gpus_the_goodput_stage_cannot_split_is_refused_before_any_minute(tmp_path):
    """Its noise-scale run splits a batch of 8 over the gpus ranks: --gpus 3 ran every stage
    before failing there, naming a batch the user never gave."""
    with pytest.raises(ConfigError, match=r"^gpus=3: must divide the goodput stage's global "
                                          r"batches \[8, 16, 32\] \(or give --no-goodput\)$"):
        QuickstartOptions(world_sizes=(1, 2, 3), gpus=3)
    assert QuickstartOptions(world_sizes=(1, 2, 3), gpus=3, goodput=False).gpus == 3
    assert not list(tmp_path.iterdir())
