from __future__ import annotations

import dataclasses
import math

import pytest

from paratune import DatasetError, Measurement, ParallelConfig, Status, get_model
from paratune.cli import main
from paratune.datasets import export_public_csv, read_dataset, write_dataset
from paratune.datasets.importers import import_files


def _records() -> list[Measurement]:
    llama = dataclasses.replace(get_model("tiny"), name="small-llama", num_kv_heads=2,
                                tie_embeddings=True)
    gelu = dataclasses.replace(get_model("tiny"), name="small-gelu", mlp="gelu",
                               ffn_hidden_size=4 * get_model("tiny").hidden_size)
    return [
        Measurement(model=llama, config=ParallelConfig(dp=2, micro_batch_size=2,
                                                       global_batch_size=8),
                    hardware="H100-80GB", step_times_s=[0.50, 0.52, 0.51], mfu=0.31,
                    peak_mem_allocated_gb=20.5, peak_mem_reserved_gb=22.25),
        Measurement(model=llama, config=ParallelConfig(dp=2, tp=2, pp=2, global_batch_size=8,
                                                       sharding="zero3",
                                                       recompute="selective"),
                    hardware="H100-80GB", step_times_s=[1.25], mfu=0.2),
        Measurement(model=gelu, config=ParallelConfig(tp=4, micro_batch_size=4,
                                                      global_batch_size=16, recompute="full"),
                    hardware="A100-80GB", step_times_s=[0.3, 0.4]),
        Measurement(model=llama, config=ParallelConfig(dp=4, micro_batch_size=16,
                                                       global_batch_size=64),
                    hardware="H100-80GB", status=Status.OOM,
                    error="CUDA out of memory. Tried to allocate 2 GiB\nmore text"),
        Measurement(model=gelu, config=ParallelConfig(pp=4, global_batch_size=8,
                                                      sharding="zero1"),
                    hardware="A100-80GB", status=Status.TIMEOUT, error="no step in 600 s"),
    ]


def _dataset(tmp_path, records=None):
    return write_dataset(tmp_path / "ds", _records() if records is None else records).path


def test_an_exported_dataset_imports_back_to_the_same_configs_and_metrics(tmp_path):
    original = read_dataset(_dataset(tmp_path)).measurements()
    counts = export_public_csv(tmp_path / "ds", tmp_path / "out.csv",
                               provenance="test rows, measured here", precision="bf16")
    assert counts == {"ok": 3, "oom": 1, "timeout": 1}
    assert (tmp_path / "out.csv").read_text().startswith("# source: test rows, measured here\n")
    report = import_files([tmp_path / "out.csv"], tmp_path / "back")
    assert report.problems == [] and report.num_records == len(original)
    # the export states the whole shape: the card names no assumption taken
    assert read_dataset(tmp_path / "back").card.notes["assumptions"] == {}
    assert report.sources == {"out.csv": "source: test rows, measured here"}
    back = read_dataset(tmp_path / "back").measurements()
    for a, b in zip(original, back, strict=True):
        # every shape field, nothing assumed (the rotary base and norm epsilon, which do not
        # change a step's cost, are not in the format)
        assert b.model == dataclasses.replace(a.model, rope_theta=b.model.rope_theta,
                                              norm_eps=b.model.norm_eps)
        assert b.config == a.config and b.hardware == a.hardware and b.status == a.status
        assert b.devices_per_node == a.devices_per_node
        assert b.source == a.source == "paratune"
        for name in ("step_time_s", "tokens_per_s", "mfu", "peak_mem_reserved_gb"):
            assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-5, nan_ok=True)
        assert b.ok or math.isnan(b.step_time_s)


def test_the_source_names_the_measurement_family_and_failures_keep_their_error(tmp_path):
    import csv

    _dataset(tmp_path)
    export_public_csv(tmp_path / "ds", tmp_path / "out.csv", source="mine_h100")
    with open(tmp_path / "out.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["source"] for r in rows} == {"mine_h100"}
    oom = next(r for r in rows if r["status"] == "oom")
    assert oom["notes"] == "CUDA out of memory. Tried to allocate 2 GiB"
    assert all(oom[k] == "" for k in ("step_time_s", "tokens_per_sec", "mfu", "gpu_mem_gb"))
    assert rows[0]["gpu_mem_gb"] == "22.25" and rows[0]["gpu_mem_allocated_gb"] == "20.5"
    back = read_dataset(import_files([tmp_path / "out.csv"], tmp_path / "back").out_dir)
    assert set(back.frame["source"]) == {"mine_h100"}


@pytest.mark.parametrize(("record", "reason"), [
    (Measurement(model=get_model("tiny"), config=ParallelConfig(), hardware="TPU-v5",
                 step_times_s=[0.1]), "hardware=.TPU-v5. is not a device of the hardware"),
    # what its importer would refuse: a step faster than the device's peak
    (Measurement(model=get_model("llama3-8b"), config=ParallelConfig(global_batch_size=64),
                 hardware="H100-80GB", step_times_s=[0.01]),
     "step_time_s=0.01 would be .* times the peak of 1 H100-80GB"),
])
def test_a_row_the_format_cannot_express_is_refused_and_nothing_written(tmp_path, record,
                                                                       reason):
    _dataset(tmp_path, [*_records()[:1], record])
    with pytest.raises(DatasetError, match=f"row 1 .*{reason}"):
        export_public_csv(tmp_path / "ds", tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"precision": "fp8"}, "row 0 .*precision='fp8' is not bf16 or fp16: on H100-80GB"),
    ({"precision": "bf16\nfp8"}, "the precision must be one line"),
    ({"source": "mine\nh100"}, "the source must be one line"),
    ({"source": " "}, "source=' ' names no measurement family"),
])
def test_what_the_importer_would_refuse_is_not_exported(tmp_path, kwargs, reason):
    """The export writes only files its importer reads back row for row: a precision the
    model does not price on the device, a cell over two lines or a source naming no
    family are refused, and nothing is written."""
    _dataset(tmp_path)
    with pytest.raises(DatasetError, match=reason):
        export_public_csv(tmp_path / "ds", tmp_path / "out.csv", **kwargs)
    assert not (tmp_path / "out.csv").exists()


def test_rows_of_nodes_smaller_than_the_catalogues_keep_their_node_size(tmp_path):
    """Exported without it, a campaign's rows on 4-GPU nodes read back on the catalogue's
    8-GPU nodes: a tensor-parallel group of 8 that crossed two nodes then sat in one."""
    from paratune.datasets.importers import public_row_config
    from paratune.models import features as F

    record = Measurement(model=dataclasses.replace(get_model("tiny"), num_kv_heads=8),
                         config=ParallelConfig(tp=8, global_batch_size=8),
                         hardware="H100-80GB", devices_per_node=4, step_times_s=[0.2])
    _dataset(tmp_path, [record])
    export_public_csv(tmp_path / "ds", tmp_path / "out.csv")
    back = read_dataset(import_files([tmp_path / "out.csv"], tmp_path / "back").out_dir)
    assert [m.devices_per_node for m in back.measurements()] == [4]
    assert F.tp_crosses_nodes(back.frame).tolist() == [1.0]
    row = {"gpu": "H100", "num_gpus": "8", "tp": "8", "pp": "1", "dp": "1", "layers": "2",
           "hidden": "64", "heads": "8", "seq_len": "32", "micro_batch": "1",
           "global_batch": "8"}
    assert public_row_config(row)["devices_per_node"] == 8
    assert public_row_config({**row, "gpus_per_node": "4"})["devices_per_node"] == 4
    assert public_row_config({**row, "gpus_per_node": "4", "nodes": "2"})
    # as `paratune predict` reads a public file
    from paratune.models._predict_io import read_config_csv

    (tmp_path / "rows.csv").write_text(",".join(row) + ",gpus_per_node\n"
                                       + ",".join(row.values()) + ",4\n")
    configs = read_config_csv(tmp_path / "rows.csv")[1]
    assert configs["devices_per_node"].tolist() == [4]
    with pytest.raises(ValueError, match=r"nodes=1 contradicts num_gpus=8 on 4-GPU nodes"):
        public_row_config({**row, "gpus_per_node": "4", "nodes": "1"})
    with pytest.raises(ValueError, match=r"gpus_per_node='0' must be a positive integer"):
        public_row_config({**row, "gpus_per_node": "0"})


def test_pipeline_schedules_and_their_virtual_stages_export_and_import_back(tmp_path):
    import csv

    tiny = get_model("tiny")
    schedules = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
    records = [Measurement(model=tiny, config=ParallelConfig(
        pp=2, global_batch_size=4, schedule=schedule, virtual_stages=virtual),
        hardware="A100-80GB", step_times_s=[0.1 * (i + 1)])
        for i, (schedule, virtual) in enumerate(schedules)]
    records.append(Measurement(model=tiny, config=ParallelConfig(dp=2, global_batch_size=4),
                               hardware="A100-80GB", step_times_s=[0.5]))
    _dataset(tmp_path, records)
    export_public_csv(tmp_path / "ds", tmp_path / "out.csv")
    with open(tmp_path / "out.csv", newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [(r["schedule"], r["virtual_stages"]) for r in rows] == [
        ("gpipe", "1"), ("1f1b", "1"), ("interleaved_1f1b", "2"), ("", "")]
    back = read_dataset(import_files([tmp_path / "out.csv"], tmp_path / "back").out_dir)
    assert [m.config for m in back.measurements()] == [m.config for m in records]


def test_export_cli_writes_several_datasets_as_one_file_and_refuses_to_replace(tmp_path,
                                                                              capsys):
    records = _records()
    write_dataset(tmp_path / "a", records[:2])
    write_dataset(tmp_path / "b", records[2:])
    out = tmp_path / "all.csv"
    args = ["datasets", "export", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out),
            "--provenance", "two runs"]
    assert main(args) == 0
    assert "wrote 5 rows (ok=3, oom=1, timeout=1)" in capsys.readouterr().out
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    assert import_files([out], None).num_records == 5
    assert main([*args[:-4], "--out", str(tmp_path), "--force"]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err
