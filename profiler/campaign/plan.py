"""Preparing a campaign directory: ``campaign.json``, one plan per world size, the skipped
configs; and what its journals still lack."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

from paratune.errors import ConfigError
from paratune.fileio import atomic_write_text
from paratune.profiler._journal import (
    CampaignPaths,
    WorldSizePlan,
    write_plan,
)
from paratune.profiler.campaign.spec import (
    CampaignSpec,
    _check_something_to_measure,
    enumerate_campaign,
)
from paratune.space import ConfigSpace, SpaceEnumeration

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
        from paratune.datasets._store import holds_data

        if holds_data(paths.root):  # the campaign's dataset would replace it
            raise ConfigError("out", str(out), "already holds a dataset that is not a "
                              "campaign's; choose another directory")
        meta = {"campaign_id": f"{spec.model.name}-{time.strftime('%Y%m%dT%H%M%S')}-"
                               f"{uuid.uuid4().hex[:6]}",
                "created": time.time(), "identity": identity}
    meta["timeout_s"] = spec.timeout_s
    if measure_here:
        meta["fingerprint"] = _campaign_fingerprint(spec.device)
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.campaign, json.dumps(meta, indent=1, default=str) + "\n")

    _write_plans(paths, spec, meta, enumerations, measure_here=measure_here)
    meta.setdefault("num_valid", {}).update(
        {str(ws): len(e.valid) for ws, e in enumerations.items()})
    meta.setdefault("num_skipped", {}).update(
        {str(ws): len(e.skipped) for ws, e in enumerations.items()})
    atomic_write_text(paths.campaign, json.dumps(meta, indent=1, default=str) + "\n")
    return paths, meta


def _write_plans(paths: CampaignPaths, spec: CampaignSpec, meta: dict[str, Any],
                 enumerations: dict[int, SpaceEnumeration], *, measure_here: bool) -> None:
    """One :class:`~paratune.datasets.journal.WorldSizePlan` per enumerated world size, and
    ``skipped.csv`` (keeping the rows of world sizes not re-planned now)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["world_size", "config", "reason"])
    if paths.skipped.exists():  # keep the rows of world sizes not re-planned now
        with open(paths.skipped, newline="") as handle:
            for row in csv.DictReader(handle):
                if int(row["world_size"]) not in enumerations:
                    writer.writerow([row["world_size"], row["config"], row["reason"]])
    for world_size, enumeration in enumerations.items():
        write_plan(paths, WorldSizePlan(
            campaign_id=meta["campaign_id"], world_size=world_size, model=spec.model,
            hardware=spec.hardware, device=spec.device,
            devices_per_node=spec.devices_per_node or world_size,
            warmup_steps=spec.warmup_steps, measured_steps=spec.measured_steps,
            seed=spec.seed, timeout_s=spec.timeout_s, data=spec.data,
            configs=tuple(enumeration.valid),
            fingerprint=({**meta["fingerprint"], "device_count": world_size}
                         if measure_here else None)))
        for config, reason in enumeration.skipped:
            writer.writerow([world_size, config.key(), reason])
    atomic_write_text(paths.skipped, buffer.getvalue())
