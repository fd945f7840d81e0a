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

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError, ParatuneError, Terminated
from paratune.trajectory import LEGACY_TRAJECTORY_COLUMNS as _LEGACY_TRAJECTORY_COLUMNS
from paratune.trajectory import TRAJECTORY_COLUMNS

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "GNS_MODES",
    "PRECONDITIONERS",
    "TRAJECTORY_COLUMNS",
    "GNSEstimate",
    "GNSJob",
    "GNSStep",
    "GradientNoiseScale",
    "NoiseScaleMeter",
    "WorkerError",
    "adam_preconditioners",
    "estimate_dict",
    "init_worker",
    "measure_layouts",
    "micro_batch_gradients",
    "resolve_mode",
    "resume_hint",
    "run_gns",
    "sharded_sqnorm",
    "single_process_reference",
    "spawn",
    "unbiased_norms",
]

logger = logging.getLogger(__name__)

_LOCALHOST = "127.0.0.1"
_GROUP_TIMEOUT_S = 300.0
"""How long a local group's rendezvous and collectives wait for a rank."""


class WorkerError(ParatuneError, RuntimeError):
    """A process started by :func:`spawn` raised or died; the message names the rank and
    the worker's exception (its traceback is logged at debug level)."""

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


# ---------------------------------------------------------------------- on a Trainer
GNS_MODES = ("auto", "dp", "accumulate")


@dataclass(frozen=True)
class GNSStep:
    """What one training step with noise-scale measurement produced."""

    loss: float
    """Global mean loss of the step's batch."""
    small_sqnorm: float
    """Mean squared norm of the small-batch gradients."""
    big_sqnorm: float
    """Squared norm of the full-batch gradient."""
    b_small: int
    """Sequences per small batch."""
    b_big: int
    """Sequences in the full batch."""
    estimate: GNSEstimate
    """The smoothed estimate after this step."""
    measured: bool = True
    """Whether this step measured the norms (``False`` on the steps between two measured
    ones under ``measure_every > 1``: the norms are NaN and the estimate is unchanged)."""


def resolve_mode(config: Any, mode: str = "auto") -> str:
    """Which small batches a layout measures: ``"dp"`` or ``"accumulate"``.

    ``"dp"``: each data-parallel rank's gradient before the all-reduce (``b_small =
    global_batch / dp``), free of extra work; the trainer supports reading it for plain DDP
    without pipelining (``pp == 1``, ``tp == 1``, ``sharding`` ``none``/``zero1``).
    ``"accumulate"``: the global batch is processed as ``num_small_batches`` consecutive
    gradient-accumulation chunks, each fully reduced over every axis, and their average is the
    big-batch gradient (``b_small = global_batch / num_small_batches``); it works under any
    layout at the price of one gradient reduction per chunk. ``"auto"`` picks ``"dp"`` where
    supported.

    Raises:
        ConfigError: unknown mode, or ``"dp"`` on a layout that does not support it.
    """
    from paratune.parallel import Sharding

    if mode not in GNS_MODES:
        raise ConfigError("mode", mode, f"must be one of {', '.join(GNS_MODES)}")
    dp_ok = (config.dp > 1 and config.pp == 1 and config.tp == 1
             and config.sharding in (Sharding.NONE, Sharding.ZERO1))
    if mode == "dp" and not dp_ok:
        raise ConfigError("mode", mode, "per-rank gradients need dp > 1 with pp=1, tp=1 and "
                          f"sharding none/zero1 (got {config.key()}); use accumulate")
    if mode == "auto":
        return "dp" if dp_ok else "accumulate"
    return mode


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


class NoiseScaleMeter:
    """Trains a :class:`~paratune.profiler.trainer.Trainer` and measures ``B_simple`` on the way.

    Build the trainer with :attr:`trainer_config` (in ``accumulate`` mode its global batch is
    one chunk), then call :meth:`step` with each full global batch on every rank.

    Args:
        config: The run's layout and global batch size.
        mode: ``"auto"``, ``"dp"`` or ``"accumulate"`` (see :func:`resolve_mode`).
        num_small_batches: Chunks per step in ``accumulate`` mode (``>= 2``).
        precondition: ``"none"`` or ``"adam"`` (see the module docstring).
        beta: Moving-average decay of :class:`GradientNoiseScale`.
        measure_every: Measure the norms on every ``measure_every``-th step only (the first
            step is measured); the steps between train as the trainer does without a meter.
            In ``dp`` mode the norms are nearly free already (this rank's gradient before the
            one all-reduce); in ``accumulate`` mode a measured step reduces each chunk
            separately, and measuring one step in ``k`` divides that cost by ``k``.

    Raises:
        ConfigError: a field breaks a rule (named in the message).
    """

    def __init__(self, config: Any, *, mode: str = "auto", num_small_batches: int = 2,
                 precondition: str = "none", beta: float = 0.95,
                 measure_every: int = 1) -> None:
        from paratune.parallel import Sharding

        if (isinstance(measure_every, bool) or not isinstance(measure_every, int)
                or measure_every < 1):
            raise ConfigError("measure_every", measure_every, "must be an integer >= 1")
        self.measure_every = measure_every
        self.steps = 0
        """Steps taken (a resumed run sets it to the step it resumes at, so that the same
        steps are measured)."""

        self.config = config
        self.mode = resolve_mode(config, mode)
        if precondition not in PRECONDITIONERS:
            raise ConfigError("precondition", precondition,
                              f"must be one of {', '.join(PRECONDITIONERS)}")
        if precondition == "adam" and config.sharding is Sharding.ZERO1 and config.dp > 1:
            raise ConfigError("precondition", precondition, "needs Adam's full second moments "
                              "on every rank; zero1 shards them")
        self.precondition = precondition
        if self.mode == "accumulate":
            if num_small_batches < 2:
                raise ConfigError("num_small_batches", num_small_batches, "must be >= 2")
            per_chunk = config.dp * config.micro_batch_size * num_small_batches
            if config.global_batch_size % per_chunk:
                raise ConfigError("global_batch_size", config.global_batch_size,
                                  f"must be divisible by num_small_batches*dp*micro_batch_size"
                                  f" = {num_small_batches}*{config.dp}*"
                                  f"{config.micro_batch_size} = {per_chunk}")
            self.num_small_batches = num_small_batches
        else:
            self.num_small_batches = config.dp
        self.tracker = GradientNoiseScale(beta=beta)

    @property
    def b_small(self) -> int:
        return self.config.global_batch_size // self.num_small_batches

    @property
    def trainer_config(self) -> Any:
        """The layout to build the trainer with (one chunk's batch in ``accumulate`` mode)."""
        if self.mode == "accumulate":
            return self.config.replace(global_batch_size=self.b_small)
        return self.config

    def step(self, trainer: Any, tokens: torch.Tensor) -> GNSStep:
        """One optimizer step on the global batch ``tokens``, measuring both norms.

        Collective: every rank calls it with the same ``tokens``
        (``[global_batch_size, seq_len + 1]``).
        """

        from paratune.parallel import MeshAxis

        gb = self.config.global_batch_size
        if tokens.shape[0] != gb:
            raise ConfigError("tokens", tuple(tokens.shape),
                              f"first dim must be global_batch_size={gb}")
        self.steps += 1
        if (self.steps - 1) % self.measure_every:
            return self._plain_step(trainer, tokens)
        params = [p for part in trainer.model_parts for p in part.parameters()
                  if p.requires_grad]
        pp_group = (trainer.mesh[MeshAxis.PP.value].get_group() if self.config.pp > 1
                    else None)
        weights = (adam_preconditioners(trainer.optimizers) if self.precondition == "adam"
                   else None)
        if self.mode == "dp":
            for p in params:
                p.grad = None
            loss = trainer.forward_backward(tokens, sync_grads=False)
            local = sharded_sqnorm(params, preconditioners=weights)
            small = _average_over_dp(params, local,
                                     trainer.mesh[MeshAxis.DP.value].get_group(),
                                     self.config.dp)
        else:
            k, chunk = self.num_small_batches, self.b_small
            sums: list[torch.Tensor | None] = [None] * len(params)
            small = loss = 0.0
            for i in range(k):
                for p in params:
                    p.grad = None
                loss += trainer.forward_backward(tokens[i * chunk:(i + 1) * chunk]) / k
                small += sharded_sqnorm(params, pp_group=pp_group, preconditioners=weights) / k
                for j, p in enumerate(params):
                    if p.grad is None:
                        continue
                    if sums[j] is None:
                        sums[j] = p.grad.detach().clone()
                    else:
                        _local(sums[j]).add_(_local(p.grad.detach()))
            for p, total in zip(params, sums):
                if total is not None:
                    _local(total).div_(k)
                p.grad = total
        big = sharded_sqnorm(params, pp_group=pp_group, preconditioners=weights)
        estimate = self.tracker.update(small, big, self.b_small, gb)
        trainer.optimizer_step()
        return GNSStep(loss=float(loss), small_sqnorm=small, big_sqnorm=big,
                       b_small=self.b_small, b_big=gb, estimate=estimate)

    def _plain_step(self, trainer: Any, tokens: torch.Tensor) -> GNSStep:
        """A step that measures nothing: the trainer's own step on the whole batch (in
        ``accumulate`` mode the chunks' gradients summed, as gradient accumulation does)."""
        if self.mode == "dp":
            loss = trainer.forward_backward(tokens)
        else:
            params = [p for part in trainer.model_parts for p in part.parameters()
                      if p.requires_grad]
            k, chunk = self.num_small_batches, self.b_small
            sums: list[torch.Tensor | None] = [None] * len(params)
            loss = 0.0
            for i in range(k):
                for p in params:
                    p.grad = None
                loss += trainer.forward_backward(tokens[i * chunk:(i + 1) * chunk]) / k
                for j, p in enumerate(params):
                    if p.grad is None:
                        continue
                    if sums[j] is None:
                        sums[j] = p.grad.detach().clone()
                    else:
                        _local(sums[j]).add_(_local(p.grad.detach()))
            for p, total in zip(params, sums):
                if total is not None:
                    _local(total).div_(k)
                p.grad = total
        trainer.optimizer_step()
        return GNSStep(loss=float(loss), small_sqnorm=math.nan, big_sqnorm=math.nan,
                       b_small=self.b_small, b_big=self.config.global_batch_size,
                       estimate=self.tracker.estimate(), measured=False)


# ---------------------------------------------------------------------- the measured run
@dataclass(frozen=True)
class GNSJob:
    """A training run on the text corpus that records the ``B_noise`` trajectory."""

    model: Any
    """:class:`~paratune.ModelSpec` (byte-level vocabulary: ``vocab_size >= 256``)."""
    config: Any
    """:class:`~paratune.ParallelConfig`; ``world_size`` processes are started."""
    steps: int
    """Optimizer steps to reach (a resumed run continues up to it)."""
    out: str
    """Trajectory CSV path (rows are appended and fsync'd as they are measured)."""
    seed: int = 0
    """Initialisation seed."""
    data_seed: int = 0
    """Data-order seed."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    mode: str = "auto"
    """Small-batch source (:func:`resolve_mode`)."""
    num_small_batches: int = 2
    """Chunks per step in ``accumulate`` mode."""
    precondition: str = "none"
    """``"none"`` or ``"adam"``."""
    beta: float = 0.95
    """Moving-average decay."""
    measure_every: int = 1
    """Measure on every ``measure_every``-th step (the trajectory has a row for each measured
    step only; see :class:`NoiseScaleMeter`)."""
    corpus_bytes: int | None = 8 << 20
    """Bytes of the standard library to read."""
    checkpoint_dir: str | None = None
    """Where to save state every ``checkpoint_every`` steps (and resume from). A run that
    does not resume removes a checkpoint left there by an earlier run before it starts."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: never)."""
    resume: bool = False
    """Continue from ``checkpoint_dir`` if it holds a complete checkpoint."""
    device: str = "auto"
    """``"cpu"`` (gloo), ``"cuda"`` (NCCL) or ``"auto"``."""

    def validate(self) -> None:
        """Check the job before any process starts.

        Raises:
            ConfigError: naming the field and the rule.
        """
        if self.steps < 1:
            raise ConfigError("steps", self.steps, "must be >= 1")
        if Path(self.out).is_dir():
            raise ConfigError("out", str(self.out), "is a directory; give the trajectory's "
                              "file path, such as gns.csv")
        if self.model.vocab_size < 256:
            raise ConfigError("model", self.model.name, "needs vocab_size >= 256 (byte-level "
                              f"text), got {self.model.vocab_size}")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", self.checkpoint_every, "must be >= 0")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError("checkpoint_dir", None,
                              "is required with checkpoint_every or resume")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", self.device, "must be auto, cpu or cuda")
        if _resolved_device(self.device) == "cuda":
            _check_gpus(self.device, self.config.world_size)
        if self.checkpoint_every:
            from paratune.profiler.reconfigure import _check_supported

            _check_supported(self.config)  # zero1 with dp > 1 cannot be checkpointed
        from paratune.profiler.trainer import check_supported

        check_supported(self.model, self.config)
        NoiseScaleMeter(self.config, mode=self.mode, num_small_batches=self.num_small_batches,
                        precondition=self.precondition, beta=self.beta,
                        measure_every=self.measure_every)


def _append_row(path: str, row: dict[str, Any]) -> None:
    import os

    new = not os.path.exists(path) or os.path.getsize(path) == 0
    line = ",".join(repr(float(row[c])) if isinstance(row[c], float) else str(row[c])
                    for c in TRAJECTORY_COLUMNS)
    with open(path, "a", encoding="utf-8") as handle:
        if new:
            handle.write(",".join(TRAJECTORY_COLUMNS) + "\n")
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _read_trajectory(path: str | Path) -> tuple[tuple[str, ...], list[list[str]]]:
    """Header and complete data rows of a trajectory CSV (``((), [])`` when it is absent).

    A row is complete when it has as many fields as the header and an integer step; a line
    torn by a kill mid-write is left out. Works for the current columns and for trajectories
    written before ``seq_len`` was added.
    """
    file = Path(path)
    if not file.exists():
        return (), []
    lines = file.read_text(encoding="utf-8").splitlines()
    if not lines:
        return (), []
    header = tuple(lines[0].split(","))
    rows = [fields for fields in (line.split(",") for line in lines[1:])
            if len(fields) == len(header) and fields[0].isdigit()]
    return header, rows


def _truncate_rows(path: str, max_step: int, *, seq_len: int) -> None:
    """Keep the header and the rows with ``step <= max_step`` (a torn last line goes too).

    A trajectory written before ``seq_len`` was a column gets it, ``seq_len`` on every kept
    row (:func:`_check_resumable` has checked that its tokens agree), so the rows the resumed
    run appends match the header.
    """
    from paratune._io import atomic_write_text

    header, rows = _read_trajectory(path)
    if not header:
        return
    kept = [fields for fields in rows if int(fields[0]) <= max_step]
    if header == _LEGACY_TRAJECTORY_COLUMNS:
        header = TRAJECTORY_COLUMNS
        kept = [[*fields, str(seq_len)] for fields in kept]
    lines = [",".join(header)] + [",".join(fields) for fields in kept]
    atomic_write_text(path, "\n".join(lines) + "\n")


def _measured_rows(path: str) -> int:
    """Complete data rows in a trajectory CSV (0 when it does not exist)."""
    return len(_read_trajectory(path)[1])


def _job_fingerprint(job: GNSJob) -> dict[str, Any]:
    """What must be the same for a checkpoint to continue ``job``'s trajectory, flat
    (``model.seq_len``, ``config.dp``, ``lr``, ...) and JSON-normalised. The small-batch
    mode and count are the resolved ones (``auto`` and ``dp`` on a dp layout agree)."""
    import json

    meter = NoiseScaleMeter(job.config, mode=job.mode, num_small_batches=job.num_small_batches,
                            precondition=job.precondition, beta=job.beta)
    fingerprint: dict[str, Any] = {f"model.{k}": v for k, v in job.model.to_dict().items()}
    fingerprint.update({f"config.{k}": v for k, v in job.config.to_dict().items()})
    fingerprint.update(seed=job.seed, data_seed=job.data_seed, lr=job.lr,
                       weight_decay=job.weight_decay, mode=meter.mode,
                       num_small_batches=meter.num_small_batches,
                       precondition=job.precondition, beta=job.beta,
                       corpus_bytes=job.corpus_bytes)
    # The numerics: the same checkpoint continued on another device would change them.
    device = _resolved_device(job.device)
    fingerprint.update(device=device, precision=_precision(device))
    return json.loads(json.dumps(fingerprint, default=str))


def _precision(device: str) -> str:
    """What the GNS workers' :class:`~paratune.profiler.trainer.Trainer` computes in on
    ``device`` (its default ``mixed_precision``, in fresh processes whose default dtype is
    float32)."""
    return "bf16-mixed" if device == "cuda" else "float32"


def _check_fingerprint(job: GNSJob, saved: dict[str, Any], found: Path) -> None:
    """Refuse a checkpoint saved by a run with other settings, naming the first field that
    differs and both values.

    A checkpoint written before fingerprints were saved is checked on what it holds (its
    layout and the moving-average decay) and accepted with a warning.
    """
    import warnings

    mine = _job_fingerprint(job)
    fingerprint = saved.get("extra", {}).get("job")
    if fingerprint is None:
        fingerprint = {f"config.{k}": v for k, v in saved["config"].items()}
        if "beta" in saved.get("gns", {}):
            fingerprint["beta"] = saved["gns"]["beta"]
        warnings.warn(f"{found} predates job fingerprints: only its parallel config and beta "
                      "can be checked against this run", stacklevel=3)
    for name in [*mine, *(n for n in fingerprint if n not in mine)]:
        if mine.get(name) != fingerprint.get(name, mine.get(name)):
            raise ConfigError(name, mine.get(name), f"differs from {fingerprint.get(name)!r}, "
                              f"the value of the run that saved the checkpoint {found}: it "
                              "cannot continue this trajectory. Resume with the same settings, "
                              "or run without resume to start a new trajectory")


def _check_rows_match(job: GNSJob, step: int, tokens: int, found: Path) -> None:
    """Refuse a checkpoint at ``step`` whose trajectory rows up to it are not exactly steps
    ``1..step`` of this run (missing, gapped or spliced rows, another sequence length)."""
    header, rows = _read_trajectory(job.out)
    if header and header not in (TRAJECTORY_COLUMNS, _LEGACY_TRAJECTORY_COLUMNS):
        raise ConfigError("out", job.out, f"has columns {','.join(header)}, not a trajectory's")
    kept = [fields for fields in rows if int(fields[0]) <= step]
    steps = [int(fields[0]) for fields in kept]
    if steps != list(range(1, step + 1)):
        last = steps[-1] if steps else None
        raise ConfigError("resume", True, f"the checkpoint {found} is at step {step} but "
                          f"{job.out} holds {len(steps)} rows up to it (last step {last}), not "
                          f"steps 1..{step}: they are not the same run. Nothing was changed; "
                          "run without resume to start a new trajectory")
    if steps:
        where = dict(zip(header, kept[-1]))
        if int(where["tokens"]) != tokens:
            raise ConfigError("resume", True, f"{job.out} has {where['tokens']} tokens at step "
                              f"{step}, the checkpoint {found} {tokens}: not the same run")
        seq_lens = {int(float(fields[-1])) for fields in kept} if "seq_len" in header else set()
        if seq_lens - {job.model.seq_len}:
            raise ConfigError("model.seq_len", job.model.seq_len, f"differs from seq_len "
                              f"{sorted(seq_lens)} of the rows of {job.out}")


def _check_resumable(job: GNSJob) -> None:
    """Check a resume before any process starts: nothing is changed when it is refused.

    Refused: measured rows without a complete checkpoint to continue from (restarting at
    step 0 would delete them); a checkpoint saved by a run with other settings (see
    :func:`_check_fingerprint`); a checkpoint past ``job.steps`` (the run would end with more
    rows than asked for); rows up to the checkpoint's step that are not its run's.
    """
    import json

    if not job.resume:
        return
    from paratune.profiler.reconfigure import RUN_STATE_FILE, find_checkpoint

    found = None if job.checkpoint_dir is None else find_checkpoint(job.checkpoint_dir)
    if found is None:
        rows = _measured_rows(job.out)
        if rows:
            raise ConfigError("resume", True, f"no complete checkpoint was saved in "
                              f"{job.checkpoint_dir} to continue the {rows} rows of "
                              f"{job.out} from (the first comes after --checkpoint-every "
                              "steps); they are kept. Rerun without --resume to start over "
                              f"(this replaces {job.out}), or give another --out")
        return
    from paratune.profiler.reconfigure import verify_checkpoint

    verify_checkpoint(found)  # refused before any process starts, nothing unpickled
    saved = json.loads((found / RUN_STATE_FILE).read_text(encoding="utf-8"))
    _check_fingerprint(job, saved, found)
    step = int(saved["step"])
    if job.steps < step:
        raise ConfigError("steps", job.steps, f"the run being resumed is already at step {step} "
                          f"(checkpoint {found}); nothing was changed. Give at least {step} "
                          "steps to continue it, or run without resume to start a new "
                          "trajectory")
    _check_rows_match(job, step, int(saved["tokens_seen"]), found)


def _start_fresh(job: GNSJob) -> None:
    """Before a run that starts at step 0: delete ``job.out`` and any checkpoint an earlier
    run left in ``job.checkpoint_dir`` (a later resume would otherwise continue from its
    weights). A checkpoint directory holding other files is refused, nothing deleted."""
    import shutil

    from paratune.profiler.reconfigure import _PREVIOUS, _SAVING, _removable

    targets = []
    if job.checkpoint_dir is not None:
        ckpt = Path(job.checkpoint_dir)
        targets = [ckpt, ckpt.with_name(ckpt.name + _PREVIOUS),
                   ckpt.with_name(ckpt.name + _SAVING)]
        for target in targets:
            if not _removable(target):
                raise ConfigError("checkpoint_dir", job.checkpoint_dir,
                                  f"{target} holds files that are not a checkpoint; move "
                                  "them away, or give another --out (the checkpoint goes "
                                  "beside it)")
    Path(job.out).parent.mkdir(parents=True, exist_ok=True)
    Path(job.out).unlink(missing_ok=True)
    for target in targets:
        shutil.rmtree(target, ignore_errors=True)


def _resolved_device(kind: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a job's ``device`` (``"auto"``: cuda when available)."""
    if kind != "auto":
        return kind
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_gpus(device: str, world_size: int) -> None:
    """One GPU per rank: NCCL cannot run two ranks of a group on one device.

    Raises:
        ConfigError: no GPU is visible (``device``), or fewer than ``world_size``
            (``config.world_size``).
    """
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise ConfigError("device", device, "runs on CUDA, but no CUDA device is visible on "
                          "this machine (use device cpu)")
    if world_size > available:
        raise ConfigError("config.world_size", world_size, f"needs one GPU per rank, but "
                          f"this machine has {available} (device {device!r} runs on CUDA): "
                          f"use a layout of at most {available} devices, or device cpu")


def _device_for(kind: str, rank: int, world_size: int) -> Any:
    import torch

    kind = _resolved_device(kind)
    if kind == "cuda":
        _check_gpus(kind, world_size)
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def init_worker(rank: int, world_size: int, port: int, device: str = "auto") -> Any:
    """Join a localhost process group (gloo on CPU, NCCL on CUDA) through the rendezvous
    store that :func:`spawn` hosts on ``port``; returns the device.

    Called in a process started by :func:`spawn`, which has already tied the process's life
    to its parent's (see :func:`_die_with_parent`).
    """
    import datetime
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dev = _device_for(device, rank, world_size)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=_GROUP_TIMEOUT_S)
    # the rendezvous store is the one :func:`spawn` hosts on ``port``: every rank a client
    store = dist.TCPStore(_LOCALHOST, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=dev if dev.type == "cuda" else None)
    return dev


def _die_with_parent(parent_pid: int) -> None:
    """End this worker when ``parent_pid``, the process that started it, dies, so a killed
    run leaves no workers writing its trajectory and checkpoint.

    The kernel is asked to send SIGTERM on the parent's death (Linux); a parent that died
    before that request (while this process was starting up) is caught by comparing the
    current parent with ``parent_pid``: an orphan has been re-parented and exits at once.
    """
    import ctypes
    import os
    import signal
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no libc prctl: nothing to set
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _spawned(rank: int, fn: Callable[..., Any], parent_pid: int, world_size: int, port: int,
             *args: Any) -> None:
    """Body of a process started by :func:`spawn`: first tie it to its parent, then run
    ``fn(rank, world_size, port, *args)``."""
    _die_with_parent(parent_pid)
    fn(rank, world_size, port, *args)


def _end_workers(processes: Sequence[Any], *, grace_s: float = 10.0) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` for all of them, SIGKILL the rest;
    returns once none is running, so none writes after this process has exited."""
    import time

    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any,
          poll: Callable[[], None] | None = None, poll_s: float = 0.5) -> None:
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` fresh processes; ``port``
    is that of the group's rendezvous store, which this process hosts while they run (``fn``
    joins the group with :func:`init_worker`).

    ``poll`` (if given) is called in this process every ``poll_s`` seconds while the
    workers run (to show their progress).

    ``fn`` must be picklable (a module-level function). A SIGTERM to this process, a SIGINT
    (``KeyboardInterrupt``) or any other exception while the workers run ends them before it
    propagates (SIGTERM as :class:`~paratune.errors.Terminated`, exit code 143); a worker
    whose parent dies, even before the worker has finished starting up, ends itself (see
    :func:`_die_with_parent`).

    Raises:
        WorkerError: a worker raised or died.
    """
    import datetime
    import multiprocessing
    import os
    import signal
    import threading

    import torch.distributed as dist
    import torch.multiprocessing as mp

    # This process hosts the group's rendezvous store on a port the kernel picks as the store
    # binds it, and holds it until the workers end: no other program can take the port
    # between its choice and its use, as with a port picked free and bound later by rank 0.
    store = dist.TCPStore(_LOCALHOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT_S))
    port = store.port

    def stop(signum: int, _frame: Any) -> None:
        raise Terminated(128 + signum)

    earlier = set(multiprocessing.active_children())
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    context = None
    try:
        context = mp.start_processes(_spawned, args=(fn, os.getpid(), world_size, port, *args),
                                     nprocs=world_size, join=False, start_method="spawn")
        while not context.join(timeout=poll_s if poll is not None else None):
            if poll is not None:
                poll()
        if poll is not None:
            poll()
    except mp.ProcessRaisedException as exc:
        # the worker's traceback is text; its last line names the exception
        lines = [line for line in str(exc).splitlines() if line.strip()]
        logger.debug("worker %d failed:\n%s", exc.error_index, exc)
        raise WorkerError(f"rank {exc.error_index} of {world_size} failed: "
                          f"{lines[-1].strip() if lines else 'no message'} "
                          "(-v for its traceback)") from None
    except mp.ProcessExitedException as exc:
        raise WorkerError(f"rank {exc.error_index} of {world_size} died: {exc}") from None
    except BaseException:
        # Interrupted (SIGINT, SIGTERM), possibly while the workers were being started.
        started = (context.processes if context is not None else
                   [p for p in multiprocessing.active_children() if p not in earlier])
        _end_workers(started)
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _gns_worker(rank: int, world_size: int, port: int, job: GNSJob) -> None:
    import time

    import torch.distributed as dist

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.mesh import closing_process_group
    from paratune.profiler.reconfigure import (
        RunState,
        find_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from paratune.profiler.trainer import Trainer

    device = init_worker(rank, world_size, port, job.device)
    with closing_process_group():
        corpus = TextCorpus.from_stdlib(max_bytes=job.corpus_bytes)
        meter = NoiseScaleMeter(job.config, mode=job.mode,
                                num_small_batches=job.num_small_batches,
                                precondition=job.precondition, beta=job.beta,
                                measure_every=job.measure_every)
        trainer = Trainer(job.model, meter.trainer_config, device=device, seed=job.seed,
                          lr=job.lr, weight_decay=job.weight_decay)
        fingerprint = _job_fingerprint(job)
        state = RunState(config=job.config, extra={"elapsed_s": 0.0, "job": fingerprint})
        ckpt = Path(job.checkpoint_dir) if job.checkpoint_dir else None
        # run_gns has checked a resume's checkpoint against this job (or started afresh:
        # deleted the trajectory and any earlier run's checkpoint) before starting us.
        if job.resume and ckpt is not None and find_checkpoint(ckpt) is not None:
            state = load_checkpoint(ckpt, trainer)
            state.config = job.config  # checked equal (run_gns: _check_fingerprint)
            meter.tracker.load_state_dict(state.gns)
            if rank == 0:
                _truncate_rows(job.out, state.step, seq_len=job.model.seq_len)
        dist.barrier()
        meter.steps = state.step
        gb, seq_len = job.config.global_batch_size, job.model.seq_len
        elapsed = float(state.extra.get("elapsed_s", 0.0))
        while state.step < job.steps:
            start = time.perf_counter()
            tokens = corpus.sequences(state.samples_seen, gb, seq_len, seed=job.data_seed)
            result = meter.step(trainer, tokens)
            elapsed += time.perf_counter() - start
            state.step += 1
            state.samples_seen += gb
            state.tokens_seen += gb * seq_len
            if rank == 0 and result.measured:
                est = result.estimate
                _append_row(job.out, {
                    "step": state.step, "tokens": state.tokens_seen, "loss": result.loss,
                    "b_simple": est.b_simple, "g2": est.g2, "trace": est.trace,
                    "g2_ema": est.g2_ema, "trace_ema": est.trace_ema,
                    "small_sqnorm": result.small_sqnorm, "big_sqnorm": result.big_sqnorm,
                    "b_small": result.b_small, "b_big": result.b_big, "elapsed_s": elapsed,
                    "seq_len": seq_len})
            if ckpt is not None and job.checkpoint_every and (
                    state.step % job.checkpoint_every == 0 or state.step == job.steps):
                state.gns = meter.tracker.state_dict()
                state.extra["elapsed_s"] = elapsed
                state.extra["job"] = fingerprint
                save_checkpoint(ckpt, trainer, state)
        trainer.close()


def run_gns(job: GNSJob, *, progress: bool = False) -> Path:
    """Train ``job.model`` on the standard-library text and write its ``B_noise`` trajectory.

    Starts ``job.config.world_size`` processes on this machine (gloo on CPU, NCCL on CUDA).
    Rank 0 appends one row per step to ``job.out`` (columns :data:`TRAJECTORY_COLUMNS`) and
    fsyncs it, so a killed run keeps every row measured; with ``checkpoint_dir`` and
    ``resume`` a rerun continues from the last complete checkpoint (rows past it are
    re-measured). Each checkpoint holds the job's fingerprint (model, config, seeds, lr,
    weight decay, small batches, preconditioner, beta, corpus size, device and precision);
    a resume whose settings differ, or whose rows up to the checkpoint's step are not steps
    ``1..step`` of that run, is refused before any process starts, as is resuming where
    ``job.out`` has rows but no complete checkpoint exists (the rows are kept); resuming
    with neither starts from step 0.
    A run starting from step 0 deletes ``job.out`` and any checkpoint left in
    ``checkpoint_dir``, so a later resume cannot continue another run's weights.
    While it runs, this process holds an exclusive lock on ``<out>.lock`` (released when it
    ends, however it ends), and a second run on the same ``out`` is refused. A SIGINT or
    SIGTERM ends the workers before it propagates (see :func:`spawn`; :func:`resume_hint`
    says what a rerun can continue from).

    Args:
        job: The run.
        progress: Show a progress bar on stderr (step of ``job.steps``, loss, latest
            ``b_simple``, time left), read from the rows as rank 0 writes them.

    Returns:
        The trajectory path.

    Raises:
        ConfigError: the job is invalid, it resumes measured rows without a checkpoint or
            from a checkpoint of another run (the differing field named) or one already past
            ``steps``, another run is writing ``out``, on CUDA this machine has fewer GPUs
            than ranks, or on the CPU its processes cannot fit in this machine's memory
            (checked before any process starts).
    """
    job.validate()
    with _locked_trajectory(job.out):
        _check_resumable(job)
        if _resolved_device(job.device) == "cpu":
            from paratune.profiler._memory import check_cpu_memory

            check_cpu_memory(job.model, job.config)
        from paratune.profiler.reconfigure import find_checkpoint

        if not (job.resume and job.checkpoint_dir is not None
                and find_checkpoint(job.checkpoint_dir) is not None):
            _start_fresh(job)
        if not progress:
            spawn(_gns_worker, job.config.world_size, job)
            return Path(job.out)
        with _ProgressBar(job) as bar:
            spawn(_gns_worker, job.config.world_size, job, poll=bar.poll)
    return Path(job.out)


class _ProgressBar:
    """A progress bar of a run's steps, fed by the trajectory rows rank 0 appends (as
    ``paratune profile`` shows its configs): step of total, loss, latest ``b_simple``
    and the time left. Reads only what was appended since the last poll."""

    def __init__(self, job: GNSJob) -> None:
        self.job = job
        self.path = Path(job.out)
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self.partial = ""
        self.columns: list[str] | None = None
        self.bar: Any = None

    def __enter__(self) -> _ProgressBar:
        from paratune._progress import progress_bar

        # a resumed run starts at its checkpoint's step (rows past it are measured again)
        self.bar = progress_bar(total=self.job.steps, initial=_checkpoint_step(self.job),
                                unit="step", desc=f"gns {self.job.config.key()}", enabled=True)
        # rows already there belong to the run being resumed: skipped until rank 0 has
        # cut them back to the checkpoint (a new file)
        with contextlib.suppress(FileNotFoundError):
            stat = self.path.stat()
            self.identity, self.offset = (stat.st_ino, stat.st_dev), stat.st_size
            with open(self.path, encoding="utf-8") as handle:
                self.columns = handle.readline().rstrip("\n").split(",")
        return self

    def __exit__(self, *exc: Any) -> None:
        # the rows written since the last poll (an interrupt can land before the next one):
        # the bar a stopped run leaves shows the step and loss it saved
        with contextlib.suppress(Exception):
            self.poll()
        self.bar.close()

    def poll(self) -> None:
        row = self._last_new_row()
        if row is None:
            return
        step = int(row["step"])
        self.bar.set_postfix_str(f"loss={float(row['loss']):.4g} "
                                 f"b_simple={float(row['b_simple']):.4g}", refresh=False)
        self.bar.update(step - self.bar.n)

    def _last_new_row(self) -> dict[str, str] | None:
        """The last complete row appended since the previous call (the file is read afresh
        when it was replaced, as a resume truncates it)."""
        import os

        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        identity = (stat.st_ino, stat.st_dev)
        if identity != self.identity or stat.st_size < self.offset:
            self.identity, self.offset, self.partial, self.columns = identity, 0, "", None
        if stat.st_size == self.offset:
            return None
        with open(self.path, encoding="utf-8") as handle:
            handle.seek(self.offset)
            text = self.partial + handle.read()
            self.offset = handle.tell()
        lines = text.split("\n")
        self.partial = lines.pop()  # an unfinished line waits for the next call
        if self.columns is None and lines:
            self.columns = lines.pop(0).split(",")
        for line in reversed(lines):
            fields = line.split(",")
            if self.columns and len(fields) == len(self.columns) and fields[0].isdigit():
                return dict(zip(self.columns, fields))
        return None


def _checkpoint_step(job: GNSJob) -> int:
    """The step of the complete checkpoint in ``job.checkpoint_dir`` (0 without one)."""
    import json

    from paratune.profiler.reconfigure import RUN_STATE_FILE, find_checkpoint

    if job.checkpoint_dir is None:
        return 0
    found = find_checkpoint(job.checkpoint_dir)
    if found is None:
        return 0
    try:
        return int(json.loads((found / RUN_STATE_FILE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError):
        return 0


def resume_hint(job: GNSJob) -> str:
    """What an interrupted run left and how to continue it: the rows measured, the
    checkpoint's step, and whether ``--resume`` can continue from it."""
    rows = _measured_rows(job.out)
    step = _checkpoint_step(job)
    measured = f"{rows} of {job.steps} steps are measured in {job.out}"
    if step:
        return (f"{measured}; the checkpoint in {job.checkpoint_dir} is at step {step}: rerun "
                f"the same command with --resume to continue from step {step + 1} (the "
                f"{rows - step} steps after it are measured again)" if rows > step else
                f"{measured}; the checkpoint in {job.checkpoint_dir} is at step {step}: rerun "
                "the same command with --resume to continue")
    if not job.checkpoint_every:
        return f"{measured}; this run saves no checkpoint, so a rerun starts from step 0"
    return (f"{measured}; no checkpoint was saved yet (the first at step "
            f"{job.checkpoint_every}), so a rerun starts from step 0")


def _lock_path(out: str | Path) -> Path:
    """The lock file of the trajectory ``out``: ``<out>.lock`` beside it."""
    path = Path(out).resolve()
    return path.with_name(path.name + ".lock")


def _locked_trajectory(out: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive lock on :func:`_lock_path` while the block runs, so that two runs
    never write one trajectory and its checkpoint (see :func:`paratune._io.exclusive_lock`:
    the kernel releases it when this process ends, however it ends).

    Raises:
        ConfigError: another process holds it (``out``, naming that process).
    """
    from paratune._io import exclusive_lock

    path = _lock_path(out)
    return exclusive_lock(path, field="out", value=str(out),
                          what=f"writing this trajectory (it holds {path})")


# ---------------------------------------------------------------------- layout check
def _layouts_worker(rank: int, world_size: int, port: int, model: Any, runs: list[dict[str, Any]],
                    steps: int, seed: int, dtype_name: str, out_dir: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.mesh import closing_process_group
    from paratune.profiler.trainer import Trainer

    torch.set_default_dtype(getattr(torch, dtype_name))
    device = init_worker(rank, world_size, port, "cpu")
    with closing_process_group():
        corpus = TextCorpus.from_stdlib(max_bytes=1 << 19)
        for index, run in enumerate(runs):
            config = run["config"]
            meter = NoiseScaleMeter(config, mode=run.get("mode", "auto"),
                                    num_small_batches=run.get("num_small_batches", 2),
                                    precondition=run.get("precondition", "none"),
                                    measure_every=run.get("measure_every", 1))
            trainer = Trainer(model, meter.trainer_config, device=device, seed=seed, lr=1e-3)
            records = []
            for step in range(steps):
                tokens = corpus.batch(step, config.global_batch_size, model.seq_len, seed=seed)
                result = meter.step(trainer, tokens)
                records.append({**asdict(result), "mode": meter.mode})
            trainer.close()
            if rank == 0:
                Path(out_dir, f"{index}.json").write_text(json.dumps(records))
            dist.barrier()


def measure_layouts(model: Any, runs: list[dict[str, Any]], *, world_size: int, steps: int = 3,
                    seed: int = 0, dtype: str = "float64") -> list[list[dict[str, Any]]]:
    """Train ``steps`` steps under each run's layout on the same text batches, in one group
    of ``world_size`` gloo processes, and return every step's :class:`GNSStep` as a dict.

    Used to check that a parallel layout measures what one process measures on the same
    small batches.

    Args:
        model: The model shape.
        runs: Dicts with ``config`` (a ParallelConfig of ``world_size`` devices) and optional
            ``mode``, ``num_small_batches``, ``precondition``, ``measure_every``.
        world_size: Processes to start.
        steps: Steps per run.
        seed: Initialisation and data seed.
        dtype: Default dtype in the workers (``float64`` makes comparisons sharp).

    Returns:
        Per run, per step, the fields of :class:`GNSStep` (``estimate`` nested) and ``mode``.
    """
    import json
    import tempfile

    for run in runs:
        run["config"].validate(model, world_size)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_layouts_worker, world_size, model, runs, steps, seed, dtype, out_dir)
        return [json.loads(Path(out_dir, f"{i}.json").read_text()) for i in range(len(runs))]


def single_process_reference(spec: Any, global_batch: int, steps: int, *, num_small: int,
                             precondition: str = "none") -> list[dict[str, float]]:
    """The noise-scale run of ``spec`` in this process with plain PyTorch, float64, one model
    and the small batches one by one: what a run under 3D parallelism must reproduce
    (per step ``loss``, ``small_sqnorm``, ``big_sqnorm`` and ``b_simple``)."""
    import torch

    from paratune.profiler.corpus import TextCorpus
    from paratune.profiler.model import build_model
    from paratune.profiler.pipeline import cross_entropy_loss

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        corpus = TextCorpus.from_stdlib(max_bytes=1 << 19)
        model = build_model(spec, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                                betas=(0.9, 0.95), eps=1e-8, foreach=False)
        gns = GradientNoiseScale()
        params = list(model.parameters())
        out = []
        for step in range(steps):
            tokens = corpus.batch(step, global_batch, spec.seq_len, seed=0)
            losses: list[float] = []

            def backward(chunk, losses=losses):
                loss = cross_entropy_loss(model(chunk[:, :-1]), chunk[:, 1:])
                losses.append(loss.item())
                loss.backward()

            weights = adam_preconditioners([opt]) if precondition == "adam" else None
            fns = [lambda c=c: backward(c) for c in tokens.chunk(num_small)]
            small, big = micro_batch_gradients(params, fns, preconditioners=weights)
            est = gns.update(small, big, global_batch // num_small, global_batch)
            opt.step()
            opt.zero_grad()
            out.append({"loss": sum(losses) / num_small, "small_sqnorm": small,
                        "big_sqnorm": big, "b_simple": est.b_simple})
        return out
    finally:
        torch.set_default_dtype(previous)
