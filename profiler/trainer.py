"""A training step under a ParallelConfig (:class:`Trainer`) and its timing.

Everything here is collective: every rank of an initialised process group whose size is
``config.world_size`` calls the same functions in the same order with the same arguments.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratune.errors import ConfigError
from paratune.parallel import MeshAxis, ParallelConfig, Sharding
from paratune.profiler.mesh import build_mesh
from paratune.profiler.model import Transformer
from paratune.profiler.parallelize import (
    apply_ddp,
    build_optimizer,
    parallelize,
)
from paratune.profiler.pipeline import (
    build_schedule,
    build_stages,
    cross_entropy_loss,
    split_model,
    stage_ids,
)
from paratune.spec import ModelSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Trainer", "check_supported", "synthetic_batch"]


def check_supported(model: ModelSpec, config: ParallelConfig) -> None:
    """Raise for layouts this profiler cannot run (beyond :meth:`ParallelConfig.validate`).

    Raises:
        ConfigError: ``zero1`` with ``tp > 1`` (``ZeroRedundancyOptimizer`` cannot partition
            DTensor parameters); tied embeddings with ``pp > 1``.
    """
    config.validate(model)
    config.check_trainer(model)


def synthetic_batch(model: ModelSpec, global_batch_size: int, *, step: int, seed: int = 0
                    ) -> torch.Tensor:
    """Uniformly random tokens, the same on every process for the same arguments.

    Args:
        model: Gives ``vocab_size`` and ``seq_len``.
        global_batch_size: Sequences in the batch.
        step: Training step (each step gets a different batch).
        seed: Data seed.

    Returns:
        A CPU ``LongTensor`` ``[global_batch_size, seq_len + 1]``.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, model.vocab_size, (global_batch_size, model.seq_len + 1),
                         generator=gen)


class Trainer:
    """One model trained under one :class:`~paratune.ParallelConfig` on this rank.

    Built in torchtitan's order: the model on the meta device, split into pipeline stages,
    tensor parallelism, activation checkpointing, ZeRO-2/3 (FSDP2), then materialised on
    ``device`` and initialised from ``seed`` (the same values as a single-process model),
    then plain data parallelism (DDP, or FSDP2 ``replicate`` for tensor-parallel models) and
    AdamW (ZeRO-1 with ``dp > 1``: ``ZeroRedundancyOptimizer``). Models with tied embeddings are
    materialised before parallelisation (meta-device materialisation would untie them).

    Data-parallel communication per step:

    - ``none`` / ``zero1``: gradients accumulate locally over the micro-batches and are
      all-reduced once, on the last one (DDP ``no_sync``, or FSDP2 ``replicate`` with
      ``set_requires_gradient_sync`` when ``tp > 1``), with and without pipelining; ZeRO-1
      then updates its optimizer shard and broadcasts the parameters.
    - ``zero2`` / ``zero3`` without pipelining: FSDP2's own schedule, as torchtitan runs it:
      each micro-batch's gradients are reduce-scattered into the rank's shard, so gradient
      memory stays sharded (what ZeRO-2/3 are for, and what the analytical memory
      estimate assumes); ``zero2`` keeps the gathered parameters from forward to backward,
      ``zero3`` frees them after forward and gathers them again for backward.
    - ``zero2`` / ``zero3`` with pipelining: torch's pipeline schedule accumulates the
      gradients of a stage's micro-batches unsharded and reduce-scatters them once, on the
      last (less traffic, more gradient memory); the measurements carry ``pp``, so the
      performance model tells the two apart.

    Args:
        model: The model shape.
        config: The layout; ``config.world_size`` must equal the process group's size.
        device: This rank's device (``cuda:N`` or ``cpu``).
        mesh: A (pp, dp, tp) mesh from :func:`~paratune.profiler.mesh.build_mesh`; built
            (or taken from the cache) when ``None``.
        seed: Initialisation seed.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        mixed_precision: bf16 compute (autocast, or FSDP2's mixed-precision policy under
            ZeRO-2/3, with float32 gradient reduction); default on for CUDA, off on CPU.

    Attributes:
        model_parts: This rank's model chunks (one per pipeline stage held; the whole model
            without pipelining), unwrapped, with the full model's parameter names.
        optimizers: One AdamW per chunk.

    Raises:
        ConfigError: the layout is invalid for this model or world size, or unsupported
            (see :func:`check_supported`).
    """

    def __init__(self, model: ModelSpec, config: ParallelConfig, *, device: torch.device,
                 mesh: DeviceMesh | None = None, seed: int = 0, lr: float = 3e-4,
                 weight_decay: float = 0.1, mixed_precision: bool | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Trainer needs an initialised default process group")
        config.validate(model, dist.get_world_size())
        check_supported(model, config)
        self.spec = model
        self.config = config
        self.device = torch.device(device)
        self.mesh = mesh if mesh is not None else build_mesh(config, self.device.type)
        self.mixed_precision = (self.device.type == "cuda" if mixed_precision is None
                                else bool(mixed_precision))
        self.pp_rank = self.mesh[MeshAxis.PP.value].get_local_rank()
        self.dp_rank = self.mesh[MeshAxis.DP.value].get_local_rank()
        self.tp_rank = self.mesh[MeshAxis.TP.value].get_local_rank()
        fsdp = config.dp_enabled and config.sharding in (Sharding.ZERO2, Sharding.ZERO3)
        mp_policy = None
        if self.mixed_precision and fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32)
        self._autocast = self.mixed_precision and mp_policy is None

        materialise_first = model.tie_embeddings
        with torch.device("meta" if not materialise_first else self.device):
            full = Transformer(model)
        if materialise_first:
            full.init_weights(seed)
        parts = split_model(full, config, self.pp_rank) if config.pp_enabled else [full]
        del full
        for part in parts:
            parallelize(part, config, self.mesh, mp_policy=mp_policy)
            if not materialise_first:
                part.to_empty(device=self.device)
                part.init_weights(seed)
        self.model_parts: list[nn.Module] = parts
        dp_mesh = self.mesh[MeshAxis.DP.value]
        plain_dp = config.dp_enabled and config.sharding in (Sharding.NONE, Sharding.ZERO1)
        self._runners: list[nn.Module] = [apply_ddp(p, dp_mesh, pipeline=config.pp_enabled)
                                          if plain_dp else p
                                          for p in parts]
        self._ddp = any(isinstance(r, nn.parallel.DistributedDataParallel)
                        for r in self._runners)
        self.optimizers: list[torch.optim.Optimizer] = [
            build_optimizer(p, config, dp_mesh, lr=lr, weight_decay=weight_decay)
            for p in parts]
        stages = stage_ids(config, self.pp_rank)
        self._has_first = 0 in stages
        self._has_last = config.num_stages - 1 in stages
        self._schedule = None
        if config.pp_enabled:
            self._stages = build_stages(self._runners, config, self.pp_rank,
                                        self.mesh[MeshAxis.PP.value].get_group(), self.device)
            self._schedule = build_schedule(self._stages, config, loss_fn=cross_entropy_loss)

    # ------------------------------------------------------------------ steps
    def forward_backward(self, tokens: torch.Tensor, *, sync_grads: bool = True) -> float:
        """:meth:`forward_backward_local`, then :meth:`global_loss` of its loss.

        Returns:
            The global mean token cross-entropy (the same on every rank).
        """
        return self.global_loss(self.forward_backward_local(tokens, sync_grads=sync_grads))

    def forward_backward_local(self, tokens: torch.Tensor, *, sync_grads: bool = True
                               ) -> torch.Tensor:
        """Forward and backward over the global batch; gradients land in ``param.grad``.

        Each rank takes its data-parallel slice of ``tokens`` and splits it into
        ``config.num_microbatches`` micro-batches (accumulated, or pipelined under PP).
        Gradients are those of the global mean token cross-entropy, as one process on the
        whole batch would compute them.

        Args:
            tokens: The GLOBAL batch, identical on every rank: ``[global_batch_size,
                seq_len + 1]`` (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``).
            sync_grads: ``False`` skips the data-parallel reduction, so each rank's
                ``param.grad`` is the gradient of the mean loss over its OWN slice
                (``local_batch_size`` sequences); :meth:`reduce_gradients` then averages
                them, after which :meth:`optimizer_step` is exact. Only plain DDP
                (``sharding`` ``none`` / ``zero1`` with ``tp == 1``) and ``pp == 1``
                support it: ZeRO-2/3 and FSDP2 ``replicate`` keep unsynchronised gradients
                in internal unsharded buffers, not in ``param.grad``, and the pipeline
                schedule reduces gradients itself. With ``dp == 1`` it changes nothing.

        Returns:
            This rank's share of the loss, a float64 scalar on ``device``, left where it is
            (no host synchronisation, no collective): the mean over this rank's slice on the
            last pipeline stage, zero elsewhere. :meth:`global_loss` turns it into the
            global mean.

        Raises:
            ConfigError: ``tokens`` has the wrong shape, or ``sync_grads=False`` is not
                supported by this layout.
        """
        cfg = self.config
        expected = (cfg.global_batch_size, self.spec.seq_len + 1)
        if tokens.dim() != 2 or tuple(tokens.shape) != expected:
            raise ConfigError("tokens", tuple(tokens.shape),
                              f"must have shape [global_batch_size, seq_len + 1] = {expected}")
        if not sync_grads and cfg.dp_enabled and (cfg.pp_enabled or not self._ddp):
            raise ConfigError("sync_grads", False, "needs pp=1 and plain DDP (sharding none "
                              "or zero1 with tp=1); this layout reduces gradients internally")
        local_size = cfg.local_batch_size
        local = tokens[self.dp_rank * local_size:(self.dp_rank + 1) * local_size]
        local = local.to(self.device, non_blocking=True)
        inputs, targets = local[:, :-1], local[:, 1:]
        with self._autocast_context():
            if self._schedule is not None:
                local_loss = self._pipeline_step(inputs, targets)
            else:
                local_loss = self._accumulate(inputs, targets, sync_grads=sync_grads)
        return local_loss

    def _autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, *, sync_grads: bool
                    ) -> torch.Tensor:
        runner = self._runners[0]
        n = self.config.num_microbatches
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        # ZeRO-2/3 in training: FSDP2's default per-micro-batch reduce-scatter (sharded
        # gradient memory); everything else reduces once, on the last micro-batch
        sharded = (self.config.dp_enabled
                   and self.config.sharding in (Sharding.ZERO2, Sharding.ZERO3))
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            last = i == n - 1
            context = (contextlib.nullcontext() if sharded and sync_grads
                       else self._grad_sync(runner, sync=sync_grads and last, last=last))
            with context:
                loss = cross_entropy_loss(runner(x), y) / n
                loss.backward()
            total += loss.detach().to(torch.float64)
        return total

    @staticmethod
    @contextlib.contextmanager
    def _grad_sync(runner: nn.Module, *, sync: bool, last: bool) -> Iterator[None]:
        """Reduce gradients over data parallelism only when ``sync`` (the last micro-batch).

        DDP: ``no_sync`` on the other micro-batches. FSDP2 (the ``replicate`` of
        tensor-parallel models, and ``fully_shard`` when gradients are kept local for the
        noise scale) the way torch's pipeline stages drive it
        (``PipelineStage.backward_maybe_with_nosync``): gradients accumulate unsharded
        locally and are reduced once, and parameters are not resharded after backward
        before the last micro-batch. The flags are back at FSDP2's defaults after the last
        micro-batch, or if one raises.
        """
        from torch.distributed.fsdp import FSDPModule

        if isinstance(runner, nn.parallel.DistributedDataParallel):
            if sync:
                yield
            else:
                with runner.no_sync():
                    yield
        elif isinstance(runner, FSDPModule):
            runner.set_is_last_backward(last)
            runner.set_requires_gradient_sync(sync)
            runner.set_reshard_after_backward(last)
            try:
                yield
            except BaseException:
                runner.set_is_last_backward(True)
                runner.set_requires_gradient_sync(True)
                runner.set_reshard_after_backward(True)
                raise
        else:
            yield

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self._has_first else ()
        if self._has_last:
            self._schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return torch.stack([loss.detach().to(torch.float64) for loss in losses]).mean()
        self._schedule.step(*args, return_outputs=False)
        return torch.zeros((), device=self.device, dtype=torch.float64)

    def global_loss(self, local_loss: torch.Tensor) -> float:
        """The global mean loss, on every rank, from each rank's
        :meth:`forward_backward_local` loss (collective: an all-reduce over all ranks and a
        host synchronisation)."""
        contributes = self._has_last and self.tp_rank == 0
        value = local_loss / self.config.dp if contributes else torch.zeros_like(local_loss)
        value = value.detach().clone()
        if dist.get_world_size() > 1:
            dist.all_reduce(value)
        return float(value)

    def reduce_gradients(self) -> None:
        """Average gradients over the data-parallel group by hand (after
        ``forward_backward(sync_grads=False)``)."""
        if not self.config.dp_enabled:
            return
        group = self.mesh[MeshAxis.DP.value].get_group()
        for part in self.model_parts:
            for param in part.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)
                    param.grad.div_(self.config.dp)

    def optimizer_step(self) -> None:
        """AdamW step on every chunk, then zero the gradients."""
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def train_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One training step as a training loop runs it: :meth:`forward_backward_local` then
        :meth:`optimizer_step`, with no host synchronisation and no collective for the loss.

        Returns:
            This rank's loss tensor (see :meth:`forward_backward_local`); pass it to
            :meth:`global_loss` (on every rank) when the value is wanted.
        """
        local_loss = self.forward_backward_local(tokens)
        self.optimizer_step()
        return local_loss

    def step(self, tokens: torch.Tensor) -> float:
        """One training step: :meth:`train_step`, then :meth:`global_loss` of its loss.

        Returns:
            The global mean loss of this step's batch.
        """
        return self.global_loss(self.train_step(tokens))

    def gather_full(self, *, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters, or their gradients, of the WHOLE model by FQN.

        Collective: gathers DTensor shards (tensor parallel, FSDP) and the stages of every
        pipeline rank, and returns the same CPU dict on every rank. Meant for checks and
        small models (everything goes through one process's memory).

        Args:
            grads: Gather ``param.grad`` instead of the parameters (missing grads skipped).
        """
        from torch.distributed.tensor import DTensor

        mine: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            for name, param in part.named_parameters():
                value = param.grad if grads else param
                if value is None:
                    continue
                value = value.detach()
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                mine[name] = value.cpu().clone()
        owner = self.dp_rank == 0 and self.tp_rank == 0
        gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine if owner else {})
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part or {})
        return full

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Drop the model, optimizer and schedule so their memory can be freed."""
        self._schedule = None
        self._stages = []
        self._runners = []
        self.optimizers = []
        self.model_parts = []
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def __getattr__(name: str) -> Any:
    # measuring a config lives in measure.py, which builds on this module; its names stay
    # importable from here (loaded on first use, as measure.py imports this module)
    if name in ("measure_config", "model_flops_utilisation"):
        from paratune.profiler import measure

        return getattr(measure, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
