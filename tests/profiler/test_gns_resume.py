"""Resuming a `paratune gns` run continues that run, and only that run."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest

from paratune.errors import ConfigError


def _job(tmp_path, **changes):
    from paratune import ParallelConfig, get_model
    from paratune.profiler.gns import GNSJob

    settings = dict(model=get_model("tiny", seq_len=32),
                    config=ParallelConfig(micro_batch_size=2, global_batch_size=4), steps=3,
                    out=str(tmp_path / "traj.csv"), checkpoint_dir=str(tmp_path / "ckpt"),
                    checkpoint_every=3, corpus_bytes=1 << 18, device="cpu", lr=1e-3)
    settings.update(changes)
    return GNSJob(**settings)


def _steps(path):
    return list(pd.read_csv(path)["step"])


@pytest.mark.slow
def test_resume_never_continues_another_runs_checkpoint(tmp_path):
    """The review's splice: run A checkpoints, run B starts afresh in the same place and is
    killed before its first checkpoint; resuming B must not continue from A's weights."""
    from paratune.profiler.gns import TRAJECTORY_COLUMNS, run_gns
    from paratune.profiler.reconfigure import find_checkpoint

    out, ckpt = tmp_path / "traj.csv", tmp_path / "ckpt"
    run_gns(_job(tmp_path))  # run A: steps 1-3, checkpoint at 3
    assert find_checkpoint(ckpt) is not None
    frame = pd.read_csv(out)
    assert tuple(frame.columns) == TRAJECTORY_COLUMNS
    assert (frame["seq_len"] == 32).all()
    rows_a = out.read_text()
    state_a = (ckpt / "run_state.json").read_text()

    # A resume with other settings is refused before any process starts, naming the field
    # and both values; neither the rows nor the checkpoint change.
    cases = [(dict(lr=3e-2), "lr", "0.03", "0.001"),
             (dict(beta=0.9), "beta", "0.9", "0.95"),
             (dict(seed=7), "seed", "7", "0"),
             (dict(data_seed=1), "data_seed", "1", "0"),
             (dict(weight_decay=0.0), "weight_decay", "0.0", "0.1"),
             (dict(precondition="adam"), "precondition", "adam", "none"),
             (dict(corpus_bytes=1 << 19), "corpus_bytes", str(1 << 19), str(1 << 18))]
    from paratune import ParallelConfig, get_model

    cases += [(dict(model=get_model("tiny", seq_len=16)), "model.seq_len", "16", "32"),
              (dict(config=ParallelConfig(micro_batch_size=1, global_batch_size=4)),
               "config.micro_batch_size", "1", "2")]
    for changes, field, mine, theirs in cases:
        with pytest.raises(ConfigError) as info:
            run_gns(_job(tmp_path, steps=5, resume=True, **changes))
        assert info.value.field == field, changes
        assert mine in str(info.value) and theirs in str(info.value), str(info.value)
        assert str(ckpt) in str(info.value)
    assert out.read_text() == rows_a
    assert (ckpt / "run_state.json").read_text() == state_a

    # Rows that are not steps 1..3 of the checkpoint's run (here step 3 lost) are refused.
    lines = rows_a.splitlines()
    out.write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(ConfigError, match=r"at step 3 .* 2 rows .*last step 2") as info:
        run_gns(_job(tmp_path, steps=5, resume=True))
    assert info.value.field == "resume"
    out.write_text(rows_a)

    # Run B: a new trajectory (no resume), other lr and seed, "killed" after 2 steps, before
    # any checkpoint of its own. Starting afresh removed A's checkpoint.
    run_gns(_job(tmp_path, steps=2, checkpoint_every=0, lr=3e-2, seed=7))
    assert find_checkpoint(ckpt) is None
    rows_b = out.read_text()
    assert _steps(out) == [1, 2]
    # Resuming B finds its rows but no checkpoint of B: refused, rows kept (before the fix
    # it loaded A's step-3 weights and appended steps 4-5 after B's steps 1-2).
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        run_gns(_job(tmp_path, steps=5, checkpoint_every=3, lr=3e-2, seed=7, resume=True))
    assert out.read_text() == rows_b


@pytest.mark.slow
def test_resume_of_a_trajectory_written_before_seq_len_was_a_column(tmp_path):
    """Rows and a checkpoint left by the previous version (no seq_len column, no
    fingerprint): the resume checks what the checkpoint holds, adds seq_len to the kept rows
    and continues, every row with the same columns."""
    from paratune.profiler.gns import TRAJECTORY_COLUMNS, run_gns

    out, ckpt = tmp_path / "traj.csv", tmp_path / "ckpt"
    run_gns(_job(tmp_path, steps=2, checkpoint_every=2))
    straight = pd.read_csv(out)
    straight.drop(columns="seq_len").to_csv(out, index=False)
    with open(out, "a") as handle:
        handle.write("3,384,5.1")  # torn row past the checkpoint
    state = json.loads((ckpt / "run_state.json").read_text())
    del state["extra"]["job"]
    (ckpt / "run_state.json").write_text(json.dumps(state))

    # The checkpoint's own layout and beta are still checked.
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_gns(_job(tmp_path, steps=4, checkpoint_every=2, resume=True, beta=0.5))
    assert info.value.field == "beta"

    with pytest.warns(UserWarning, match="predates job fingerprints"):
        run_gns(_job(tmp_path, steps=4, checkpoint_every=2, resume=True))
    resumed = pd.read_csv(out)
    assert tuple(resumed.columns) == TRAJECTORY_COLUMNS
    assert list(resumed["step"]) == [1, 2, 3, 4]
    assert (resumed["seq_len"] == 32).all()
    assert list(resumed["loss"][:2]) == pytest.approx(list(straight["loss"]), rel=1e-12)
    assert list(resumed["tokens"]) == [128, 256, 384, 512]


def test_legacy_rows_count_and_are_upgraded_when_truncated(tmp_path):
    from paratune.profiler.gns.trajectory import (
        _LEGACY_TRAJECTORY_COLUMNS,
        TRAJECTORY_COLUMNS,
        _measured_rows,
        _truncate_rows,
    )

    out = tmp_path / "old.csv"
    row = ["1.0"] * (len(_LEGACY_TRAJECTORY_COLUMNS) - 2)
    out.write_text(",".join(_LEGACY_TRAJECTORY_COLUMNS) + "\n" + "\n".join(
        ",".join([str(s), str(s * 128), *row]) for s in (1, 2, 3)) + "\n4,512,1.0")
    # Old rows still count: a resume without a checkpoint is refused over them.
    assert _measured_rows(str(out)) == 3
    _truncate_rows(str(out), 2, seq_len=32)
    frame = pd.read_csv(out)
    assert tuple(frame.columns) == TRAJECTORY_COLUMNS
    assert list(frame["step"]) == [1, 2] and list(frame["seq_len"]) == [32, 32]


@pytest.mark.slow
def test_gns_command_checkpoints_by_default_so_resume_can_continue(tmp_path):
    """`--resume` alone used to find nothing: no checkpoint was saved unless
    --checkpoint-every was given. A run without it saves one (at its last step at the
    latest), and the same command with --resume and more steps continues from it."""
    from paratune.cli import main
    from paratune.profiler.reconfigure import RUN_STATE_FILE, find_checkpoint

    out, ckpt = tmp_path / "t.csv", tmp_path / "t-checkpoint"
    base = ["gns", "--model", "tiny", "--seq-len", "32", "--corpus-mb", "0.25",
            "--config", "mb=2,gb=4", "--device", "cpu", "--no-track", "--no-progress",
            "--out", str(out)]
    assert main([*base, "--steps", "2"]) == 0
    found = find_checkpoint(ckpt)
    assert found is not None
    assert json.loads((found / RUN_STATE_FILE).read_text())["step"] == 2
    first = out.read_text()
    assert _steps(out) == [1, 2]

    assert main([*base, "--steps", "3", "--resume"]) == 0
    assert _steps(out) == [1, 2, 3]
    # Continued, not restarted: steps 1-2 are the first run's rows as written (a fresh run
    # measures them again, with other elapsed times), and step 3 is saved.
    assert out.read_text().startswith(first)
    assert json.loads((find_checkpoint(ckpt) / RUN_STATE_FILE).read_text())["step"] == 3


@pytest.mark.slow
def test_a_run_measuring_every_other_step_resumes(tmp_path, capsys):
    """With --measure-every 2 the rows are steps 1, 3, ...: a resume took them for lost
    rows (it wanted steps 1..4) and refused every such run."""
    from paratune.cli import main

    out = tmp_path / "t.csv"
    base = ["gns", "--model", "tiny", "--seq-len", "32", "--corpus-mb", "0.25",
            "--config", "mb=2,gb=4", "--device", "cpu", "--no-track", "--no-progress",
            "--measure-every", "2", "--checkpoint-every", "2", "--out", str(out)]
    assert main([*base, "--steps", "4"]) == 0
    assert _steps(out) == [1, 3]
    first = out.read_text()
    assert main([*base, "--steps", "6", "--resume"]) == 0
    assert _steps(out) == [1, 3, 5] and out.read_text().startswith(first)
    # another measuring period is another run: its checkpoint does not continue this one
    capsys.readouterr()
    assert main([*base[:-6], "--measure-every", "3", "--checkpoint-every", "2", "--out",
                 str(out), "--steps", "8", "--resume"]) == 2
    assert "--measure-every=3: differs from 2" in capsys.readouterr().err
    assert _steps(out) == [1, 3, 5]


def test_gns_command_saves_no_checkpoint_when_told_or_when_the_layout_cannot(tmp_path,
                                                                           monkeypatch,
                                                                           capsys):
    from paratune.cli import main
    from paratune.profiler import _gns_cli, gns

    jobs = []

    def fake_run(job, *, progress=False):
        jobs.append(job)
        pd.DataFrame([{c: 1 for c in gns.TRAJECTORY_COLUMNS}]).to_csv(job.out, index=False)
        return tmp_path / "t.csv"

    monkeypatch.setattr(gns, "run_gns", fake_run)
    out = tmp_path / "t.csv"
    base = ["gns", "--model", "tiny", "--steps", "3", "--out", str(out), "--no-track"]
    assert main([*base, "--config", "dp=1,gb=4"]) == 0
    assert jobs[-1].checkpoint_every == _gns_cli.DEFAULT_CHECKPOINT_EVERY == 50
    assert jobs[-1].checkpoint_dir == str(tmp_path / "t-checkpoint")
    assert main([*base, "--config", "dp=1,gb=4", "--checkpoint-every", "0", "--force"]) == 0
    assert jobs[-1].checkpoint_every == 0 and jobs[-1].checkpoint_dir is not None
    # A layout that cannot be checkpointed runs without, and says so.
    assert main([*base, "--config", "dp=2,gb=4,sharding=zero1", "--force"]) == 0
    assert jobs[-1].checkpoint_every == 0
    assert "cannot be checkpointed" in capsys.readouterr().err


def test_an_out_that_is_a_directory_is_refused(tmp_path):
    from paratune import ParallelConfig, get_model
    from paratune.profiler.gns import GNSJob

    job = GNSJob(model=get_model("tiny"), config=ParallelConfig(global_batch_size=8),
                 steps=2, out=tmp_path)
    with pytest.raises(ConfigError, match=r"out=.*: is a directory; give the trajectory's"):
        job.validate()


def test_a_resume_on_another_device_is_refused(tmp_path, monkeypatch):
    """The device and the precision it computes in (bf16 on CUDA, float32 on the CPU) are
    part of the fingerprint: a checkpoint saved on one is not continued on the other."""
    from pathlib import Path

    import torch

    from paratune.profiler.gns.job import _check_fingerprint, _job_fingerprint

    cpu = _job_fingerprint(_job(tmp_path, device="cpu"))
    assert (cpu["device"], cpu["precision"]) == ("cpu", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _job_fingerprint(_job(tmp_path, device="auto")) == cpu  # auto: what it ran on
    gpu = _job(tmp_path, device="cuda")
    assert _job_fingerprint(gpu)["precision"] == "bf16-mixed"
    with pytest.raises(ConfigError) as info:
        _check_fingerprint(gpu, {"extra": {"job": cpu}}, Path("ckpt"))
    assert info.value.field == "device" and "'cpu'" in str(info.value)
    older = {k: v for k, v in cpu.items() if k not in ("device", "precision")}
    _check_fingerprint(_job(tmp_path, device="cpu"), {"extra": {"job": older}}, Path("ckpt"))


def test_a_cuda_run_needs_a_gpu_per_rank(tmp_path, monkeypatch):
    """Checked before any process starts (NCCL cannot put two ranks on one GPU); this needs
    no GPU: the count is what CUDA reports."""
    import torch

    from paratune import ParallelConfig

    two = ParallelConfig(dp=2, micro_batch_size=2, global_batch_size=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _job(tmp_path, device="cuda").validate()  # one rank, one GPU
    for device in ("cuda", "auto"):
        with pytest.raises(ConfigError, match="needs one GPU per rank, but this machine has 1"
                           ) as info:
            _job(tmp_path, device=device, config=two).validate()
        assert (info.value.field, info.value.value) == ("config.world_size", 2)
    _job(tmp_path, device="cpu", config=two).validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="no CUDA device is visible") as info:
        _job(tmp_path, device="cuda").validate()
    assert info.value.field == "device"


@pytest.mark.slow
def test_resuming_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path, capsys):
    """`--resume --steps 2` on a run checkpointed at step 3 used to exit 0 keeping 3 rows."""
    from paratune.cli import main
    from paratune.profiler.gns import run_gns

    out, ckpt = tmp_path / "g.csv", tmp_path / "g-checkpoint"
    run_gns(_job(tmp_path, out=str(out), checkpoint_dir=str(ckpt)))  # steps 1-3, saved at 3
    rows, state = out.read_text(), (ckpt / "run_state.json").read_text()
    with pytest.raises(ConfigError, match="the run being resumed is already at step 3") as info:
        run_gns(_job(tmp_path, out=str(out), checkpoint_dir=str(ckpt), steps=2, resume=True))
    assert (info.value.field, info.value.value) == ("steps", 2)
    # The command names the flag (same settings as _job, so only the steps differ).
    assert main(["gns", "--model", "tiny", "--seq-len", "32", "--corpus-mb", "0.25",
                 "--config", "mb=2,gb=4", "--device", "cpu", "--checkpoint-every", "3",
                 "--no-track", "--out", str(out), "--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratune gns: error: --steps=2: the run being resumed is already "
                          "at step 3"), err
    assert out.read_text() == rows
    assert (ckpt / "run_state.json").read_text() == state


_HOLD_LOCK = """
import sys, time
from paratune.profiler.gns.trajectory import _locked_trajectory
with _locked_trajectory(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_run_on_an_output_another_process_is_writing_is_refused(tmp_path):
    """Two runs on one --out both wrote its trajectory. The lock is the kernel's: a second
    run is refused while another process holds it, and it is free once that process has
    died, even by SIGKILL (no stale lock to clean up)."""
    import subprocess
    import sys

    from paratune.profiler.gns import TRAJECTORY_COLUMNS, run_gns
    from paratune.profiler.gns.trajectory import _locked_trajectory

    out, ckpt = tmp_path / "traj.csv", tmp_path / "ckpt"
    rows = ",".join(TRAJECTORY_COLUMNS) + "\n"
    out.write_text(rows)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        for resume in (False, True):
            with pytest.raises(ConfigError, match=rf"is in use: another process \(pid "
                               rf"{holder.pid}\) is writing this trajectory \(it holds "
                               r".*traj\.csv\.lock\)") as info:
                run_gns(_job(tmp_path, resume=resume))
            assert info.value.field == "out"
        assert out.read_text() == rows and not ckpt.exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # Released with the process that held it; held here, it refuses a second holder.
    with (_locked_trajectory(out), pytest.raises(ConfigError, match="is in use"),
          _locked_trajectory(out)):
        pass
