"""The parallelism is real: every layout computes exactly the single-process step.

One group of 4 gloo processes runs one optimizer step of the same model (same seed, same
global batch) under each layout in turn; the loss, every gradient and every updated
parameter (gathered whole by name across tensor-parallel / FSDP shards and pipeline stages)
are compared with the same step in one process. Everything runs in float64, where
reduction-order differences are ~1e-15, so the tolerances below (loss and gradients 1e-10
relative, parameters 1e-9 relative to the tensor's largest entry) are tight enough that a
missing or doubled reduction, a wrong shard or a lost micro-batch fails by many orders of
magnitude.
"""

from __future__ import annotations

import pytest

from paratune import ParallelConfig, get_model
from paratune.profiler.equivalence import run_layouts

LOSS_RTOL = 1e-10
GRAD_RTOL = 1e-10
PARAM_RTOL = 1e-9

_GB = 8
_SPEC = get_model("tiny").replace(seq_len=32)
_GPT = _SPEC.replace(tie_embeddings=True, mlp="gelu", num_kv_heads=2)
LAYOUTS = [
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=_GB),
    ParallelConfig(pp=2, tp=2, micro_batch_size=2, global_batch_size=_GB),
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB),
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=_GB, sharding="zero3"),
    # ZeRO-2 without pipelining: parameters kept unsharded and gradients accumulated over the
    # two micro-batches, reduce-scattered once.
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=_GB, sharding="zero2"),
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=_GB, sharding="zero2",
                   recompute="full"),
    ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=_GB, sharding="zero1"),
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB,
                   schedule="interleaved_1f1b", virtual_stages=2, recompute="selective"),
    ParallelConfig(pp=4, micro_batch_size=2, global_batch_size=_GB, schedule="gpipe"),
    # GPT-style: tied embedding (left unsplit by TP, materialised before FSDP), GELU MLP,
    # 2 kv heads.
    (_GPT, ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=_GB, sharding="zero3")),
    (_GPT, ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=_GB,
                          recompute="full")),
]


@pytest.fixture(scope="module")
def results():
    return run_layouts(_SPEC, LAYOUTS, world_size=4, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[
    f"gpt-{c[1].key()}" if isinstance(c, tuple) else c.key() for c in LAYOUTS])
def test_layout_matches_single_process(results, index):
    result = results[index]
    layout = LAYOUTS[index]
    assert result.config == (layout[1] if isinstance(layout, tuple) else layout)
    assert not result.error, result.error
    assert not result.missing
    assert result.loss_rel_diff < LOSS_RTOL
    assert result.grad_rel_diff < GRAD_RTOL
    assert result.param_rel_diff < PARAM_RTOL, result.worst_param


def test_comparison_detects_a_lost_data_parallel_reduction():
    """Control: a rank that skipped the gradient all-reduce would step on its own half of
    the batch; that must miss the tolerances above by orders of magnitude."""
    import torch

    from paratune.profiler.equivalence import compare, reference_step
    from paratune.profiler.trainer import synthetic_batch

    spec = get_model("tiny").replace(seq_len=32)
    tokens = synthetic_batch(spec, _GB, step=0, seed=7)
    ref = reference_step(spec, tokens, seed=7, dtype=torch.float64)
    half = reference_step(spec, tokens[: _GB // 2], seed=7, dtype=torch.float64)
    result = compare(LAYOUTS[0], half, ref)
    assert result.grad_rel_diff > 1e3 * GRAD_RTOL
    assert result.param_rel_diff > 1e3 * PARAM_RTOL
    same = compare(LAYOUTS[0], reference_step(spec, tokens, seed=7, dtype=torch.float64), ref)
    assert same.loss_rel_diff == same.grad_rel_diff == same.param_rel_diff == 0.0
