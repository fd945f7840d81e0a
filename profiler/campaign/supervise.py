"""Supervising a local worker group: following its events, settling what a dead launch left,
relaunching on the remaining configs."""

from __future__ import annotations

import logging
import math
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paratune.measurement import Status
from paratune.profiler._journal import (
    EXIT_RELAUNCH,
    EXIT_TIMEOUT,
    CampaignPaths,
    EventTail,
    JournalEntry,
    WorldSizePlan,
    append_record,
    failure_record,
    journal_keys,
    load_plan,
)
from paratune.profiler.campaign.spec import CampaignError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from paratune.profiler.launcher import LocalGroup


@dataclass
class _Progress:
    """Counts shown in the progress bar."""

    bar: Any = None
    ok: int = 0
    failed: int = 0

    def record(self, entry: JournalEntry) -> None:
        if entry.ok:
            self.ok += 1
        else:
            self.failed += 1
        if self.bar is not None:
            from collections import OrderedDict

            self.bar.set_postfix(OrderedDict(ok=self.ok, failed=self.failed), refresh=False)
            self.bar.update(1)


@dataclass
class _Launch:
    """What the parent saw of one launch."""

    group: LocalGroup
    started_keys: list[str] = field(default_factory=list)
    first_seen: dict[str, float] = field(default_factory=dict)
    causes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per config: ``fail`` and ``timeout`` events, each with ``_seen`` (parent clock)."""
    exits: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Rank -> (exit code, parent clock when seen), for ranks that ended on their own."""
    stop_reason: str = ""
    exit_codes: list[int] = field(default_factory=list)

    def first_failure_seen(self, key: str) -> float | None:
        seen = [e["_seen"] for e in self.causes.get(key, []) if e["event"] == "fail"]
        return min(seen) if seen else None


def _watch(launch: _Launch, paths: CampaignPaths, world_size: int, plan: WorldSizePlan,
           on_entry: Callable[[JournalEntry], None], *, fail_grace_s: float,
           startup_timeout_s: float, poll_s: float = 0.1) -> None:
    """Follow a launch until it ends or must be killed; records why in ``stop_reason``."""
    group = launch.group
    tails = [EventTail(paths.events(world_size, r)) for r in range(world_size)]
    for tail in tails:  # only this launch's events
        tail._offset = tail.path.stat().st_size if tail.path.exists() else 0
    journal_tail = EventTail(paths.journal(world_size))
    journal_tail._offset = (paths.journal(world_size).stat().st_size
                            if paths.journal(world_size).exists() else 0)
    done = journal_keys(paths.journal(world_size))
    timeout_s = plan.timeout_s
    first_exit: float | None = None

    def drain() -> None:
        now = time.monotonic()
        for tail in tails:
            for event in tail.read():
                if event.get("attempt") != group.attempt:
                    continue
                key, kind = event.get("key", ""), event.get("event")
                if kind == "start" and key not in launch.first_seen:
                    launch.first_seen[key] = now
                    launch.started_keys.append(key)
                elif kind in ("fail", "timeout"):
                    launch.causes.setdefault(key, []).append({**event, "_seen": now})
        for line in journal_tail.read():
            entry = JournalEntry.from_dict(line)
            done.add(entry.key)
            on_entry(entry)

    while True:
        time.sleep(poll_s)
        # Exits first, then events: a failure a peer's death caused is never seen earlier.
        codes = group.poll()
        now = time.monotonic()
        for rank, code in enumerate(codes):
            if code is not None and rank not in launch.exits:
                launch.exits[rank] = (code, now)
        drain()
        if all(c is not None for c in codes):
            launch.stop_reason = "exited"
            break
        if any(c not in (None, 0) for c in codes):
            # A rank died or asked for a fresh group; the others may be stuck waiting on it.
            first_exit = first_exit or now
            if now - first_exit > 3.0:
                launch.stop_reason = "rank exited"
                break
            continue
        pending = [k for k in launch.started_keys if k not in done]
        if pending:
            key = pending[0]
            failed_at = launch.first_failure_seen(key)
            if failed_at is not None and now - failed_at > fail_grace_s:
                launch.stop_reason = "rank failed"
                break
            if now - launch.first_seen[key] > timeout_s + 10.0:
                launch.causes.setdefault(key, []).append(
                    {"event": "timeout", "rank": -1, "time": time.time(), "_seen": now})
                launch.stop_reason = "timeout"
                break
        elif not launch.started_keys and now - group.started > startup_timeout_s:
            launch.stop_reason = "startup timeout"
            break
    group.kill()
    launch.exit_codes = group.wait()
    drain()


def _describe_exit(rank: int, code: int) -> str:

    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with code {code}"


def _root_cause(launch: _Launch, key: str, world_size: int, timeout_s: float
                ) -> tuple[Status, str]:
    """Why a config in flight produced no record: the earliest of the failures, timeouts
    and deaths seen (a peer's error after a rank died or timed out is a consequence)."""
    causes = sorted(launch.causes.get(key, []), key=lambda e: e.get("time", 0.0))
    own = {e.get("rank") for e in causes}
    deaths = [(seen, rank, code) for rank, (code, seen) in launch.exits.items()
              if code not in (0, EXIT_RELAUNCH, EXIT_TIMEOUT) and rank not in own]
    first_event_seen = min((e["_seen"] for e in causes), default=math.inf)
    if deaths and min(deaths)[0] <= first_event_seen:
        _, rank, code = min(deaths)
        return Status.ERROR, f"{_describe_exit(rank, code)} while measuring this config"
    if causes:
        root = causes[0]
        if root["event"] == "timeout":
            return Status.TIMEOUT, f"no result within the per-config timeout of {timeout_s:g} s"
        fails = [e for e in causes if e["event"] == "fail"]
        oom = root.get("status") == Status.OOM.value
        error = root.get("error", "")
        if len(fails) < world_size:
            error += " (the other ranks were left waiting and the group was torn down)"
        return (Status.OOM if oom else Status.ERROR), error
    return Status.ERROR, (f"the process group ended while measuring this config "
                          f"({launch.stop_reason}; exit codes {launch.exit_codes})")


def _settle(launch: _Launch, paths: CampaignPaths, world_size: int, plan: WorldSizePlan,
            on_entry: Callable[[JournalEntry], None]) -> bool:
    """Journal the outcome of the config a dead launch left unfinished.

    Returns:
        Whether there was such a config.
    """
    done = journal_keys(paths.journal(world_size))
    pending = [k for k in launch.started_keys if k not in done]
    if not pending:
        return False
    key = pending[0]
    by_key = {config.key(): config for config in plan.configs}
    status, error = _root_cause(launch, key, world_size, plan.timeout_s)
    record = failure_record(plan, by_key[key], status, error)
    append_record(paths.journal(world_size), record, attempt=launch.group.attempt,
                  resolved_by="parent")
    on_entry(JournalEntry(key=key, world_size=world_size, row=record.to_row(),
                          attempt=launch.group.attempt, resolved_by="parent"))
    return True


def _run_world_size(paths: CampaignPaths, world_size: int, progress: _Progress, *,
                    fail_grace_s: float, startup_timeout_s: float | None,
                    extra_env: dict[str, str] | None, on_entry_hook: Callable[[str], None]
                    ) -> None:
    from paratune.profiler.launcher import launch_local

    plan_path = paths.plan(world_size)
    plan = load_plan(plan_path)
    keys = plan.keys()
    no_progress = 0
    startup_timeout = startup_timeout_s or max(120.0, plan.timeout_s)

    def on_entry(entry: JournalEntry) -> None:
        progress.record(entry)
        on_entry_hook(entry.key)

    while True:
        done = journal_keys(paths.journal(world_size))
        remaining = [k for k in keys if k not in done]
        if not remaining:
            return
        attempt = f"local-ws{world_size}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
        group = launch_local(plan_path, world_size, attempt=attempt, log_dir=paths.logs,
                             device=plan.device, extra_env=extra_env)
        launch = _Launch(group=group)
        _watch(launch, paths, world_size, plan, on_entry, fail_grace_s=fail_grace_s,
               startup_timeout_s=startup_timeout)
        settled = _settle(launch, paths, world_size, plan, on_entry)
        codes = launch.exit_codes
        progressed = settled or len(journal_keys(paths.journal(world_size)) - done) > 0
        if progressed:
            no_progress = 0
            if not settled and not all(c in (0, EXIT_RELAUNCH) for c in codes):
                log.warning("ws=%d launch %s ended (%s, exit codes %s)", world_size, attempt,
                            launch.stop_reason, codes)
            continue
        no_progress += 1
        log.warning("ws=%d: worker group finished no config (%s, exit codes %s)", world_size,
                    launch.stop_reason, codes)
        if no_progress >= 3:
            raise CampaignError(f"the worker group of world size {world_size} finished no "
                                f"config in 3 launches ({launch.stop_reason}, exit codes "
                                f"{codes}); its output:\n{group.log_tail()}")
