"""Frameworks with no measurement fitted on, predicted as well-tuned ones: Megatron-LM's
published GPT runs (22B to 1T parameters, 8 to 512 A100, tensor and pipeline parallelism)
and torchtitan's (Llama 2 13B to Llama 3 70B on 64 A100, FSDP alone) from a model fitted on
the public nanotron and Megatron-DeepSpeed measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "data" / "published_megatron_a100.csv"
TORCHTITAN = REPO / "data" / "published_torchtitan_a100.csv"
ROWS = {PUBLISHED: 8, TORCHTITAN: 3}


@pytest.mark.parametrize("path", list(ROWS), ids=lambda p: p.stem)
def test_the_published_runs_import_whole(path):
    from paratune.datasets import parse_public_csv

    records, problems = parse_public_csv(path)
    assert not problems, problems
    assert len(records) == ROWS[path] and all(r.step_time_s > 0 for r in records)


def test_torchtitans_runs_are_fsdp_alone_with_their_stated_shapes():
    """The rows state every shape column (nothing assumed) and the layout FSDP2 runs:
    ZeRO-3 over all 64 ranks, no tensor or pipeline parallelism; the step time derived from
    the published tokens/s per GPU gives back the published MFU under the model FLOPs
    convention."""
    from paratune.models import features as F
    from paratune.models import load_measurements

    rows = load_measurements([TORCHTITAN])
    assert (rows["sharding"] == "zero3").all() and (rows["dp"] == 64).all()
    assert (rows["tp"] == 1).all() and (rows["pp"] == 1).all()
    assert set(rows["mlp"]) == {"swiglu"} and (rows["num_kv_heads"] <= rows["num_heads"]).all()
    mfu = F.step_time_at_mfu(F.Columns(rows)) / rows["step_time_s"].to_numpy(float)
    np.testing.assert_allclose(mfu, rows["mfu"].to_numpy(float), rtol=0.03)


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
    """Each source within the targets (median predicted / measured in [0.8, 1.25], median
    APE <= 20%, every row predicted); q10-q90 covering 80% of the runs of both together."""
    import sys

    sys.path.insert(0, str(REPO / "experiments"))
    import pandas as pd
    from published_runs import score

    from paratune.measurement import family_of
    from paratune.models import PerformanceModel, load_measurements, metrics
    from paratune.models._estimators import PRED_WARNING

    model = PerformanceModel(n_estimators=200).fit(
        load_measurements(sorted(public_dir.glob("*.csv"))))
    published = load_measurements(list(ROWS)).reset_index(drop=True)
    pred = model.predict(published).reset_index(drop=True)
    assert np.isfinite(pred["pred_step_time_s"].to_numpy(float)).all()
    assert all(f"no measurement of family {family_of(s)}" in w
               for s, w in zip(published["source"], pred[PRED_WARNING], strict=True))
    both = pd.concat([published, pred], axis=1)
    rows = score(both)
    assert [r["source"] for r in rows] == ["megatron_lm_korthikanti2022", "torchtitan_fsdp2"]
    for row in rows:
        assert 0.8 <= row["ratio_median"] <= 1.25, row
        assert row["mdape"] <= 20.0, row
    assert metrics(both, both)["coverage"] >= 0.8
    ratio = pred["pred_tokens_per_sec_per_gpu"].to_numpy(float) / (
        published["global_batch_size"].to_numpy(float) * published["seq_len"].to_numpy(float)
        / (published["step_time_s"].to_numpy(float) * published["world_size"].to_numpy(float)))
    assert np.all(np.abs(ratio - 1.0) < 0.35), ratio
