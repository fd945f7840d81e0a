"""Parallelisation techniques, one function each, a mesh in; applied in a fixed order.

Order (as in torchtitan): :func:`apply_tp`, then :func:`apply_activation_checkpointing`, then
data parallelism: :func:`apply_fsdp` (``zero2`` / ``zero3``) or, once parameters are
materialised, :func:`apply_ddp` (``none`` and ``zero1``; ZeRO-1 then shards the optimizer
state in :func:`build_optimizer`). :func:`parallelize` applies the meta-device-safe part of a
:class:`~paratune.ParallelConfig`'s recipe to one model chunk (the full model or a stage).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig, Recompute, Sharding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from paratune.profiler.model import Transformer

__all__ = ["apply_activation_checkpointing", "apply_ddp", "apply_fsdp", "apply_tp",
           "build_optimizer", "has_dtensor_params", "parallelize", "tp_plan"]


def tp_plan(model: Transformer) -> dict[str, Any]:
    """The Megatron-style tensor-parallel plan of ``model`` as a plain dict.

    Attention ``wq``/``wk``/``wv`` and MLP ``w1``/``w3`` are split column-wise (by heads / by
    inner features) and ``wo``/``w2`` row-wise, so each block needs one all-reduce in forward
    and one in backward per half. The embedding is split row-wise (by vocabulary, output
    all-reduced) and the output projection column-wise with the logits gathered
    (``Replicate``), so the loss is the plain cross-entropy on full logits. With tied
    embeddings the shared matrix is left replicated (one tensor cannot be split two ways).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    tied = model.spec.tie_embeddings
    if model.tok_embeddings is not None and not tied:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None and not tied:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        plan.update({
            f"{prefix}.attention.wq": ColwiseParallel(),
            f"{prefix}.attention.wk": ColwiseParallel(),
            f"{prefix}.attention.wv": ColwiseParallel(),
            f"{prefix}.attention.wo": RowwiseParallel(),
            f"{prefix}.feed_forward.w1": ColwiseParallel(),
            f"{prefix}.feed_forward.w2": RowwiseParallel(),
        })
        if block.feed_forward.w3 is not None:
            plan[f"{prefix}.feed_forward.w3"] = ColwiseParallel()
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Shard ``model`` over ``tp_mesh`` with :func:`tp_plan` (in place).

    Args:
        model: Full model or pipeline stage.
        tp_mesh: The 1-D ``tp`` sub-mesh.

    Returns:
        ``model``, its split weights now DTensors on ``tp_mesh``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    if tp == 1:
        return model
    parallelize_module(model, tp_mesh, tp_plan(model))
    for block in model.layers.values():
        block.attention.num_local_heads = model.spec.num_heads // tp
        block.attention.num_local_kv_heads = model.spec.num_kv_heads // tp
    return model


def apply_activation_checkpointing(model: Transformer, *, mode: str) -> Transformer:
    """Recompute activations in backward instead of keeping them (in place).

    Args:
        model: Full model or pipeline stage.
        mode: ``"none"``; ``"full"``: every block keeps only its input and is recomputed
            whole; ``"selective"``: every block recomputes its attention half (norm,
            projections, rotary, attention scores, output projection) and keeps the MLP's
            activations, which saves the attention activations (the ``seq_len``-quadratic
            part under a math kernel) for about a third of a block's forward FLOPs.

    Returns:
        ``model``.
    """
    mode = Recompute(mode).value
    for block in model.layers.values():
        block.recompute = mode
    return model


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool,
               mp_policy: Any | None = None) -> nn.Module:
    """Shard parameters, gradients and optimizer state over ``dp_mesh`` with FSDP2.

    Each transformer block is its own FSDP unit (one all-gather / reduce-scatter per block),
    and the root holds the embedding, final norm and output projection.

    Args:
        model: Full model or pipeline stage (after :func:`apply_tp` if any).
        dp_mesh: The 1-D ``dp`` sub-mesh.
        reshard_after_forward: ``True`` frees gathered parameters after forward (ZeRO-3),
            ``False`` keeps them until backward (ZeRO-2).
        mp_policy: An FSDP2 ``MixedPrecisionPolicy``; ``None`` for full precision.

    Returns:
        ``model`` (now also an ``FSDPModule``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _quiet_view_output_warning()
    policy = mp_policy or MixedPrecisionPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=policy)
    return model


def has_dtensor_params(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (tensor parallel or FSDP)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _quiet_view_output_warning() -> None:
    """Silence FSDP2's warning that the wrapped model returns a view (the replicated logits of
    the tensor-parallel output layer). It guards against in-place ops on that view, which
    drop the pre-backward hook; the loss reads the logits out of place, and the equivalence
    tests check the gradients against a single process."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                            category=UserWarning)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, pipeline: bool = False) -> nn.Module:
    """Replicate ``model`` over ``dp_mesh`` and average gradients (plain data parallelism).

    Models with plain tensors use ``DistributedDataParallel`` (bucketed all-reduce that
    overlaps backward), which ``ZeroRedundancyOptimizer`` and pipeline stages both support.
    A tensor-parallel model (DTensor parameters, which DDP cannot bucket) uses torch's
    FSDP2-based ``replicate`` instead.

    Args:
        model: Full model or pipeline stage (after :func:`apply_tp` if any).
        dp_mesh: The 1-D ``dp`` sub-mesh.
        pipeline: ``model`` is a pipeline stage. The schedule runs one backward per
            micro-batch and lets only the last one reduce; DDP's bucket rebuild after the first
            step would record every parameter once per micro-batch and fail its size check,
            so the stage's buckets stay as built (``find_unused_parameters`` turns the rebuild
            off; every parameter is used, so nothing else changes).

    Returns:
        The module to call: a ``DistributedDataParallel`` wrapping ``model`` (parameter
        names gain a ``module.`` prefix on the wrapper only), or ``model`` itself.
    """
    if has_dtensor_params(model):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        _quiet_view_output_warning()
        replicate(model, mesh=dp_mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    # buffers (the rotary tables) are computed alike on every rank: never synchronised;
    # newer torch names the option forward_sync_buffers and deprecates broadcast_buffers
    import inspect

    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(
                          DistributedDataParallel.__init__).parameters
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=device_ids,
                                   process_group=dp_mesh.get_group(), init_sync=False,
                                   find_unused_parameters=pipeline, **no_buffer_sync)


def build_optimizer(model: nn.Module, config: ParallelConfig, dp_mesh: DeviceMesh | None, *,
                    lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters; ZeRO-1 shards its state over ``dp_mesh``.

    Args:
        model: The (unwrapped) model chunk.
        config: Chooses ZeRO-1 (``sharding="zero1"``) or a plain AdamW.
        dp_mesh: The ``dp`` sub-mesh (needed for ZeRO-1).
        lr: Learning rate.
        weight_decay: Decoupled weight decay (applied to every parameter, as in the
            single-process reference).

    Returns:
        The optimizer: ``ZeroRedundancyOptimizer`` for ZeRO-1 with ``dp > 1``, else AdamW
        (with ``dp == 1`` there is nothing to partition: ZeRO-1 is plain AdamW, and its state
        checkpoints like any other).

    Raises:
        ConfigError: ZeRO-1 over DTensor (tensor-parallel) parameters, which
            ``ZeroRedundancyOptimizer`` cannot broadcast.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": lr, "weight_decay": weight_decay, "betas": (0.9, 0.95), "eps": 1e-8}
    if config.sharding is Sharding.ZERO1 and config.dp_enabled:
        if has_dtensor_params(model):
            raise ConfigError("sharding", "zero1", f"needs tp=1 (tp={config.tp}): "
                              "ZeroRedundancyOptimizer cannot partition DTensor parameters")
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = dp_mesh.get_group() if dp_mesh is not None else None
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       process_group=group, **kwargs)
    # torch's default implementation: multi-tensor (foreach) kernels on CUDA, as in real runs.
    return torch.optim.AdamW(params, **kwargs)


def parallelize(model: Transformer, config: ParallelConfig, mesh: DeviceMesh, *,
                mp_policy: Any | None = None) -> Transformer:
    """Apply the tensor-parallel, activation-checkpointing and ZeRO-2/3 parts of ``config``.

    These work on parameters still on the meta device, so a model too large for one device
    is never materialised whole. Plain data parallelism (``sharding`` ``none`` / ``zero1``)
    wraps materialised parameters and is applied afterwards with :func:`apply_ddp`.

    Args:
        model: Full model or pipeline stage.
        config: The layout.
        mesh: The 3-D (pp, dp, tp) mesh.
        mp_policy: FSDP2 mixed-precision policy for ZeRO-2/3 (``None``: full precision).

    Returns:
        ``model``.
    """
    from paratune.parallel import MeshAxis

    if config.tp_enabled:
        apply_tp(model, mesh[MeshAxis.TP.value])
    if config.recompute is not Recompute.NONE:
        apply_activation_checkpointing(model, mode=config.recompute.value)
    if config.dp_enabled and config.sharding in (Sharding.ZERO2, Sharding.ZERO3):
        apply_fsdp(model, mesh[MeshAxis.DP.value],
                   reshard_after_forward=config.sharding is Sharding.ZERO3, mp_policy=mp_policy)
    return model
