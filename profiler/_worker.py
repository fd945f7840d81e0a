"""Worker entry point: one rank of a group that profiles many configs in one set of processes.

Run as ``python -m paratune.profiler._worker --plan OUT/plan-ws<N>.json`` by the local
launcher, or under ``torchrun`` on a cluster: the process group is initialised from the same
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) either way.

For each config not yet in the journal, every rank writes a ``start`` event, calls
:func:`~paratune.profiler.trainer.measure_config` (which builds mesh, model and optimizer,
runs the steps and frees everything), writes a ``fail`` event if it raised, and then all
ranks exchange their outcomes over a separate gloo group (so a rank that failed early can
never be matched with a collective of the training step). Rank 0 appends the record to the
journal. After any failure the group exits with :data:`EXIT_RELAUNCH` so that the next
config starts in fresh processes (ranks that failed at different points would otherwise
leave collectives unmatched). A watchdog thread
exits the process with :data:`EXIT_TIMEOUT` when a config runs past its timeout. Under
torchrun, a rank whose config failed waits at most :func:`fail_grace_s` for the others'
outcomes (they may be stuck in a collective the failed rank left): then it exits with
:data:`EXIT_RELAUNCH`, torchrun ends the group, and the next launch records the failure
from the events (the local launcher's parent does the same for its groups). Under torchrun
a rank stopped from outside (SIGTERM, which torchrun forwards when it is stopped itself, or
SIGINT) writes an ``interrupted`` event for the config in flight and exits: a launch stopped
that way does not count as an attempt of the config.

Fault injection, for tests only: ``PARATUNE_FAULT`` holds comma-separated
``kind:config-key[:rank]`` entries (kind ``hang``, ``raise``, ``oom`` or ``exit``; no rank
means every rank), applied just before the config is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratune.measurement import Measurement, Status, StepTiming
from paratune.parallel import ParallelConfig
from paratune.profiler._faults import FAULT_ENV, inject, is_oom, parse_faults
from paratune.profiler._journal import (
    EXIT_RELAUNCH,
    EXIT_TIMEOUT,
    CampaignPaths,
    EventLog,
    WorldSizePlan,
    append_record,
    failure_record,
    journal_keys,
    load_plan,
    resolve_unfinished,
)
from paratune.profiler.processes import die_with_parent, init_process_group

__all__ = ["FAULT_ENV", "is_oom", "main", "parse_faults"]

PARENT_ENV = "PARATUNE_PARENT_PID"
ATTEMPT_ENV = "PARATUNE_ATTEMPT"
DIE_WITH_LAUNCHER_ENV = "PARATUNE_DIE_WITH_LAUNCHER"
"""Set (to ``1``) by a campaign that starts torchrun itself: each rank then dies with the
torchrun that started it, as the local launcher's ranks die with their parent."""
FAIL_GRACE_S = 10.0
"""Longest wait, under torchrun, for the other ranks' outcomes after a config failed on this
rank (see :func:`fail_grace_s`)."""


def fail_grace_s(timeout_s: float) -> float:
    """Seconds a rank whose config failed waits for the other ranks' outcomes under torchrun:
    :data:`FAIL_GRACE_S`, and at most half the per-config timeout."""
    return min(FAIL_GRACE_S, timeout_s / 2)


class _Watchdog(threading.Thread):
    """Ends the process when a config overruns its timeout, the launching parent dies, or the
    other ranks' outcomes do not arrive by the deadline :meth:`give_up_at` set."""

    def __init__(self, events: EventLog, timeout_s: float, parent_pid: int | None) -> None:
        super().__init__(daemon=True, name="paratune-watchdog")
        self.events = events
        self.timeout_s = timeout_s
        self.parent_pid = parent_pid
        self.current: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._deadline: float | None = None

    def give_up_at(self, deadline: float | None) -> None:
        """Exit with :data:`EXIT_RELAUNCH` once ``time.monotonic()`` passes ``deadline``
        (``None``: never). Once this returns with ``None`` the watchdog cannot fire on an
        earlier deadline: the caller may go on writing the journal."""
        with self._lock:
            self._deadline = deadline

    def run(self) -> None:
        while True:
            time.sleep(0.5)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(1)
            with self._lock:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    sys.stderr.write("the other ranks did not report their outcome in time "
                                     "(stuck in a collective?); exiting for a fresh group\n")
                    sys.stderr.flush()
                    os._exit(EXIT_RELAUNCH)
            current = self.current
            if current and time.monotonic() - current[1] > self.timeout_s:
                self.events.write("timeout", current[0], timeout_s=self.timeout_s)
                sys.stderr.write(f"config {current[0]} ran past {self.timeout_s:g} s; exiting\n")
                sys.stderr.flush()
                os._exit(EXIT_TIMEOUT)


class _StopHandler(threading.Thread):
    """Under torchrun: on SIGTERM or SIGINT, write an ``interrupted`` event for the config in
    flight (:attr:`key`) and exit with ``128 + signal``.

    The signal is read from :func:`signal.set_wakeup_fd` by this thread, so the event is
    written even while the main thread is blocked in a collective or a kernel (where a
    Python signal handler would not run until it returned).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, events: EventLog) -> None:
        super().__init__(daemon=True, name="paratune-stop")
        self.events = events
        self.key: str | None = None
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        for sig in self.SIGNALS:
            signal.signal(sig, lambda *_: None)  # the C handler wakes this thread
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def run(self) -> None:
        while True:
            data = os.read(self._read, 16)
            stopped = [s for s in data if s in self.SIGNALS]
            if stopped:
                break
        sig = signal.Signals(stopped[0])
        key = self.key
        if key:
            with contextlib.suppress(OSError):
                self.events.write("interrupted", key, signal=sig.name)
        sys.stderr.write(f"stopped by {sig.name}"
                         f"{f' while measuring {key}' if key else ''}; exiting\n")
        sys.stderr.flush()
        os._exit(128 + int(sig))


def _describe(exc: BaseException, rank: int) -> str:
    """``rank R: Type: message (at file:line)``, plus the innermost cause when chained."""

    def one(e: BaseException) -> str:
        frames = traceback.extract_tb(e.__traceback__)
        where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        return f"{type(e).__name__}: {' '.join(str(e).split())}{where}"

    root = exc
    for _ in range(10):
        nxt = root.__cause__ or root.__context__
        if nxt is None:
            break
        root = nxt
    text = f"rank {rank}: {one(exc)}"
    if root is not exc:
        text += f"; caused by {one(root)}"
    return text[:2000]


@dataclass
class _Rank:
    """This rank of a worker group: its plan, place, device, and what watches it."""

    plan: WorldSizePlan
    paths: CampaignPaths
    rank: int
    device: Any
    control: Any
    """A gloo group for exchanging outcomes (never matched with a training collective)."""
    events: EventLog
    watchdog: _Watchdog
    stop: _StopHandler | None
    parent_pid: int | None
    """The supervising parent (local launcher), ``None`` under torchrun."""
    fingerprint: dict[str, Any]
    """This machine's, recorded with the failures this rank journals."""


def _tie_to_launcher() -> int | None:
    """Die with whoever launched this rank (the local launcher's parent, or the torchrun agent
    of a campaign that started torchrun itself); returns the supervising parent's pid."""
    supervised = os.environ.get(PARENT_ENV)
    parent_pid = int(supervised) if supervised else None
    if parent_pid is not None:
        die_with_parent(parent_pid, signal.SIGKILL)
    elif os.environ.get(DIE_WITH_LAUNCHER_ENV):
        launcher = os.getppid()  # torchrun's agent
        if launcher == 1:  # it is gone already
            os._exit(1)
        die_with_parent(launcher, signal.SIGKILL)
    return parent_pid


def _join(plan: WorldSizePlan, paths: CampaignPaths, rank: int, attempt: str | None,
          parent_pid: int | None) -> _Rank:
    """Join the group, agree on the launch's identifier, start the watchdog (and, under
    torchrun, the stop handler)."""
    import torch
    import torch.distributed as dist

    from paratune.profiler.fingerprint import fingerprint

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if plan.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    init_process_group(device, timeout_s=plan.timeout_s + 120)
    control = dist.new_group(backend="gloo",
                             timeout=datetime.timedelta(seconds=plan.timeout_s + 120))
    if not attempt:  # under torchrun: one identifier for this launch, chosen by rank 0
        box: list[Any] = [f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-"
                          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-"
                          f"{time.strftime('%Y%m%dT%H%M%S')}"]
        dist.broadcast_object_list(box, src=0, group=control)
        attempt = str(box[0])
    events = EventLog(paths.events(plan.world_size, rank), rank=rank, attempt=attempt)
    watchdog = _Watchdog(events, plan.timeout_s, parent_pid)
    watchdog.start()
    stop: _StopHandler | None = None
    if parent_pid is None:  # the local launcher's parent stops its groups with SIGKILL
        stop = _StopHandler(events)
        stop.start()
    return _Rank(plan=plan, paths=paths, rank=rank, device=device, control=control,
                 events=events, watchdog=watchdog, stop=stop, parent_pid=parent_pid,
                 fingerprint=fingerprint(device, world_size=plan.world_size))


def _todo(me: _Rank) -> list[ParallelConfig]:
    """The plan's configs the journal does not hold yet, as rank 0 reads it (under torchrun
    after settling what a dead earlier launch left)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if me.rank == 0:
        if me.parent_pid is None:  # under torchrun: settle what a dead earlier launch left
            resolve_unfinished(me.paths, me.plan, fingerprint=me.fingerprint)
        done = journal_keys(me.paths.journal(me.plan.world_size))
        box[0] = [c.to_dict() for c in me.plan.configs if c.key() not in done]
    dist.broadcast_object_list(box, src=0, group=me.control)
    return [ParallelConfig.from_dict(c) for c in box[0]]


def _measure(me: _Rank, config: ParallelConfig, faults: list[tuple[str, str, int | None]]
             ) -> tuple[Measurement | None, Status, str, dict[str, Any]]:
    """Measure one config on this rank: ``(measurement or None, status, error, details)``;
    every failure becomes the status, with a ``fail`` event."""
    import torch

    from paratune.profiler.measure import MeasureOptions, measure_config

    key, plan = config.key(), me.plan
    details: dict[str, Any] = {}
    try:
        inject(faults, key, me.rank)
        options = MeasureOptions(warmup_steps=plan.warmup_steps,
                                 measured_steps=plan.measured_steps, seed=plan.seed,
                                 data=plan.data, devices_per_node=plan.devices_per_node)
        measurement = measure_config(plan.model, config, hardware=plan.hardware,
                                     device=me.device, options=options, details=details)
        return measurement, Status.OK, "", details
    except Exception as exc:  # every failure becomes this config's status
        status = Status.OOM if is_oom(exc) else Status.ERROR
        error = _describe(exc, me.rank)
        traceback.print_exc()
        me.events.write("fail", key, status=status.value, error=error)
        gc.collect()
        if me.device.type == "cuda":
            torch.cuda.empty_cache()
        if me.parent_pid is None:
            # Under torchrun nobody else ends a group whose other ranks are stuck in a
            # collective this rank left; the fail event is written, the next launch
            # records it (resolve_unfinished).
            me.watchdog.give_up_at(time.monotonic() + fail_grace_s(plan.timeout_s))
        return None, status, error, details


def _record(me: _Rank, config: ParallelConfig, measurement: Measurement | None,
            outcomes: list[tuple[Status, str]], call_s: float) -> Measurement:
    """The journal record of a config every rank has reported on: the measurement when all
    succeeded, else a failure naming the ranks' errors (``oom`` if any ran out of memory)."""
    if all(status is Status.OK for status, _ in outcomes):
        assert measurement is not None
        measurement.campaign_id = me.plan.campaign_id
        measurement.timing = dataclasses.replace(measurement.timing, call_s=call_s)
        return measurement
    failed = [(s, e) for s, e in outcomes if s is not Status.OK]
    kind = Status.OOM if any(s is Status.OOM for s, _ in failed) else Status.ERROR
    texts = list(dict.fromkeys(e for _, e in failed))
    record = failure_record(me.plan, config, kind, " | ".join(texts[:4]),
                            fingerprint=me.fingerprint)
    record.timing = StepTiming(call_s=call_s)
    return record


def _finish(me: _Rank, exit_code: int) -> None:
    """End the group cleanly when every config is done (under torchrun rank 0 then leaves
    the dataset ready in the campaign directory)."""
    import torch.distributed as dist

    from paratune.profiler.mesh import clear_mesh_cache

    if exit_code == 0:
        me.events.write("finished")
    me.watchdog.current = None
    clear_mesh_cache()
    if exit_code == 0:
        dist.barrier(group=me.control)
        dist.destroy_process_group()
        if me.rank == 0 and me.parent_pid is None:
            # Under torchrun nobody else is watching: leave the dataset ready in OUT.
            from paratune.datasets.materialise import materialise

            materialise(me.paths.root)


def run_worker(plan_path: str | Path, *, attempt: str | None = None) -> int:
    """Profile the configs of one plan that the journal does not hold yet (collective).

    Returns:
        The process exit code (0 when every config is done).
    """
    faults = parse_faults(os.environ.get(FAULT_ENV, ""))  # fail fast, before heavy imports
    import torch.distributed as dist

    plan = load_plan(plan_path)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        print(f"WORLD_SIZE={world} must equal the plan's world_size={plan.world_size}",
              file=sys.stderr)
        return 2
    parent_pid = _tie_to_launcher()
    me = _join(plan, CampaignPaths(Path(plan_path).resolve().parent), rank,
               attempt or os.environ.get(ATTEMPT_ENV), parent_pid)
    todo = _todo(me)
    print(f"rank {rank}/{world} ({me.events.attempt}): {len(todo)} configs to measure",
          flush=True)
    exit_code = 0
    for config in todo:
        key = config.key()
        if me.stop is not None:
            me.stop.key = key
        me.events.write("start", key)
        me.watchdog.current = (key, time.monotonic())
        began = time.perf_counter()
        measurement, status, error, details = _measure(me, config, faults)
        call_s = time.perf_counter() - began
        outcomes: list[Any] = [None] * world
        dist.all_gather_object(outcomes, (status, error), group=me.control)
        me.watchdog.give_up_at(None)
        me.watchdog.current = None
        outcomes = [(Status(s), e) for s, e in outcomes]
        if rank == 0:
            record = _record(me, config, measurement, outcomes, call_s)
            append_record(me.paths.journal(world), record, call_s=call_s,
                          attempt=me.events.attempt, load_average=os.getloadavg()[0],
                          **details)
        me.events.write("end", key, status=status.value)
        if me.stop is not None:
            me.stop.key = None
        print(f"{key}: {status.value} in {call_s:.2f} s", flush=True)
        if any(s is not Status.OK for s, _ in outcomes):
            # After a failure the ranks may have left collectives unmatched (a rank that
            # raised early skipped some): the next config starts in fresh processes.
            exit_code = EXIT_RELAUNCH
            break
    _finish(me, exit_code)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paratune.profiler._worker",
        description="One rank of a paratune profiling group (local launcher or torchrun).")
    parser.add_argument("--plan", required=True, help="the world size's plan-ws<N>.json")
    parser.add_argument("--attempt", default=None, help="launch identifier for the events")
    args = parser.parse_args(argv)
    code = run_worker(args.plan, attempt=args.attempt)
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        os._exit(code)  # without waiting on peers that may be stuck in a collective
    return code


if __name__ == "__main__":
    sys.exit(main())
