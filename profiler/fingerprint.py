"""Hardware and software fingerprint recorded with every measurement."""

from __future__ import annotations

import platform
import socket
from typing import Any

from paratune.measurement import FINGERPRINT_FIELDS

__all__ = ["cpu_model", "fingerprint"]


def cpu_model() -> str:
    """The CPU model name (from ``/proc/cpuinfo`` where it exists)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(device: Any = None, *, world_size: int | None = None) -> dict[str, Any]:
    """What produced a measurement: devices, CPU, library versions and host.

    Args:
        device: The ``torch.device`` the job ran on (``None``: CUDA if available, else CPU).
        world_size: Devices in the job; defaults to the process group's size, else the
            visible CUDA device count (or 1 on CPU).

    Returns:
        A dict with exactly the keys of :data:`paratune.measurement.FINGERPRINT_FIELDS`.
    """
    import torch
    import torch.distributed as dist

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            world_size = torch.cuda.device_count() if cuda else 1
    nccl = ""
    if cuda:
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (RuntimeError, AttributeError):
            nccl = ""
    info = {
        "device_name": torch.cuda.get_device_name(device) if cuda else cpu_model(),
        "device_count": int(world_size),
        "cpu": cpu_model(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "nccl_version": nccl,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
    }
    assert tuple(info) == FINGERPRINT_FIELDS
    return info
