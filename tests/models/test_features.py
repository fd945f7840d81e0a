"""One test per analytical feature, against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from paratune import ModelSpec, ParallelConfig, get_hardware, get_model
from paratune.models import features as F

H100 = get_hardware("H100")
# A small Llama-style model with round numbers: every figure below is checkable by hand.
SPEC = ModelSpec(name="t", num_layers=8, hidden_size=1024, num_heads=8, ffn_hidden_size=4096,
                 vocab_size=32768, seq_len=2048)


def row(**config):
    base = {"global_batch_size": 64}
    base.update(config)
    return F.config_row(SPEC, ParallelConfig(**base), H100)


def test_model_flops_per_device_matches_spec():
    frame = row(dp=2, tp=2, pp=2, micro_batch_size=2)
    expected = SPEC.flops_per_token() * 64 * 2048 / 8
    assert F.model_flops_per_device(frame)[0] == pytest.approx(expected)


def test_num_microbatches():
    assert F.num_microbatches(row(dp=4, micro_batch_size=2))[0] == 8


@pytest.mark.parametrize(("schedule", "virtual", "expected"), [
    ("1f1b", 1, 3 / (8 + 3)),
    ("gpipe", 1, 3 / (8 + 3)),
    ("interleaved_1f1b", 2, 1.5 / (8 + 1.5)),
])
def test_bubble_fraction_by_schedule(schedule, virtual, expected):
    frame = row(dp=2, pp=4, micro_batch_size=4, schedule=schedule, virtual_stages=virtual)
    assert F.bubble_fraction(frame)[0] == pytest.approx(expected)
    assert F.bubble_fraction(row(dp=2, micro_batch_size=4))[0] == 0


def test_interleaved_bubble_follows_the_largest_chunk():
    # 8 layers over pp=2 ranks x 3 virtual stages: chunks of 2, 2, 1, 1, 1, 1 layers (4 per
    # rank); filling the pipeline takes pp-1 = 1 pass of a 2-layer chunk, half a rank's
    # micro-batch, not (pp-1)/v = 1/3 of it
    frame = row(pp=2, micro_batch_size=4, schedule="interleaved_1f1b", virtual_stages=3)
    assert F.bubble_fraction(frame)[0] == pytest.approx(0.5 / (16 + 0.5))
    parts = F.analytical_step_time(frame)
    per_micro = (parts["compute_s"][0] + parts["tp_s"][0] + parts["pp_s"][0]) / 16
    assert parts["bubble_s"][0] == pytest.approx(0.5 * per_micro)
    # uneven stages without interleaving: pp-1 passes of the fullest stage, as before
    deep = F.config_row(ModelSpec(name="t7", num_layers=7, hidden_size=1024, num_heads=8,
                                  ffn_hidden_size=4096, vocab_size=32768, seq_len=2048),
                        ParallelConfig(pp=2, micro_batch_size=4, global_batch_size=64), H100)
    assert F.bubble_fraction(deep)[0] == pytest.approx(1 / (16 + 1))


def test_tp_bytes_per_microbatch_and_node_crossing():
    frame = row(tp=4, pp=2, micro_batch_size=1)
    tensor = 1 * 2048 * 1024 * 2  # micro * seq * hidden * bf16
    expected = 4 * 4 * 2 * 3 / 4 * tensor  # 4 layers/stage, 4 all-reduces, 2(tp-1)/tp
    assert F.tp_bytes_per_microbatch(frame)[0] == pytest.approx(expected)
    assert F.tp_bytes_per_microbatch(row(tp=4, pp=2, recompute="full"))[0] == pytest.approx(
        expected * 6 / 4)
    assert F.tp_crosses_nodes(frame)[0] == 0
    assert F.tp_crosses_nodes(row(tp=16))[0] == 1


def test_groups_across_nodes_reduce_hierarchically():
    # H100 nodes of 8: 450 GB/s inside, 50 GB/s per device across. Inside a node every byte
    # of the ring's traffic goes at 450 GB/s.
    intra, inter = 450e9, 50e9
    inside = row(tp=8)
    assert F.hierarchical_tp_s_per_microbatch(inside)[0] == pytest.approx(
        F.tp_bytes_per_microbatch(inside)[0] / intra)
    # tp=16 over two whole nodes: 2*7/8 of the tensor inside each node, then 2*1/2 of it
    # across, each of the node's 8 cards carrying an eighth; the ring's traffic is 2*15/16
    wide = row(tp=16)
    tensor = F.tp_bytes_per_microbatch(wide)[0] / (2 * 15 / 16)
    expected = tensor * (2 * 7 / 8 / intra + 2 * 1 / 2 / (8 * inter))
    assert F.hierarchical_tp_s_per_microbatch(wide)[0] == pytest.approx(expected)
    # 6x less than every byte at the inter-node bandwidth, as the analytical estimate has it
    flat = F.tp_bytes_per_microbatch(wide)[0] / inter
    assert 5 < flat / expected < 7
    # data parallelism of 16 with tp=1 spans two nodes with 8 members in each: the same
    # shape; with tp=8 one member per node, which is the plain ring across nodes
    per_byte = F.group_seconds_per_byte(F.Columns(wide), np.array([16.0]), np.array([8.0]),
                                        np.array([True]))[0]
    assert per_byte == pytest.approx(expected / F.tp_bytes_per_microbatch(wide)[0])
    assert F.group_seconds_per_byte(F.Columns(wide), np.array([4.0]), np.array([1.0]),
                                    np.array([True]))[0] == pytest.approx(1 / inter)


def test_hierarchical_reduction_keeps_the_overlap_of_the_analytical_one():
    # inside a node both count the same bytes at the same bandwidth, latency and overlap
    frame = pd.concat([row(dp=8, micro_batch_size=1), row(dp=4, tp=2, sharding="zero1")],
                      ignore_index=True)
    assert np.allclose(F.hierarchical_dp_s(frame), F.analytical_step_time(frame)["dp_s"])
    # across nodes with 8 members per node the hierarchical reduction is the cheaper one
    wide = row(dp=32, micro_batch_size=1, global_batch_size=64, sharding="zero1")
    assert F.hierarchical_dp_s(wide)[0] < 0.5 * F.analytical_step_time(wide)["dp_s"][0]


def test_pp_p2p_bytes_and_node_crossing():
    assert F.pp_p2p_bytes_per_microbatch(row(pp=2, micro_batch_size=2))[0] == pytest.approx(
        2 * 2 * 2048 * 1024 * 2)
    assert F.pp_p2p_bytes_per_microbatch(row())[0] == 0
    assert F.pp_crosses_nodes(row(pp=2, dp=4, tp=2))[0] == 1  # stride 8: every boundary
    assert F.pp_crosses_nodes(row(pp=4, dp=1, tp=4))[0] == pytest.approx(1 / 3)
    assert F.pp_crosses_nodes(row(pp=4, tp=2))[0] == 0  # 8 devices, one node


# Bytes per parameter, times (dp-1)/dp: bf16 gradients (2) reduced, bf16 parameters (2)
# gathered; dp=4 and micro-batch 1 of a global batch of 64 make 16 micro-batches per step.
@pytest.mark.parametrize(("sharding", "pp", "per_param"), [
    ("none", 1, 2 * 2),  # all-reduce of the gradients
    ("zero1", 1, 2 + 2),  # reduce-scatter of the gradients, all-gather of the parameters
    ("zero2", 1, 16 * (2 + 2)),  # both once per micro-batch (reduce-scattered per backward)
    ("zero3", 1, 16 * (2 + 2 + 2)),  # and the parameters gathered again for the backward
    ("none", 2, 2 * 2),
    ("zero1", 2, 2 + 2),
    ("zero2", 2, 2 + 2),  # pipelined: gradients accumulate unsharded, reduced once
    ("zero3", 2, 2 + 16 * (2 + 2)),  # ... but parameters gathered every micro-batch
])
def test_dp_reduction_bytes_by_sharding(sharding, pp, per_param):
    frame = row(dp=4, pp=pp, micro_batch_size=1, sharding=sharding)
    if pp == 1:
        params = SPEC.num_params  # untied: both embeddings on the single stage
    else:  # the fullest rank: half the blocks, one embedding, the final norm
        params = (SPEC.num_params - 2 * 32768 * 1024 - 1024) / 2 + 32768 * 1024 + 1024
    assert F.dp_reduction_bytes(frame)[0] == pytest.approx(per_param * 3 / 4 * params,
                                                           rel=1e-6)
    assert F.dp_crosses_nodes(frame)[0] == 0
    assert F.dp_crosses_nodes(row(dp=16, tp=1))[0] == 1
    assert F.dp_crosses_nodes(row(dp=4, tp=4))[0] == 1


@pytest.mark.parametrize(("sharding", "params", "grads", "optimizer"), [
    ("none", 2, 4, 12), ("zero1", 2, 4, 3), ("zero2", 2, 1, 3), ("zero3", 0.5, 1, 3)])
def test_parameter_gradient_optimizer_memory(sharding, params, grads, optimizer):
    frame = row(dp=4, sharding=sharding)
    n = SPEC.num_params
    assert F.parameter_memory_bytes(frame)[0] == pytest.approx(params * n, rel=1e-6)
    assert F.gradient_memory_bytes(frame)[0] == pytest.approx(grads * n, rel=1e-6)
    assert F.optimizer_memory_bytes(frame)[0] == pytest.approx(optimizer * n, rel=1e-6)


def test_activation_memory_scales_with_micro_batch_tp_and_recompute():
    one = F.activation_memory_bytes(row(micro_batch_size=1))[0]
    tokens = 2048
    per_layer = tokens * (18 * 1024 + 2 * 3 * 4096)
    assert one == pytest.approx(8 * per_layer + tokens * 32768 * 4)
    assert F.activation_memory_bytes(row(micro_batch_size=2))[0] == pytest.approx(2 * one)
    assert F.activation_memory_bytes(row(tp=2, micro_batch_size=1))[0] == pytest.approx(one / 2)
    logits = tokens * 32768 * 4
    full = F.activation_memory_bytes(row(micro_batch_size=1, recompute="full"))[0]
    assert full - logits == pytest.approx(8 * tokens * 1024 * 2 + per_layer)
    # 1F1B keeps pp micro-batches in flight on the first stage
    f1b = F.activation_memory_bytes(row(pp=4, micro_batch_size=1))[0]
    assert f1b == pytest.approx(4 * 2 * per_layer)


def test_gpipe_last_rank_holds_every_micro_batch_and_its_logits():
    # GPipe runs all 64 forwards before any backward: the first rank holds 64 micro-batches of
    # its 2 layers, the last rank the same plus the 64 micro-batches' fp32 logits
    tokens = 2048
    per_layer = tokens * (18 * 1024 + 2 * 3 * 4096)
    logits = tokens * 32768 * 4
    gpipe = F.activation_memory_bytes(row(pp=4, micro_batch_size=1, schedule="gpipe"))[0]
    assert gpipe == pytest.approx(64 * (2 * per_layer + logits))


def test_full_recompute_working_set_is_not_multiplied_by_micro_batches_in_flight():
    # each micro-batch in flight stores its layers' inputs; the one layer being recomputed
    # is materialised once, whatever the micro-batches in flight
    tokens = 2048
    per_layer = tokens * (18 * 1024 + 2 * 3 * 4096)
    inputs = tokens * 1024 * 2
    logits = tokens * 32768 * 4
    first = F.activation_memory_bytes(row(pp=8, micro_batch_size=1, recompute="full"))[0]
    # pp=8: one layer per rank, 8 micro-batches in flight on the first rank; the last rank's
    # one micro-batch with its logits is the larger
    assert first == pytest.approx(max(8 * inputs + per_layer, inputs + per_layer + logits))
    assert first == pytest.approx(inputs + per_layer + logits)
    # a small vocabulary: the first rank is the fuller
    small = ModelSpec(name="v", num_layers=8, hidden_size=1024, num_heads=8,
                      ffn_hidden_size=4096, vocab_size=256, seq_len=2048)
    frame = F.config_row(small, ParallelConfig(pp=4, micro_batch_size=1, global_batch_size=64,
                                               recompute="full"), H100)
    assert F.activation_memory_bytes(frame)[0] == pytest.approx(4 * 2 * inputs + per_layer)


def test_analytical_step_time_is_compute_plus_communication_with_bubble():
    frame = row(dp=1, micro_batch_size=1)
    parts = F.analytical_step_time(frame)
    assert parts["step_time_s"][0] == pytest.approx(
        SPEC.flops_per_token() * 64 * 2048 / H100.peak_flops)
    piped = F.analytical_step_time(row(pp=2, micro_batch_size=1))
    assert piped["bubble_s"][0] > 0 and piped["pp_s"][0] > 0
    total = sum(piped[k][0] for k in ("compute_s", "tp_s", "pp_s", "bubble_s", "dp_s"))
    assert piped["step_time_s"][0] == pytest.approx(total)
    # crossing nodes uses the slower link (ZeRO-1: the reduction that nothing hides)
    kw = dict(micro_batch_size=1, global_batch_size=64, sharding="zero1")
    inside = F.analytical_step_time(row(dp=8, **kw))
    across = F.analytical_step_time(row(dp=16, **kw))
    ratio = H100.intra_node_bw / H100.inter_node_bw
    across_bytes_s = across["dp_s"][0] - F.dp_latency_s(row(dp=16, **kw))[0]
    assert across_bytes_s / inside["dp_s"][0] == pytest.approx(ratio * (15 / 16) / (7 / 8))


def test_ddp_hides_its_all_reduce_behind_the_last_backward_and_zero1_does_not():
    kw = dict(dp=16, micro_batch_size=1, global_batch_size=64)
    ddp = F.analytical_step_time(row(**kw))
    zero1 = F.analytical_step_time(row(**kw, sharding="zero1"))
    # the same bytes (2 per gradient), ZeRO-1's exposed, DDP's less the last backward
    last_backward = 2.0 / 3.0 * ddp["compute_s"][0] / F.num_microbatches(row(**kw))[0]
    assert ddp["dp_s"][0] == pytest.approx(max(zero1["dp_s"][0] - last_backward,
                                               0.1 * zero1["dp_s"][0]))
    assert ddp["dp_s"][0] < zero1["dp_s"][0]


def test_full_recompute_scales_the_compute_by_four_thirds():
    # the baseline the learned correction is fitted to (see analytical_step_time)
    plain = F.analytical_step_time(row(dp=1, micro_batch_size=1))["compute_s"][0]
    full = F.analytical_step_time(row(dp=1, micro_batch_size=1, recompute="full"))["compute_s"]
    assert plain == pytest.approx(SPEC.flops_per_token() * 64 * 2048 / H100.peak_flops)
    assert full[0] == pytest.approx(4 / 3 * plain)


def test_tp_groups_cross_nodes_unless_tp_divides_the_node():
    spec = SPEC.replace(num_heads=12, num_kv_heads=12, hidden_size=1152, vocab_size=32760)
    crosses = [F.tp_crosses_nodes(F.config_row(spec, ParallelConfig(tp=tp, dp=24 // tp,
                                                                     global_batch_size=48),
                                               H100))[0] for tp in (2, 4, 6, 12)]
    assert crosses == [0.0, 0.0, 1.0, 1.0]  # 6 fits in 8 devices but not in their layout


def test_a_well_tuned_framework_grows_its_buckets_with_the_data_parallel_group():
    """Megatron-LM's buckets hold max(40M, 1M x dp) parameters: at dp=256 (32 nodes) a
    256M-parameter bucket, where the fixed 25 MB bucket cuts the same gradients in ~10x as
    many ring reductions, each paying 2 (nodes - 1) hops."""
    from paratune.models._step_time import _stage_gradient_bytes

    kw = dict(dp=256, tp=1, micro_batch_size=1, global_batch_size=256)
    frame = row(**kw)
    c = F.Columns(frame)
    grads = _stage_gradient_bytes(c)[0]
    hops = 2 * (32 - 1) * F.DP_HOP_LATENCY_S
    fixed = F.dp_latency_s(frame)[0]
    tuned = F.dp_latency_s(frame, well_tuned=True)[0]
    assert fixed == pytest.approx(np.ceil(grads / F.DP_BUCKET_BYTES) * hops)
    assert tuned == pytest.approx(np.ceil(grads / (256e6 * 2)) * hops)
    assert tuned < fixed / 5
    # a small group keeps the 40M-parameter floor; one node pays no latency either way
    small = row(dp=16, tp=1, micro_batch_size=4, global_batch_size=64)
    assert F.dp_latency_s(small, well_tuned=True)[0] == pytest.approx(
        np.ceil(_stage_gradient_bytes(F.Columns(small))[0] / 80e6) * 2 * (2 - 1)
        * F.DP_HOP_LATENCY_S)
    assert F.dp_latency_s(row(dp=8, micro_batch_size=8), well_tuned=True)[0] == 0.0
    # the reduction's seconds shrink by the latency saved, nothing else
    assert (F.hierarchical_dp_s(frame)[0] - F.hierarchical_dp_s(frame, well_tuned=True)[0]
            == pytest.approx(fixed - tuned))


def test_dp_latency_is_paid_every_micro_batch_where_the_reduction_is():
    # dp=32, tp=2 spans 8 nodes; 4 micro-batches per step
    kw = dict(dp=32, tp=2, micro_batch_size=1, global_batch_size=128)
    once = F.dp_latency_s(row(**kw))[0]
    assert once > 0
    assert F.dp_latency_s(row(**kw, sharding="zero1"))[0] == pytest.approx(once)
    assert F.dp_latency_s(row(**kw, sharding="zero2"))[0] == pytest.approx(4 * once)
    assert F.dp_latency_s(row(**kw, sharding="zero3"))[0] == pytest.approx(4 * once)


def test_dp_latency_counts_buckets_and_inter_node_ring_steps():
    # inside one node, or without data parallelism: no latency term
    assert F.dp_latency_s(row(dp=8, micro_batch_size=1, global_batch_size=64))[0] == 0
    assert F.dp_latency_s(row(dp=1, tp=16, micro_batch_size=1))[0] == 0
    # dp=32, tp=2 on 8-device nodes spans 8 nodes: 2 * 7 ring steps per bucket
    frame = row(dp=32, tp=2, micro_batch_size=1, global_batch_size=64)
    assert F.dp_nodes(frame)[0] == 8
    stage_bytes = (F.parameter_memory_bytes(frame)[0])  # bf16 weights = bf16 gradients
    buckets = np.ceil(stage_bytes / F.DP_BUCKET_BYTES)
    assert F.dp_latency_s(frame)[0] == pytest.approx(buckets * 14 * F.DP_HOP_LATENCY_S)
    # tp fills the node: every data-parallel rank sits in another node
    assert F.dp_nodes(row(dp=4, tp=8, micro_batch_size=1, global_batch_size=64))[0] == 4
    # the latency grows with the nodes spanned, the bytes term does not
    wider = row(dp=64, tp=2, micro_batch_size=1, global_batch_size=64)
    assert F.dp_latency_s(wider)[0] > F.dp_latency_s(frame)[0]


def test_features_are_finite_and_relative():
    frame = pd.concat([row(dp=2, tp=2, pp=2, micro_batch_size=2), row(tp=16)])
    X, analytical = F.compute_features(frame)
    assert X.shape == (2, len(F.FEATURE_NAMES)) and np.isfinite(X).all()
    # the shares of compute and traffic are of the core's step, which also holds the
    # element-wise work, the loss and the fixed costs: parts of a whole, not all of it
    shares = X[:, [F.FEATURE_NAMES.index(f"frac_{k}") for k in ("compute", "tp", "pp", "dp")]]
    assert (shares >= 0).all() and (shares.sum(axis=1) < 1).all()
    assert (shares[:, 0] > 0).all()
    assert (analytical["error"] == "").all()


def test_the_tensor_parallel_share_of_a_group_across_nodes_is_the_hierarchical_one():
    """A 16-way tensor-parallel group over two 8-device nodes: the bare analytical estimate
    prices every byte at one network card's bandwidth and reads the step as nearly all
    traffic; the feature is the share the core gives it (reduced within each node first),
    and it shrinks as the model widens, which the flat share hardly does."""
    from paratune.models._calibration import core_shares

    wider = ModelSpec(name="w", num_layers=8, hidden_size=4096, num_heads=32,
                      ffn_hidden_size=16384, vocab_size=32768, seq_len=2048)
    small = row(tp=16, micro_batch_size=8)
    wide = F.config_row(wider, ParallelConfig(tp=16, micro_batch_size=8, global_batch_size=64),
                        H100)
    for frame in (small, wide):
        X, analytical = F.compute_features(frame)
        flat = analytical["tp_s"][0] / analytical["step_time_s"][0]
        share = X[0, F.FEATURE_NAMES.index("frac_tp")]
        assert share == pytest.approx(core_shares(F.Columns(frame), analytical)["tp"][0])
        assert share < 0.8 * flat
    share = [F.compute_features(f)[0][0, F.FEATURE_NAMES.index("frac_tp")]
             for f in (small, wide)]
    assert share[1] < share[0]


def test_zero1_over_one_data_parallel_rank_has_the_features_of_no_sharding():
    """ZeRO-1 over dp=1 shards nothing: the same run as none, so the same features (a model
    must not tell them apart by a category the measurements almost never hold)."""
    for layout in (dict(tp=2, pp=4, micro_batch_size=2), dict(pp=8, micro_batch_size=1)):
        plain, zero1 = (F.compute_features(row(**layout, sharding=s))[0]
                        for s in ("none", "zero1"))
        np.testing.assert_array_equal(zero1, plain)
    # with data parallelism it shards the optimizer state: other features
    plain, zero1 = (F.compute_features(row(dp=2, pp=4, micro_batch_size=2, sharding=s))[0]
                    for s in ("none", "zero1"))
    assert not np.array_equal(zero1, plain)


def test_unknown_hardware_gives_nan_and_message():
    frame = row()
    frame["hardware"] = "TPU-v9"
    _, analytical = F.compute_features(frame)
    assert np.isnan(analytical["step_time_s"][0])
    assert analytical["error"][0].startswith("hardware='TPU-v9': is not a known device")


def test_unknown_option_value_gives_message_naming_field_and_rule():
    frame = pd.concat([row(), row(), row()]).reset_index(drop=True)
    frame["sharding"] = ["zero-1", "zero1", None]
    X, analytical = F.compute_features(frame)
    assert analytical["error"][0] == "sharding='zero-1' must be one of none, zero1, zero2, zero3"
    # a known value and an empty cell (the default) are fine
    assert list(analytical["error"][1:]) == ["", ""]
    assert X[2, F.FEATURE_NAMES.index("sharding")] == 0


def test_model_keys_keep_every_digit():
    a, b = row(), row()
    a["vocab_size"], b["vocab_size"] = 1048576, 1048580
    keys = F.model_keys(pd.concat([a, b]))
    assert keys[0] != keys[1] and "V1048576" in keys[0]


def test_features_of_a_mixed_frame_are_those_of_its_rows_one_by_one():
    """Each row's features depend on that row alone: a frame of varied layouts, options,
    models and devices gets the rows it would get one configuration at a time."""
    layouts = [
        (SPEC, dict(dp=2, tp=2, micro_batch_size=2), "H100", None),
        (SPEC, dict(dp=4, pp=2, micro_batch_size=1, sharding="zero3", recompute="full"),
         "A100-40GB", None),
        (SPEC, dict(tp=4, pp=2, micro_batch_size=4, schedule="gpipe"), "B200", 4),
        (SPEC, dict(dp=2, pp=4, micro_batch_size=1, schedule="interleaved_1f1b",
                    virtual_stages=2, sharding="zero1"), "H200", None),
        (SPEC, dict(dp=8, micro_batch_size=2, sharding="zero2", recompute="selective"),
         "cpu", None),
        (get_model("llama3.2-1b", seq_len=4096),
         dict(dp=4, tp=8, pp=2, micro_batch_size=1, global_batch_size=256), "H100", 8),
        (SPEC, dict(dp=2, tp=2, micro_batch_size=2), "H100", None),  # unknown hardware below
    ]
    frame = pd.concat([F.config_row(model, ParallelConfig(**{"global_batch_size": 64, **cfg}),
                                    hw, devices_per_node=per_node)
                       for model, cfg, hw, per_node in layouts], ignore_index=True)
    frame.loc[len(layouts) - 1, "hardware"] = "TPU-v9"
    X, analytical = F.compute_features(frame)
    singles = [F.compute_features(frame.iloc[[i]]) for i in range(len(frame))]
    assert X.shape == (len(frame), len(F.FEATURE_NAMES))
    np.testing.assert_allclose(X, np.vstack([x for x, _ in singles]), rtol=1e-6,
                               equal_nan=True)
    assert set(analytical) == set(singles[0][1])
    for key, values in analytical.items():
        stacked = np.concatenate([part[key] for _, part in singles])
        if values.dtype == object:  # the messages
            assert list(values) == list(stacked), key
        else:
            np.testing.assert_allclose(values, stacked, rtol=1e-12, equal_nan=True,
                                       err_msg=key)
    # the rows are really different configurations, and only the last lacks figures
    known = X[:-1]
    assert len(np.unique(known, axis=0)) == len(known)
    assert np.isfinite(analytical["step_time_s"][:-1]).all()
    assert np.isnan(analytical["step_time_s"][-1])
    assert analytical["error"][-1].startswith("hardware='TPU-v9'")


def test_model_keys_name_the_architecture_not_the_label():
    a = row()
    renamed = a.assign(model_name="something-else", dp=4, tp=2)
    deeper = a.assign(num_layers=a["num_layers"] * 2)
    keys = F.model_keys(pd.concat([a, renamed, deeper], ignore_index=True))
    assert keys[0] == keys[1] != keys[2]
    assert keys[0].startswith(f"L{a['num_layers'].iloc[0]:g}-H{a['hidden_size'].iloc[0]:g}-")


def test_stalled_pipeline_needs_a_pipeline_an_accelerator_slow_micro_batches_and_low_mfu():
    from paratune.predictor import config_frame

    configs = [ParallelConfig(dp=2, tp=2, pp=4, micro_batch_size=1, global_batch_size=16),
               ParallelConfig(dp=8, tp=2, pp=1, micro_batch_size=1, global_batch_size=16)]
    small = get_model("llama3.2-1b", seq_len=4096)
    gpu = config_frame(small, configs, "H100")
    micro = F.num_microbatches(gpu)
    stalled_time = 1.2 * micro  # 1.2 s per micro-batch: a few percent of an H100's peak
    assert F.stalled_pipeline(gpu, stalled_time).tolist() == [True, False]  # pp=1: no pipeline
    cpu = config_frame(small, configs, "cpu")
    assert not F.stalled_pipeline(cpu, stalled_time).any()  # ordinary on a CPU
    assert not F.stalled_pipeline(gpu, 0.4 * micro).any()  # fast micro-batches
    assert not F.stalled_pipeline(gpu, np.full(2, np.nan)).any()  # no measurement
    # slow micro-batches that keep the device busy: a large model near peak, not a stall
    large = config_frame(get_model("llama3-70b", seq_len=4096),
                         [ParallelConfig(dp=2, tp=2, pp=4, micro_batch_size=8,
                                         global_batch_size=128)], "H100")
    busy = F.model_flops_per_device(large) / (0.5 * get_hardware("H100").peak_flops)
    assert busy / F.num_microbatches(large) > F.STALL_MIN_SECONDS_PER_MICROBATCH
    assert not F.stalled_pipeline(large, busy).any()
    assert F.stalled_pipeline(large, 10 * busy).all()  # 5% of peak: stalled


def test_step_time_at_mfu_is_the_model_flops_at_that_share_of_the_peak():
    frame = row(dp=2, tp=2, pp=2, micro_batch_size=2)
    at_peak = F.model_flops_per_device(frame)[0] / H100.peak_flops
    assert F.step_time_at_mfu(frame)[0] == pytest.approx(at_peak)
    assert F.step_time_at_mfu(frame, 0.5)[0] == pytest.approx(2 * at_peak)


def test_stall_floor_is_the_fastest_step_the_stalled_regime_admits():
    from paratune.predictor import config_frame

    configs = [ParallelConfig(dp=2, tp=2, pp=4, micro_batch_size=1, global_batch_size=16),
               ParallelConfig(dp=2, tp=2, pp=4, micro_batch_size=8, global_batch_size=128)]
    frame = config_frame(get_model("llama3-70b", seq_len=4096), configs, "H100")
    floor = F.stall_floor_s(frame)
    micro = F.num_microbatches(frame)
    by_mfu = F.model_flops_per_device(frame) / (F.STALL_MAX_MFU * get_hardware("H100").peak_flops)
    np.testing.assert_allclose(floor, np.maximum(F.STALL_MIN_SECONDS_PER_MICROBATCH * micro,
                                                 by_mfu))
    assert by_mfu[1] > F.STALL_MIN_SECONDS_PER_MICROBATCH * micro[1]  # a large model: MFU binds
    # just above the floor a run is stalled, just below it is not
    assert F.stalled_pipeline(frame, floor * 1.01).all()
    assert not F.stalled_pipeline(frame, floor * 0.99).any()
