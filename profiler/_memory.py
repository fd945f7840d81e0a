"""Whether a CPU run fits in this machine's memory, checked before any process starts.

On the CPU every rank is a process on this machine, and all of them share its memory: a
model too large for it does not fail cleanly, the kernel's out-of-memory killer ends the
workers (or other processes). The estimate here is a lower bound of what one rank holds
(float32 weights, gradients and AdamW's two moments, 16 bytes per parameter of its share,
plus the interpreter and libraries), so a run it refuses cannot fit.
"""

from __future__ import annotations

import os

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig, Sharding
from paratune.spec import ModelSpec

__all__ = ["PROCESS_OVERHEAD_GB", "check_cpu_memory", "cpu_process_memory_gb",
           "physical_memory_bytes"]

PROCESS_OVERHEAD_GB = 0.3
"""Interpreter, PyTorch and gloo of one worker process, before any model state."""

_WEIGHT_BYTES, _GRADIENT_BYTES, _ADAM_BYTES = 4.0, 4.0, 8.0
_ZERO_LEVEL = {Sharding.NONE: 0, Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3}


def cpu_process_memory_gb(model: ModelSpec, config: ParallelConfig) -> float:
    """Least memory in GB one rank of ``config`` needs to train ``model`` on the CPU.

    The rank's share of the parameters is ``num_params / (tp * pp)``; ZeRO-1 shards the
    optimizer state over data parallelism, ZeRO-2 the gradients too, ZeRO-3 the weights too.
    Activations are left out (the estimate is a lower bound).
    """
    share = model.num_params / (config.tp * config.pp)
    sharding = _ZERO_LEVEL[Sharding(config.sharding)]
    dp = config.dp

    def over(level: int) -> float:
        return dp if sharding >= level else 1

    state = share * (_WEIGHT_BYTES / over(3) + _GRADIENT_BYTES / over(2) + _ADAM_BYTES / over(1))
    return state / 1e9 + PROCESS_OVERHEAD_GB


def physical_memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_cpu_memory(model: ModelSpec, config: ParallelConfig, *,
                     processes: int | None = None, total_bytes: int | None = None) -> None:
    """Raise when ``processes`` ranks of ``config`` cannot fit in this machine's memory.

    Args:
        model: The model trained.
        config: The parallel config (its world size is the process count by default).
        processes: Processes started on this machine (default ``config.world_size``).
        total_bytes: Memory to fit in (default :func:`physical_memory_bytes`).

    Raises:
        ConfigError: naming ``model``, with the estimate and the machine's memory.
    """
    processes = config.world_size if processes is None else processes
    total_gb = (physical_memory_bytes() if total_bytes is None else total_bytes) / 1e9
    per_process = cpu_process_memory_gb(model, config)
    needed = per_process * processes
    if needed > total_gb:
        raise ConfigError(
            "model", model.name,
            f"{model.num_params / 1e9:.3g}B parameters under {config.key()} need at least "
            f"{per_process:.1f} GB per process on the CPU (float32 weights, gradients and "
            f"AdamW state) x {processes} processes = {needed:.1f} GB, more than this "
            f"machine's {total_gb:.1f} GB of memory; use a smaller model, or more tensor or "
            f"pipeline parallelism, or a GPU")
