from __future__ import annotations

import os
from pathlib import Path

import pytest

from paratune import Recompute, Sharding, Status
from paratune.datasets.importers import (
    import_files,
    is_public_csv,
    parse_public_csv,
    read_public_csv,
)

REPO = Path(__file__).resolve().parents[2]
HEADER = ("source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
          "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,tokens_per_sec,"
          "step_time_s,tokens_per_sec_per_gpu,precision,notes,nodes,grad_accum,gpu_mem_gb,status")
GOOD = ("ultrascale_playbook_nanotron,1B,1,16,2048,32,4096,H100-80GB,8,1,1,8,1,2,256,0,,,0.392,"
        "321200,,40150,bf16,nodes=1;grad_accum=16;gpu_mem_gb=50.2,1,16,50.2,ok")


def _public_dir() -> Path:
    path = Path(os.environ.get("PARATUNE_PUBLIC_DATA", REPO.parent / "shared/data/public-gpu"))
    if not (path / "ultrascale_playbook_h100.csv").exists():
        pytest.skip(f"public GPU measurements not found at {path}")
    return path


def _write(tmp_path: Path, *rows: str, comment: bool = True) -> Path:
    path = tmp_path / "rows.csv"
    lines = (["# source: test rows"] if comment else []) + [HEADER, *rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_good_row_maps_config_hardware_and_metrics(tmp_path):
    records, problems = parse_public_csv(_write(tmp_path, GOOD))
    assert problems == []
    (m,) = records
    assert m.status is Status.OK and m.hardware == "H100-80GB" and m.devices_per_node == 8
    assert (m.config.dp, m.config.tp, m.config.pp, m.config.micro_batch_size) == (8, 1, 1, 2)
    assert m.config.num_microbatches == 16 and m.config.sharding is Sharding.NONE
    assert m.model.ffn_hidden_size == 8192 and m.model.vocab_size == 131072
    assert m.step_time_s == pytest.approx(256 * 4096 / 321200)
    assert m.tokens_per_s_per_device == pytest.approx(40150)
    assert m.peak_mem_reserved_gb == pytest.approx(50.2)


@pytest.mark.parametrize(("change", "reason"), [
    ({"dp": "4"}, "dp*tp*pp = 4*1*1 = 4 contradicts num_gpus=8"),
    ({"tp": ""}, "missing tp"),
    ({"grad_accum": "8"}, "contradicts global_batch=256"),
    ({"gpu": "TPU-v5"}, "gpu='TPU-v5' is not a known device"),
    ({"notes": "nodes=1;FLAG=source_dims_inconsistent"}, "FLAG=source_dims_inconsistent"),
    ({"tokens_per_sec": "100000"}, "contradicts tokens_per_sec_per_gpu"),
    ({"cp": "2"}, "context parallelism"),
    ({"mfu": "", "tokens_per_sec": "", "tokens_per_sec_per_gpu": "", "status": ""},
     "no status and no step_time_s or tokens_per_sec"),
])
def test_unmappable_rows_are_reported_with_line_and_reason(tmp_path, change, reason):
    cells = dict(zip(HEADER.split(","), GOOD.split(",")))
    cells.update(change)
    bad = ",".join(cells[h] for h in HEADER.split(","))
    records, problems = parse_public_csv(_write(tmp_path, GOOD, bad, GOOD))
    assert len(records) == 2
    (problem,) = problems
    assert problem.line == 4  # comment, header, good row, then the bad one
    assert reason in problem.reason


def test_header_without_comment_and_failed_status(tmp_path):
    failed = GOOD.replace(",0.392,321200,,40150,", ",,,,,").replace("50.2,ok", ",failed")
    rows, provenance = read_public_csv(_write(tmp_path, failed, comment=False))
    assert provenance == ""
    (row,) = rows
    assert row.line == 2 and row.measurement.status is Status.ERROR
    assert "no metrics" in row.measurement.error


def test_vtrain_row_is_gpt_with_full_recompute(tmp_path):
    path = tmp_path / "v.csv"
    path.write_text(",".join(HEADER.split(",")[:24]) + "\n"
                    "vtrain_ground_truth_single_node,GPT,,24,1024,16,1024,A100,8,2,2,2,1,4,32,,"
                    "full (use_checkpoint=true),,,,0.219733,,,note\n")
    (m,), problems = parse_public_csv(path)
    assert not problems
    assert m.model.mlp == "gelu" and m.model.ffn_hidden_size == 4096 and m.model.tie_embeddings
    assert m.config.recompute is Recompute.FULL and m.hardware == "A100-80GB"
    assert m.step_time_s == pytest.approx(0.219733)


def test_missing_required_column_fails_naming_it(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("model,layers\n1B,16\n")
    assert not is_public_csv(path)
    with pytest.raises(ValueError, match=r"missing columns.*hidden"):
        read_public_csv(path)


def test_public_files_import_with_every_skipped_row_explained():
    data = _public_dir()
    paths = sorted(data.glob("*.csv"))
    report = import_files(paths, None)
    assert report.num_rows == report.num_records + len(report.problems)
    assert report.num_records > 2500
    # every FLAG row of the source is among the reported ones, with its line number
    flagged = {(p.name, i + 1) for p in paths
               for i, line in enumerate(p.read_text().splitlines()) if "FLAG=" in line}
    reported = {(Path(p.path).name, p.line) for p in report.problems}
    assert flagged and flagged <= reported
    assert report.duplicates  # configurations recorded both ok and failed
    assert "both records are kept" in report.summary()


def test_import_writes_a_dataset(tmp_path):
    from paratune import datasets

    report = import_files([_write(tmp_path, GOOD, GOOD.replace(",8,1,1,8,", ",8,1,1,4,"))],
                          tmp_path / "ds")
    assert report.num_records == 1 and len(report.problems) == 1
    back = datasets.read_dataset(tmp_path / "ds")
    assert len(back.frame) == 1 and back.frame["status"].iloc[0] == "ok"
