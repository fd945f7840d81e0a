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
