from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from paratune import DatasetError, Recompute, Sharding, Status, get_model
from paratune.cli import main
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
GOOD_ZERO1 = GOOD.replace(",256,0,,", ",256,1,,")  # another configuration


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
    ({"tp": "", "dp": ""}, "missing tp and dp (one of num_gpus, tp, pp and dp may be left "
                           "empty, no more)"),
    ({"num_gpus": "", "pp": ""}, "missing num_gpus and pp"),
    ({"dp": "", "tp": "3"}, "dp is empty and num_gpus=8 is not a multiple of tp*pp = 3"),
    ({"micro_batch": "", "grad_accum": "5"},
     "micro_batch is empty and global_batch=256 is not a multiple of dp*grad_accum = 8*5"),
    ({"micro_batch": "", "grad_accum": ""}, "missing micro_batch"),
    ({"grad_accum": "8"}, "contradicts global_batch=256"),
    ({"gpu": "TPU-v5"}, "gpu='TPU-v5' is not a known device"),
    ({"notes": "nodes=1;FLAG=source_dims_inconsistent"}, "FLAG=source_dims_inconsistent"),
    ({"tokens_per_sec": "100000"}, "contradicts tokens_per_sec_per_gpu"),
    ({"cp": "2"}, "dp*tp*pp*cp = 8*1*1*2 = 16 contradicts num_gpus=8"),
    ({"heads": "2", "tp": "4", "dp": "2", "grad_accum": ""}, "tp=4: must divide num_heads=2"),
    ({"tp": "inf"}, "tp='inf' must be a finite number"),
    ({"tp": "-2"}, "tp='-2' must be a positive integer"),
    ({"global_batch": "100", "grad_accum": ""},
     "global_batch=100 is not a multiple of dp*micro_batch"),
    ({"mfu": "39.2"}, "mfu='39.2' must be a fraction in [0, 1]"),
    ({"mfu": "-0.1"}, "mfu='-0.1' must be a fraction in [0, 1]"),
    ({"mfu": "inf"}, "mfu='inf' must be a finite number"),
    ({"tokens_per_sec": "-5", "tokens_per_sec_per_gpu": ""}, "tokens_per_sec='-5' must be "
                                                             "positive"),
    ({"tokens_per_sec": "", "tokens_per_sec_per_gpu": "", "step_time_s": "-2"},
     "step_time_s='-2' must be positive"),
    ({"gpu_mem_gb": "0"}, "gpu_mem_gb='0' must be positive"),
    # a hundred times the measured rate: more than the eight devices' peak can compute
    ({"tokens_per_sec": "", "tokens_per_sec_per_gpu": "4015000"},
     "would be 32.7 times the peak of 8 H100-80GB for this model's matrix products alone"),
    ({"gpu_mem_gb": "-inf"}, "gpu_mem_gb='-inf' must be a finite number"),
    ({"params_b": "one"}, "params_b='one' is not a number"),
    ({"global_batch": "2_56"}, "global_batch='2_56' is not a number"),
    ({"status": "done"}, "status='done' is not one of"),
    ({"status": "failed"}, "status='failed' contradicts the stated mfu, tokens_per_sec"),
    ({"mfu": "", "tokens_per_sec": "", "tokens_per_sec_per_gpu": "", "status": ""},
     "no status and no step_time_s or tokens_per_sec"),
])
def test_unmappable_rows_are_reported_with_line_and_reason(tmp_path, change, reason):
    cells = dict(zip(HEADER.split(","), GOOD.split(",")))
    cells.update(change)
    bad = ",".join(cells[h] for h in HEADER.split(","))
    records, problems = parse_public_csv(_write(tmp_path, GOOD, bad, GOOD_ZERO1))
    assert len(records) == 2
    (problem,) = problems
    assert problem.line == 4  # comment, header, good row, then the bad one
    assert reason in problem.reason


def test_a_split_sequence_counts_in_the_gpus_and_survives_the_round_trip(tmp_path):
    """A row with ``cp`` holds dp*tp*pp*cp GPUs, a data-parallel degree left empty is what
    the others leave, and the export writes ``cp`` back (empty where it is 1)."""
    from paratune.datasets import export_public_csv, write_dataset

    cells = dict(zip(HEADER.split(","), GOOD.split(",")))
    cells.update(cp="2", dp="", grad_accum="32")
    records, problems = parse_public_csv(_write(tmp_path, GOOD, ",".join(cells.values())))
    assert problems == []
    assert [(m.config.dp, m.config.cp, m.config.world_size) for m in records] == [
        (8, 1, 8), (4, 2, 8)]
    write_dataset(tmp_path / "ds", records, card={"campaign_id": "cp"})
    out = tmp_path / "out.csv"
    export_public_csv(tmp_path / "ds", out)
    again, problems = parse_public_csv(out)
    assert problems == [] and [m.config.cp for m in again] == [1, 2]
    assert {m.config.key() for m in again} == {m.config.key() for m in records}


@pytest.mark.parametrize("empty", ["num_gpus", "tp", "pp", "dp", "micro_batch"])
def test_one_degree_left_to_arithmetic_is_what_the_others_imply(tmp_path, empty):
    """Published tables often give the GPUs, tensor and pipeline degrees and leave the
    data-parallel one (or the micro-batch, where the micro-batches per step are stated)."""
    from paratune.datasets.importers import public_row_layout

    cells = dict(zip(HEADER.split(","), GOOD.split(",")))
    # every degree above 1, so that no empty cell reads as a default of 1
    cells.update(tp="2", pp="2", dp="2", grad_accum="64", notes="")
    cells[empty] = ""
    (m,), problems = parse_public_csv(_write(tmp_path, ",".join(cells.values())))
    assert problems == []
    assert (m.config.dp, m.config.tp, m.config.pp, m.config.micro_batch_size) == (2, 2, 2, 2)
    assert m.config.world_size == 8
    # and as predict reads a row
    _, config, _ = public_row_layout(cells)
    assert config == m.config


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


@pytest.mark.parametrize(("source", "model", "mlp"), [
    ("megatron_lm_h100_sweep", "llama-8B", "swiglu"),  # the model's name decides
    ("my_benchmarks", "gpt-1B", "gelu"),
    ("megatron_lm_h100_sweep", "1B", "gelu"),  # else the source
    ("ultrascale_playbook_nanotron", "1B", "swiglu"),
])
def test_model_family_by_model_name_then_source(tmp_path, source, model, mlp):
    cells = dict(zip(HEADER.split(","), GOOD.split(",")))
    cells.update(source=source, model=model)
    (m,), problems = parse_public_csv(
        _write(tmp_path, ",".join(cells[h] for h in HEADER.split(","))))
    assert not problems and m.model.mlp == mlp


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


def test_the_repository_h200_measurements_import_without_a_rejected_row():
    path = REPO / "data" / "paratune_h200.csv"
    report = import_files([path], None)
    assert report.problems == [] and report.num_rows == 45
    assert report.status_counts == {"ok": 38, "oom": 7}
    assert report.sources["paratune_h200.csv"].startswith("source: paratune's own profiler")
    records, _ = parse_public_csv(path)
    assert {m.hardware for m in records} == {"H200"}
    assert {m.model.name for m in records} == {"llama3.2-1b", "llama3.2-3b"}
    # the catalogue's shapes, every column stated: nothing assumed
    assert all(m.model == dataclasses.replace(get_model(m.model.name), seq_len=2048)
               for m in records)


def test_import_writes_a_dataset(tmp_path):
    from paratune import datasets

    report = import_files([_write(tmp_path, GOOD, GOOD.replace(",8,1,1,8,", ",8,1,1,4,"))],
                          tmp_path / "ds")
    assert report.num_records == 1 and len(report.problems) == 1
    back = datasets.read_dataset(tmp_path / "ds")
    assert len(back.frame) == 1 and back.frame["status"].iloc[0] == "ok"


def test_import_with_no_usable_row_writes_nothing_and_says_why(tmp_path, capsys):
    bad = _write(tmp_path, GOOD.replace(",8,1,1,8,", ",8,1,1,4,"))  # 1*1*4 != 8
    with pytest.raises(DatasetError, match=r"^import: no row to import, nothing written "
                                           rf"\(each was left out: {bad}:3: dp\*tp\*pp"):
        import_files([bad], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    # parsing alone still reports, without counts it does not have
    report = import_files([bad], None)
    assert report.num_records == 0 and report.summary().startswith("imported 0 of 1 rows\n")
    empty = _write(tmp_path)
    assert main(["datasets", "import", str(empty), "--out", str(tmp_path / "ds")]) == 2
    assert capsys.readouterr().err.endswith(
        "no row to import, nothing written (nothing below the files' headers)\n")
    assert not (tmp_path / "ds").exists()


def test_bom_crlf_quotes_and_line_breaks_keep_line_numbers(tmp_path):
    bad = GOOD.replace(",8,1,1,8,", ",8,1,1,4,")
    quoted = GOOD.replace("nodes=1;grad_accum=16;gpu_mem_gb=50.2", '"a, b\r\nc"')
    text = "\r\n".join(["# source: test rows", HEADER, quoted, bad, ""])
    path = tmp_path / "excel.csv"
    path.write_bytes(text.encode("utf-8-sig"))  # spreadsheet export: BOM and CRLF
    rows, provenance = read_public_csv(path)
    assert provenance == "source: test rows"
    assert [r.line for r in rows] == [3, 5]  # the quoted cell spans lines 3-4
    assert rows[0].measurement is not None and rows[0].raw["notes"] == "a, b\r\nc"
    assert "contradicts num_gpus=8" in rows[1].error


def test_a_trailing_separator_and_a_quoted_comment_line_are_read_as_spreadsheets_write_them(
        tmp_path):
    """A spreadsheet ends each row with a separator after the last column, and csv.writer
    quotes a one-cell comment that holds commas."""
    path = tmp_path / "sheet.csv"
    path.write_text('"# source: a sweep, its table 3"\n' + HEADER + ",\n" + GOOD + ",\n"
                    + GOOD_ZERO1 + ",,\n")
    rows, provenance = read_public_csv(path)
    assert provenance == "source: a sweep, its table 3"
    assert [r.error for r in rows] == ["", ""]
    assert [r.measurement.config.sharding.value for r in rows] == ["none", "zero1"]
    # a cell with a value beyond the header is still no trailing separator
    path.write_text(HEADER + "\n" + GOOD + ",x\n")
    rows, _ = read_public_csv(path)
    assert rows[0].error == "has 29 cells but the header has 28 columns"


@pytest.mark.parametrize(("lines", "line", "reason"), [
    ([GOOD + ",1,2"], 3, "has 30 cells but the header has 28 columns"),
    ([",".join(GOOD.split(",")[:20])], 3, "has 20 cells but the header has 28 columns"),
    ([GOOD, "# source: another file", HEADER, GOOD_ZERO1], 4, "a '#' comment line after "
                                                                "the header"),
    ([GOOD, HEADER, GOOD_ZERO1], 4, "repeats the header"),
    ([GOOD, GOOD], 4, "rows.csv:3 (every cell equal)"),
    ([GOOD.replace(",ok", ',"ok'), GOOD_ZERO1], 3, "column status: a quoted cell spans lines "
                                                   "3-4"),
    ([GOOD.replace("bf16,", 'bf16,"'), GOOD_ZERO1, GOOD], 3, "has 24 cells but the header "
                                                             "has 28 columns (its cells span "
                                                             "lines 3-5"),
])
def test_rows_that_do_not_line_up_are_reported_not_guessed(tmp_path, lines, line, reason):
    rows, _ = read_public_csv(_write(tmp_path, *lines))
    problems = [(r.line, r.error) for r in rows if r.measurement is None]
    assert any(n == line and reason in error for n, error in problems), problems


def test_the_same_run_written_twice_differently_is_a_duplicate(tmp_path):
    """One run, written once with every degree and once leaving ``dp`` to arithmetic, maps
    to one record: the second is reported as a copy of the first, naming its line, in one
    file and across two; a row that differs in a measured figure is another run."""
    no_dp = GOOD.replace(",8,1,1,8,1,2,", ",8,1,1,,1,2,")
    assert no_dp != GOOD
    rows, _ = read_public_csv(_write(tmp_path, GOOD, no_dp))
    assert rows[0].measurement is not None and rows[1].measurement is None
    assert rows[1].error.startswith(f"duplicate of {tmp_path / 'rows.csv'}:3 (the same run "
                                    "written differently")
    other = tmp_path / "other.csv"
    other.write_text(HEADER + "\n" + no_dp + "\n")
    report = import_files([_write(tmp_path, GOOD), other], tmp_path / "store")
    assert [(p.line, "duplicate of" in p.reason) for p in report.problems] == [(2, True)]
    slower = GOOD.replace(",0.392,321200,,40150,", ",0.391,320400,,40050,")
    rows, _ = read_public_csv(_write(tmp_path, GOOD, slower))
    assert all(r.measurement is not None for r in rows)


def test_unreadable_files_are_errors_naming_the_file(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "latin1.csv").write_bytes(("# source: x\n" + HEADER + "\n"
                                           + GOOD.replace("bf16", "caf\xe9")).encode("latin-1"))
    (tmp_path / "twice.csv").write_text(HEADER + ",tp\n" + GOOD + ",4\n")
    cases = {"empty.csv": "no CSV header", "latin1.csv": r"line 3 is not UTF-8",
             "twice.csv": r"twice\.csv:1: the header names column 'tp' twice",
             "dir": "is a directory, not a CSV file"}
    (tmp_path / "dir").mkdir()
    for name, message in cases.items():
        with pytest.raises(DatasetError, match=message):
            import_files([tmp_path / name], None)
    with pytest.raises(FileNotFoundError):
        import_files([tmp_path / "missing.csv"], None)
    assert main(["datasets", "import", str(tmp_path / "dir"), "--out",
                 str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_mixed_sources_in_one_import_keep_each_provenance(tmp_path):
    ultra = _write(tmp_path, GOOD)
    vtrain = tmp_path / "v.csv"
    vtrain.write_text("# source: vTrain\n# source: vTrain, table 2\n"
                      + ",".join(HEADER.split(",")[:24]) + "\n"
                      "vtrain_ground_truth_single_node,GPT,,24,1024,16,1024,A100,8,2,2,2,1,4,"
                      "32,,full,,,,0.219733,,,\n")
    bare = tmp_path / "bare.csv"
    bare.write_text(HEADER + "\n" + GOOD_ZERO1 + "\n")
    report = import_files([ultra, vtrain, bare], tmp_path / "ds")
    assert report.num_records == 3 and not report.problems
    assert report.sources == {"rows.csv": "source: test rows",
                              "v.csv": "source: vTrain | source: vTrain, table 2",
                              "bare.csv": ""}
    assert "no '# source:' provenance line in bare.csv" in report.summary()
    with pytest.raises(DatasetError, match="given twice"):
        import_files([ultra, tmp_path / "." / "rows.csv"], None)


def test_import_without_replace_leaves_the_dataset_there(tmp_path):
    from paratune.datasets import read_dataset
    from paratune.datasets._store import DatasetExistsError

    out = tmp_path / "ds"
    import_files([_write(tmp_path, GOOD)], out, replace=False)  # nothing there yet
    card = (out / "card.json").read_text()
    bare = tmp_path / "bare.csv"
    bare.write_text(HEADER + "\n" + GOOD_ZERO1 + "\n" + GOOD + "\n")
    with pytest.raises(DatasetExistsError, match="already holds a dataset"):
        import_files([bare], out, replace=False)
    assert (out / "card.json").read_text() == card and len(read_dataset(out)) == 1
    import_files([bare], out)
    assert len(read_dataset(out)) == 2


@pytest.mark.parametrize(("word", "recompute"), [
    ("true", Recompute.FULL), ("Yes", Recompute.FULL), ("1", Recompute.FULL),
    ("false", Recompute.NONE), ("no", Recompute.NONE), ("0", Recompute.NONE),
    ("full", Recompute.FULL), ("selective", Recompute.SELECTIVE), ("", Recompute.NONE),
])
def test_recompute_takes_yes_and_no_words(tmp_path, word, recompute):
    (m,), problems = parse_public_csv(_write(tmp_path, GOOD.replace(",256,0,,", f",256,0,{word},")))
    assert not problems and m.config.recompute is recompute


def test_recompute_refuses_other_words(tmp_path):
    _, (problem,) = parse_public_csv(_write(tmp_path, GOOD.replace(",256,0,,", ",256,0,maybe,")))
    assert problem.reason == "recompute='maybe' is not none, full or selective"


# ------------------------------------------------------- shape columns and the GPT-style default
# a 125M GPT-2-sized model from a source that defaults to the Llama vocabulary (131072, untied),
# for which params_b=0.125 is too small
SMALL = ("fsdp_benchmark,small-125m,0.125,12,768,12,1024,H100-80GB,8,1,1,8,1,8,64,3,,,,"
         "1000000,,,bf16,,1,1,30.0,ok")
SHAPE_HEADER = ",vocab_size,ffn_hidden_size,num_kv_heads,mlp,tie_embeddings"


def _write_shaped(tmp_path, *rows):
    path = tmp_path / "shaped.csv"
    path.write_text("\n".join(["# source: test rows", HEADER + SHAPE_HEADER, *rows]) + "\n")
    return path


def test_a_params_b_too_small_for_the_family_vocabulary_takes_the_gpt_style_default(tmp_path):
    records, problems = parse_public_csv(_write(tmp_path, SMALL))
    assert problems == []
    (m,) = records
    spec = m.model
    assert (spec.mlp, spec.ffn_hidden_size, spec.vocab_size, spec.tie_embeddings,
            spec.num_kv_heads) == ("gelu", 4 * 768, 51200, True, 12)
    assert "GPT-style default" in spec.extra["assumptions"]
    assert spec.num_params == pytest.approx(0.125e9, rel=0.01)
    # the dataset's card says so, with the rows that took it
    from paratune.datasets import read_dataset

    import_files([_write(tmp_path, SMALL)], tmp_path / "ds")
    taken = read_dataset(tmp_path / "ds").card.notes["assumptions"]
    assert taken == {spec.extra["assumptions"]: 1}


@pytest.mark.parametrize(("cells", "expect"), [
    # the stated vocabulary fits params_b with the source family's (Llama) other assumptions
    (",32000,,,,", {"vocab_size": 32000, "mlp": "swiglu", "ffn_hidden_size": 1792,
                    "tie_embeddings": False}),
    (",,2048,,,", {"ffn_hidden_size": 2048, "vocab_size": 51200}),
    (",,,4,,", {"num_kv_heads": 4, "ffn_hidden_size": 3072}),
    (",,,,swiglu,", {"mlp": "swiglu", "ffn_hidden_size": 2048}),  # 8/3 x 768 rounded to 256
    (",,,,,false", {"tie_embeddings": False, "vocab_size": 51200}),
    # every column stated: the family's defaults play no part
    (",50304,3072,6,gelu,true", {"vocab_size": 50304, "ffn_hidden_size": 3072,
                                 "num_kv_heads": 6, "mlp": "gelu", "tie_embeddings": True}),
])
def test_each_shape_column_round_trips_through_import(tmp_path, cells, expect):
    from paratune import datasets
    from paratune.models._data import load_measurements

    src = _write_shaped(tmp_path, SMALL + cells)
    report = import_files([src], tmp_path / "ds")
    assert report.num_records == 1 and report.problems == []
    # the dataset written by `datasets import`, and the rows `fit` and `evaluate` read from
    # the CSV itself, carry the stated shape
    for frame in (datasets.read_dataset(tmp_path / "ds").frame, load_measurements([src])):
        row = frame.iloc[0]
        assert {k: (bool(row[k]) if k == "tie_embeddings" else row[k]) for k in expect} \
            == expect


def test_a_llama_source_row_that_states_its_vocabulary_keeps_the_solved_mlp_width(tmp_path):
    # a 1B Llama with a 32000 vocabulary: the SwiGLU width is solved from params_b with it
    row = GOOD.replace(",1,16,2048,32,", ",1.1,22,2048,32,") + ",32000,,4,,"
    (m,), problems = parse_public_csv(_write_shaped(tmp_path, row))
    assert problems == []
    assert (m.model.mlp, m.model.vocab_size, m.model.num_kv_heads) == ("swiglu", 32000, 4)
    assert m.model.num_params == pytest.approx(1.1e9, rel=0.02)


@pytest.mark.parametrize(("cells", "reason"), [
    (",0,,,,", "vocab_size='0' must be a positive integer"),
    (",,-8,,,", "ffn_hidden_size='-8' must be a positive integer"),
    (",,,five,,", "num_kv_heads='five' is not a number"),
    (",,,5,,", "invalid num_kv_heads=5: must divide num_heads=12"),
    (",,,,moe,", "mlp='moe' must be swiglu or gelu"),
    (",,,,,sometimes", "tie_embeddings='sometimes' must be true or false"),
])
def test_bad_shape_values_are_reported_naming_the_column_and_rule(tmp_path, cells, reason):
    rows, _ = read_public_csv(_write_shaped(tmp_path, SMALL + cells))
    (row,) = rows
    assert row.measurement is None and reason in row.error and "\n" not in row.error


_PIPE_HEADER = ("source,model,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,micro_batch,"
                "global_batch,schedule,virtual_stages,step_time_s")


def _pipeline_row(schedule: str, virtual: str, *, pp: int = 4, global_batch: int = 64) -> str:
    return (f"megatron_lm_test,GPT-1B,24,2048,16,2048,A100-80GB,8,2,{pp},{4 // pp},1,"
            f"{global_batch},{schedule},{virtual},1.5")


@pytest.mark.parametrize(("schedule", "virtual", "pp", "expected"), [
    ("", "", 4, ("1f1b", 1)),
    ("1F1B", "1", 4, ("1f1b", 1)),
    ("interleaved", "3", 4, ("interleaved_1f1b", 3)),
    ("interleaved-1f1b", "2", 4, ("interleaved_1f1b", 2)),
    ("", "2", 4, ("interleaved_1f1b", 2)),  # chunks per rank say the schedule
    ("GPipe", "", 4, ("gpipe", 1)),
    ("gpipe", "", 1, ("1f1b", 1)),  # no pipeline: the schedule is moot
])
def test_a_pipeline_schedule_and_its_virtual_stages_are_read(tmp_path, schedule, virtual, pp,
                                                              expected):
    from paratune.models._predict_io import read_config_csv

    path = tmp_path / "pipe.csv"
    path.write_text(f"{_PIPE_HEADER}\n{_pipeline_row(schedule, virtual, pp=pp)}\n")
    (m,), problems = parse_public_csv(path)
    assert problems == []
    assert (m.config.schedule.value, m.config.virtual_stages) == expected
    # predict reads the same layout
    _, configs, errors = read_config_csv(path)
    assert not errors[0]
    assert (configs["schedule"].iloc[0], int(configs["virtual_stages"].iloc[0])) == expected


@pytest.mark.parametrize(("schedule", "virtual", "pp", "global_batch", "reason"), [
    ("interleaved_1f1b", "", 4, 64,
     "virtual_stages='': an interleaved schedule needs its model chunks per pipeline rank"),
    ("interleaved", "1", 4, 64, "virtual_stages=1: must be >= 2 with schedule=interleaved_1f1b"),
    ("1f1b", "2", 4, 64,
     "virtual_stages=2: must be 1 unless schedule=interleaved_1f1b (schedule=1f1b)"),
    ("zb-h1", "", 4, 64, "schedule='zb-h1' is not 1f1b, interleaved_1f1b or gpipe"),
    ("interleaved", "2", 1, 64, "schedule='interleaved_1f1b': interleaved_1f1b needs pp >= 2"),
    ("interleaved", "2", 4, 6, "global_batch=6: interleaved_1f1b needs the number of "
                               "micro-batches (6) to be a multiple of pp=4"),
])
def test_a_schedule_the_layout_cannot_run_is_refused_with_its_rule(tmp_path, schedule, virtual,
                                                                   pp, global_batch, reason):
    path = tmp_path / "pipe.csv"
    path.write_text(f"{_PIPE_HEADER}\n"
                    f"{_pipeline_row(schedule, virtual, pp=pp, global_batch=global_batch)}\n")
    records, (problem,) = parse_public_csv(path)
    assert records == [] and problem.reason.startswith(reason), problem.reason


# ------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("word", ["bf16", "FP16", "bfloat16", "float16", "bf16-mixed",
                                  "16-mixed", "amp_fp16", "BF16 (AMP)", "", "nan", "bf16-true",
                                  "mixed precision (bf16)", "torch.bfloat16", "n/a"])
def test_sixteen_bit_precision_however_spelled_is_imported(tmp_path, word):
    (m,), problems = parse_public_csv(_write(tmp_path, GOOD.replace(",bf16,", f",{word},")))
    assert not problems and m.hardware == "H100-80GB"


@pytest.mark.parametrize("word", ["fp8", "FP8-CS", "float8_e4m3", "mxfp8", "fp32", "tf32",
                                  "torch.float32", "32-true"])
def test_a_gpu_row_in_another_precision_is_refused_naming_it(tmp_path, word):
    """The core prices a GPU's matrix products at its dense 16-bit peak: an FP8 or 32-bit
    run would be fitted (and predicted) as a different job, so it is reported instead."""
    records, (problem,) = parse_public_csv(
        _write(tmp_path, GOOD_ZERO1, GOOD.replace(",bf16,", f",{word},")))
    assert len(records) == 1 and problem.line == 4
    assert problem.reason.startswith(f"precision={word!r} is not bf16 or fp16: on H100-80GB")


def test_a_long_context_run_near_peak_is_not_taken_for_an_impossible_one(tmp_path):
    """Attention, which sources count differently (causal halves or not), is left out of
    the bound: a 1B model on 131,072-token sequences split over 8 H100s (cp 8) at 60% of
    peak on the work it does is imported, not refused."""
    from paratune.spec import ModelSpec

    model = ModelSpec(name="1B", num_layers=16, hidden_size=2048, num_heads=32,
                      ffn_hidden_size=8192, vocab_size=131072, seq_len=131072)
    # causal attention counted once (half the full square), at 60% of the devices' peak
    flops = 3 * (2 * model.num_matmul_params + 2 * 16 * 131072 * 2048) * 131072
    step = flops / (0.6 * 8 * 989e12)
    cells = dict(zip(HEADER.split(","), GOOD.split(",")))
    cells.update({"seq_len": "131072", "dp": "1", "cp": "8", "micro_batch": "1",
                  "global_batch": "1", "grad_accum": "", "mfu": "", "tokens_per_sec": "",
                  "tokens_per_sec_per_gpu": "", "step_time_s": f"{step:.4f}", "gpu_mem_gb": ""})
    (m,), problems = parse_public_csv(_write(tmp_path, ",".join(cells[h] for h in
                                                                 HEADER.split(","))))
    assert not problems and m.config.cp == 8
