"""The memory baselines of experiments/memory_baselines.py: Megatron-LM's theoretical memory
formula against independent arithmetic, and the scoring of feasibility calls."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from paratune import ParallelConfig, get_model
from paratune.predictor import config_frame

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import memory_baselines as mb  # from experiments/, put on the path above


def _frame(model, **layout):
    return config_frame(model, [ParallelConfig(**layout)], "H100")


def test_weights_and_optimizer_are_18_bytes_per_parameter_of_the_whole_model_on_one_device():
    model = get_model("llama3-8b", seq_len=4096)  # SwiGLU, grouped-query attention, untied
    out = mb.megatron_theoretical_memory(_frame(model, global_batch_size=1))
    assert out["weight_optimizer_bytes"][0] == pytest.approx(18.0 * model.num_params)


def test_distributed_optimizer_and_model_parallel_shards():
    model = get_model("llama3-8b", seq_len=4096)
    h, vocab = model.hidden_size, model.vocab_size
    blocks = model.num_layers * model.params_per_layer + h
    out = mb.megatron_theoretical_memory(_frame(
        model, dp=4, tp=2, pp=4, micro_batch_size=1, global_batch_size=32, sharding="zero1"))
    # first stage: a quarter of the blocks and the input embedding (no output layer with
    # pp > 1), over tp, at 6 + 12/dp bytes
    expected = (blocks / 4 + h * vocab) / 2 * (6 + 12 / 4)
    assert out["weight_optimizer_bytes"][0] == pytest.approx(expected)


def test_activations_follow_korthikanti_table_2():
    # GPT (GeLU, ffn = 4h): with sequence parallelism and selective recomputation a layer
    # holds 34*s*b*h/t bytes (Korthikanti et al. 2022, Table 2); without, s*b*h*(10 + 24/t)
    model = get_model("llama3-8b", seq_len=2048).replace(
        mlp="gelu", ffn_hidden_size=4 * 4096, tie_embeddings=True)
    s, b, h, L, t, p = 2048, 2, 4096, 32, 4, 2
    frame = _frame(model, tp=t, pp=p, micro_batch_size=b, global_batch_size=16,
                   recompute="selective")
    embedding = 8 * s * b * p + s * b * h * p  # 8 micro-batches >= pp: no discount
    with_sp = mb.megatron_theoretical_memory(frame, sequence_parallel=True)
    assert with_sp["activation_bytes"][0] == pytest.approx((34 * s * b * h * L + embedding) / t)
    without = mb.megatron_theoretical_memory(frame)
    assert without["activation_bytes"][0] == pytest.approx(
        (s * b * h * (10 + 24 / t) * L + embedding) * 1.05)
    # fewer micro-batches than stages: only that many are in flight
    few = _frame(model, tp=t, pp=4, micro_batch_size=b, global_batch_size=2,
                 recompute="selective")
    one = mb.megatron_theoretical_memory(few, sequence_parallel=True)["activation_bytes"][0]
    embedding4 = 8 * s * b * 4 + s * b * h * 4
    assert one == pytest.approx((34 * s * b * h * L + embedding4) / 4 / t)


def test_score_counts_false_fits_per_configuration(model_dir, synthetic):
    from paratune.models import load_model

    part = synthetic.reset_index(drop=True)
    pred = load_model(model_dir).predict(part).reset_index(drop=True)
    rows = mb.score(pd.concat([part, pred], axis=1))
    assert [r["predictor"] for r in rows][:2] == ["paratune feasibility classifier",
                                                   "paratune memory regressor < 80%"]
    from paratune.models._data import feasibility_table

    configs = feasibility_table(part)
    failed = int((configs["feasible"] == 0).sum())
    assert failed > 0
    for row in rows:
        assert row["configs"] == len(configs)
        assert 0 <= row["accuracy_pct"] <= 100
        assert row["false_fits"] <= failed
        assert row["false_fits_pct_of_failed"] == pytest.approx(
            100 * row["false_fits"] / failed)
        assert np.isfinite(row["mem_mdape_pct"]) and row["mem_n"] == (synthetic["status"]
                                                                      == "ok").sum()
