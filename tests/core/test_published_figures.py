"""Published figures the presets and the hardware catalogue must reproduce exactly.

Parameter counts are those of the released checkpoints (embeddings and output layer counted
separately where they are not tied, as in the Llama 3 and 3.2 model cards). Hardware figures
are vendor datasheet figures: dense bf16 peak FLOP/s, NVLink bandwidth per GPU and direction,
the device memory's bandwidth, and one network adapter per GPU between nodes (200 Gb/s HDR
on A100 and A800 systems, 400 Gb/s NDR / ConnectX-7 on H100, H800, H200 and B200 systems).
The A800 and H800 are the A100 and H100 with NVLink cut to 400 GB/s (200 per direction).
"""

from __future__ import annotations

import pytest

from paratune.hardware import get_hardware
from paratune.spec import get_model


@pytest.mark.parametrize(("name", "num_params"), [
    ("llama3.2-1b", 1_235_814_400),
    ("llama3.2-3b", 3_212_749_824),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3-405b", 405_853_388_800),
])
def test_preset_parameter_counts_match_the_released_models(name, num_params):
    assert get_model(name).num_params == num_params


_TFLOPS, _GBPS = 1e12, 1e9


@pytest.mark.parametrize(("name", "tflops"), [
    ("A100-40GB", 312), ("A100-80GB", 312), ("H100-80GB", 989), ("H200", 989), ("B200", 2250),
    ("A800-80GB", 312), ("H800", 989),
])
def test_dense_bf16_peak_is_the_datasheet_figure(name, tflops):
    assert get_hardware(name).peak_flops == pytest.approx(tflops * _TFLOPS, rel=1e-12)


@pytest.mark.parametrize(("name", "gb_per_s"), [
    ("A100-40GB", 300), ("A100-80GB", 300), ("H100-80GB", 450), ("H200", 450), ("B200", 900),
    ("A800-80GB", 200), ("H800", 200),
])
def test_nvlink_bandwidth_per_gpu_and_direction(name, gb_per_s):
    assert get_hardware(name).intra_node_bw == pytest.approx(gb_per_s * _GBPS, rel=1e-12)


@pytest.mark.parametrize(("name", "gbit_per_s"), [
    ("A100-40GB", 200), ("A100-80GB", 200), ("H100-80GB", 400), ("H200", 400), ("B200", 400),
    ("A800-80GB", 200), ("H800", 400),
])
def test_inter_node_bandwidth_is_one_adapter_per_gpu(name, gbit_per_s):
    assert get_hardware(name).inter_node_bw == pytest.approx(gbit_per_s / 8 * _GBPS, rel=1e-12)


@pytest.mark.parametrize(("name", "gb_per_s"), [
    ("A100-40GB", 1555), ("A100-80GB", 2039), ("H100-80GB", 3350), ("H200", 4800),
    ("B200", 8000), ("A800-80GB", 2039), ("H800", 3350),
])
def test_device_memory_bandwidth_is_the_datasheet_figure(name, gb_per_s):
    assert get_hardware(name).memory_bw == pytest.approx(gb_per_s * _GBPS, rel=1e-12)


def test_the_cpu_has_no_memory_bandwidth_or_matmul_share_to_price_work_with():
    cpu = get_hardware("cpu")
    assert cpu.memory_bw is None and cpu.matmul_efficiency is None
    assert all(0 < get_hardware(n).matmul_efficiency <= 1
               for n in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200", "A800-80GB",
                         "H800"))


def test_aliases_resolve_to_the_same_entries():
    assert get_hardware("H100") is get_hardware("H100-80GB")
    assert get_hardware("A100") is get_hardware("A100-80GB")
    assert get_hardware("NVIDIA A800-SXM4-80GB") is get_hardware("A800")
    assert get_hardware("NVIDIA H800 80GB HBM3") is get_hardware("H800")
