"""The parallelism is real: every layout computes exactly the single-process training.

One group of 4 gloo processes runs two optimizer steps of the same model (same seed, same
global batches) under each layout in turn, and one group of 8 runs a full pp x dp x tp
layout; every step's loss, the last step's gradients and the updated parameters (gathered
whole by name across tensor-parallel / FSDP shards and pipeline stages) are compared with
the same steps in one process. Two steps, because Adam's first step moves each element by
about ``lr * sign(g)`` whatever the optimizer state: the second checks the state each
layout keeps (sharded by ZeRO-1/2/3) and the gradients at the updated parameters.
Everything runs in float64, where reduction-order differences are ~1e-13 after two steps,
so the tolerances below (loss and gradients 1e-10 relative, parameters 1e-9 relative to the
tensor's largest entry) are tight enough that a missing or doubled reduction, a wrong
shard, a lost micro-batch or a step on stale optimizer state fails by many orders of
magnitude.

Covered (layout x schedule x sharding x recompute, micro-batches per data-parallel rank):

=========================  ===========  =====  ==========  ===  =====================
layout                     schedule     shard  recompute   mbs  also
=========================  ===========  =====  ==========  ===  =====================
dp2 tp2                    -            none   none        2    GQA, 2 q heads per kv
pp2 tp2                    1f1b         -      none        4
pp2 dp2                    1f1b         none   none        4
pp2 dp2                    1f1b         zero3  full        3    odd micro-batch count
pp2 dp2                    1f1b         zero1  none        4
dp4                        -            zero3  none        2
dp4                        -            zero2  none        2
dp2 tp2                    -            zero2  full        2
dp4                        -            zero1  none        1
pp2 dp2                    interl. v2   none   selective   4    4 stages on 2 ranks
pp2 dp2                    interl. v2   zero2  none        4
pp2 dp2                    interl. v2   zero1  none        4
pp2 tp2                    interl. v2   -      full        8
pp4                        gpipe        -      none        4
dp4 (GPT)                  -            zero3  none        2    tied, GELU, 1 kv/rank
dp2 tp2 (GPT)              -            none   full        2    tied, GELU, 1 kv/rank
dp2 tp2 (GPT)              -            zero3  selective   4    tied, FSDP2 on TP
pp2 dp2 tp2 (8 processes)  interl. v2   zero3  selective   6    3D
=========================  ===========  =====  ==========  ===  =====================

Not covered because the trainer refuses them with a ``ConfigError``: tied embeddings with
``pp > 1`` and ``zero1`` with ``tp > 1`` (see ``test_trainer.py``).
"""

from __future__ import annotations

import pytest
import torch

from paratune import ParallelConfig, get_model
from paratune.profiler.equivalence import run_layouts

LOSS_RTOL = 1e-10
GRAD_RTOL = 1e-10
PARAM_RTOL = 1e-9
STEPS = 2

_GB = 8
_SPEC = get_model("tiny").replace(seq_len=32)
_GPT = _SPEC.replace(tie_embeddings=True, mlp="gelu", num_kv_heads=2)
LAYOUTS = [
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=_GB),
    ParallelConfig(pp=2, tp=2, micro_batch_size=2, global_batch_size=_GB),
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB),
    # Three micro-batches: a count that is not a power of two scales gradients inexactly, so
    # float32 rounding anywhere in the model shows (a power of two hides it); ZeRO-3 and
    # full recompute inside pipeline stages.
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=6, sharding="zero3",
                   recompute="full"),
    # ZeRO-1 inside pipeline stages: each stage's optimizer state sharded over its dp ranks.
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB, sharding="zero1"),
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=_GB, sharding="zero3"),
    # ZeRO-2 without pipelining: parameters kept unsharded and gradients accumulated over the
    # two micro-batches, reduce-scattered once.
    ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=_GB, sharding="zero2"),
    ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=_GB, sharding="zero2",
                   recompute="full"),
    ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=_GB, sharding="zero1"),
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB,
                   schedule="interleaved_1f1b", virtual_stages=2, recompute="selective"),
    # Two FSDP roots (virtual stages) per rank.
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB,
                   schedule="interleaved_1f1b", virtual_stages=2, sharding="zero2"),
    # ZeRO-1 over two virtual stages per rank.
    ParallelConfig(pp=2, dp=2, micro_batch_size=1, global_batch_size=_GB,
                   schedule="interleaved_1f1b", virtual_stages=2, sharding="zero1"),
    ParallelConfig(pp=2, tp=2, micro_batch_size=1, global_batch_size=_GB,
                   schedule="interleaved_1f1b", virtual_stages=2, recompute="full"),
    ParallelConfig(pp=4, micro_batch_size=2, global_batch_size=_GB, schedule="gpipe"),
    # GPT-style: tied embedding (left unsplit by TP, materialised before FSDP), GELU MLP,
    # 2 kv heads.
    (_GPT, ParallelConfig(dp=4, micro_batch_size=1, global_batch_size=_GB, sharding="zero3")),
    (_GPT, ParallelConfig(dp=2, tp=2, micro_batch_size=2, global_batch_size=_GB,
                          recompute="full")),
    (_GPT, ParallelConfig(dp=2, tp=2, micro_batch_size=1, global_batch_size=_GB,
                          sharding="zero3", recompute="selective")),
]
# pp x dp x tp at once (8 processes): FSDP2 over the (dp, tp) mesh inside interleaved
# pipeline stages, six micro-batches per data-parallel rank.
LAYOUTS_3D = [
    ParallelConfig(pp=2, dp=2, tp=2, micro_batch_size=1, global_batch_size=12,
                   schedule="interleaved_1f1b", virtual_stages=2, sharding="zero3",
                   recompute="selective"),
]


def _layout_id(layout) -> str:
    return f"gpt-{layout[1].key()}" if isinstance(layout, tuple) else layout.key()


def _check(result, layout) -> None:
    assert result.config == (layout[1] if isinstance(layout, tuple) else layout)
    assert not result.error, result.error
    assert not result.missing
    assert result.loss_rel_diff < LOSS_RTOL
    assert result.grad_rel_diff < GRAD_RTOL
    assert result.param_rel_diff < PARAM_RTOL, result.worst_param


@pytest.fixture(scope="module")
def results():
    return run_layouts(_SPEC, LAYOUTS, world_size=4, seed=7, steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[_layout_id(c) for c in LAYOUTS])
def test_layout_matches_single_process(results, index):
    _check(results[index], LAYOUTS[index])


@pytest.mark.slow
def test_3d_layout_matches_single_process():
    results = run_layouts(_SPEC, LAYOUTS_3D, world_size=8, seed=7, steps=STEPS)
    for result, layout in zip(results, LAYOUTS_3D, strict=True):
        _check(result, layout)


def test_float64_model_is_not_rounded_to_float32():
    """The comparison is only as sharp as the model's arithmetic: norms and rotary
    embeddings upcast half-precision activations to float32 but must not round float64 ones
    down to it (then layouts agree only to ~1e-7, and only while every gradient scale is a
    power of two)."""
    from paratune.profiler.model import RMSNorm, _apply_rope, rope_tables

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, 8, dtype=torch.float64, generator=gen)
    norm = RMSNorm(8).double()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert norm(x).dtype == torch.float64
    assert (norm(x) - expected).abs().max() < 1e-14
    cos, sin = (t.double() for t in rope_tables(8, 5, 10000.0))
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos.view(1, 5, 1, 4), sin.view(1, 5, 1, 4)
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    assert (_apply_rope(x, cos, sin) - rotated).abs().max() < 1e-14
    # half precision is still computed in float32 and returned in its own dtype
    half = x.to(torch.bfloat16)
    assert norm.to(torch.bfloat16)(half).dtype == torch.bfloat16
    assert _apply_rope(half, cos, sin).dtype == torch.bfloat16


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


def test_second_step_detects_lost_optimizer_state():
    """Control: a layout whose second step started from fresh Adam state (a ZeRO shard that
    lost its moments) must miss the parameter tolerance by orders of magnitude, although its
    first step and every gradient are exact."""
    from paratune.profiler.equivalence import (
        compare,
        reference_optimizer,
        reference_steps,
        reference_update,
    )
    from paratune.profiler.model import build_model
    from paratune.profiler.trainer import synthetic_batch

    batches = [synthetic_batch(_SPEC, _GB, step=step, seed=7) for step in range(STEPS)]
    ref = reference_steps(_SPEC, batches, seed=7, dtype=torch.float64)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(_SPEC, seed=7)
        losses = []
        for tokens in batches:  # a new optimizer each step: no state carried over
            loss, grads = reference_update(model, reference_optimizer(model), tokens)
            losses.append(loss)
    finally:
        torch.set_default_dtype(previous)
    stateless = {"loss": losses[-1], "losses": losses, "grads": grads,
                 "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    result = compare(LAYOUTS[0], stateless, ref)
    assert result.loss_rel_diff < LOSS_RTOL and result.grad_rel_diff < GRAD_RTOL
    assert result.param_rel_diff > 1e3 * PARAM_RTOL
