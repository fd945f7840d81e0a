"""Measuring ``B_simple`` while a :class:`~paratune.profiler.trainer.Trainer` trains.

In a data-parallel run the small batches are free: every data-parallel rank holds the
gradient of its own ``global_batch / dp`` sequences before the gradient all-reduce, and the
average over ranks afterwards is the big batch. Under any other layout the global batch is
processed as consecutive gradient-accumulation chunks, each fully reduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.profiler.gns.estimator import GNSEstimate, GradientNoiseScale
from paratune.profiler.gns.norms import (
    PRECONDITIONERS,
    _average_over_dp,
    accumulate_chunks,
    adam_preconditioners,
    sharded_sqnorm,
)

if TYPE_CHECKING:
    import torch


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
            loss, small = accumulate_chunks(
                trainer, params, tokens, self.num_small_batches,
                sqnorm=lambda: sharded_sqnorm(params, pp_group=pp_group,
                                              preconditioners=weights))
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
            loss, _ = accumulate_chunks(trainer, params, tokens, self.num_small_batches)
        trainer.optimizer_step()
        return GNSStep(loss=float(loss), small_sqnorm=math.nan, big_sqnorm=math.nan,
                       b_small=self.b_small, b_big=self.config.global_batch_size,
                       estimate=self.tracker.estimate(), measured=False)
