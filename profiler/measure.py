"""Measuring one config: its training steps timed for real, with memory and timing records.

Each step starts after a barrier and ends after a device synchronise; its time is the slowest
rank's. Everything built for a config is freed before :func:`measure_config` returns.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import resource
import time
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratune.errors import ConfigError
from paratune.hardware import get_hardware
from paratune.measurement import Measurement, StepTiming
from paratune.parallel import ParallelConfig
from paratune.profiler.mesh import build_mesh
from paratune.profiler.trainer import Trainer, check_supported, synthetic_batch
from paratune.spec import ModelSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeasureOptions", "measure_config", "model_flops_utilisation"]

_GB = 1e9


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
    corpus = _stdlib_corpus()
    if model.vocab_size < corpus.vocab_size:
        raise ConfigError("data", data, f"real text is byte-level: it needs vocab_size >= "
                          f"{corpus.vocab_size} (model {model.name} has {model.vocab_size})")
    return lambda size, step, seed: corpus.batch(step, size, model.seq_len, seed=seed)


DATA_SOURCES = ("synthetic", "text")
"""What a measured step trains on: uniform random tokens, or the byte-level corpus of
Python's own sources."""


@dataclass(frozen=True)
class MeasureOptions:
    """How one config is measured: its steps, seed and data, checked when built."""

    warmup_steps: int = 3
    """Steps run first and not timed (at least one on CUDA, checked where the device is
    known)."""
    measured_steps: int = 10
    """Steps timed (>= 1)."""
    seed: int = 0
    """Initialisation and data seed."""
    data: str = "synthetic"
    """``"synthetic"`` (uniform random tokens, the default for timing) or ``"text"`` (the
    byte-level corpus of Python's own sources, for a byte-level vocabulary)."""
    devices_per_node: int | None = None
    """Recorded with the measurement; the campaign passes its plan's value so that ok and
    failed rows agree. ``None``: ``LOCAL_WORLD_SIZE``, else the visible GPUs, else the world
    size."""

    def __post_init__(self) -> None:
        if self.measured_steps < 1:
            raise ConfigError("measured_steps", self.measured_steps, "must be >= 1")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", self.warmup_steps, "must be >= 0")
        if self.data not in DATA_SOURCES:
            raise ConfigError("data", self.data, "must be synthetic or text")

    @classmethod
    def build(cls, options: MeasureOptions | None = None, **overrides: Any) -> MeasureOptions:
        """``options`` (default: the defaults) with ``overrides`` by field name.

        Raises:
            ConfigError: an override that is no field (field ``measure_options``).
        """
        options = options if options is not None else cls()
        if not overrides:
            return options
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError("measure_options", unknown[0],
                              f"is not one of {', '.join(sorted(names))}")
        return replace(options, **overrides)


def measure_config(model: ModelSpec, config: ParallelConfig, *, hardware: str,
                   device: torch.device | str, options: MeasureOptions | None = None,
                   mesh: DeviceMesh | None = None, details: dict[str, Any] | None = None,
                   **overrides: Any) -> Measurement:
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
        options: Steps, seed, data and devices per node (see :class:`MeasureOptions`).
        mesh: A prebuilt (pp, dp, tp) mesh.
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
        **overrides: Fields of :class:`MeasureOptions` by name (``measured_steps=5``), over
            ``options``.

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

    options = MeasureOptions.build(options, **overrides)
    warmup_steps, measured_steps, seed = (options.warmup_steps, options.measured_steps,
                                          options.seed)
    device = torch.device(device)
    _check_warmup_on(device, warmup_steps)
    batches = _batch_source(model, options.data)
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
    if mesh is None:
        mesh = build_mesh(config, device.type)
    mesh_s = time.perf_counter() - start
    trainer = Trainer(model, config, device=device, mesh=mesh, seed=seed)
    _synchronize(device)
    build_s = time.perf_counter() - start
    build_peak = _after_build(device)
    try:
        times, in_steps, loss = _timed_steps(trainer, batches, config, device, seed,
                                             warmup_steps=warmup_steps,
                                             measured_steps=measured_steps)
    finally:
        teardown_start = time.perf_counter()
        trainer.close()
        del trainer
        teardown_s = time.perf_counter() - teardown_start
    fingerprint_info = fingerprint(device, world_size=world)

    overhead_s = time.perf_counter() - start - in_steps
    peak_rss = _peak_rss_gb()
    step_times, (build_s, mesh_s, teardown_s, overhead_s, peak_rss, rss_increase,
                 rss_before_max, rss_not_reset, build_peak, alloc, reserved) = _slowest_rank(
        times, [build_s, mesh_s, teardown_s, overhead_s, peak_rss,
                max(0.0, peak_rss - rss_before), rss_before, 0.0 if rss_reset else 1.0,
                build_peak,
                torch.cuda.max_memory_allocated(device) / _GB if device.type == "cuda" else 0.0,
                torch.cuda.max_memory_reserved(device) / _GB if device.type == "cuda" else 0.0],
        device)
    if details is not None:
        details.update(build_s=build_s, mesh_s=mesh_s, teardown_s=teardown_s,
                       overhead_s=overhead_s,
                       rss_before_gb=rss_before_max, rss_peak_increase_gb=rss_increase,
                       peak_rss_reset=1.0 - rss_not_reset)
        if device.type == "cuda":
            details["build_peak_mem_allocated_gb"] = build_peak
    devices_per_node = options.devices_per_node
    if devices_per_node is None:
        devices_per_node = _devices_per_node(device, world)
    measurement = Measurement(
        model=model, config=config, hardware=hw.name,
        devices_per_node=int(devices_per_node), step_times_s=step_times,
        peak_rss_gb=peak_rss, loss=loss, warmup_steps=warmup_steps,
        fingerprint=fingerprint_info,
        timing=StepTiming(build_s=build_s, mesh_s=mesh_s, teardown_s=teardown_s,
                          overhead_s=overhead_s))
    if device.type == "cuda":
        measurement.peak_mem_allocated_gb = alloc
        measurement.peak_mem_reserved_gb = reserved
    if hw.peak_flops:
        measurement.mfu = model_flops_utilisation(
            model.flops_per_token() * measurement.tokens_per_s / world, hw.peak_flops,
            hw.name)
    return measurement


def _check_warmup_on(device: torch.device, warmup_steps: int) -> None:
    if warmup_steps < 1 and device.type == "cuda":
        raise ConfigError("warmup_steps", warmup_steps, "must be >= 1 on CUDA: the first "
                          "step pays one-off costs (kernel and library initialisation, "
                          "communicators, allocator growth) that are not the step time")


def _after_build(device: torch.device) -> float:
    """The allocator peak of building the trainer in GB (0 on the CPU), then a clean slate
    for the steps' peak: on CUDA the steps' peak, not initialisation's (which may hold full
    unsharded parameters), so what initialisation left in the caching allocator is released
    first, or the reserved peak would start from it."""
    if device.type != "cuda":
        return 0.0
    build_peak = torch.cuda.max_memory_allocated(device) / _GB
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return build_peak


def _timed_steps(trainer: Trainer, batches: Any, config: ParallelConfig, device: torch.device,
                 seed: int, *, warmup_steps: int, measured_steps: int
                 ) -> tuple[list[float], float, float]:
    """Run the warm-up and measured steps: ``(measured step times, seconds in all steps,
    global loss of the last step)``; each step starts after a barrier and ends after a
    device synchronise."""
    times: list[float] = []
    in_steps = 0.0
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
    return times, in_steps, trainer.global_loss(local_loss)  # once, after the timed steps


def _slowest_rank(times: list[float], figures: list[float], device: torch.device
                  ) -> tuple[list[float], list[float]]:
    """The largest of each step time and each figure over the ranks (one all-reduce)."""
    stats = torch.tensor(times + figures, dtype=torch.float64,
                         device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    values = stats.tolist()
    return values[:len(times)], values[len(times):]


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
