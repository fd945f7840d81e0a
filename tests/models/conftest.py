from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from paratune import Measurement, ParallelConfig, Status, get_model
from paratune.models import features as F

REPO = Path(__file__).resolve().parents[2]


def public_data_dir() -> Path:
    return Path(os.environ.get("PARATUNE_PUBLIC_DATA", REPO.parent / "shared/data/public-gpu"))


@pytest.fixture(scope="session")
def public_dir() -> Path:
    path = public_data_dir()
    if not (path / "ultrascale_playbook_h100.csv").exists():
        pytest.skip(f"public GPU measurements not found at {path}")
    return path


def synthetic_measurements(seed: int = 0, n_per_model: int = 60, *,
                           stalls: bool = False) -> pd.DataFrame:
    """Measurement rows whose step time is a known function of the analytical estimate.

    The hidden truth: tensor parallelism beyond 2 costs 20% per doubling, configurations
    whose analytical memory exceeds the device fail with OOM. With ``stalls``, pipelines of
    4 or more stages that span more than one node take 1.2 s per micro-batch (the stalled
    regime), whatever the model.
    """
    from paratune.predictor import config_frame

    rng = np.random.default_rng(seed)
    records = []
    for name in ("llama3.2-1b", "llama3.2-3b", "llama3-8b"):
        model = get_model(name, seq_len=4096)
        configs = []
        for _ in range(n_per_model):
            tp, pp, dp = (int(2 ** rng.integers(0, 4)) for _ in range(3))
            micro = int(2 ** rng.integers(0, 3))
            configs.append(ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                                          global_batch_size=dp * micro * 8,
                                          sharding="zero1" if rng.random() < 0.5 else "none"))
        frame = config_frame(model, configs, "H100")
        analytical = F.analytical_step_time(frame)["step_time_s"]
        memory = F.analytical_memory_gb(frame)
        for i, config in enumerate(configs):
            m = Measurement(model=model, config=config, hardware="H100-80GB",
                            devices_per_node=8, source="synthetic")
            if memory[i] > 80:
                m.status, m.error = Status.OOM, "CUDA out of memory"
            else:
                m.step_time_s = analytical[i] * 1.5 * 1.2 ** max(np.log2(config.tp) - 1, 0) * (
                    float(rng.lognormal(0, 0.02)))
                if stalls and config.pp >= 4 and config.world_size > 8:
                    m.step_time_s = 1.2 * config.num_microbatches * float(rng.lognormal(0, 0.05))
                m.tokens_per_s = config.global_batch_size * model.seq_len / m.step_time_s
                m.peak_mem_reserved_gb = memory[i] * 0.9
            records.append(m.to_row())
    return pd.DataFrame(records)


@pytest.fixture(scope="session")
def synthetic() -> pd.DataFrame:
    return synthetic_measurements()


@pytest.fixture(scope="session")
def make_synthetic():
    return synthetic_measurements


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, synthetic) -> Path:
    """A performance model fitted on :func:`synthetic` by ``paratune fit`` (20 trees)."""
    from paratune.cli import main

    tmp = tmp_path_factory.mktemp("fit")
    data = tmp / "data.csv"
    synthetic.to_csv(data, index=False)
    out = tmp / "model"
    assert main(["fit", str(data), "--out", str(out), "--n-estimators", "20",
                 "--no-mlflow"]) == 0
    return out
