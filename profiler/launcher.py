"""Starting the worker group of one world size: locally, or the torchrun command for a cluster.

Both start the same entry point, ``python -m paratune.profiler._worker --plan PLAN``, with
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so what is tested locally is what runs on a cluster.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from paratune.profiler._worker import ATTEMPT_ENV, PARENT_ENV
from paratune.profiler.processes import dies_with_this_process

__all__ = ["LocalGroup", "dies_with_this_process", "free_port", "launch_local",
           "restart_budget", "slurm_command", "torchrun_command"]

WORKER_MODULE = "paratune.profiler._worker"


def restart_budget(num_configs: int) -> int:
    """torchrun ``--max-restarts`` for a plan of ``num_configs`` configs.

    Every failed config ends its group (the next config starts in fresh processes), and
    torchrun counts each such end as a restart: a failure a rank reported (``oom``,
    ``error``, ``timeout``) is recorded by the next launch, a group that dies without a
    report after the second launch that dies on that config. Two restarts per config, and
    three for launches that fail before measuring anything, cover the whole plan.
    """
    return 2 * max(0, int(num_configs)) + 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class LocalGroup:
    """The processes of one local launch (one per rank, each in its own session)."""

    processes: list[subprocess.Popen]
    attempt: str
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)
    _handles: list[IO[bytes]] = field(default_factory=list, repr=False)

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.processes]

    def kill(self) -> None:
        """SIGKILL every rank and anything it started."""
        for p in self.processes:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)

    def wait(self, timeout: float = 30.0) -> list[int]:
        """Wait for every rank to end (killing those still alive after ``timeout``)."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.processes:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                codes.append(p.wait())
        for handle in self._handles:
            handle.close()
        self._handles.clear()
        return codes

    def log_tail(self, num_chars: int = 2000) -> str:
        """The end of each rank's output."""
        parts = []
        for rank, path in enumerate(self.logs):
            try:
                text = path.read_text(errors="replace")[-num_chars:]
            except OSError:
                text = ""
            parts.append(f"--- rank {rank} ({path.name}) ---\n{text}")
        return "\n".join(parts)


def launch_local(plan_path: str | Path, world_size: int, *, attempt: str, log_dir: str | Path,
                 device: str = "cpu", extra_env: dict[str, str] | None = None) -> LocalGroup:
    """Start ``world_size`` worker processes on this machine for one plan.

    Args:
        plan_path: The world size's plan file.
        world_size: Ranks to start.
        attempt: Identifier of this launch (tagged on every event).
        log_dir: Where each rank's output goes (``<attempt>-rank<R>.log``).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank R on GPU R).
        extra_env: Variables added to the workers' environment (``OMP_NUM_THREADS``,
            unless set: the cores shared among the ranks on CPU, ``1`` on CUDA as torchrun
            sets it).
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = _worker_env(world_size, device, extra_env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", PYTHONUNBUFFERED="1")
    base[PARENT_ENV] = str(os.getpid())
    base[ATTEMPT_ENV] = attempt
    processes, logs, handles = [], [], []
    # the absolute path: a later run recognises the processes of this campaign by it
    command = [sys.executable, "-m", WORKER_MODULE, "--plan", str(Path(plan_path).resolve())]
    for rank in range(world_size):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        log = log_dir / f"{attempt}-rank{rank}.log"
        handle = open(log, "wb")  # noqa: SIM115 - closed by LocalGroup.wait
        handles.append(handle)
        processes.append(subprocess.Popen(command, env=env, stdout=handle,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
        logs.append(log)
    return LocalGroup(processes=processes, attempt=attempt, logs=logs, _handles=handles)


def _worker_env(world_size: int, device: str, extra_env: dict[str, str] | None
                ) -> dict[str, str]:
    """This process's environment with ``extra_env`` and a default ``OMP_NUM_THREADS``
    (kept when set): on CPU the cores shared among the ranks (gloo computes on them); on
    CUDA ``1`` with more than one rank, as torchrun sets it."""
    env = dict(os.environ)
    env.update(extra_env or {})
    if "OMP_NUM_THREADS" not in env:
        if device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
        elif world_size > 1:
            env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun_command(plan_path: str | Path, *, nproc_per_node: int | str,
                     nnodes: int | str = "$NNODES",
                     rdzv_endpoint: str = "$MASTER_ADDR:29500", rdzv_id: str = "paratune",
                     max_restarts: int | None = None) -> str:
    """The torchrun command that runs one world size's plan on a cluster.

    Every node runs the same command; torchrun's c10d rendezvous at ``rdzv_endpoint`` forms
    the group. The campaign directory must be on a filesystem every node sees. After a
    failure torchrun restarts the group (up to ``max_restarts`` times; default
    :func:`restart_budget` of the plan's configs, read from ``plan_path``) and the workers
    carry on from the journal, recording the config that failed, hung or crashed.
    """
    if max_restarts is None:
        from paratune.datasets.journal import load_plan

        max_restarts = restart_budget(len(load_plan(plan_path).configs))
    parts = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
             f"--max-restarts={max_restarts}", "-m", WORKER_MODULE, "--plan",
             shlex.quote(str(plan_path))]
    return " ".join(parts)


def slurm_command(plan_path: str | Path, *, nnodes: int, nproc_per_node: int,
                  rdzv_id: str = "paratune", port: int = 29500,
                  max_restarts: int | None = None) -> str:
    """The same inside a SLURM allocation: one torchrun per node via ``srun``, with the
    rendezvous on the allocation's first node (two shell lines)."""
    inner = torchrun_command(plan_path, nproc_per_node=nproc_per_node, nnodes=nnodes,
                             rdzv_endpoint=f"$head:{port}", rdzv_id=rdzv_id,
                             max_restarts=max_restarts)
    return ('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
            f"srun --nodes={nnodes} --ntasks-per-node=1 {inner}")
