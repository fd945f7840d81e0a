"""Context parallelism (``cp``): a sequence split over ``cp`` ranks that pass keys and values
around a ring in attention, as Megatron-LM and torchtitan run it. The layout rules, the
public format and the store take it; the performance model predicts it from the physics
(each rank's share of the tokens, the ring's exchange, gradients reduced over ``dp * cp``),
as a layout no measurement reached; paratune's own trainer refuses it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError, ParallelConfig, get_model
from paratune.batch import ConfigBatch
from paratune.models import features as F
from paratune.predictor import config_frame


def _frame(model, configs, hardware="H100"):
    return config_frame(model, configs, hardware)


def test_the_layout_counts_cp_in_its_world_and_keeps_the_old_keys():
    plain = ParallelConfig(dp=2, tp=2, micro_batch_size=1, global_batch_size=8)
    split = plain.replace(cp=4)
    assert (plain.world_size, split.world_size) == (4, 16)
    assert plain.key() == "dp2-tp2-pp1-mb1-gb8-1f1b-v1-none-none"  # as before cp existed
    assert split.key() == plain.key() + "-cp4"
    assert split.num_microbatches == plain.num_microbatches == 4
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp\*cp = 2\*2\*1\*4 = 16 must equal the "
                                          r"world size 8"):
        split.validate(world_size=8)
    with pytest.raises(ConfigError, match=r"cp.*must be a positive integer"):
        ParallelConfig(cp=0)
    # two chunks per rank, one from each end of the sequence: 2*cp must divide it
    odd = get_model("tiny", seq_len=20)
    with pytest.raises(ConfigError, match=r"2\*cp = 8 must divide seq_len=20"):
        split.validate(odd, runnable=False)
    split.validate(get_model("tiny", seq_len=32), runnable=False)


def test_the_batch_rules_say_what_the_dataclass_says():
    model = get_model("tiny", seq_len=20)
    configs = [ParallelConfig(dp=2, micro_batch_size=1, global_batch_size=4, cp=cp)
               for cp in (1, 5, 4)]
    batch = ConfigBatch.from_configs(model, configs, "H100")
    assert batch.world_size.tolist() == [2, 10, 8]
    errors = batch.validate(runnable=False)
    for config, error in zip(configs, errors, strict=True):
        try:
            config.validate(model, runnable=False)
            expected = None
        except ConfigError as exc:
            expected = str(exc)
        assert (None if error is None else str(error)) == expected
    assert errors[0] is None and errors[1] is None and "2*cp = 8" in str(errors[2])
    # a frame without the column reads cp = 1
    frame = _frame(model, configs[:1]).drop(columns=["cp"])
    assert ConfigBatch.from_frame(frame).cp.tolist() == [1]


def test_paratunes_trainer_refuses_a_split_sequence():
    config = ParallelConfig(dp=2, cp=2, micro_batch_size=1, global_batch_size=4)
    with pytest.raises(ConfigError, match="no context parallelism"):
        config.check_trainer(get_model("tiny"))
    with pytest.raises(ConfigError, match="no context parallelism"):
        config.mesh_shape()


def test_the_analytical_step_splits_the_tokens_and_reduces_over_dp_times_cp():
    """Doubling cp with the other degrees fixed halves each rank's tokens: its matrix
    products, element-wise work and tensor- and pipeline-parallel traffic per micro-batch;
    the gradients are reduced over the dp*cp ranks that hold the same parameters, and the
    activations held halve."""
    model = get_model("llama3-8b", seq_len=8192)
    base = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=1, global_batch_size=16)
    frame = _frame(model, [base, base.replace(cp=2)])
    c = F.Columns(frame)
    assert c.world.tolist() == [8, 16]
    per_micro = F.analytical_step_time(c)["compute_s"] / F.num_microbatches(c)
    assert per_micro[1] == pytest.approx(per_micro[0] / 2)
    for part in (F.tp_bytes_per_microbatch, F.pp_p2p_bytes_per_microbatch,
                 F.elementwise_s_per_microbatch, F.loss_s_per_microbatch):
        values = part(c)
        assert values[1] == pytest.approx(values[0] / 2)
    # the reduction's group: dp*cp = 4 ranks, not dp = 2
    four = F.Columns(_frame(model, [base.replace(dp=4, global_batch_size=32)]))
    assert F.dp_reduction_bytes(c)[1] == pytest.approx(F.dp_reduction_bytes(four)[0])
    activations = F.activation_memory_bytes(c)
    assert activations[1] == pytest.approx(activations[0] / 2)
    # ZeRO-1 with one data-parallel rank but two context-parallel ones shards over the two
    zero1 = ParallelConfig(tp=2, micro_batch_size=1, global_batch_size=8, sharding="zero1")
    z = F.Columns(_frame(model, [zero1, zero1.replace(cp=2)]))
    assert z.sharding.tolist() == [0.0, 1.0]
    optimizer = F.optimizer_memory_bytes(z)
    assert optimizer[1] == pytest.approx(optimizer[0] / 2)


def test_the_exports_shard_over_the_context_parallel_ranks():
    """Megatron-LM gets the degree and, with ZeRO-1 over dp*cp > 1 ranks, its distributed
    optimizer; torchtitan the degree, and a note where it shards over the context-parallel
    ranks although no sharding was asked."""
    from paratune import get_hardware
    from paratune.tuner import megatron_args, torchtitan_args
    from paratune.tuner._export_titan import torchtitan_notes

    model, hw = get_model("llama3-8b"), get_hardware("H100")
    zero1 = ParallelConfig(tp=2, cp=2, micro_batch_size=1, global_batch_size=8,
                           sharding="zero1")
    args = megatron_args(model, zero1, hw)
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert "--use-distributed-optimizer" in args
    assert "--use-distributed-optimizer" not in megatron_args(model, zero1.replace(cp=1), hw)
    titan = torchtitan_args(model, zero1, hw)
    assert titan[titan.index("--parallelism.context_parallel_degree") + 1] == "2"
    ddp = ParallelConfig(dp=2, cp=2, micro_batch_size=1, global_batch_size=8)
    assert any("over the context-parallel ranks" in n for n in torchtitan_notes(model, ddp))
    assert not any("context-parallel" in n for n in torchtitan_notes(model, ddp.replace(cp=1)))


def test_the_ring_exchange_costs_only_what_attention_does_not_cover():
    """Long sequences inside a node: the attention of the chunk in hand covers the ring's
    transfer (nothing added). Short sequences over many nodes: keys and values cross the
    network while little attention runs, and the exchange adds time, more the more ranks."""
    long_ = get_model("llama3-8b", seq_len=32768)
    inside = ParallelConfig(tp=2, cp=4, micro_batch_size=1, global_batch_size=1)
    assert F.cp_s_per_microbatch(F.Columns(_frame(long_, [inside])))[0] == 0.0
    short = get_model("llama3-8b", seq_len=2048)
    across = [ParallelConfig(tp=8, cp=cp, micro_batch_size=1, global_batch_size=1)
              for cp in (2, 4, 8)]
    exposed = F.cp_s_per_microbatch(F.Columns(_frame(short, across)))
    assert np.all(exposed > 0) and np.all(np.diff(exposed) > 0)


def test_a_split_sequence_is_predicted_from_the_core_and_says_so(model_dir):
    """No fitted row split its sequences, so a cp row is beyond the fitted context-parallel
    degrees: the calibrated core's prediction (faster per device-token than the same layout
    with whole sequences on half the devices, but not twice), with a warning; the rows
    without the column predict as before."""
    from paratune.models import load_model
    from paratune.models._estimators import PRED_WARNING

    model = load_model(model_dir)
    spec = get_model("llama3-8b", seq_len=4096)
    base = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=1, global_batch_size=16)
    frame = _frame(spec, [base, base.replace(cp=2)], "H100").assign(source="synthetic")
    pred = model.predict(frame).reset_index(drop=True)
    step = pred["pred_step_time_s"].to_numpy(float)
    assert np.isfinite(step).all()
    assert step[0] / 2 < step[1] < step[0]
    assert "context-parallel degrees by 1.0 doublings" in pred[PRED_WARNING][1]
    assert "context-parallel" not in pred[PRED_WARNING][0]
    without = model.predict(frame.drop(columns=["cp"]).iloc[:1]).reset_index(drop=True)
    pd.testing.assert_frame_equal(without, pred.iloc[:1])
