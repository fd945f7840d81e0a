from __future__ import annotations

import pytest

from paratune import ConfigError, get_hardware


@pytest.mark.parametrize(("name", "canonical"), [
    ("H100-80GB", "H100-80GB"),
    ("h100", "H100-80GB"),
    ("H100 SXM", "H100-80GB"),
    ("H100-SXM5-80GB", "H100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("A100", "A100-80GB"),
    ("A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("A100-SXM4-40GB", "A100-40GB"),
    ("a100_40gb", "A100-40GB"),
    ("A100 40 GB", "A100-40GB"),
    ("NVIDIA H200 141GB HBM3e", "H200"),
    ("cpu", "cpu"),
])
def test_vendor_spellings_resolve(name, canonical):
    assert get_hardware(name).name == canonical


@pytest.mark.parametrize("name", [
    "H100 PCIe",  # lower bandwidth than the SXM part in the catalogue
    "A100-PCIE-40GB",
    "H100-94GB",
    "A100-SXM4-64GB",
    "TPU-v9",
    "NVIDIA",
    "",
])
def test_other_devices_are_unknown(name):
    with pytest.raises(ConfigError, match="is not a known device"):
        get_hardware(name)
