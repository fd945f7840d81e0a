"""Squared gradient norms of a model spread over tensor, pipeline and data parallelism.

:func:`sharded_sqnorm` sums tensor-parallel shards (DTensor ``Shard`` placements) over their
mesh group, counts replicated tensors once, and sums pipeline stages (distinct layers) over
the ``pp`` group. With ``precondition="adam"`` each squared entry is weighted by
``1 / (sqrt(v_hat) + eps)`` from Adam's bias-corrected second moment, as Pollux (Qiao et al.
2021) does for adaptive optimizers; before the optimizer's first step the weight is one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn


PRECONDITIONERS = ("none", "adam")


def adam_preconditioners(optimizers: Iterable[torch.optim.Optimizer]
                         ) -> dict[torch.Tensor, torch.Tensor]:
    """Per-parameter weights ``1 / (sqrt(v_hat) + eps)`` from Adam(W) second moments.

    Args:
        optimizers: Adam or AdamW optimizers (parameters without state yet are left out and
            get weight one).

    Returns:
        Parameter -> weight tensor of the parameter's (local) shape.
    """

    weights: dict[torch.Tensor, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            eps = group.get("eps", 1e-8)
            beta2 = group.get("betas", (0.9, 0.999))[1]
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if "exp_avg_sq" not in state:
                    continue
                step = float(state["step"])
                v = _local(state["exp_avg_sq"]).detach().double()
                v_hat = v / (1.0 - beta2 ** step)
                weights[param] = 1.0 / (v_hat.sqrt() + eps)
    return weights


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_sqnorm(parameters: Iterable[torch.Tensor], *, pp_group: Any = None,
                   grads: Sequence[torch.Tensor] | None = None,
                   preconditioners: dict[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Squared norm of the whole model's gradient, its parts spread over tp and pp ranks.

    Each distinct parameter element is counted exactly once: a DTensor gradient sharded on
    some mesh dimensions (``Shard``) has its local sum all-reduced over those dimensions'
    groups; replicated placements and plain tensors are counted once; the per-stage totals
    are then summed over ``pp_group`` (pipeline stages hold distinct parameters). Every rank of
    a (pp x tp) slice gets the same value. The data-parallel axis is not reduced: each
    data-parallel rank gets the norm of its own gradient.

    Args:
        parameters: This rank's parameters (all model chunks); those without a gradient are
            skipped.
        pp_group: Process group of the pipeline axis, or ``None`` without pipelining.
        grads: Use these tensors instead of ``p.grad`` (same order as ``parameters``).
        preconditioners: Optional per-parameter weights (see :func:`adam_preconditioners`).

    Returns:
        The squared norm, as a Python float (accumulated in float64).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    params = list(parameters)
    grads = [p.grad for p in params] if grads is None else list(grads)
    if len(grads) != len(params):
        raise ConfigError("grads", len(grads), f"must match the {len(params)} parameters")
    replicated = torch.zeros((), dtype=torch.float64)
    # Sums to all-reduce over the groups of their sharded mesh dimensions, keyed by those groups.
    sharded: dict[tuple[int, ...], tuple[tuple[Any, ...], torch.Tensor]] = {}
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        local = _local(grad).detach()
        squares = local.double().square()
        if preconditioners is not None and param in preconditioners:
            squares = squares * preconditioners[param].to(squares.device)
        value = squares.sum()
        groups: tuple[Any, ...] = ()
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            groups = tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                           if isinstance(placement, Shard) and mesh.size(dim) > 1)
        if groups:
            key = tuple(id(g) for g in groups)
            previous = sharded[key][1] if key in sharded else 0.0
            sharded[key] = (groups, previous + value)
        else:
            replicated = replicated.to(value.device) + value
    total = replicated
    for groups, part in sharded.values():
        part = part.clone()
        for group in groups:
            dist.all_reduce(part, group=group)
        total = total.to(part.device) + part
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        total = total.clone()
        dist.all_reduce(total, group=pp_group)
    return float(total)


def micro_batch_gradients(parameters: Sequence[nn.Parameter],
                          backward_fns: Sequence[Callable[[], Any]], *,
                          pp_group: Any = None,
                          preconditioners: dict[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[float, float]:
    """Accumulate the mean gradient of several small batches and measure both norms.

    Runs each ``backward_fn`` (which must leave the gradient of its small batch's mean loss
    in ``p.grad``, starting from zero), records that gradient's squared norm, and leaves the
    average of the small-batch gradients in ``p.grad``: the big-batch gradient, ready for
    the optimizer. This is the single-process (or per data-parallel rank) counterpart of
    reading per-rank gradients before the data-parallel reduction.

    Args:
        parameters: Parameters the backward functions write gradients into.
        backward_fns: One callable per small batch.
        pp_group: Pipeline process group (see :func:`sharded_sqnorm`).
        preconditioners: Optional per-parameter weights.

    Returns:
        ``(mean small-batch squared norm, big-batch squared norm)``.

    Raises:
        ConfigError: fewer than one backward function.
    """

    if not backward_fns:
        raise ConfigError("backward_fns", 0, "needs at least one small batch")
    params = list(parameters)
    totals: list[torch.Tensor | None] = [None] * len(params)
    small = 0.0
    for fn in backward_fns:
        for p in params:
            p.grad = None
        fn()
        small += sharded_sqnorm(params, pp_group=pp_group, preconditioners=preconditioners)
        for i, p in enumerate(params):
            if p.grad is not None:
                totals[i] = p.grad.detach().clone() if totals[i] is None else totals[i] + p.grad
    count = len(backward_fns)
    for p, total in zip(params, totals):
        p.grad = None if total is None else total / count
    big = sharded_sqnorm(params, pp_group=pp_group, preconditioners=preconditioners)
    return small / count, big


def _average_over_dp(params: Sequence[torch.Tensor], local_sqnorm: float, group: Any,
                     dp: int) -> float:
    """Average plain-tensor gradients over ``group`` with ONE all-reduce (one flat bucket, as
    DDP does, with this rank's squared norm riding along); returns the mean squared norm."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    dtype = torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float64
    flat = torch.cat([g.detach().reshape(-1).to(dtype) for g in grads]
                     + [torch.tensor([local_sqnorm], dtype=dtype, device=grads[0].device
                                     if grads else None)])
    dist.all_reduce(flat, group=group)
    flat.div_(dp)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
    return float(flat[-1])


def accumulate_chunks(trainer: Any, params: Sequence[torch.Tensor], tokens: torch.Tensor,
                      num_chunks: int, *, sqnorm: Callable[[], float] | None = None
                      ) -> tuple[float, float]:
    """Gradient accumulation over ``num_chunks`` consecutive equal chunks of ``tokens``.

    Each chunk's gradient is computed from zero by ``trainer.forward_backward`` (fully reduced
    over every mesh axis) and summed; the mean of the chunks' gradients is left in ``p.grad``,
    ready for the optimizer. ``sqnorm`` (if given) is called after each chunk's backward,
    while ``p.grad`` holds that chunk's gradient alone.

    Returns:
        ``(mean chunk loss, mean of sqnorm() over the chunks)`` (NaN without ``sqnorm``).
    """
    chunk = tokens.shape[0] // num_chunks
    sums: list[torch.Tensor | None] = [None] * len(params)
    small = loss = 0.0
    for i in range(num_chunks):
        for p in params:
            p.grad = None
        loss += trainer.forward_backward(tokens[i * chunk:(i + 1) * chunk]) / num_chunks
        if sqnorm is not None:
            small += sqnorm() / num_chunks
        for j, p in enumerate(params):
            if p.grad is None:
                continue
            if sums[j] is None:
                sums[j] = p.grad.detach().clone()
            else:
                _local(sums[j]).add_(_local(p.grad.detach()))
    for p, total in zip(params, sums):
        if total is not None:
            _local(total).div_(num_chunks)
        p.grad = total
    return loss, small if sqnorm is not None else math.nan
