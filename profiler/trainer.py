"""A training step under a ParallelConfig (:class:`Trainer`) and its timing.

Everything here is collective: every rank of an initialised process group whose size is
``config.world_size`` calls the same functions in the same order with the same arguments.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import resource
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratune.errors import ConfigError
from paratune.hardware import get_hardware
from paratune.measurement import Measurement
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

__all__ = ["Trainer", "check_supported", "measure_config", "synthetic_batch"]

_GB = 1e9


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


# ---------------------------------------------------------------------- measurement
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_free_memory() -> None:
    """Hand memory the C allocator keeps after ``free`` back to the OS (glibc
    ``malloc_trim``), so the RSS a config starts from is what is still in use."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _reset_peak_rss() -> bool:
    """Reset this process's resident-set high-water mark (``VmHWM``) to its current RSS.

    Linux resets it when ``5`` is written to ``/proc/self/clear_refs``. Returns ``False``
    where that is not possible; :func:`_peak_rss_gb` then reports the lifetime peak.
    """
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return False
    return _status_hwm_gb() is not None


def _status_hwm_gb() -> float | None:
    """``VmHWM`` from ``/proc/self/status`` in GB (``None`` where unavailable)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / _GB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak_rss_gb() -> float:
    """Peak resident set size since the last :func:`_reset_peak_rss` (``VmHWM``), or the
    process-lifetime peak (``ru_maxrss``, KiB on Linux) where ``/proc`` is unavailable."""
    hwm = _status_hwm_gb()
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GB


def _current_rss_gb() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / _GB
    except (OSError, ValueError, IndexError):
        return math.nan


def _devices_per_node(device: torch.device, world_size: int) -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    if device.type == "cuda":
        return max(1, min(world_size, torch.cuda.device_count()))
    return world_size


@functools.lru_cache(maxsize=1)
def _stdlib_corpus() -> Any:
    from paratune.profiler.corpus import TextCorpus

    return TextCorpus.from_stdlib()


def _batch_source(model: ModelSpec, data: str) -> Any:
    """``(global_batch_size, step, seed) -> tokens`` for ``data`` (checked before building)."""
    if data == "synthetic":
        return lambda size, step, seed: synthetic_batch(model, size, step=step, seed=seed)
    if data != "text":
        raise ConfigError("data", data, "must be synthetic or text")
    corpus = _stdlib_corpus()
    if model.vocab_size < corpus.vocab_size:
        raise ConfigError("data", data, f"real text is byte-level: it needs vocab_size >= "
                          f"{corpus.vocab_size} (model {model.name} has {model.vocab_size})")
    return lambda size, step, seed: corpus.batch(step, size, model.seq_len, seed=seed)


def measure_config(model: ModelSpec, config: ParallelConfig, *, hardware: str,
                   device: torch.device | str, warmup_steps: int = 3,
                   measured_steps: int = 10, seed: int = 0, mesh: DeviceMesh | None = None,
                   details: dict[str, Any] | None = None, data: str = "synthetic",
                   devices_per_node: int | None = None) -> Measurement:
    """Time training steps of ``model`` under ``config`` (collective over all ranks).

    Builds the mesh (unless given; meshes are cached per shape) and a :class:`Trainer`, runs
    ``warmup_steps`` uncounted steps, then ``measured_steps`` steps on
    :func:`synthetic_batch` data (or real text with ``data="text"``). Each step starts after
    a barrier and ends after a device synchronise; its time is the slowest rank's. Everything
    built is freed before returning.

    Args:
        model: The model shape.
        config: The layout; ``config.world_size`` must equal the process group's size.
        hardware: :class:`~paratune.hardware.HardwareSpec` name (for MFU and the record).
        device: This rank's device.
        warmup_steps: Steps run first and not timed (at least one on CUDA).
        measured_steps: Steps timed.
        seed: Initialisation and data seed.
        mesh: A prebuilt (pp, dp, tp) mesh.
        data: ``"synthetic"`` (uniform random tokens, the default for timing) or ``"text"``
            (the byte-level corpus of Python's own sources, for a byte-level vocabulary).
        devices_per_node: Recorded with the measurement; the campaign passes its plan's
            value so that ok and failed rows agree. ``None``: ``LOCAL_WORLD_SIZE``, else
            the visible GPUs, else the world size.
        details: If given, filled with ``build_s`` (including ``mesh_s``, the part spent
            getting the mesh: creating process groups the first time a shape is seen,
            about nothing once cached) and ``teardown_s`` (slowest rank),
            ``overhead_s`` (all wall time outside the warm-up and measured steps: build,
            barriers, teardown, fingerprint; slowest rank), ``rss_before_gb`` (largest
            current RSS before building), ``rss_peak_increase_gb`` (how far this config's
            RSS peak rose above the RSS it started from, largest over ranks) and
            ``peak_rss_reset`` (1.0 when every rank could reset its high-water mark, so
            ``peak_rss_gb`` is this config's own); on CUDA also
            ``build_peak_mem_allocated_gb`` (allocator peak while building the trainer:
            initialisation may materialise more than the steps hold).

    Returns:
        An ``ok`` :class:`~paratune.Measurement`: step times, peak memory (on CUDA the
        allocator peaks of the warm-up and measured steps, after the trainer is built; on
        CPU ``peak_rss_gb``: the largest RSS high-water mark over ranks since this config
        started, reset first where Linux allows it, else the process-lifetime peak), MFU
        where the device's peak FLOP/s is known (model FLOPs: recomputation is not
        counted), the last step's loss and the fingerprint.

    Raises:
        ConfigError: invalid or unsupported layout (before anything is built).
        torch.OutOfMemoryError: and any other failure of the step; nothing is caught.
    """
    from paratune.profiler.fingerprint import fingerprint

    if measured_steps < 1:
        raise ConfigError("measured_steps", measured_steps, "must be >= 1")
    device = torch.device(device)
    if warmup_steps < 0:
        raise ConfigError("warmup_steps", warmup_steps, "must be >= 0")
    if warmup_steps < 1 and device.type == "cuda":
        raise ConfigError("warmup_steps", warmup_steps, "must be >= 1 on CUDA: the first "
                          "step pays one-off costs (kernel and library initialisation, "
                          "communicators, allocator growth) that are not the step time")
    batches = _batch_source(model, data)
    hw = get_hardware(hardware)
    world = dist.get_world_size()
    config.validate(model, world)
    check_supported(model, config)
    gc.collect()
    rss_reset = _reset_peak_rss()
    rss_before = _current_rss_gb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    dist.barrier()
    start = time.perf_counter()
    in_steps = 0.0
    if mesh is None:
        mesh = build_mesh(config, device.type)
    mesh_s = time.perf_counter() - start
    trainer = Trainer(model, config, device=device, mesh=mesh, seed=seed)
    _synchronize(device)
    build_s = time.perf_counter() - start
    build_peak = 0.0
    if device.type == "cuda":
        # The steps' peak, not initialisation's (which may hold full unsharded parameters):
        # what initialisation left in the caching allocator is released first, or the
        # reserved peak would start from it.
        build_peak = torch.cuda.max_memory_allocated(device) / _GB
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    try:
        local_loss = None
        for step in range(warmup_steps + measured_steps):
            tokens = batches(config.global_batch_size, step, seed)
            _synchronize(device)
            dist.barrier()
            begin = time.perf_counter()
            # As a training loop runs it: the loss stays on the device, unreduced.
            local_loss = trainer.train_step(tokens)
            _synchronize(device)
            elapsed = time.perf_counter() - begin
            in_steps += elapsed
            if step >= warmup_steps:
                times.append(elapsed)
        assert local_loss is not None
        loss = trainer.global_loss(local_loss)  # once, after the timed steps
    finally:
        teardown_start = time.perf_counter()
        trainer.close()
        del trainer
        teardown_s = time.perf_counter() - teardown_start
    fingerprint_info = fingerprint(device, world_size=world)

    overhead_s = time.perf_counter() - start - in_steps
    peak_rss = _peak_rss_gb()
    stats = torch.tensor(
        times + [build_s, mesh_s, teardown_s, overhead_s, peak_rss,
                 max(0.0, peak_rss - rss_before), rss_before, 0.0 if rss_reset else 1.0,
                 build_peak,
                 torch.cuda.max_memory_allocated(device) / _GB if device.type == "cuda" else 0.0,
                 torch.cuda.max_memory_reserved(device) / _GB if device.type == "cuda" else 0.0],
        dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    values = stats.tolist()
    step_times = values[:measured_steps]
    (build_s, mesh_s, teardown_s, overhead_s, peak_rss, rss_increase, rss_before_max,
     rss_not_reset, build_peak, alloc, reserved) = values[measured_steps:]
    if details is not None:
        details.update(build_s=build_s, mesh_s=mesh_s, teardown_s=teardown_s,
                       overhead_s=overhead_s,
                       rss_before_gb=rss_before_max, rss_peak_increase_gb=rss_increase,
                       peak_rss_reset=1.0 - rss_not_reset)
        if device.type == "cuda":
            details["build_peak_mem_allocated_gb"] = build_peak
    if devices_per_node is None:
        devices_per_node = _devices_per_node(device, world)
    measurement = Measurement(
        model=model, config=config, hardware=hw.name,
        devices_per_node=int(devices_per_node), step_times_s=step_times,
        peak_rss_gb=peak_rss, loss=loss, warmup_steps=warmup_steps,
        fingerprint=fingerprint_info)
    if device.type == "cuda":
        measurement.peak_mem_allocated_gb = alloc
        measurement.peak_mem_reserved_gb = reserved
    if hw.peak_flops:
        measurement.mfu = model_flops_utilisation(
            model.flops_per_token() * measurement.tokens_per_s / world, hw.peak_flops,
            hw.name)
    return measurement


def model_flops_utilisation(flops_per_s: float, peak_flops: float, hardware: str) -> float:
    """Model FLOPs per second per device as a fraction of the device's peak; NaN, with a
    warning, above 1: no device runs faster than its peak, so the peak is another device's
    (the campaign was told the wrong ``--hardware``), and the fraction would be wrong. The
    step times stay as measured."""
    mfu = flops_per_s / peak_flops
    if mfu > 1.0:
        import logging

        logging.getLogger(__name__).warning(
            "%.3g model FLOP/s per device is %.2fx the peak of %s: is --hardware right? The "
            "MFU is left empty", flops_per_s, mfu, hardware)
        return math.nan
    return mfu
