"""One measured (or failed) configuration: the record every package exchanges."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from paratune.errors import ConfigError
from paratune.parallel import ParallelConfig
from paratune.scalars import plain
from paratune.spec import ModelSpec

__all__ = ["FINGERPRINT_FIELDS", "TIMING_PREFIX", "Measurement", "Status", "StepTiming",
           "family_of"]


class Status(StrEnum):
    """Outcome of profiling one configuration."""

    OK = "ok"
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"


TIMING_PREFIX = "timing_"
"""Prefix of the dataset columns of a :class:`StepTiming` (``timing_build_s``, ...)."""


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """Where a profiled config's wall time went outside its measured steps: seconds, the
    slowest rank's; NaN where not recorded (imported rows, failed configs)."""

    build_s: float = math.nan
    """Building the mesh, model and optimizer (``mesh_s`` included)."""
    mesh_s: float = math.nan
    """Getting the mesh: creating process groups the first time a shape is seen, about
    nothing once cached."""
    teardown_s: float = math.nan
    """Freeing what was built."""
    overhead_s: float = math.nan
    """All wall time outside the warm-up and measured steps: build, barriers, teardown,
    fingerprint."""
    call_s: float = math.nan
    """The whole measurement call, as the worker that made it timed it."""

    def to_dict(self) -> dict[str, float]:
        """The recorded (finite) fields by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if math.isfinite(getattr(self, f.name))}

    @classmethod
    def from_dict(cls, data: Any) -> StepTiming:
        """From a mapping holding some of the fields by name (others are ignored)."""
        return cls(**{f.name: _seconds(data[f.name]) for f in dataclasses.fields(cls)
                      if data.get(f.name) is not None})

    def to_columns(self) -> dict[str, float]:
        """The dataset columns: every field, prefixed with :data:`TIMING_PREFIX`."""
        return {TIMING_PREFIX + f.name: float(getattr(self, f.name))
                for f in dataclasses.fields(self)}

    @classmethod
    def from_columns(cls, row: Any) -> StepTiming:
        """Inverse of :meth:`to_columns` (columns a row lacks stay NaN)."""
        return cls(**{f.name: _seconds(row[TIMING_PREFIX + f.name])
                      for f in dataclasses.fields(cls)
                      if row.get(TIMING_PREFIX + f.name) is not None})


def family_of(source: str | None, *, missing: str = "paratune") -> str:
    """The measurement family a record's ``source`` names: its first ``_``-separated word,
    lower case, any run of characters other than letters, digits, ``.`` and ``-`` made one
    ``-`` (``vtrain_ground_truth_single_node`` and ``vtrain_ground_truth_multi_node`` are one
    family, ``vtrain``; a family names files of a saved model, and a framework asked for by
    ``paratune tune --framework`` is spelt as one); ``missing`` where it names none."""
    word = (source or "").strip().lower().split("_")[0]
    return re.sub(r"[^a-z0-9.\-]+", "-", word).strip("-") or missing


def _seconds(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


FINGERPRINT_FIELDS = ("device_name", "device_count", "cpu", "torch_version", "cuda_version",
                      "nccl_version", "python_version", "hostname")


@dataclass(kw_only=True)
class Measurement:
    """A configuration and what happened when it ran.

    Flattened to one row by :meth:`to_row`: the model fields, the config fields, the
    metrics and the fingerprint become columns (see ``paratune.datasets`` for the schema).
    """

    model: ModelSpec
    """The model trained."""
    config: ParallelConfig
    """The layout it ran under."""
    hardware: str
    """:class:`~paratune.hardware.HardwareSpec` name (``"cpu"``, ``"H100-80GB"``, ...)."""
    devices_per_node: int = 1
    """Devices per node in the cluster that ran it (decides which groups cross nodes)."""
    status: Status = Status.OK
    """Outcome."""
    error: str = ""
    """Error text for a failed run."""
    step_times_s: list[float] = field(default_factory=list)
    """Measured step times (slowest rank's), warm-up excluded."""
    step_time_s: float = math.nan
    """Median step time in seconds (from ``step_times_s`` or as published)."""
    step_time_mean_s: float = math.nan
    step_time_p10_s: float = math.nan
    step_time_p90_s: float = math.nan
    step_time_std_s: float = math.nan
    tokens_per_s: float = math.nan
    """Tokens per second for the whole cluster (at the median step time)."""
    peak_mem_allocated_gb: float = math.nan
    """Largest peak over ranks of memory allocated by tensors (CUDA) in GB."""
    peak_mem_reserved_gb: float = math.nan
    """Largest peak over ranks of memory reserved by the allocator (CUDA) in GB."""
    peak_rss_gb: float = math.nan
    """Largest peak resident set size over ranks (CPU) in GB."""
    mfu: float = math.nan
    """Model FLOPs utilisation, a fraction, where the device peak is known."""
    loss: float = math.nan
    """Loss of the last measured step (a sanity check that training ran)."""
    warmup_steps: int = 0
    measured_steps: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """Hardware and software that produced it (keys in :data:`FINGERPRINT_FIELDS`)."""
    source: str = "paratune"
    """Where the record comes from (``"paratune"`` or a public source's name)."""
    campaign_id: str = ""
    timestamp: float = field(default_factory=time.time)
    timing: StepTiming = field(default_factory=StepTiming)
    """Where the profiling call's time went besides the measured steps (columns
    ``timing_*``)."""

    def __post_init__(self) -> None:
        try:
            self.status = Status(self.status)
        except ValueError:
            raise ConfigError("status", self.status, "must be one of "
                              + ", ".join(s.value for s in Status)) from None
        if self.step_times_s and math.isnan(self.step_time_s):
            self._summarise()

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def _summarise(self) -> None:
        times = sorted(self.step_times_s)
        n = len(times)

        def quantile(q: float) -> float:
            pos = q * (n - 1)
            lo, hi = math.floor(pos), math.ceil(pos)
            return times[lo] + (times[hi] - times[lo]) * (pos - lo)

        self.step_time_s = quantile(0.5)
        self.step_time_mean_s = sum(times) / n
        self.step_time_p10_s = quantile(0.1)
        self.step_time_p90_s = quantile(0.9)
        mean = self.step_time_mean_s
        self.step_time_std_s = math.sqrt(sum((t - mean) ** 2 for t in times) / n)
        self.measured_steps = n
        tokens = self.config.global_batch_size * self.model.seq_len
        self.tokens_per_s = tokens / self.step_time_s if self.step_time_s > 0 else math.nan

    # ------------------------------------------------------------------ rows
    def to_row(self) -> dict[str, Any]:
        """One flat dict: ``model_*`` / model fields, config fields, metrics, fingerprint."""
        row: dict[str, Any] = {"model_name": self.model.name}
        model = self.model.to_dict()
        model.pop("name")
        row.update(model)
        row.update(self.config.to_dict())
        row.update(world_size=self.world_size, num_microbatches=self.config.num_microbatches,
                   hardware=self.hardware, devices_per_node=self.devices_per_node,
                   status=self.status.value, error=self.error,
                   step_times_s=list(self.step_times_s))
        for f in dataclasses.fields(self):
            metric = f.name.startswith(("step_time_", "peak_", "tokens_per_s")) or f.name in (
                "mfu", "loss", "warmup_steps", "measured_steps", "source", "campaign_id",
                "timestamp")
            if metric:
                row[f.name] = getattr(self, f.name)
        row["tokens_per_s_per_device"] = self.tokens_per_s_per_device
        row.update(self.timing.to_columns())
        for key in FINGERPRINT_FIELDS:
            row[key] = self.fingerprint.get(key, "")
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Measurement:
        """Inverse of :meth:`to_row` (extra keys are ignored)."""
        try:
            model_fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"name", "extra"}
            model = ModelSpec(name=str(row["model_name"]),
                              **{k: plain(row[k]) for k in model_fields if k in row})
            config_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
            config = ParallelConfig(**{k: plain(row[k]) for k in config_fields if k in row})
        except KeyError as exc:
            raise ConfigError(str(exc.args[0]), None, "missing from the record") from None
        metrics = {}
        for f in dataclasses.fields(cls):
            if f.name in row and f.name not in ("model", "config", "fingerprint", "step_times_s",
                                                "timing"):
                metrics[f.name] = plain(row[f.name])
        times = row.get("step_times_s")
        times = [] if times is None else [float(t) for t in times]
        fingerprint = {k: plain(row[k]) for k in FINGERPRINT_FIELDS if k in row}
        return cls(model=model, config=config, fingerprint=fingerprint, step_times_s=times,
                   timing=StepTiming.from_columns(row), **metrics)


