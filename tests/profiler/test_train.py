from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def _run(*args: str, nproc: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}"] if nproc else [sys.executable])
    return subprocess.run([*launcher, "-m", "paratune.profiler.train", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_torchrun_trains_on_text_and_loss_falls():
    config = {"dp": 1, "pp": 2, "global_batch_size": 8, "micro_batch_size": 2}
    proc = _run("--model", "tiny", "--config", json.dumps(config), "--steps", "12",
                "--log-every", "1", "--lr", "3e-3", nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 13  # 12 step lines and the final summary
    assert losses[-1] < losses[0] - 0.3  # byte-level text: the model learns quickly
    assert "tokens/s" in proc.stdout.splitlines()[-1]


def test_bad_config_is_named_and_exits_2():
    proc = _run("--model", "tiny", "--config", json.dumps({"tp": 3}), "--steps", "1")
    assert proc.returncode == 2
    assert "dp*tp*pp = 1*3*1 = 3 must equal the world size 1" in proc.stderr


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ +loss (\d+\.\d+)", stdout, re.M)]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_data_parallel_pipeline_stages_train_several_steps_like_one_process(sharding):
    # One-step equivalence is proven elsewhere; this catches state that breaks on later
    # steps (DDP rebuilding its buckets after the first pipelined step).
    common = {"global_batch_size": 8, "micro_batch_size": 2}
    args = ("--model", "tiny", "--steps", "3", "--log-every", "1", "--data", "synthetic")
    single = _run(*args, "--config", json.dumps(common))
    layout = {**common, "dp": 2, "pp": 2, "sharding": sharding}
    parallel = _run(*args, "--config", json.dumps(layout), nproc=4)
    assert single.returncode == 0, single.stderr[-2000:]
    assert parallel.returncode == 0, parallel.stderr[-2000:]
    assert len(_losses(parallel.stdout)) == 3
    assert _losses(parallel.stdout) == pytest.approx(_losses(single.stdout), abs=2e-4)


@pytest.mark.parametrize("cuda", [False, True])
def test_process_group_gets_the_device_set_first_and_nccl_its_device_id(monkeypatch, cuda):
    """On CUDA the rank's device is current before NCCL starts and is passed as
    ``device_id`` (simulated); on CPU a real gloo group is started from the launcher's
    environment, with neither."""
    import torch
    import torch.distributed as dist

    from paratune.profiler import train
    from paratune.profiler.launcher import free_port

    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set", index)))
    if cuda:
        monkeypatch.setattr(dist, "init_process_group",
                            lambda backend, **kw: calls.append(("init", backend, kw)))
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("LOCAL_RANK", "3")
        train._init_process_group()
        assert calls[0] == ("set", 3)
        (_, backend, kwargs), = calls[1:]
        assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 3)
        return

    real_init = dist.init_process_group

    def recording_init(backend, **kwargs):
        calls.append(("init", backend, kwargs))
        return real_init(backend, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", recording_init)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    try:
        train._init_process_group()
        assert dist.is_initialized()
        assert dist.get_backend() == "gloo"
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (_, backend, kwargs), = calls  # no device was set
    assert backend == "gloo" and "device_id" not in kwargs
    assert "store" not in kwargs  # the rendezvous the environment names, not a local store


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_num_gpus() < 1, reason="needs CUDA")
def test_trains_a_few_steps_on_cuda():
    """NCCL end to end: the step-time and loss reductions run on CUDA tensors (NCCL has no
    CPU backend), bf16 autocast, two logged steps."""
    proc = _run("--model", "tiny", "--config", json.dumps({"global_batch_size": 4}),
                "--steps", "2", "--log-every", "1", "--data", "synthetic")
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = _losses(proc.stdout)
    assert len(losses) == 2 and all(4.0 < loss < 7.0 for loss in losses)
    assert proc.stdout.splitlines()[-1].startswith("done: 2 steps")


@pytest.mark.gpu
@pytest.mark.skipif(_num_gpus() < 2, reason="needs 2 GPUs")
def test_torchrun_trains_data_parallel_on_two_gpus():
    proc = _run("--model", "tiny", "--config", json.dumps({"dp": 2, "global_batch_size": 4}),
                "--steps", "2", "--log-every", "1", "--data", "synthetic", nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(_losses(proc.stdout)) == 2


def _tiny_hf_config(directory) -> str:
    """A Hugging Face config.json of the tiny preset's shape, with a long context."""
    directory.mkdir(parents=True)
    path = directory / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 352,
        "vocab_size": 256, "max_position_embeddings": 4096, "rope_theta": 10000.0}))
    return str(path)


def test_seq_len_sets_the_tokens_per_sequence_of_a_preset_and_a_config_json(tmp_path):
    from paratune import get_model
    from paratune.profiler.train import parse_args, resolve_model

    path = _tiny_hf_config(tmp_path / "byte-llama")
    for name, seq_len in (("tiny", 48), (path, 48), ("tiny", None)):
        args = parse_args(["--model", name, "--config", "{}",
                           *(["--seq-len", str(seq_len)] if seq_len else [])])
        assert args.seq_len == seq_len
        assert resolve_model(args.model, args.seq_len) == get_model(name, seq_len=seq_len)
    assert resolve_model(path, 48).seq_len == 48
    assert resolve_model("tiny").seq_len == get_model("tiny").seq_len == 128
    # a real run: sequences of the length given
    proc = _run("--model", path, "--seq-len", "32", "--config",
                json.dumps({"global_batch_size": 2}), "--steps", "2", "--log-every", "1",
                "--data", "synthetic")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(_losses(proc.stdout)) == 2
    assert proc.stdout.splitlines()[-1].startswith("done: 2 steps of 2 x 32 tokens")
    bad = _run("--model", "tiny", "--seq-len", "0", "--config", "{}")
    assert bad.returncode == 2
    assert "argument --seq-len: must be an integer >= 1, not '0'" in bad.stderr


@pytest.mark.slow
def test_the_exported_torchrun_command_trains_the_model_tuned(tmp_path):
    import shlex

    from paratune import ParallelConfig, get_hardware, get_model
    from paratune.tuner import recommendation

    model = get_model(_tiny_hf_config(tmp_path / "byte-llama"), seq_len=32)
    rec = recommendation(model, ParallelConfig(global_batch_size=2), get_hardware("cpu"))
    argv = shlex.split(rec["launch"]["torchrun"])
    assert argv[0] == "torchrun" and "--standalone" in argv
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:],
                           "--log-every", "5"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("done: 20 steps of 2 x 32 tokens")


@pytest.mark.slow
def test_a_whole_plan_trains_in_one_launch_switching_layouts(tmp_path):
    """Two phases of a plan's launch.json: batch 4 on dp2, then batch 8 on tp2 at a higher
    learning rate, handed over through a checkpoint in one torchrun launch."""
    launch = {"phases": [
        {"config": {"dp": 2, "global_batch_size": 4, "micro_batch_size": 2},
         "start_step": 0, "end_step": 3, "lr": 1e-3},
        {"config": {"tp": 2, "global_batch_size": 8, "micro_batch_size": 4},
         "start_step": 3, "end_step": 5, "lr": 1.4e-3}]}
    path = tmp_path / "launch.json"
    path.write_text(json.dumps(launch))
    proc = _run("--model", "tiny", "--plan", str(path), "--log-every", "1",
                "--checkpoint-dir", str(tmp_path / "ckpt"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "phase 1: dp2-tp1-pp1-mb2-gb4" in out and "lr 0.001, 3 steps" in out
    assert "phase 2: dp1-tp2-pp1-mb4-gb8" in out and "lr 0.0014, 2 steps" in out
    assert len(_losses(out)) == 5
    assert "done: 5 steps of 8 x" in out.splitlines()[-1]


def test_a_plan_that_cannot_switch_is_named_and_exits_2(tmp_path):
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"phases": []}))
    proc = _run("--model", "tiny", "--plan", str(path))
    assert proc.returncode == 2 and "plan" in proc.stderr and "no phases" in proc.stderr
