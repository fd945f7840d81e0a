"""A framework with no measurement fitted on, predicted as a well-tuned one: Megatron-LM's
published GPT runs (22B to 1T parameters, 8 to 512 A100) from a model fitted on the public
nanotron and Megatron-DeepSpeed measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "data" / "published_megatron_a100.csv"


def test_the_published_runs_import_whole():
    from paratune.datasets import parse_public_csv

    records, problems = parse_public_csv(PUBLISHED)
    assert not problems, problems
    assert len(records) == 8 and all(r.step_time_s > 0 for r in records)


def test_the_elementwise_share_falls_as_the_model_widens():
    """The memory-bound part of a block shrinks next to its matrix products as the model
    widens (same layout family: tensor-parallel 8, one micro-batch's worth of tokens), which
    is what lets the default core predict large models at a higher share of peak."""
    from paratune.models import features as F
    from paratune.models import load_measurements

    rows = load_measurements([PUBLISHED])
    c = F.Columns(rows)
    times = F.analytical_step_time(c)
    per_micro = times["compute_s"] / F.num_microbatches(c)
    share = F.elementwise_s_per_microbatch(c) / per_micro
    order = np.argsort(c.hidden, kind="stable")
    widths, shares = c.hidden[order], share[order]
    for w in np.unique(widths)[1:]:
        assert shares[widths == w].max() < shares[widths < w].min()
    # without a memory bandwidth in the catalogue (the CPU) the part is zero, not NaN
    cpu = F.Columns(rows.assign(hardware="cpu"))
    assert np.all(F.elementwise_s_per_microbatch(cpu) == 0.0)


@pytest.mark.slow
def test_published_runs_of_an_unmeasured_framework_are_predicted_within_target(public_dir):
    import sys

    sys.path.insert(0, str(REPO / "experiments"))
    import pandas as pd
    from published_runs import score

    from paratune.models import PerformanceModel, load_measurements
    from paratune.models._estimators import PRED_WARNING

    model = PerformanceModel(n_estimators=200).fit(
        load_measurements(sorted(public_dir.glob("*.csv"))))
    published = load_measurements([PUBLISHED])
    pred = model.predict(published)
    assert pred[PRED_WARNING].str.contains("no measurement of family megatron").all()
    (row,) = score(pd.concat([published.reset_index(drop=True), pred], axis=1))
    assert 0.8 <= row["ratio_median"] <= 1.25, row
    assert row["mdape"] <= 20.0, row
    assert row["coverage"] >= 80.0, row
    ratio = pred["pred_tokens_per_sec_per_gpu"].to_numpy(float) / (
        published["global_batch_size"].to_numpy(float) * published["seq_len"].to_numpy(float)
        / (published["step_time_s"].to_numpy(float) * published["world_size"].to_numpy(float)))
    assert np.all(np.abs(ratio - 1.0) < 0.35), ratio
