"""Profiling campaigns: every valid config of a grid, for each world size, measured for real.

A campaign enumerates the configuration space (:class:`~paratune.space.ConfigSpace`) for
each world size, reports the invalid configs as skipped with the rule each breaks, and
profiles the valid ones with one launch of ``world_size`` worker processes per world size
(each config rebuilds mesh, model and optimizer inside those processes). The parent process
supervises the group: a config that hangs past its timeout, a rank that raises while the
others wait, or a rank that dies is recorded as that config's status (``timeout``, ``error``,
``oom``), the group is torn down and relaunched on the remaining configs. Every finished
config is appended to a journal with an fsync before the next one starts, so killing the
campaign (even with ``kill -9``) loses nothing measured, and ``resume=True`` redoes nothing
that finished. At the end the journals become a dataset (parquet + card) in the campaign
directory, and the campaign is one MLflow run.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune._io import atomic_write_text, exclusive_lock
from paratune.errors import ConfigError, ParatuneError
from paratune.measurement import Status
from paratune.parallel import MAX_DEVICES, ParallelConfig, check_magnitude
from paratune.profiler._journal import (
    EXIT_RELAUNCH,
    EXIT_TIMEOUT,
    CampaignPaths,
    EventTail,
    append_record,
    failure_record,
    journal_keys,
    read_journal,
    read_plan,
    write_plan,
)
from paratune.space import ConfigSpace, SpaceEnumeration
from paratune.spec import ModelSpec

if TYPE_CHECKING:
    from paratune.datasets import Dataset
    from paratune.profiler.launcher import LocalGroup

__all__ = ["CampaignError", "CampaignProgress", "CampaignResult", "CampaignSpec",
           "campaign_progress", "default_space",
           "detect_device", "detect_hardware", "enumerate_campaign", "materialise",
           "prepare_campaign", "run_campaign", "torchrun_commands"]

log = logging.getLogger(__name__)

EXPERIMENT = "paratune-profile"
"""MLflow experiment of profiling campaigns."""


class CampaignError(ParatuneError, RuntimeError):
    """A campaign cannot go on (e.g. its worker group never starts)."""


def default_space(model: ModelSpec) -> ConfigSpace:
    """The grid profiled when none is given.

    For the ``tiny`` model it is small enough that world sizes 1, 2 and 4 run in a few
    minutes on two CPU cores while still covering every degree layout (dp, tp, pp), all
    three pipeline schedules, every sharding level and full recomputation; for other models
    it is the full default :class:`~paratune.space.ConfigSpace`.
    """
    if model.name == "tiny":
        return ConfigSpace(global_batch_sizes=(8,), micro_batch_sizes=(2,))
    return ConfigSpace()


def detect_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_NO_CUDA = "runs on CUDA, but no CUDA device is visible on this machine"
"""The rule of a CUDA run on a machine without one (as ``paratune gns`` words it)."""


def detect_hardware(device: str) -> str:
    """The catalogue name of this machine's device (``"cpu"`` for the CPU).

    Raises:
        ConfigError: no CUDA device is visible (``device``), or the GPU is not in the
            catalogue (pass ``--hardware`` explicitly).
    """
    from paratune.hardware import HARDWARE

    if device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.device_count() == 0:
        raise ConfigError("device", device, f"{_NO_CUDA}: use --device cpu here, or name the "
                          "cluster's GPU with --hardware and print the commands to run there "
                          "with --print-command")
    name = torch.cuda.get_device_name(0)
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    upper = name.upper()
    matches = [spec for spec in HARDWARE.values() if spec.device_type == "cuda"
               and spec.name.split("-")[0].upper() in upper]
    if not matches:
        raise ConfigError("hardware", name, "is not in the hardware catalogue; pass --hardware "
                          f"with one of {', '.join(sorted(HARDWARE))}")
    return min(matches, key=lambda spec: abs(spec.memory_gb - memory_gb)).name


@dataclass(kw_only=True)
class CampaignSpec:
    """What a campaign profiles and how."""

    model: ModelSpec
    """The model trained."""
    world_sizes: tuple[int, ...] = (1, 2, 4)
    """Device counts, one worker group each, profiled in this order."""
    space: ConfigSpace | None = None
    """The grid; ``None`` takes :func:`default_space`."""
    warmup_steps: int = 3
    """Steps run before timing each config (not counted)."""
    measured_steps: int = 10
    """Steps timed per config."""
    timeout_s: float = 300.0
    """Seconds one config may take (build, warm-up and measured steps) before it is
    recorded as ``timeout`` and its group torn down."""
    seed: int = 0
    """Initialisation and data seed."""
    device: str = "cpu"
    """``"cpu"`` (gloo) or ``"cuda"`` (NCCL)."""
    hardware: str = "cpu"
    """:class:`~paratune.hardware.HardwareSpec` name recorded with the measurements."""
    devices_per_node: int | None = None
    """Devices per node (decides tensor-parallel groups that would cross nodes); ``None``:
    each world size fits in one node."""
    data: str = "synthetic"
    """Training tokens: ``"synthetic"`` (random, the default for timing) or ``"text"`` (the
    byte-level corpus of Python's own sources)."""

    def __post_init__(self) -> None:
        from paratune.hardware import get_hardware

        sizes = self.world_sizes
        if isinstance(sizes, int):
            sizes = (sizes,)
        if not sizes:
            raise ConfigError("world_sizes", list(sizes), "must list at least one world size")
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError("world_sizes", size, "must be a positive integer")
            check_magnitude("world_sizes", size, MAX_DEVICES)
        self.world_sizes = tuple(dict.fromkeys(sizes))
        if self.space is None:
            self.space = default_space(self.model)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError("warmup_steps", self.warmup_steps, "must be an integer >= 0")
        if self.device == "cuda" and self.warmup_steps < 1:
            raise ConfigError("warmup_steps", self.warmup_steps, "must be >= 1 on CUDA: the "
                              "first step pays one-off costs (kernel and library "
                              "initialisation, communicators, allocator growth)")
        if not isinstance(self.measured_steps, int) or self.measured_steps < 1:
            raise ConfigError("measured_steps", self.measured_steps, "must be an integer >= 1")
        if not (isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError("timeout_s", self.timeout_s,
                              "must be a finite positive number of seconds")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError("device", self.device, "must be cpu or cuda")
        if self.data not in ("synthetic", "text"):
            raise ConfigError("data", self.data, "must be synthetic or text")
        if self.data == "text" and self.model.vocab_size < 256:
            raise ConfigError("data", self.data, f"real text is byte-level: it needs "
                              f"vocab_size >= 256 (model {self.model.name} has "
                              f"{self.model.vocab_size})")
        self.hardware = get_hardware(self.hardware).name
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ConfigError("devices_per_node", self.devices_per_node,
                              "must be a positive integer")

    def identity(self) -> dict[str, Any]:
        """The fields that decide what is measured (a resumed campaign must match them)."""
        assert self.space is not None
        identity = {"model": self.model.to_dict(), "world_sizes": list(self.world_sizes),
                    "grid": self.space.to_dict(), "warmup_steps": self.warmup_steps,
                    "measured_steps": self.measured_steps, "seed": self.seed,
                    "device": self.device, "hardware": self.hardware,
                    "devices_per_node": self.devices_per_node}
        if self.data != "synthetic":  # campaigns written before the option stay resumable
            identity["data"] = self.data
        return identity


def enumerate_campaign(spec: CampaignSpec) -> dict[int, SpaceEnumeration]:
    """Valid and skipped configs per world size.

    Configs that :meth:`ParallelConfig.validate` accepts but the profiler cannot run (see
    :func:`paratune.profiler.trainer.check_supported`) are skipped with that reason too, and
    so, on the CPU, are configs whose ranks on one machine cannot fit in its memory (see
    :func:`paratune.profiler._memory.check_cpu_memory`).
    """
    from paratune.profiler._memory import check_cpu_memory
    from paratune.profiler.trainer import check_supported

    assert spec.space is not None
    result = {}
    for world_size in spec.world_sizes:
        node = spec.devices_per_node or world_size
        enumeration = spec.space.enumerate(spec.model, world_size, devices_per_node=node)
        valid = []
        # on the CPU every rank of a machine shares its memory: a config whose ranks cannot
        # fit is skipped with the reason, before any process starts
        per_machine = min(world_size, spec.devices_per_node or world_size)
        for config in enumeration.valid:
            try:
                check_supported(spec.model, config)
                if spec.device == "cpu":
                    check_cpu_memory(spec.model, config, processes=per_machine)
            except ConfigError as exc:
                enumeration.skipped.append((config, str(exc)))
                continue
            valid.append(config)
        result[world_size] = SpaceEnumeration(valid=valid, skipped=enumeration.skipped)
    return result


# ---------------------------------------------------------------------- preparation
def _check_something_to_measure(spec: CampaignSpec,
                                enumerations: dict[int, SpaceEnumeration]) -> None:
    """Raise when no world size of ``spec`` has a single valid config."""
    if any(e.valid for e in enumerations.values()):
        return
    assert spec.space is not None
    # the checks of this profiler and machine (trainer support, memory) come last in each
    # enumeration and say most about a layout that is otherwise valid: shown first
    reasons = list(dict.fromkeys(reason for e in enumerations.values()
                                 for _, reason in reversed(e.skipped)))
    shown = "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    sizes = ", ".join(str(w) for w in spec.world_sizes)
    raise ConfigError(
        "world_sizes", list(spec.world_sizes),
        f"no config of {sizes} devices can be profiled for {spec.model.name} with "
        f"this grid (global_batch_sizes={list(spec.space.global_batch_sizes)}, "
        f"tp_degrees={_listed(spec.space.tp_degrees)}, "
        f"pp_degrees={_listed(spec.space.pp_degrees)}): nothing to profile"
        + (f" ({shown})" if shown else ""))


def _listed(values: tuple[int, ...] | None) -> object:
    return "any" if values is None else list(values)


_MISSING = object()


def _differs(name: str, value: Any, stored: Any, out: str | Path) -> ConfigError:
    """The refusal of a resume whose ``name`` (``value``) differs from the stored campaign's:
    of a model or grid, the subfields that differ, each with both values."""
    where = f"differs from the campaign being resumed in {out}"
    if not (isinstance(value, dict) and isinstance(stored, dict)):
        return ConfigError(name, value, f"{where} ({stored!r})")
    diffs = []
    for key in [*value, *(k for k in stored if k not in value)]:
        new, old = value.get(key, _MISSING), stored.get(key, _MISSING)
        if new != old:
            # a model's name is the model: "model='small'", not "name='small'"
            label = "model" if (name, key) == ("model", "name") else key
            diffs.append((label, new, old))
    assert diffs  # the dicts differ

    def shown(v: Any) -> str:
        return "unset" if v is _MISSING else repr(v)

    (label, new, old), *more = diffs
    also = "".join(f"; {k}={shown(n)} differs too ({shown(o)})" for k, n, o in more)
    return ConfigError(label, None if new is _MISSING else new, f"{where} ({shown(old)}){also}")


def _campaign_fingerprint(device: str) -> dict[str, Any]:
    from paratune.profiler.fingerprint import fingerprint

    return fingerprint(device)


def prepare_campaign(spec: CampaignSpec, out: str | Path, *, resume: bool = False,
                     enumerations: dict[int, SpaceEnumeration] | None = None,
                     measure_here: bool = True) -> tuple[CampaignPaths, dict[str, Any]]:
    """Write (or, resuming, check) ``campaign.json``, the per-world-size plans and
    ``skipped.csv`` in ``out``.

    Args:
        spec: What to profile.
        out: Campaign directory.
        resume: Check and reuse the campaign already in ``out``.
        enumerations: :func:`enumerate_campaign` of ``spec``, where already computed.
        measure_here: Whether this machine measures the campaign now: its fingerprint is
            then stored (``fingerprint`` of ``campaign.json``) and put into the plans, for
            the records of configs that fail under the local launcher's supervision. A
            campaign prepared to be measured elsewhere (the printed commands) gets none in
            its plans: the workers record their own machine's, and ``campaign.json`` keeps
            what it held.

    Returns:
        The campaign's paths and its metadata (``campaign.json``'s content).

    Raises:
        ConfigError: no world size has a valid config (nothing is written then); ``out``
            already holds a campaign and ``resume`` is false; or ``resume`` is true and
            there is none, or it profiles something else.
    """
    paths = CampaignPaths(Path(out))
    identity = spec.identity()
    if enumerations is None:
        enumerations = enumerate_campaign(spec)
    _check_something_to_measure(spec, enumerations)
    if resume:
        if not paths.campaign.exists():
            raise ConfigError("resume", str(out), "holds no campaign.json: nothing to resume")
        meta = json.loads(paths.campaign.read_text())
        stored = dict(meta.get("identity", {}))
        if isinstance(stored.get("grid"), dict):
            # a grid stored before options were kept sorted: compare it as the space it is
            with contextlib.suppress(ConfigError):  # else compared as stored, and refused
                stored["grid"] = ConfigSpace.from_dict(stored["grid"]).to_dict()
        # campaigns on the default synthetic tokens store no data field
        stored.setdefault("data", "synthetic")
        identity.setdefault("data", spec.data)
        for name, value in identity.items():
            if name == "world_sizes" and set(value) <= set(stored.get(name, [])):
                continue  # a part of the campaign's world sizes
            if stored.get(name) != value:
                raise _differs(name, value, stored.get(name), out)
    else:
        if paths.campaign.exists() or paths.journals():
            raise ConfigError("out", str(out), "already holds a campaign; pass --resume to "
                              "continue it, or choose another directory")
        meta = {"campaign_id": f"{spec.model.name}-{time.strftime('%Y%m%dT%H%M%S')}-"
                               f"{uuid.uuid4().hex[:6]}",
                "created": time.time(), "identity": identity}
    meta["timeout_s"] = spec.timeout_s
    if measure_here:
        meta["fingerprint"] = _campaign_fingerprint(spec.device)
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.campaign, json.dumps(meta, indent=1, default=str) + "\n")

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["world_size", "config", "reason"])
    if paths.skipped.exists():  # keep the rows of world sizes not re-planned now
        with open(paths.skipped, newline="") as handle:
            for row in csv.DictReader(handle):
                if int(row["world_size"]) not in enumerations:
                    writer.writerow([row["world_size"], row["config"], row["reason"]])
    for world_size, enumeration in enumerations.items():
        write_plan(paths, world_size, {
            "campaign_id": meta["campaign_id"], "world_size": world_size,
            "model": spec.model.to_dict(), "hardware": spec.hardware, "device": spec.device,
            "devices_per_node": spec.devices_per_node or world_size,
            "warmup_steps": spec.warmup_steps, "measured_steps": spec.measured_steps,
            "seed": spec.seed, "timeout_s": spec.timeout_s, "data": spec.data,
            **({"fingerprint": {**meta["fingerprint"], "device_count": world_size}}
               if measure_here else {}),
            "configs": [c.to_dict() for c in enumeration.valid]})
        for config, reason in enumeration.skipped:
            writer.writerow([world_size, config.key(), reason])
    atomic_write_text(paths.skipped, buffer.getvalue())
    meta.setdefault("num_valid", {}).update(
        {str(ws): len(e.valid) for ws, e in enumerations.items()})
    meta.setdefault("num_skipped", {}).update(
        {str(ws): len(e.skipped) for ws, e in enumerations.items()})
    atomic_write_text(paths.campaign, json.dumps(meta, indent=1, default=str) + "\n")
    return paths, meta


# ---------------------------------------------------------------------- supervision
@dataclass
class _Progress:
    """Counts shown in the progress bar."""

    bar: Any = None
    ok: int = 0
    failed: int = 0

    def record(self, entry: dict[str, Any]) -> None:
        if entry["row"]["status"] == Status.OK.value:
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


def _watch(launch: _Launch, paths: CampaignPaths, world_size: int, plan: dict[str, Any],
           on_entry: Callable[[dict[str, Any]], None], *, fail_grace_s: float,
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
    timeout_s = float(plan["timeout_s"])
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
        for entry in journal_tail.read():
            done.add(entry["key"])
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
    import signal

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


def _settle(launch: _Launch, paths: CampaignPaths, world_size: int, plan: dict[str, Any],
            on_entry: Callable[[dict[str, Any]], None]) -> bool:
    """Journal the outcome of the config a dead launch left unfinished.

    Returns:
        Whether there was such a config.
    """
    done = journal_keys(paths.journal(world_size))
    pending = [k for k in launch.started_keys if k not in done]
    if not pending:
        return False
    key = pending[0]
    by_key = {ParallelConfig.from_dict(c).key(): ParallelConfig.from_dict(c)
              for c in plan["configs"]}
    status, error = _root_cause(launch, key, world_size, float(plan["timeout_s"]))
    record = failure_record(plan, by_key[key], status, error)
    append_record(paths.journal(world_size), record, attempt=launch.group.attempt,
                  resolved_by="parent")
    on_entry({"key": key, "row": record.to_row()})
    return True


def _run_world_size(paths: CampaignPaths, world_size: int, progress: _Progress, *,
                    fail_grace_s: float, startup_timeout_s: float | None,
                    extra_env: dict[str, str] | None, on_entry_hook: Callable[[str], None]
                    ) -> None:
    from paratune.profiler.launcher import launch_local

    plan_path = paths.plan(world_size)
    plan = read_plan(plan_path)
    keys = [ParallelConfig.from_dict(c).key() for c in plan["configs"]]
    no_progress = 0
    startup_timeout = startup_timeout_s or max(120.0, float(plan["timeout_s"]))

    def on_entry(entry: dict[str, Any]) -> None:
        progress.record(entry)
        on_entry_hook(entry["key"])

    while True:
        done = journal_keys(paths.journal(world_size))
        remaining = [k for k in keys if k not in done]
        if not remaining:
            return
        attempt = f"local-ws{world_size}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
        group = launch_local(plan_path, world_size, attempt=attempt, log_dir=paths.logs,
                             device=plan["device"], extra_env=extra_env)
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


def _run_world_size_torchrun(paths: CampaignPaths, world_size: int, progress: _Progress, *,
                             extra_env: dict[str, str] | None,
                             on_entry_hook: Callable[[str], None]) -> None:
    """Run one world size's plan with ``torchrun --standalone`` on this machine (the same
    worker and restart path as on a cluster, without the parent's supervision), as
    ``python -m torch.distributed.run`` of the running interpreter."""
    import shlex
    import subprocess

    from paratune.profiler._worker import DIE_WITH_LAUNCHER_ENV
    from paratune.profiler.launcher import dies_with_this_process, torchrun_command

    plan = read_plan(paths.plan(world_size))
    journal = paths.journal(world_size)
    tail = EventTail(journal)
    tail._offset = journal.stat().st_size if journal.exists() else 0
    command = torchrun_command(paths.plan(world_size).resolve(), nproc_per_node=world_size,
                               nnodes=1, rdzv_endpoint="localhost:0",
                               rdzv_id=f"{plan['campaign_id']}-ws{world_size}")
    import sys

    # torchrun of this interpreter (a ``torchrun`` first on PATH may be another
    # installation's, running another paratune); the printed cluster commands keep torchrun
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            *[a for a in shlex.split(command)[1:] if not a.startswith("--rdzv")]]
    env = dict(os.environ, **(extra_env or {}))
    env[DIE_WITH_LAUNCHER_ENV] = "1"
    if plan["device"] == "cpu" and "OMP_NUM_THREADS" not in env:
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
                for entry in tail.read():
                    progress.record(entry)
                    on_entry_hook(entry["key"])
        except BaseException:  # interrupted or terminated: torchrun must not run on alone
            _stop_torchrun(proc)
            raise
    for entry in tail.read():
        progress.record(entry)
        on_entry_hook(entry["key"])
    left = _plan_keys(paths, world_size) - journal_keys(journal)
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


def _unfinished(paths: CampaignPaths, world_sizes: tuple[int, ...]
                ) -> dict[int, set[str] | None]:
    """The world sizes with configs still to measure: per world size, the keys of its plan
    that its journal does not hold (``None`` for a world size without a plan yet)."""
    left: dict[int, set[str] | None] = {}
    for world_size in world_sizes:
        if not paths.plan(world_size).exists():
            left[world_size] = None
            continue
        keys = _plan_keys(paths, world_size) - journal_keys(paths.journal(world_size))
        if keys:
            left[world_size] = keys
    return left


@dataclass
class CampaignProgress:
    """How far the profiling of a campaign directory got (see :func:`campaign_progress`)."""

    out: Path
    campaign_id: str
    planned: dict[int, int | None]
    """Per world size of the campaign: configs in its plan (``None``: not planned yet)."""
    journaled: dict[int, int]
    """Per world size: configs of its plan that its journal holds."""
    num_rows: int
    """Rows the journals hold (what :func:`materialise` writes as the dataset)."""

    @property
    def finished(self) -> bool:
        """Whether every config of every world size is journaled."""
        return all(planned is not None and self.journaled[ws] >= planned
                   for ws, planned in self.planned.items())


def campaign_progress(out: str | Path) -> CampaignProgress | None:
    """Configs planned and journaled per world size of the campaign in ``out``.

    Returns:
        ``None`` where ``out`` holds no campaign (no ``campaign.json``).
    """
    paths = CampaignPaths(Path(out))
    if not paths.campaign.exists():
        return None
    meta = json.loads(paths.campaign.read_text())
    world_sizes = tuple(int(ws) for ws in meta.get("identity", {}).get("world_sizes")
                        or sorted(map(int, meta.get("num_valid", {}))))
    left = _unfinished(paths, world_sizes)
    planned: dict[int, int | None] = {}
    journaled: dict[int, int] = {}
    for world_size in world_sizes:
        if left.get(world_size, set()) is None:  # no plan yet
            planned[world_size] = None
            journaled[world_size] = 0
            continue
        planned[world_size] = len(_plan_keys(paths, world_size))
        journaled[world_size] = planned[world_size] - len(left.get(world_size, set()))
    num_rows = sum(len(read_journal(journal)) for journal in paths.journals())
    return CampaignProgress(out=paths.root, campaign_id=str(meta.get("campaign_id", "")),
                            planned=planned, journaled=journaled, num_rows=num_rows)


# ---------------------------------------------------------------------- results
def materialise(out: str | Path) -> Dataset:
    """Write the campaign's journals as a dataset (parquet + card) in ``out``, atomically.

    Returns:
        The dataset written.

    Raises:
        ConfigError: ``out`` is not a campaign directory, or no config of it has finished.
    """
    from paratune.datasets import DatasetCard, write_dataset

    paths = CampaignPaths(Path(out))
    if not paths.campaign.exists():
        raise ConfigError("out", str(out), "holds no campaign.json: not a campaign directory")
    meta = json.loads(paths.campaign.read_text())
    rows = [entry["row"] for journal in paths.journals() for entry in read_journal(journal)]
    if not rows:
        raise ConfigError("out", str(out), "no config of this campaign has finished yet: "
                          "there is nothing to write as a dataset")
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        per = counts.setdefault(str(row["world_size"]), {s.value: 0 for s in Status})
        per[row["status"]] = per.get(row["status"], 0) + 1
    from paratune.measurement import FINGERPRINT_FIELDS

    # the machine that measured, as its rows name it (a campaign prepared on one machine and
    # measured on another records the latter); unknown when no row names one
    fingerprint: dict[str, Any] = {}
    named = [r for r in rows if any(r.get(k) not in (None, "")
                                    for k in FINGERPRINT_FIELDS if k != "device_count")]
    if named:
        fingerprint = {k: named[0].get(k) for k in FINGERPRINT_FIELDS}
    ok_rows = [r for r in rows if r["status"] == Status.OK.value]
    machines: list[dict[str, Any]] = []
    if ok_rows:
        # a campaign resumed on another machine or software stack measured on several: the
        # card names the first, and its notes every one with its number of successful rows
        fields = [k for k in FINGERPRINT_FIELDS if k != "device_count"]
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for row in ok_rows:
            key = tuple(str(row.get(k)) for k in fields)
            entry = seen.setdefault(key, {**{k: row.get(k) for k in fields}, "num_ok_rows": 0})
            entry["num_ok_rows"] += 1
        machines = list(seen.values())
        fingerprint = {k: ok_rows[0].get(k) for k in FINGERPRINT_FIELDS}
    if rows:  # the machine had at least as many devices as the largest group used
        fingerprint = {**fingerprint, "device_count": max(int(r["world_size"]) for r in rows)}
    identity = meta.get("identity", {})
    card = DatasetCard(
        campaign_id=meta["campaign_id"], source="paratune", fingerprint=fingerprint,
        grid={**identity, "model": identity.get("model", {}).get("name"),
              "model_spec": identity.get("model")},
        notes={"counts_per_world_size": counts,
               "skipped_per_world_size": meta.get("num_skipped", {}),
               "valid_per_world_size": meta.get("num_valid", {}),
               **({"fingerprints": machines} if len(machines) > 1 else {})})
    import pandas as pd

    return write_dataset(paths.root, pd.DataFrame(rows), card=card)


def _in_step_seconds(entry: dict[str, Any]) -> float:
    """Seconds a journal entry spent in warm-up and measured steps."""
    row = entry["row"]
    measured = float(sum(row.get("step_times_s") or []))
    if row["status"] != Status.OK.value:
        return 0.0
    call_s, build_s, teardown_s = (entry.get(k) for k in ("call_s", "build_s", "teardown_s"))
    if call_s is not None and entry.get("overhead_s") is not None:
        # measure_config's time minus everything outside its warm-up and measured steps
        return max(measured, float(call_s) - float(entry["overhead_s"]))
    if None not in (call_s, build_s, teardown_s):
        # measure_config's own time minus building and freeing: warm-up + measured steps
        # (and the barrier before each step).
        return max(measured, float(call_s) - float(build_s) - float(teardown_s))
    median = float(row.get("step_time_s") or 0.0)
    return measured + int(row.get("warmup_steps") or 0) * (median if math.isfinite(median)
                                                           else 0.0)


@dataclass
class CampaignResult:
    """What a campaign produced."""

    out: Path
    campaign_id: str
    dataset: Dataset
    counts: dict[int, dict[str, int]]
    """Per world size: configs ``valid``, ``skipped`` and per status."""
    wall_s: float
    """Wall time of this run (a resumed campaign counts only the resumed part)."""
    num_measured: int
    """Configs finished in this run (any status)."""
    in_step_s: float
    """Seconds those configs spent in warm-up and measured steps."""
    run_id: str | None = None
    """MLflow run id."""
    worker_cpu_s: float = math.nan
    """CPU seconds (user + system) used by the worker processes of this run: with ``n``
    free cores a CPU campaign cannot take less than ``worker_cpu_s / n`` seconds of wall
    time, whatever else the machine is running."""

    @property
    def overhead_per_config_s(self) -> float:
        """Wall time outside warm-up and measured steps, per config finished in this run."""
        if not self.num_measured:
            return math.nan
        return (self.wall_s - self.in_step_s) / self.num_measured

    def summary_rows(self) -> list[dict[str, Any]]:
        frame = self.dataset.frame
        rows = []
        for world_size, counts in self.counts.items():
            row: dict[str, Any] = {"world_size": world_size, **counts}
            sub = frame[(frame["world_size"] == world_size) & (frame["status"] == "ok")]
            if len(sub):
                best = sub.loc[sub["tokens_per_s"].idxmax()]
                row["best_tokens_per_s"] = float(best["tokens_per_s"])
                row["best_step_s"] = float(best["step_time_s"])
                row["best_config"] = ParallelConfig.from_dict(
                    {k: best[k].item() if hasattr(best[k], "item") else best[k]
                     for k in ParallelConfig.__dataclass_fields__}).key()
            rows.append(row)
        return rows

    def summary(self) -> str:
        """The summary table: counts per status and the best config per world size."""
        from paratune._table import format_table

        columns = ["world_size", "valid", "ok", "oom", "error", "timeout", "skipped",
                   "best_tokens_per_s", "best_step_s", "best_config"]
        table = format_table(self.summary_rows(), columns,
                             headers={"world_size": "world", "best_tokens_per_s": "best tok/s",
                                      "best_step_s": "step s"},
                             title=f"campaign {self.campaign_id} -> {self.out}")
        return f"{table}\n{self.footer()}"

    def footer(self) -> str:
        """One line on this run: configs measured and time spent, or that nothing was new."""
        if not self.num_measured:
            finished = sum(counts.get(s.value, 0) for counts in self.counts.values()
                           for s in Status)
            return (f"nothing new to measure: {finished} configs already measured "
                    f"({self.wall_s:.1f} s this run)")
        cpu_s = 0.0 if self.worker_cpu_s <= 0 else self.worker_cpu_s  # never "-0"; nan kept
        return (f"{self.num_measured} configs in {self.wall_s:.1f} s this run "
                f"(workers used {cpu_s:.0f} CPU s); "
                f"{self.overhead_per_config_s:.2f} s per config outside warm-up and "
                f"measured steps")


def _counts(paths: CampaignPaths, meta: dict[str, Any], world_sizes: tuple[int, ...]
            ) -> dict[int, dict[str, int]]:
    counts = {}
    for world_size in world_sizes:
        per = {"valid": int(meta["num_valid"][str(world_size)]),
               "skipped": int(meta["num_skipped"][str(world_size)])}
        per.update({s.value: 0 for s in Status})
        for entry in read_journal(paths.journal(world_size)):
            per[entry["row"]["status"]] += 1
        counts[world_size] = per
    return counts


@contextlib.contextmanager
def _tracked(track: bool, meta: dict[str, Any], spec: CampaignSpec, paths: CampaignPaths,
             resume: bool) -> Iterator[Any]:
    if not track:
        yield None
        return
    from paratune.tracking import start_run

    params = {"model": spec.model.name, "model_spec": spec.model.to_dict(),
              "world_sizes": list(spec.world_sizes), "grid": spec.identity()["grid"],
              "warmup_steps": spec.warmup_steps, "measured_steps": spec.measured_steps,
              "timeout_s": spec.timeout_s, "device": spec.device, "hardware": spec.hardware,
              "devices_per_node": spec.devices_per_node, "token_source": spec.data,
              "seed": spec.seed, "campaign_id": meta["campaign_id"],
              "out": str(paths.root.resolve())}
    with contextlib.ExitStack() as stack:
        run = None
        if resume and meta.get("mlflow_run_id"):
            try:
                run = stack.enter_context(start_run(EXPERIMENT, run_id=meta["mlflow_run_id"]))
            except Exception as exc:  # not in this store (another tracking URI): a new run
                log.info("cannot reopen MLflow run %s (%s); starting a new one",
                         meta["mlflow_run_id"], exc)
        if run is None:
            run = stack.enter_context(start_run(EXPERIMENT, run_name=meta["campaign_id"],
                                                params=params,
                                                tags={"campaign_id": meta["campaign_id"]}))
            meta["mlflow_run_id"] = run.run_id
            atomic_write_text(paths.campaign, json.dumps(meta, indent=1, default=str) + "\n")
        yield run


def run_campaign(spec: CampaignSpec, out: str | Path, *, resume: bool = False,
                 track: bool = True, progress: bool = True, launcher: str = "local",
                 fail_grace_s: float = 3.0,
                 startup_timeout_s: float | None = None,
                 extra_env: dict[str, str] | None = None,
                 on_record: Callable[[str], None] | None = None) -> CampaignResult:
    """Profile every valid config of ``spec`` for each world size, with local worker groups.

    Args:
        spec: What to profile.
        out: Campaign directory (journal, plans, logs, and the dataset at the end).
        resume: Continue the campaign already in ``out``, skipping finished configs.
        track: Log the campaign as an MLflow run (``MLFLOW_TRACKING_URI`` or ./mlflow.db).
        progress: Show a progress bar (configs done, failed, ETA) on stderr.
        launcher: ``"local"`` (worker groups supervised by this process) or ``"torchrun"``
            (``torchrun --standalone`` per world size: the cluster code path, on this
            machine; hangs and crashes are then handled by the workers' watchdog and
            torchrun's restarts).
        fail_grace_s: After a rank reports a failure, seconds to wait for the others
            before the group is torn down.
        startup_timeout_s: Seconds a new group may take to start its first config
            (default: the larger of 120 s and the config timeout).
        extra_env: Extra environment variables for the workers.
        on_record: Called with each config key as it is journaled.

    Returns:
        The campaign's result, with the dataset materialised in ``out``.

    Raises:
        ConfigError: bad spec, ``out`` already holds a campaign (without ``resume``) or
            another process is profiling it, or processes of an earlier launch of it still
            run on this machine (resuming, once they had time to end),
            more CUDA devices are asked for than this machine has (unless resuming a
            campaign whose every config is journaled: that only writes the dataset), or on
            the CPU a config's processes cannot fit in this machine's memory (``model``;
            nothing is started).
        CampaignError: a worker group repeatedly fails to start.
    """
    import resource

    started = time.monotonic()
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if launcher not in ("local", "torchrun"):
        raise ConfigError("launcher", launcher, "must be local or torchrun")
    # resuming a campaign whose every config is journaled (e.g. one run on a cluster with
    # the printed commands) only writes its dataset: it needs none of the devices
    finished = resume and CampaignPaths(Path(out)).campaign.exists() and not _unfinished(
        CampaignPaths(Path(out)), spec.world_sizes)
    if spec.device == "cuda" and not finished:
        import torch

        available = torch.cuda.device_count()
        if available == 0:
            raise ConfigError("device", spec.device, f"{_NO_CUDA} (use device cpu)")
        too_big = [w for w in spec.world_sizes if w > available]
        if too_big:
            raise ConfigError("world_sizes", too_big[0], f"needs more GPUs than the "
                              f"{available} on this machine (with either launcher): "
                              f"profile world sizes up to {available} here, and larger ones "
                              "on a cluster, with the commands that 'paratune profile "
                              "--print-command' prints")
    with _locked(spec, out, resume=resume) as prepared:
        paths, meta = prepare_campaign(spec, out, measure_here=not finished, **prepared)
        return _run_campaign(spec, paths, meta, resume=resume, launcher=launcher,
                             track=track, progress=progress, on_record=on_record,
                             fail_grace_s=fail_grace_s, startup_timeout_s=startup_timeout_s,
                             extra_env=extra_env, started=started,
                             children_before=children_before)


@contextlib.contextmanager
def _locked(spec: CampaignSpec, out: str | Path, *, resume: bool
            ) -> Iterator[dict[str, Any]]:
    """Hold the campaign directory's lock (``out/.lock``) while the block prepares and runs
    it, so that a second process on the same campaign is refused before it rewrites a file.
    The refusals that need no lock come first and leave nothing behind: a grid without a
    valid config, a resume of nothing. Yields :func:`prepare_campaign`'s keyword arguments
    (the enumeration those checks computed)."""
    enumerations = enumerate_campaign(spec)
    _check_something_to_measure(spec, enumerations)
    if resume and not CampaignPaths(Path(out)).campaign.exists():
        raise ConfigError("resume", str(out), "holds no campaign.json: nothing to resume")
    with exclusive_lock(Path(out) / ".lock", field="out", value=str(out),
                        what="profiling this campaign"):
        yield {"resume": resume, "enumerations": enumerations}


def _run_campaign(spec: CampaignSpec, paths: CampaignPaths, meta: dict[str, Any], *,
                  resume: bool, launcher: str, track: bool, progress: bool,
                  on_record: Any, fail_grace_s: float, startup_timeout_s: float,
                  extra_env: dict[str, str] | None, started: float,
                  children_before: Any) -> CampaignResult:
    """:func:`run_campaign` once the campaign is prepared and locked."""
    import resource

    left = _unfinished(paths, spec.world_sizes)
    if left and resume:  # under the lock: no later run can start a launch meanwhile
        _await_earlier_launches(paths)
        # what the earlier launch journaled while this run waited is not this run's
        left = _unfinished(paths, spec.world_sizes)
    before = {ws: journal_keys(paths.journal(ws)) for ws in spec.world_sizes}
    total = sum(int(meta["num_valid"][str(ws)]) - len(before[ws] & _plan_keys(paths, ws))
                for ws in spec.world_sizes)
    bar = None
    if progress:
        from paratune._progress import progress_bar

        bar = progress_bar(total=total, unit="config", enabled=True,
                           desc=f"profiling ws={spec.world_sizes[0]}")
    state = _Progress(bar=bar)
    with _tracked(track, meta, spec, paths, resume) as run:
        try:
            for world_size in spec.world_sizes:
                if world_size not in left:  # every config journaled: nothing to launch
                    continue
                if bar is not None:
                    bar.set_description(f"profiling ws={world_size}")
                hook = on_record or (lambda key: None)
                if launcher == "torchrun":
                    _run_world_size_torchrun(paths, world_size, state, extra_env=extra_env,
                                             on_entry_hook=hook)
                else:
                    _run_world_size(paths, world_size, state, fail_grace_s=fail_grace_s,
                                    startup_timeout_s=startup_timeout_s, extra_env=extra_env,
                                    on_entry_hook=hook)
                if int(meta["num_valid"][str(world_size)]):  # else there may be no row yet
                    materialise(paths.root)
        finally:
            if bar is not None:
                bar.close()
        dataset = materialise(paths.root)
        new_entries = [e for ws in spec.world_sizes for e in read_journal(paths.journal(ws))
                       if e["key"] not in before[ws]]
        result = CampaignResult(
            out=paths.root, campaign_id=meta["campaign_id"], dataset=dataset,
            counts=_counts(paths, meta, spec.world_sizes),
            wall_s=time.monotonic() - started, num_measured=len(new_entries),
            in_step_s=sum(_in_step_seconds(e) for e in new_entries),
            run_id=run.run_id if run is not None and run.lost is None else None)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        # never below zero (float rounding of equal totals, when no worker ran)
        result.worker_cpu_s = max(0.0, (children.ru_utime + children.ru_stime)
                                  - (children_before.ru_utime + children_before.ru_stime))
        if run is not None:
            metrics: dict[str, float] = {"wall_s": result.wall_s,
                                         "worker_cpu_s": result.worker_cpu_s,
                                         "num_measured": result.num_measured,
                                         "overhead_per_config_s": result.overhead_per_config_s}
            for world_size, counts in result.counts.items():
                for name, value in counts.items():
                    metrics[f"ws{world_size}_{name}"] = value
                metrics[f"ws{world_size}_failed"] = sum(counts[s.value] for s in Status
                                                        if s is not Status.OK)
            for name in ("valid", "skipped", *(s.value for s in Status)):
                metrics[name] = sum(c[name] for c in result.counts.values())
            metrics["failed"] = sum(c[s.value] for c in result.counts.values()
                                    for s in Status if s is not Status.OK)
            run.log_metrics(metrics)
            run.log_artifact(paths.root / "card.json", "dataset")
            run.log_artifact(paths.root / dataset.card.data_file, "dataset")
            run.log_artifact(paths.skipped)
    return result


def _plan_keys(paths: CampaignPaths, world_size: int) -> set[str]:
    plan = read_plan(paths.plan(world_size))
    return {ParallelConfig.from_dict(c).key() for c in plan["configs"]}


def torchrun_commands(spec: CampaignSpec, out: str | Path, *, nnodes: int | None = None,
                      nproc_per_node: int | None = None, rdzv_endpoint: str | None = None,
                      slurm: bool = False, resume: bool = False) -> list[str]:
    """Prepare ``out`` and return, per world size, the command that runs it on a cluster.

    Args:
        spec: What to profile.
        out: Campaign directory, on a filesystem every node sees.
        nnodes: Nodes per job; default ``world_size / nproc_per_node`` (at least 1).
        nproc_per_node: Processes (GPUs) per node; default ``spec.devices_per_node`` or
            the world size.
        rdzv_endpoint: ``host:port`` of the rendezvous (default ``$MASTER_ADDR:29500``).
        slurm: Return ``srun`` command lines for a SLURM allocation instead.
        resume: Reuse a campaign already prepared in ``out``.

    Returns:
        One shell command per world size. After they ran, ``paratune profile --resume``
        with the same options (or :func:`materialise`) writes the dataset.

    Raises:
        ConfigError: the nodes cannot hold a world size (``nproc_per_node``, or
            ``devices_per_node`` of ``spec``, does not divide it; ``nnodes`` times it is not
            it), checked before anything is written; or :func:`prepare_campaign` refuses.
    """
    from paratune.profiler.launcher import slurm_command, torchrun_command

    # the node layout is checked before anything is prepared: a refused one leaves no
    # campaign behind (whose devices_per_node a corrected command could not resume)
    layouts = {}
    for world_size in spec.world_sizes:
        per_node = nproc_per_node or spec.devices_per_node or world_size
        per_node = min(per_node, world_size)
        if world_size % per_node:  # named as given: the argument, or the spec's node size
            raise ConfigError("nproc_per_node" if nproc_per_node else "devices_per_node",
                              per_node, f"must divide the world size {world_size}")
        nodes = nnodes or world_size // per_node
        if nodes * per_node != world_size:
            raise ConfigError("nnodes", nodes, f"nnodes*nproc_per_node = {nodes}*{per_node} "
                              f"must equal the world size {world_size}")
        layouts[world_size] = (nodes, per_node)
    resume = resume or CampaignPaths(Path(out)).campaign.exists()
    with _locked(spec, out, resume=resume) as prepared:
        paths, meta = prepare_campaign(spec, out, measure_here=False, **prepared)
    commands = []
    for world_size in spec.world_sizes:
        nodes, per_node = layouts[world_size]
        rdzv_id = f"{meta['campaign_id']}-ws{world_size}"
        plan = paths.plan(world_size).resolve()
        if slurm:
            commands.append(slurm_command(plan, nnodes=nodes, nproc_per_node=per_node,
                                          rdzv_id=rdzv_id))
        else:
            commands.append(torchrun_command(
                plan, nproc_per_node=per_node, nnodes=nodes, rdzv_id=rdzv_id,
                rdzv_endpoint=rdzv_endpoint or ("localhost:29500" if nodes == 1
                                                else "$MASTER_ADDR:29500")))
    return commands
