from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from paratune.errors import ConfigError
from paratune.profiler.gns import (
    GradientNoiseScale,
    adam_preconditioners,
    micro_batch_gradients,
    sharded_sqnorm,
    single_process_reference,
    unbiased_norms,
)

# Least squares with x ~ N(0, I_d), y = w* . x + noise (std sigma), loss 0.5 (w . x - y)^2.
# At w = w* + delta the per-example gradient (x x^T) delta - noise x has mean G = delta and
# covariance Sigma = (|delta|^2 + sigma^2) I + delta delta^T, so
# B_simple = (d (|delta|^2 + sigma^2) + |delta|^2) / |delta|^2 in closed form.
DIM, SIGMA = 16, 1.0


def _problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(DIM, generator=gen, dtype=torch.float64)
    delta = torch.randn(DIM, generator=gen, dtype=torch.float64)
    delta = delta / delta.norm() * 0.8
    model = nn.Linear(DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    return gen, w_star, delta, model


def _backward_fn(model, gen, w_star, size):
    def run():
        x = torch.randn(size, DIM, generator=gen, dtype=torch.float64)
        y = x @ w_star + SIGMA * torch.randn(size, generator=gen, dtype=torch.float64)
        loss = 0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()
        loss.backward()
    return run


def _true_b_simple(delta, weights=None):
    weights = torch.ones(DIM, dtype=torch.float64) if weights is None else weights
    trace = float((weights * ((delta.norm() ** 2 + SIGMA**2) + delta**2)).sum())
    return trace / float((weights * delta**2).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_batch_estimate_matches_closed_form(seed):
    gen, w_star, delta, model = _problem(seed)
    gns = GradientNoiseScale(beta=0.995)
    num_small, b_small = 4, 8
    for _ in range(800):
        fns = [_backward_fn(model, gen, w_star, b_small) for _ in range(num_small)]
        small, big = micro_batch_gradients(list(model.parameters()), fns)
        est = gns.update(small, big, b_small, num_small * b_small)
    truth = _true_b_simple(delta)
    assert truth == pytest.approx((DIM * (0.64 + 1) + 0.64) / 0.64)
    assert est.b_simple == pytest.approx(truth, rel=0.15)
    assert est.g2_ema == pytest.approx(float(delta.norm() ** 2), rel=0.15)
    # The big-batch gradient is left in .grad: the mean of the small ones, whose squared norm
    # is the big-batch norm the estimate uses. One more step, replayed one batch at a time.
    state = gen.get_state()
    fns = [_backward_fn(model, gen, w_star, b_small) for _ in range(num_small)]
    _, big = micro_batch_gradients(list(model.parameters()), fns)
    left = model.weight.grad.clone()
    gen.set_state(state)
    grads = []
    for fn in [_backward_fn(model, gen, w_star, b_small) for _ in range(num_small)]:
        model.weight.grad = None
        fn()
        grads.append(model.weight.grad.clone())
    torch.testing.assert_close(left, torch.stack(grads).mean(0), rtol=1e-12, atol=0)
    assert big == pytest.approx(float(left.square().sum()), rel=1e-12)


def test_adam_preconditioned_estimate_matches_closed_form():
    gen, w_star, delta, model = _problem(5)
    # lr=0: Adam's second moments fill up while the point (and so G and Sigma) stays put.
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    for _ in range(50):
        opt.zero_grad()
        _backward_fn(model, gen, w_star, 32)()
        opt.step()
    weights = adam_preconditioners([opt])
    assert set(weights) == {model.weight}
    gns = GradientNoiseScale(beta=0.995)
    for _ in range(800):
        fns = [_backward_fn(model, gen, w_star, 8) for _ in range(4)]
        small, big = micro_batch_gradients(list(model.parameters()), fns,
                                           preconditioners=weights)
        est = gns.update(small, big, 8, 32)
    truth = _true_b_simple(delta, weights[model.weight].flatten())
    assert est.b_simple == pytest.approx(truth, rel=0.15)
    assert truth != pytest.approx(_true_b_simple(delta), rel=0.02)


def test_unbiased_norms_invert_the_expectation():
    g2, trace = 2.0, 30.0
    small = g2 + trace / 4
    big = g2 + trace / 32
    assert unbiased_norms(small, big, 4, 32) == pytest.approx((g2, trace))


def test_ema_is_bias_corrected_and_state_round_trips():
    gns = GradientNoiseScale(beta=0.9)
    first = gns.update(2.0 + 30.0 / 4, 2.0 + 30.0 / 32, 4, 32)
    assert first.g2_ema == pytest.approx(2.0) and first.b_simple == pytest.approx(15.0)
    second = gns.update(1.0 + 30.0 / 4, 1.0 + 30.0 / 32, 4, 32)
    # each average divided by 1 - beta**t, t the updates so far (not 1 - beta): the ratio
    # b_simple cancels the correction, the averages themselves do not
    assert second.g2_ema == pytest.approx((0.9 * 0.1 * 2 + 0.1 * 1) / (1 - 0.9 ** 2))
    assert second.trace_ema == pytest.approx(30.0)
    other = GradientNoiseScale()
    other.load_state_dict(gns.state_dict())
    assert other.b_simple == gns.b_simple
    expected = (0.9 * 0.1 * 30 + 0.1 * 30) / (0.9 * 0.1 * 2 + 0.1 * 1)
    assert gns.b_simple == pytest.approx(expected)
    assert math.isnan(GradientNoiseScale().b_simple)


@pytest.mark.parametrize(("args", "field"), [
    ((1.0, 0.5, 0, 8), "b_small"),
    ((1.0, 0.5, 8, 8), "b_big"),
    ((math.nan, 0.5, 2, 8), "small_sqnorm"),
])
def test_bad_inputs_name_the_field(args, field):
    with pytest.raises(ConfigError) as info:
        GradientNoiseScale().update(*args)
    assert info.value.field == field
    with pytest.raises(ConfigError, match="beta"):
        GradientNoiseScale(beta=1.0)


def test_sqnorm_of_plain_tensors():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
    params[0].grad = torch.tensor([1.0, 2.0, 2.0])
    params[1].grad = torch.full((2, 2), 0.5)
    assert sharded_sqnorm(params) == pytest.approx(9.0 + 1.0)


# ---------------------------------------------------------------------- under 3D parallelism
def _small_llama():
    from paratune import get_model

    return get_model("tiny").replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                     ffn_hidden_size=176, seq_len=32)


@pytest.mark.slow
def test_3d_parallel_estimate_equals_single_process_on_same_batches():
    from paratune import ParallelConfig
    from paratune.profiler.gns import measure_layouts

    spec = _small_llama()
    gb, steps = 8, 2
    layouts = [
        # accumulate mode: two chunks of 4 sequences, each reduced over dp, tp shards summed.
        {"config": ParallelConfig(dp=2, tp=2, global_batch_size=gb)},
        # pipeline stages summed over pp, ZeRO-2 gradient shards summed over dp.
        {"config": ParallelConfig(pp=2, dp=2, global_batch_size=gb, sharding="zero2")},
        # dp mode: each of the 4 ranks' gradient before the all-reduce is a small batch.
        {"config": ParallelConfig(dp=4, global_batch_size=gb)},
        {"config": ParallelConfig(dp=2, tp=2, global_batch_size=gb), "precondition": "adam"},
    ]
    got = measure_layouts(spec, layouts, world_size=4, steps=steps)
    reference = [single_process_reference(spec, gb, steps, num_small=2),
                 single_process_reference(spec, gb, steps, num_small=4),
                 single_process_reference(spec, gb, steps, num_small=2, precondition="adam")]
    assert [r[0]["mode"] for r in got] == ["accumulate", "accumulate", "dp", "accumulate"]
    assert got[2][0]["b_small"] == 2 and got[0][0]["b_small"] == 4
    for run, ref in zip(got, [reference[0], reference[0], reference[1], reference[2]]):
        for step, ref_step in zip(run, ref):
            assert step["loss"] == pytest.approx(ref_step["loss"], rel=1e-9)
            assert step["small_sqnorm"] == pytest.approx(ref_step["small_sqnorm"], rel=1e-9)
            assert step["big_sqnorm"] == pytest.approx(ref_step["big_sqnorm"], rel=1e-9)
            assert step["estimate"]["b_simple"] == pytest.approx(ref_step["b_simple"], rel=1e-7)
    # Real text has gradient noise: a positive, finite estimate; the loss falls.
    assert all(math.isfinite(r[-1]["estimate"]["b_simple"]) for r in got)
    assert all(r[-1]["estimate"]["b_simple"] > 0 for r in got)
    assert got[0][-1]["loss"] < got[0][0]["loss"]
    # Preconditioning changes the measured quantity.
    assert reference[2][-1]["big_sqnorm"] != pytest.approx(reference[0][-1]["big_sqnorm"],
                                                           rel=1e-3)


@pytest.mark.slow
def test_measuring_every_kth_step_trains_the_same_and_measures_the_same_norms():
    from paratune import ParallelConfig
    from paratune.profiler.gns import measure_layouts

    spec = _small_llama()
    runs = []
    for config in (ParallelConfig(dp=4, global_batch_size=8),
                   ParallelConfig(dp=2, tp=2, global_batch_size=8)):
        runs += [{"config": config}, {"config": config, "measure_every": 2}]
    got = measure_layouts(spec, runs, world_size=4, steps=4)
    for every_step, every_other in (got[0:2], got[2:4]):
        for i, (a, b) in enumerate(zip(every_step, every_other)):
            # the steps between measured ones train exactly as measured steps do
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-9)
            assert b["measured"] is (i % 2 == 0)
            if b["measured"]:
                assert b["small_sqnorm"] == pytest.approx(a["small_sqnorm"], rel=1e-9)
                assert b["big_sqnorm"] == pytest.approx(a["big_sqnorm"], rel=1e-9)
            else:
                assert math.isnan(b["small_sqnorm"]) and math.isnan(b["big_sqnorm"])
        assert every_other[-1]["estimate"]["num_updates"] == 2
        assert math.isfinite(every_other[-1]["estimate"]["b_simple"])


def test_measure_every_must_be_a_positive_integer():
    from paratune import ParallelConfig
    from paratune.profiler.gns import NoiseScaleMeter

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="measure_every"):
            NoiseScaleMeter(ParallelConfig(dp=2, global_batch_size=4), measure_every=bad)


# ---------------------------------------------------------------------- the `gns` command
def test_parse_config_reads_both_spellings():
    from paratune import ParallelConfig
    from paratune.profiler._gns_cli import parse_config

    want = ParallelConfig(dp=2, tp=2, micro_batch_size=4, global_batch_size=32)
    assert parse_config("dp=2,tp=2,mb=4,gb=32") == want
    assert parse_config("dp2-tp2-pp1-mb4-gb32") == want
    assert parse_config("pp=2,gb=8,schedule=gpipe").schedule == "gpipe"
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config("dq=2")
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config("dp2-xx3")


def _rows(path):
    import pandas as pd

    return pd.read_csv(path)


@pytest.mark.slow
def test_gns_command_writes_a_trajectory_and_resumes_after_a_kill(tmp_path):
    from paratune.cli import main
    from paratune.profiler.gns import TRAJECTORY_COLUMNS

    common = ["gns", "--model", "tiny", "--seq-len", "32", "--corpus-mb", "0.5", "--no-track",
              "--lr", "2e-3"]
    # Two data-parallel processes, per-rank small batches.
    straight = tmp_path / "straight.csv"
    assert main([*common, "--config", "dp=2,gb=8", "--steps", "4", "--out", str(straight)]) == 0
    frame = _rows(straight)
    assert tuple(frame.columns) == TRAJECTORY_COLUMNS
    assert list(frame["step"]) == [1, 2, 3, 4]
    assert list(frame["tokens"]) == [256, 512, 768, 1024]
    assert (frame["b_small"] == 4).all() and (frame["b_big"] == 8).all()
    assert (frame["seq_len"] == 32).all()
    # Checkpointed by default (every 50 steps and at the end), so --resume alone can continue.
    from paratune.profiler.reconfigure import find_checkpoint

    assert find_checkpoint(tmp_path / "straight-checkpoint") is not None
    assert frame["loss"].iloc[-1] < frame["loss"].iloc[0]
    assert np_isfinite_all(frame["b_simple"])
    from paratune.tuner.gns_trajectory import load_trajectory

    assert len(load_trajectory(straight)) == len(frame)  # the tuner reads every row

    # Killed after a checkpoint at step 2 (the default saves at the end) with a torn row 3
    # half written: the resumed run (--resume, nothing else) re-measures step 3 and ends
    # where the uninterrupted run ends.
    killed = tmp_path / "killed.csv"
    assert main([*common, "--config", "dp=2,gb=8", "--steps", "2", "--out", str(killed)]) == 0
    with open(killed, "a") as handle:
        handle.write("3,768,5.1")
    assert main([*common, "--config", "dp=2,gb=8", "--steps", "4", "--out", str(killed),
                 "--resume"]) == 0
    resumed = _rows(killed)
    assert list(resumed["step"]) == [1, 2, 3, 4]
    for column in ("loss", "small_sqnorm", "big_sqnorm", "b_simple"):
        assert list(resumed[column]) == pytest.approx(list(frame[column]), rel=1e-6), column


def np_isfinite_all(series) -> bool:
    import numpy as np

    return bool(np.isfinite(series.to_numpy(dtype=float)).all())


def test_gns_job_rejects_bad_settings_before_starting():
    from paratune import ParallelConfig, get_model
    from paratune.profiler.gns import GNSJob

    tiny = get_model("tiny")
    cases = [
        (dict(steps=0), "steps"),
        (dict(config=ParallelConfig(dp=2, tp=2, global_batch_size=4), mode="dp"), "mode"),
        (dict(config=ParallelConfig(global_batch_size=3)), "global_batch_size"),
        (dict(resume=True), "checkpoint_dir"),
        (dict(precondition="sgd"), "precondition"),
        # zero1 with dp > 1 cannot be checkpointed: refused up front, not at the first save.
        (dict(config=ParallelConfig(dp=2, global_batch_size=4, sharding="zero1"),
              checkpoint_every=2, checkpoint_dir="ckpt"), "sharding"),
    ]
    for changes, field in cases:
        settings = dict(model=tiny, config=ParallelConfig(global_batch_size=4), steps=3,
                        out="unused.csv")
        settings.update(changes)
        with pytest.raises(ConfigError) as info:
            GNSJob(**settings).validate()
        assert info.value.field == field, changes


def test_a_cpu_run_that_cannot_fit_in_memory_is_refused_before_any_process_starts(
        tmp_path, capsys):
    from paratune import ParallelConfig, get_model
    from paratune.cli import main
    from paratune.profiler import check_cpu_memory, cpu_process_memory_gb
    from paratune.profiler.gns import GNSJob, run_gns

    llama = get_model("llama3-8b")
    # 8e9 parameters x 16 bytes (float32 weights, gradients, Adam moments) per process
    eight = ParallelConfig(dp=8, global_batch_size=16)
    assert cpu_process_memory_gb(llama, eight) == pytest.approx(128.8, abs=0.5)
    zero3 = eight.replace(sharding="zero3")
    assert cpu_process_memory_gb(llama, zero3) == pytest.approx(128.5 / 8 + 0.3, abs=0.1)
    with pytest.raises(ConfigError, match=r"x 8 processes = 1030\.\d GB, more than this "
                                          r"machine's 64\.0 GB") as info:
        check_cpu_memory(llama, eight, total_bytes=64 * 10**9)
    assert info.value.field == "model" and info.value.value == "llama3-8b"
    check_cpu_memory(get_model("tiny"), ParallelConfig(dp=4, global_batch_size=16))
    check_cpu_memory(get_model("small"), ParallelConfig(dp=4, global_batch_size=16))

    out = tmp_path / "gns.csv"
    with pytest.raises(ConfigError, match="more than this machine's"):
        run_gns(GNSJob(model=llama, config=eight, steps=2, out=str(out), device="cpu"))
    assert main(["gns", "--model", "llama3-8b", "--config", "dp=8,gb=16", "--steps", "2",
                 "--device", "cpu", "--out", str(out), "--no-track"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratune gns: error: model='llama3-8b': ")
    assert "GB per process on the CPU" in err and "Traceback" not in err
    assert not out.exists()


def test_resuming_measured_rows_without_a_checkpoint_is_refused_and_keeps_them(tmp_path):
    """A resume that finds rows but no complete checkpoint (e.g. one left incomplete by a run
    killed before the atomic save) would restart at step 0 and delete the measured rows: it
    is refused before any process starts, and the file is untouched."""
    from paratune import ParallelConfig, get_model
    from paratune.profiler.gns import TRAJECTORY_COLUMNS, GNSJob, run_gns

    out = tmp_path / "traj.csv"
    rows = ",".join(TRAJECTORY_COLUMNS) + "\n" + "\n".join(
        ",".join([str(step), str(step * 128)] + ["1.0"] * (len(TRAJECTORY_COLUMNS) - 2))
        for step in (1, 2, 3)) + "\n"
    out.write_text(rows)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"")  # DCP files, but no run_state.json
    job = GNSJob(model=get_model("tiny"), config=ParallelConfig(global_batch_size=4), steps=5,
                 out=str(out), checkpoint_dir=str(ckpt), resume=True, device="cpu")
    with pytest.raises(ConfigError, match=r"no complete checkpoint.*3 rows.*kept") as info:
        run_gns(job)
    assert info.value.field == "resume"
    assert out.read_text() == rows


def _failing_worker(rank: int, world_size: int, port: int, how: str) -> None:
    import os

    from paratune.errors import ConfigError

    if rank == 1:
        if how == "raise":
            raise ConfigError("lr", -1.0, "must be >= 0")
        os._exit(3)


@pytest.mark.parametrize(("how", "message"), [
    ("raise", r"^rank 1 of 2 failed: paratune\.errors\.ConfigError: lr=-1\.0: must be >= 0 "
              r"\(-v for its traceback\)$"),
    ("exit", r"^rank 1 of 2 died: .*exit code 3"),
])
def test_spawn_names_the_failed_rank_and_its_error(how, message):
    from paratune.profiler.gns import WorkerError, spawn

    with pytest.raises(WorkerError, match=message):
        spawn(_failing_worker, 2, how)


def _port_check_worker(rank: int, world_size: int, port: int, out: str) -> None:
    import errno
    import socket

    import torch.distributed as dist

    from paratune.profiler.gns import init_worker

    # before this rank joins: whether another program could still bind the group's port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
            taken = "free"
        except OSError as exc:
            taken = "in use" if exc.errno == errno.EADDRINUSE else str(exc)
    init_worker(rank, world_size, port, "cpu")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    with open(out, "w") as handle:
        handle.write(f"{taken} {value.item():g}")


def test_spawn_holds_the_rendezvous_port_before_any_worker_starts(tmp_path):
    """The group's port is bound from before the workers start until they end, so no other
    program can take it in between (a port picked free and bound later by rank 0 could be)."""
    from paratune.profiler.gns import spawn

    out = tmp_path / "port.txt"
    spawn(_port_check_worker, 1, str(out))
    assert out.read_text() == "in use 1"


# ---------------------------------------------------------------------- process handling
def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_until(condition, timeout_s: float) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


_ORPHAN_SCRIPT = '''
import os
import signal
import sys
import threading
import time

if __name__ == "__mp_main__":
    # A worker starting up: this module is imported before the worker's function runs. Note
    # the pid, then wait until the parent is gone (the worker is given another parent).
    parent = os.getppid()
    open(os.path.join(os.environ["GNS_TEST_DIR"], f"{os.getpid()}.started"), "w").close()
    waited = time.monotonic() + 30
    while os.getppid() == parent and time.monotonic() < waited:
        time.sleep(0.01)


def work(rank, world_size, port, out):
    open(os.path.join(out, f"{os.getpid()}.ran"), "w").close()
    time.sleep(60)  # training, as an orphan


if __name__ == "__main__":
    import torch.multiprocessing  # noqa: F401  (imported now: the workers start at once)

    from paratune.profiler.gns import spawn

    def kill_once_both_started():  # whatever the machine's pace
        folder = os.environ["GNS_TEST_DIR"]
        while sum(name.endswith(".started") for name in os.listdir(folder)) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_once_both_started, daemon=True).start()
    spawn(work, 2, sys.argv[1])
'''


@pytest.mark.slow
def test_workers_whose_parent_died_during_their_start_up_exit(tmp_path):
    """SIGKILL of the parent while its workers are still starting (before any of them could
    ask the kernel to follow the parent's death): they must not go on training as orphans."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = {**os.environ, "GNS_TEST_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "parent.log"
    with open(log, "w") as handle:  # not a pipe: orphans would hold it open
        parent = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                                cwd=tmp_path, timeout=60, stdout=handle, stderr=handle)
    assert parent.returncode == -signal.SIGKILL, log.read_text()
    pids: list[int] = []
    try:
        assert _wait_until(lambda: len(list(tmp_path.glob("*.started"))) == 2, 20)
        pids = [int(p.stem) for p in tmp_path.glob("*.started")]
        _wait_until(lambda: list(tmp_path.glob("*.ran"))
                    or not any(_alive(pid) for pid in pids), 30)
        assert not list(tmp_path.glob("*.ran")), "an orphaned worker ran"
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _gns_command(out, steps: int, *extra: str) -> list[str]:
    return ["gns", "--model", "tiny", "--seq-len", "32", "--corpus-mb", "0.5", "--no-track",
            "--config", "dp=2,gb=4,mb=2", "--checkpoint-every", "2", "--steps", str(steps),
            "--out", str(out), *extra]


@pytest.mark.slow
@pytest.mark.parametrize(("signame", "code", "said"), [("SIGINT", 130, "interrupted"),
                                                       ("SIGTERM", 143, "terminated")])
def test_a_signal_ends_the_workers_and_leaves_a_resumable_run(tmp_path, capsys, monkeypatch,
                                                              signame, code, said):
    """kill -INT or -TERM of `paratune gns` (as schedulers send) stops the run at once: the
    workers are ended, not waited for, it says how many steps are saved and how to resume,
    and --resume continues from what they left. While it runs, a second run on the same
    --out is refused. Both runs show their progress (step, loss, b_simple) on stderr; the
    tracked one names its MLflow run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from paratune.cli import main
    from paratune.profiler.reconfigure import find_checkpoint

    out, ckpt = tmp_path / "g.csv", tmp_path / "g-checkpoint"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # SIGINT with its default action, as in a shell's foreground job: a test session that
    # itself runs in the background (SIGINT ignored, which children inherit) must not make
    # the command deaf to it
    run = subprocess.Popen([sys.executable, "-m", "paratune.cli", *_gns_command(out, 100_000)],
                           env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _wait_until(lambda: run.poll() is None and out.exists()
                           and len(out.read_text().splitlines()) > 4
                           and find_checkpoint(ckpt) is not None, 60), run.poll()

        # A second run on the same output is refused; the first keeps its files.
        assert main(_gns_command(out, 3, "--force")) == 2  # even --force: it is in use
        err = capsys.readouterr().err
        assert err.startswith(f"paratune gns: error: --out='{out}': is in use: another "
                              f"process (pid {run.pid}) is writing this trajectory (it holds "
                              f"{out}.lock)"), err
        assert find_checkpoint(ckpt) is not None

        workers = _children(run.pid)
        assert len(workers) >= 2
        run.send_signal(getattr(signal, signame))
        # Ended, not waited for: the workers had 100000 steps to go, so a run that waited
        # for them would not end within this timeout.
        _, stderr = run.communicate(timeout=30)
        assert run.returncode == code, stderr
        assert f"paratune gns: {said}" in stderr
        assert "/100000 [" in stderr and "loss=" in stderr and "b_simple=" in stderr
        assert _wait_until(lambda: not any(_alive(pid) for pid in workers), 10)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()

    rows = out.read_text()
    time.sleep(0.5)
    assert out.read_text() == rows  # nothing writes any more
    steps = list(_rows(out)["step"])
    assert steps == list(range(1, len(steps) + 1))
    import json

    from paratune.profiler.reconfigure import RUN_STATE_FILE

    saved = int(json.loads((find_checkpoint(ckpt) / RUN_STATE_FILE).read_text())["step"])
    assert saved >= 2
    (hint,) = [line for line in stderr.splitlines() if line.startswith("paratune gns: stopped")]
    assert f"{len(steps)} of 100000 steps are measured in {out}" in hint, hint
    assert f"is at step {saved}: rerun the same command with --resume" in hint, hint
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    resumed = [c for c in _gns_command(out, len(steps) + 2, "--resume") if c != "--no-track"]
    assert main(resumed) == 0
    assert list(_rows(out)["step"]) == list(range(1, len(steps) + 3))
    captured = capsys.readouterr()
    assert f"{len(steps) + 2}/{len(steps) + 2} [" in captured.err
    assert "MLflow run " in captured.out


def test_a_gns_run_that_fails_still_leaves_its_mlflow_run(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from paratune.cli import main
    from paratune.fileio import exclusive_lock

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "g.csv"
    command = [c for c in _gns_command(out, 2) if c != "--no-track"]
    # another process writing the same trajectory makes the run fail once it has started
    with exclusive_lock(tmp_path / "g.csv.lock", field="out", value=str(out), what="writing"):
        assert main(command) == 2
    assert "is in use" in capsys.readouterr().err
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("paratune-gns").experiment_id])
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.data.params["model"] == "tiny" and run.data.params["steps"] == "2"
