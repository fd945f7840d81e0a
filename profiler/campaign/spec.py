"""What a campaign profiles: its spec, the grid per world size, and this machine's device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paratune.errors import ConfigError, ParatuneError
from paratune.parallel import MAX_DEVICES, check_magnitude, check_seed
from paratune.space import ConfigSpace, SpaceEnumeration
from paratune.spec import ModelSpec

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
        hardware = get_hardware(self.hardware)
        if hardware.device_type != self.device:
            # a CPU's timings recorded as an H100's would be fitted as the H100's
            raise ConfigError("hardware", self.hardware, f"is a {hardware.device_type} device "
                              f"and the campaign runs on {self.device}: give the device it "
                              f"runs on (--device {hardware.device_type}, e.g. on a login "
                              f"node preparing a GPU campaign) or the hardware it is")
        self.hardware = hardware.name
        check_seed("seed", self.seed)
        if self.devices_per_node is not None:
            if (isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node,
                                                                           int)
                    or self.devices_per_node < 1):
                raise ConfigError("devices_per_node", self.devices_per_node,
                                  "must be a positive integer")
            for size in self.world_sizes:
                # a world of a few devices sits in one node; a larger one fills whole nodes
                if size > self.devices_per_node and size % self.devices_per_node:
                    raise ConfigError("devices_per_node", self.devices_per_node,
                                      f"must divide the world size {size}")

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
