"""Failures of a profiled config: telling an out-of-memory failure from another, and the
fault injection the tests use.

``PARATUNE_FAULT`` holds comma-separated ``kind:config-key[:rank]`` entries (kind ``hang``,
``raise``, ``oom`` or ``exit``; no rank means every rank), applied just before the config is
measured.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["FAULT_ENV", "inject", "is_oom", "parse_faults"]


FAULT_ENV = "PARATUNE_FAULT"


_FAULT_KINDS = ("hang", "raise", "oom", "exit")


def parse_faults(text: str) -> list[tuple[str, str, int | None]]:
    """``kind:key[:rank]`` entries of :data:`FAULT_ENV`.

    Raises:
        ValueError: an entry names an unknown kind or a non-integer rank.
    """
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        if len(parts) not in (2, 3) or parts[0] not in _FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}={entry!r}: must be kind:config-key[:rank] with kind "
                             f"one of {', '.join(_FAULT_KINDS)}")
        rank = int(parts[2]) if len(parts) == 3 else None
        faults.append((parts[0], parts[1], rank))
    return faults


def inject(faults: list[tuple[str, str, int | None]], key: str, rank: int) -> None:
    import torch

    for kind, fault_key, fault_rank in faults:
        if fault_key != key or (fault_rank is not None and fault_rank != rank):
            continue
        if kind == "hang":
            while True:
                time.sleep(3600)
        if kind == "raise":
            raise RuntimeError(f"injected fault on rank {rank}")
        if kind == "oom":
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory on rank {rank}")
        if kind == "exit":
            os.kill(os.getpid(), signal.SIGKILL)


_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")
"""Lower-case fragments of the messages of allocation failures: CUDA's (``CUDA out of
memory``) and the CPU allocator's (``DefaultCPUAllocator: can't allocate memory: you tried to
allocate N bytes. Error code 12 (Cannot allocate memory)``)."""


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an out-of-memory failure, on a GPU or on the CPU: a
    ``torch.OutOfMemoryError``, a ``MemoryError``, an ``OSError`` with ``ENOMEM``, or an
    error whose message is an allocator's (the CPU allocator raises a plain
    ``RuntimeError``); also when such a failure is the cause of the exception raised."""
    import errno

    import torch

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 10:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, OSError) and current.errno == errno.ENOMEM:
            return True
        text = str(current).lower()
        if any(fragment in text for fragment in _OOM_TEXTS):
            return True
        current = current.__cause__ or (None if current.__suppress_context__
                                         else current.__context__)
    return False
