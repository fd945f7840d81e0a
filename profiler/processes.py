"""The one place where paratune starts, ties and joins worker processes.

* :func:`die_with_parent` (in a started process) and :func:`dies_with_this_process` (a
  ``preexec_fn`` for :class:`subprocess.Popen`) have Linux signal a worker when the process
  that started it dies, even by ``kill -9``; an orphan (its parent gone before the request)
  exits at once.
* :func:`init_process_group` joins a ``torch.distributed`` group, gloo on the CPU, NCCL on
  CUDA with the device bound from the start, from a given store or torchrun's environment.
* :func:`spawn` and :func:`init_worker` run a function in a local group of fresh processes
  whose rendezvous store this process hosts; the campaign's groups (``launcher.py``) and
  torchrun start ``paratune.profiler._worker``, which ties itself and joins the same way.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from paratune.errors import ConfigError, ParatuneError, Terminated

logger = logging.getLogger(__name__)


_LOCALHOST = "127.0.0.1"


_GROUP_TIMEOUT_S = 300.0
"""How long a local group's rendezvous and collectives wait for a rank."""


class WorkerError(ParatuneError, RuntimeError):
    """A process started by :func:`spawn` raised or died; the message names the rank and
    the worker's exception (its traceback is logged at debug level)."""


def resolved_device(kind: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a job's ``device`` (``"auto"``: cuda when available)."""
    if kind != "auto":
        return kind
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_gpus(device: str, world_size: int) -> None:
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


def device_for(kind: str, rank: int, world_size: int) -> Any:
    import torch

    kind = resolved_device(kind)
    if kind == "cuda":
        check_gpus(kind, world_size)
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def init_worker(rank: int, world_size: int, port: int, device: str = "auto") -> Any:
    """Join a localhost process group (gloo on CPU, NCCL on CUDA) through the rendezvous
    store that :func:`spawn` hosts on ``port``; returns the device.

    Called in a process started by :func:`spawn`, which has already tied the process's life
    to its parent's (see :func:`die_with_parent`).
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dev = device_for(device, rank, world_size)
    # the rendezvous store is the one :func:`spawn` hosts on ``port``: every rank a client
    store = dist.TCPStore(_LOCALHOST, port, is_master=False,
                          timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT_S))
    init_process_group(dev, timeout_s=_GROUP_TIMEOUT_S, store=store, rank=rank,
                       world_size=world_size)
    return dev


_PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent dies (Linux)."""


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (``None`` where there is none: not Linux)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """End this process when ``parent_pid``, the process that started it, dies, so a killed
    run leaves no workers writing its files.

    The kernel is asked to send ``sig`` on the parent's death (Linux); a parent that died
    before that request (while this process was starting up) is caught by comparing the
    current parent with ``parent_pid``: an orphan has been re-parented and exits at once.
    """
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent_pid:
        os._exit(1)


def dies_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that ties the child to this process as
    :func:`die_with_parent` does (``sig`` on this process's death). ``None`` where ``prctl``
    does not exist.

    libc is loaded here, in the parent: between ``fork`` and ``exec`` the child only calls it.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def init_process_group(device: Any, *, timeout_s: float, store: Any = None,
                       rank: int | None = None, world_size: int | None = None) -> None:
    """Join this process's ``torch.distributed`` group: NCCL on a CUDA ``device`` (given to
    NCCL as ``device_id``, so the communicator is bound to it from the start), else gloo.

    Args:
        device: This rank's ``torch.device`` (on CUDA already the current device).
        timeout_s: Rendezvous and collective timeout.
        store: A rendezvous store (with ``rank`` and ``world_size``); ``None`` reads
            torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).
        rank: This process's rank, with ``store``.
        world_size: Ranks in the group, with ``store``.
    """
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kwargs["device_id"] = device
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kwargs)


def _spawned(rank: int, fn: Callable[..., Any], parent_pid: int, world_size: int, port: int,
             *args: Any) -> None:
    """Body of a process started by :func:`spawn`: first tie it to its parent, then run
    ``fn(rank, world_size, port, *args)``."""
    die_with_parent(parent_pid)
    fn(rank, world_size, port, *args)


def end_workers(processes: Sequence[Any], *, grace_s: float = 10.0) -> None:
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
    :func:`die_with_parent`).

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
        end_workers(started)
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
