"""Gradient noise scale of a training run: the two-batch estimator of McCandlish et al. (2018).

The *simple noise scale* ``B_simple = tr(Sigma) / |G|^2`` compares the per-example gradient
covariance ``Sigma`` with the squared norm of the true gradient ``G``; batches much smaller
than it waste little compute per step, batches much larger waste compute on redundant
examples, which is why goodput needs it.

Two-batch estimator (McCandlish et al. 2018, appendix A.1): with ``|g_small|^2`` the squared
norm of a gradient averaged over ``B_small`` examples and ``|g_big|^2`` that over ``B_big``,
``E|g_B|^2 = |G|^2 + tr(Sigma) / B`` gives the unbiased estimates

* ``|G|^2    = (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)``
* ``tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)``.

Each is noisy step to step, so each is smoothed with a bias-corrected exponential moving
average before the ratio is taken (a ratio of averages, not an average of ratios).

In a data-parallel run the small batches are free: every data-parallel rank holds the
gradient of its own ``global_batch / dp`` sequences before the gradient all-reduce, and the
average over ranks afterwards is the big batch. :func:`sharded_sqnorm` computes a squared
norm over a model split by tensor and pipeline parallelism: tensor-parallel shards (DTensor
``Shard`` placements) are summed over their mesh group, replicated tensors are counted once,
and pipeline stages (which hold distinct layers) are summed over the ``pp`` group. Units are
sequences (the batch unit of :class:`~paratune.ParallelConfig`).

Preconditioning: by default the plain Euclidean norm is used (``precondition="none"``). With
``precondition="adam"`` each squared gradient entry is weighted by ``1 / (sqrt(v_hat) +
eps)`` from Adam's bias-corrected second moment, as Pollux (Qiao et al. 2021) does for
adaptive optimizers; before the optimizer's first step the weight is one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["PRECONDITIONERS", "GNSEstimate", "GradientNoiseScale", "adam_preconditioners",
           "estimate_dict", "micro_batch_gradients", "sharded_sqnorm", "unbiased_norms"]

PRECONDITIONERS = ("none", "adam")


def unbiased_norms(small_sqnorm: float, big_sqnorm: float, b_small: float,
                   b_big: float) -> tuple[float, float]:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from a small- and a big-batch squared norm.

    Args:
        small_sqnorm: ``|g|^2`` of a gradient averaged over ``b_small`` examples (or the mean
            of several such squared norms, which is still unbiased and less noisy).
        big_sqnorm: ``|g|^2`` of the gradient averaged over ``b_big`` examples.
        b_small: Small batch size.
        b_big: Big batch size, larger than ``b_small``.

    Returns:
        ``(g2, trace)``: estimates of ``|G|^2`` and ``tr(Sigma)`` (either may be negative on a
        single step; their averages are not).

    Raises:
        ConfigError: ``b_small`` is not positive or ``b_big <= b_small``.
    """
    if not b_small > 0:
        raise ConfigError("b_small", b_small, "must be positive")
    if not b_big > b_small:
        raise ConfigError("b_big", b_big, f"must be larger than b_small={b_small} (the "
                          "two-batch estimator needs two different batch sizes)")
    g2 = (b_big * big_sqnorm - b_small * small_sqnorm) / (b_big - b_small)
    trace = (small_sqnorm - big_sqnorm) / (1.0 / b_small - 1.0 / b_big)
    return float(g2), float(trace)


@dataclass(frozen=True)
class GNSEstimate:
    """One update of :class:`GradientNoiseScale`."""

    g2: float
    """This step's unbiased estimate of ``|G|^2``."""
    trace: float
    """This step's unbiased estimate of ``tr(Sigma)``."""
    g2_ema: float
    """Bias-corrected moving average of ``g2``."""
    trace_ema: float
    """Bias-corrected moving average of ``trace``."""
    b_simple: float
    """``trace_ema / g2_ema`` in examples (NaN while ``g2_ema <= 0``)."""
    num_updates: int
    """Updates so far, this one included."""


class GradientNoiseScale:
    """Moving averages of ``|G|^2`` and ``tr(Sigma)`` and their ratio ``B_simple``.

    Args:
        beta: Decay of the exponential moving averages (``0 <= beta < 1``); the estimate
            averages over roughly ``1 / (1 - beta)`` steps.
    """

    def __init__(self, *, beta: float = 0.95) -> None:
        if not 0.0 <= beta < 1.0:
            raise ConfigError("beta", beta, "must be in [0, 1)")
        self.beta = beta
        self.g2_avg_ = 0.0
        self.trace_avg_ = 0.0
        self.num_updates_ = 0

    def update(self, small_sqnorm: float, big_sqnorm: float, b_small: float,
               b_big: float) -> GNSEstimate:
        """Fold in one step's squared norms.

        Args:
            small_sqnorm: Mean squared norm of the small-batch gradients.
            big_sqnorm: Squared norm of the big-batch (full) gradient.
            b_small: Examples per small batch.
            b_big: Examples in the big batch.

        Returns:
            The updated estimate.

        Raises:
            ConfigError: on bad batch sizes (see :func:`unbiased_norms`) or a non-finite norm.
        """
        for name, value in (("small_sqnorm", small_sqnorm), ("big_sqnorm", big_sqnorm)):
            if not math.isfinite(value):
                raise ConfigError(name, value, "must be finite")
        g2, trace = unbiased_norms(small_sqnorm, big_sqnorm, b_small, b_big)
        self.g2_avg_ = self.beta * self.g2_avg_ + (1.0 - self.beta) * g2
        self.trace_avg_ = self.beta * self.trace_avg_ + (1.0 - self.beta) * trace
        self.num_updates_ += 1
        return self.estimate(g2=g2, trace=trace)

    def estimate(self, *, g2: float = math.nan, trace: float = math.nan) -> GNSEstimate:
        """The current smoothed estimate (``g2``/``trace`` fill the per-step fields)."""
        if self.num_updates_ == 0:
            return GNSEstimate(g2, trace, math.nan, math.nan, math.nan, 0)
        correction = 1.0 - self.beta ** self.num_updates_
        g2_ema = self.g2_avg_ / correction
        trace_ema = self.trace_avg_ / correction
        b_simple = trace_ema / g2_ema if g2_ema > 0 else math.nan
        return GNSEstimate(g2, trace, g2_ema, trace_ema, b_simple, self.num_updates_)

    @property
    def b_simple(self) -> float:
        return self.estimate().b_simple

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state, so a resumed or reconfigured run keeps its averages."""
        return {"beta": self.beta, "g2_avg": self.g2_avg_, "trace_avg": self.trace_avg_,
                "num_updates": self.num_updates_}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.g2_avg_ = float(state["g2_avg"])
        self.trace_avg_ = float(state["trace_avg"])
        self.num_updates_ = int(state["num_updates"])


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


def estimate_dict(estimate: GNSEstimate) -> dict[str, float]:
    """A flat dict of an estimate (for tables and MLflow metrics)."""
    return {k: float(v) for k, v in asdict(estimate).items()}
