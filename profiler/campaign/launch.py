"""A world size under ``torchrun --standalone``, and the processes of earlier launches of a
campaign found on this machine (``/proc``)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratune.datasets.materialise import plan_keys
from paratune.errors import ConfigError
from paratune.profiler._journal import (
    CampaignPaths,
    EventTail,
    JournalEntry,
    journal_keys,
    load_plan,
)
from paratune.profiler.campaign.spec import CampaignError
from paratune.profiler.campaign.supervise import _Progress

log = logging.getLogger(__name__)


def _run_world_size_torchrun(paths: CampaignPaths, world_size: int, progress: _Progress, *,
                             extra_env: dict[str, str] | None,
                             on_entry_hook: Callable[[str], None]) -> None:
    """Run one world size's plan with ``torchrun --standalone`` on this machine (the same
    worker and restart path as on a cluster, without the parent's supervision), as
    ``python -m torch.distributed.run`` of the running interpreter."""
    import shlex
    import subprocess

    from paratune.profiler._worker import DIE_WITH_LAUNCHER_ENV
    from paratune.profiler.launcher import torchrun_command
    from paratune.profiler.processes import dies_with_this_process

    plan = load_plan(paths.plan(world_size))
    journal = paths.journal(world_size)
    tail = EventTail(journal)
    tail._offset = journal.stat().st_size if journal.exists() else 0
    command = torchrun_command(paths.plan(world_size).resolve(), nproc_per_node=world_size,
                               nnodes=1, rdzv_endpoint="localhost:0",
                               rdzv_id=f"{plan.campaign_id}-ws{world_size}")
    import sys

    # torchrun of this interpreter (a ``torchrun`` first on PATH may be another
    # installation's, running another paratune); the printed cluster commands keep torchrun
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            *[a for a in shlex.split(command)[1:] if not a.startswith("--rdzv")]]
    env = dict(os.environ, **(extra_env or {}))
    env[DIE_WITH_LAUNCHER_ENV] = "1"
    if plan.device == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    paths.logs.mkdir(parents=True, exist_ok=True)
    log_path = paths.logs / f"torchrun-ws{world_size}-{time.strftime('%H%M%S')}.log"
    with open(log_path, "wb") as handle:
        # torchrun gets SIGTERM when this process dies, even by kill -9 (it then ends its
        # ranks, which also die with it), and has its own process group to be signalled as
        # a whole
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=dies_with_this_process(signal.SIGTERM))
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                for line in tail.read():
                    progress.record(JournalEntry.from_dict(line))
                    on_entry_hook(line["key"])
        except BaseException:  # interrupted or terminated: torchrun must not run on alone
            _stop_torchrun(proc)
            raise
    for line in tail.read():
        progress.record(JournalEntry.from_dict(line))
        on_entry_hook(line["key"])
    left = plan_keys(paths, world_size) - journal_keys(journal)
    if proc.returncode != 0 or left:
        raise CampaignError(f"torchrun for world size {world_size} exited with code "
                            f"{proc.returncode}, {len(left)} configs unfinished; see {log_path} "
                            f"(run again with --resume to continue)")


def _stop_torchrun(proc: Any, grace_s: float = 10.0) -> None:
    """End a local torchrun: SIGTERM (it ends its workers), SIGKILL after ``grace_s``."""
    import subprocess

    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group (its session)
        proc.kill()
        proc.wait()


_EARLIER_LAUNCH_WAIT_S = 30.0
"""How long a run waits for the processes of an earlier launch of its campaign (ending after
their parent died) before refusing to start its own."""


def _campaign_processes(paths: CampaignPaths) -> list[int]:
    """Processes on this machine, other than this one, running a plan of the campaign in
    ``paths`` (``--plan DIR/plan-ws<N>.json`` on their command line): the ranks and the
    torchrun of any launch, by this or another process, and a printed torchrun command run
    here by hand."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    root = paths.root.resolve()
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = [os.fsdecode(a) for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:  # ended meanwhile, or not ours to read
            continue
        plans = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--plan"]
        plans += [a.split("=", 1)[1] for a in argv if a.startswith("--plan=")]
        for plan in plans:
            path = Path(plan)
            if not path.is_absolute():
                try:
                    path = Path(os.readlink(entry / "cwd")) / path
                except OSError:
                    continue
            if path.name.startswith("plan-ws") and path.parent.resolve() == root:
                pids.append(int(entry.name))
                break
    return sorted(pids)


def _await_earlier_launches(paths: CampaignPaths, wait_s: float | None = None) -> None:
    """Wait until no process of an earlier launch of this campaign runs on this machine.

    The ranks of a campaign whose parent was killed die with it, but not at the same instant
    (torchrun first ends its ranks); a run that launched meanwhile would measure the same
    configs a second time, and both would append them to the journal.

    Raises:
        ConfigError: some are still running after ``wait_s`` (``out``; default
            :data:`_EARLIER_LAUNCH_WAIT_S`).
    """
    deadline = time.monotonic() + (_EARLIER_LAUNCH_WAIT_S if wait_s is None else wait_s)
    pids = _campaign_processes(paths)
    if pids:
        log.warning("waiting for %d processes of an earlier launch of %s to end (pids %s)",
                    len(pids), paths.root, pids)
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = _campaign_processes(paths)
    if pids:
        raise ConfigError("out", str(paths.root), f"processes of an earlier launch of this "
                          f"campaign are still running (pids {', '.join(map(str, pids))}): "
                          "end them before profiling it again")
