"""Catalogue of accelerators (and the CPU) that paratune knows the speeds of."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from paratune.errors import ConfigError

__all__ = ["HARDWARE", "HardwareSpec", "get_hardware"]


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One kind of device and the node it sits in.

    Bandwidths are per device and per direction, in bytes per second: what one GPU can send
    to a peer inside its node (NVLink) and to a peer in another node (its share of the node's
    network). Figures are vendor peaks; the learned model corrects for what is reached.
    """

    name: str
    """Canonical name, e.g. ``"H100-80GB"``."""
    device_type: str = "cuda"
    """``"cuda"`` or ``"cpu"``."""
    backend: str = "nccl"
    """torch.distributed backend to use."""
    peak_flops: float | None = None
    """Dense bf16 peak FLOP/s per device (vendor figure); ``None`` where no honest figure
    exists. MFU is reported only against this."""
    nominal_flops: float | None = None
    """A rough FLOP/s figure for analytical estimates where there is no vendor peak (the
    CPU); the learned model corrects it, and it is never used for MFU."""
    memory_gb: float = 0.0
    """Device memory in GB (1e9 bytes)."""
    devices_per_node: int = 8
    """Devices that share the fast intra-node link."""
    intra_node_bw: float = 0.0
    """Bytes/s per device to a peer in the same node."""
    inter_node_bw: float = 0.0
    """Bytes/s per device to a peer in another node."""
    memory_bw: float | None = None
    """Bytes/s of the device's own memory (HBM), vendor figure: the pace of the memory-bound
    work of a step (norms, activations, residual adds); ``None`` where not known."""
    matmul_efficiency: float | None = None
    """Share of ``peak_flops`` a well-tuned framework's matrix products sustain in training:
    the compute pace of a framework paratune has no measurement of. ``None``: the
    calibrated core's default (0.8)."""
    aliases: tuple[str, ...] = ()
    """Other names that resolve to this entry (case-insensitive)."""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["aliases"] = list(self.aliases)
        return data

    @property
    def effective_flops(self) -> float | None:
        """The peak if known, else the nominal figure: the compute speed analytical features use."""
        return self.peak_flops if self.peak_flops is not None else self.nominal_flops

    def num_nodes(self, num_devices: int) -> int:
        """Nodes needed for ``num_devices`` devices."""
        return max(1, -(-num_devices // self.devices_per_node))


_GB = 1e9
_A100_80GB = HardwareSpec(name="A100-80GB", peak_flops=312e12, memory_gb=80.0,
                          intra_node_bw=300 * _GB, inter_node_bw=25 * _GB,
                          memory_bw=2039 * _GB, matmul_efficiency=0.8, aliases=("A100",))
_H100_80GB = HardwareSpec(name="H100-80GB", peak_flops=989e12, memory_gb=80.0,
                          intra_node_bw=450 * _GB, inter_node_bw=50 * _GB,
                          memory_bw=3350 * _GB, matmul_efficiency=0.6,
                          aliases=("H100", "H100-SXM"))
_NVLINK_CUT = 200 * _GB
"""NVLink per direction of the export variants of the A100 and H100 (China): the same
devices with NVLink cut to 400 GB/s both directions together."""

HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(name="cpu", device_type="cpu", backend="gloo", peak_flops=None,
                     nominal_flops=5e10,
                     memory_gb=0.0, devices_per_node=1024, intra_node_bw=5 * _GB,
                     inter_node_bw=1.25 * _GB, aliases=("gloo",)),
        HardwareSpec(name="A100-40GB", peak_flops=312e12, memory_gb=40.0,
                     intra_node_bw=300 * _GB, inter_node_bw=25 * _GB, memory_bw=1555 * _GB,
                     matmul_efficiency=0.8),
        _A100_80GB,
        dataclasses.replace(_A100_80GB, name="A800-80GB", intra_node_bw=_NVLINK_CUT,
                            aliases=("A800",)),
        _H100_80GB,
        dataclasses.replace(_H100_80GB, name="H800", intra_node_bw=_NVLINK_CUT,
                            aliases=("H800-80GB",)),
        HardwareSpec(name="H200", peak_flops=989e12, memory_gb=141.0,
                     intra_node_bw=450 * _GB, inter_node_bw=50 * _GB, memory_bw=4800 * _GB,
                     matmul_efficiency=0.6, aliases=("H200-141GB",)),
        HardwareSpec(name="B200", peak_flops=2250e12, memory_gb=180.0,
                     intra_node_bw=900 * _GB, inter_node_bw=50 * _GB, memory_bw=8000 * _GB,
                     matmul_efficiency=0.6, aliases=("B200-180GB",)),
    )
}

# Words of vendor spellings ("NVIDIA A100-SXM4-80GB", "H100 80GB HBM3") that name the SXM
# form factor or the memory type of the one part the catalogue has. PCIe and NVL parts are
# slower and stay unknown.
_IGNORED_WORDS = frozenset({"nvidia", "sxm", "sxm4", "sxm5", "hbm2", "hbm2e", "hbm3", "hbm3e"})


def _normalise(name: str) -> str:
    """Lower case, words joined by hyphens, ``80 GB`` as ``80gb``, :data:`_IGNORED_WORDS`
    dropped: ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100-80gb"``."""
    text = re.sub(r"(\d+)[\s_-]*gb\b", r"\1gb", str(name).strip().lower())
    words = [w for w in re.split(r"[\s_-]+", text) if w and w not in _IGNORED_WORDS]
    return "-".join(words)


_LOOKUP = {_normalise(key): spec for spec in HARDWARE.values()
           for key in (spec.name, *spec.aliases)}


def get_hardware(name: str) -> HardwareSpec:
    """Resolve a catalogue entry by name or alias.

    Case, spaces or underscores for hyphens, a leading ``NVIDIA`` and the SXM form-factor
    and HBM memory-type words do not matter (``"NVIDIA H100 80GB HBM3"`` is ``H100-80GB``);
    the memory size does (``A100-SXM4-40GB`` is ``A100-40GB``).

    Raises:
        ConfigError: the name is not in the catalogue.
    """
    key = _normalise(name)
    if key in _LOOKUP:
        return _LOOKUP[key]
    known = ", ".join(sorted(HARDWARE))
    raise ConfigError("gpu", name, f"is not a known device ({known})")
