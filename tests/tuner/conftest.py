"""Shared fixtures of the tuner tests.

``ClosedFormPredictor`` is a small, deterministic predictor written for these tests: it maps
a config frame to throughput and memory with a closed-form cost model (compute with a
micro-batch efficiency curve, pipeline bubble, data-parallel and tensor-parallel
communication, a memory model). It is a component under test for search mechanics (regret
against exhaustive enumeration, storage, resume), not a stand-in for the learned model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from paratune.hardware import get_hardware
from paratune.predictor import (
    PRED_FEASIBLE_PROB,
    PRED_PEAK_MEM_GB,
    PRED_STEP_TIME_S,
    PRED_TOKENS_PER_SEC_PER_GPU,
)

REPO = Path(__file__).resolve().parents[2]


def public_data_dir() -> Path:
    return Path(os.environ.get("PARATUNE_PUBLIC_DATA", REPO.parent / "shared/data/public-gpu"))


class ClosedFormPredictor:
    """Throughput and memory from a closed-form cost model (vectorised)."""

    def __init__(self, *, calls: list | None = None) -> None:
        self.calls = calls if calls is not None else []

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        self.calls.append(len(frame))
        f = {c: frame[c].to_numpy() for c in frame.columns}
        hw = [get_hardware(h) for h in frame["hardware"]]
        peak = np.array([h.peak_flops or 1e12 for h in hw])
        mem_cap = np.array([h.memory_gb or 1e9 for h in hw])
        intra = np.array([h.intra_node_bw for h in hw])
        inter = np.array([h.inter_node_bw for h in hw])
        dp, tp, pp = f["dp"].astype(float), f["tp"].astype(float), f["pp"].astype(float)
        mbs = f["micro_batch_size"].astype(float)
        gbs = f["global_batch_size"].astype(float)
        v = f["virtual_stages"].astype(float)
        seq, h, layers = (f["seq_len"].astype(float), f["hidden_size"].astype(float),
                          f["num_layers"].astype(float))
        params = layers * 12 * h * h + 2 * f["vocab_size"].astype(float) * h
        m = gbs / (dp * mbs)
        recompute = np.select([f["recompute"] == "full", f["recompute"] == "selective"],
                              [4 / 3, 1.05], 1.0)
        flops = 6 * params * gbs * seq * recompute
        eff = 0.6 * (mbs * seq / (mbs * seq + 2048)) * (1 - 0.06 * np.log2(tp))
        compute = flops / (dp * tp * pp * peak * eff)
        bubble = np.where(f["schedule"] == "gpipe", 1.0, 1.0) * (pp - 1) / (m * v)
        per_node = f["devices_per_node"].astype(float)
        tp_bw = np.where(tp <= per_node, intra, inter)
        tp_comm = 4 * layers / pp * m * mbs * seq * h * 2 * (tp - 1) / tp / tp_bw
        dp_bw = np.where(dp * tp <= per_node, intra, inter)
        shard = np.select([f["sharding"] == "zero3", f["sharding"] == "zero2"], [1.5, 1.05], 1.0)
        dp_comm = 2 * 2 * params / (tp * pp) * (dp - 1) / dp / dp_bw * shard
        step = compute * (1 + bubble) + tp_comm + dp_comm * 0.7
        state = {"none": 16.0, "zero1": 4 + 12.0 / dp, "zero2": 2 + 14.0 / dp,
                 "zero3": 16.0 / dp}
        bytes_per_param = np.array([state[s] if isinstance(state[s], float) else state[s][i]
                                    for i, s in enumerate(f["sharding"])], dtype=float)
        weights = params / (tp * pp) * bytes_per_param / 1e9
        act_layer = np.select([f["recompute"] == "full", f["recompute"] == "selective"],
                              [2.0, 18.0], 34.0)
        inflight = np.where(f["schedule"] == "gpipe", m, np.minimum(m, pp))
        acts = act_layer * seq * mbs * h * layers / pp / tp * inflight / 1e9
        mem = weights + acts
        out = pd.DataFrame({
            PRED_STEP_TIME_S: step,
            PRED_TOKENS_PER_SEC_PER_GPU: gbs * seq / step / (dp * tp * pp),
            PRED_FEASIBLE_PROB: 1 / (1 + np.exp((mem - 0.9 * mem_cap) / 4)),
            PRED_PEAK_MEM_GB: mem,
        })
        out[f"{PRED_TOKENS_PER_SEC_PER_GPU}_q10"] = out[PRED_TOKENS_PER_SEC_PER_GPU] * (
            1 - 0.05 * np.log2(pp))
        out[f"{PRED_TOKENS_PER_SEC_PER_GPU}_q90"] = out[PRED_TOKENS_PER_SEC_PER_GPU] * 1.05
        return out


@pytest.fixture(scope="session")
def public_data() -> Path:
    """The public GPU measurements (``PARATUNE_PUBLIC_DATA``); skips the test if absent."""
    path = public_data_dir()
    if not (path / "ultrascale_playbook_h100.csv").exists():
        pytest.skip(f"public GPU measurements not found at {path}")
    return path


@pytest.fixture
def closed_form() -> ClosedFormPredictor:
    return ClosedFormPredictor()


@pytest.fixture(scope="session")
def saved_model(tmp_path_factory) -> Path:
    """The directory of a small :class:`~paratune.models.PerformanceModel` fitted on synthetic
    measurements of llama3 models (4096-token sequences) on H100s; needs no public data."""
    from paratune.models import PerformanceModel
    from tests.models.conftest import synthetic_measurements

    model = PerformanceModel(n_estimators=40, aux_estimators=10, n_jobs=1, random_state=0)
    return model.fit(synthetic_measurements()).save(tmp_path_factory.mktemp("pm") / "model")


@pytest.fixture(autouse=True)
def _tmp_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def run_with_trajectory(command: str, trajectory: Path, tmp_path: Path) -> tuple[int, str]:
    """Run ``paratune tune`` (the trajectory as ``--gns``) or ``paratune plan`` (as
    ``--trajectory``) of llama3-8b on 8 H100s, untracked; returns the exit code and the flag
    that names the trajectory. The predictor does not exist: a trajectory error comes first."""
    from paratune.cli import main

    flag = "--gns" if command == "tune" else "--trajectory"
    extra = ["--objective", "goodput", "--trials", "5"] if command == "tune" else []
    code = main([command, "--model", "llama3-8b", "--gpus", "8", "--hardware", "H100",
                 "--predictor", str(tmp_path / "no-model"), "--output", str(tmp_path / "o"),
                 "--no-track", *extra, flag, str(trajectory)])
    return code, flag
