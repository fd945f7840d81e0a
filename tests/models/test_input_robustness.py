"""Input files that are almost, but not quite, what predict, fit and evaluate expect."""

from __future__ import annotations

import pandas as pd
import pytest

from paratune.cli import main
from paratune.errors import DatasetError
from paratune.models._data import load_measurements
from paratune.models._predict_io import read_config_csv
from paratune.predictor import CONFIG_COLUMNS
from tests.models.test_cli import PUBLIC_HEADER, PUBLIC_ROWS


def _predict(model_dir, src, capsys) -> tuple[pd.DataFrame, str]:
    """``paratune predict`` of ``src``: the output as text, and what it printed."""
    capsys.readouterr()
    out = src.with_name(src.stem + "_out.csv")
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    return pd.read_csv(out, keep_default_na=False, dtype=str), capsys.readouterr().out


# ------------------------------------------------ a column named like a public-format column
@pytest.mark.parametrize(("column", "value"), [
    ("num_gpus", "64"), ("gpu", "H100-80GB"), ("params_b", "8")])
def test_predict_own_format_passes_through_a_column_named_like_a_public_one(
        model_dir, synthetic, tmp_path, capsys, column, value):
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).copy()
    frame[column] = value
    src = tmp_path / "own_plus.csv"
    frame.to_csv(src, index=False)
    result, printed = _predict(model_dir, src, capsys)
    assert "predicted 3 of 3 rows" in printed
    assert result["pred_error"].tolist() == ["", "", ""]
    assert result[column].tolist() == [value] * 3
    assert list(result.columns[:len(frame.columns)]) == list(frame.columns)
    assert (result["pred_step_time_s"].astype(float) > 0).all()


def test_fit_reads_measurement_rows_with_a_gpu_column(synthetic, tmp_path):
    src = tmp_path / "rows.csv"
    synthetic.head(5).assign(gpu="H100-80GB").to_csv(src, index=False)
    frame = load_measurements([src])
    assert len(frame) == 5 and (frame["gpu"] == "H100-80GB").all()


def test_a_public_header_missing_a_column_is_still_named(synthetic, tmp_path):
    """A header with a public-only column and no full paratune format is told what it lacks."""
    src = tmp_path / "rows.csv"
    synthetic.head(2).drop(columns="status").assign(gpu="H100").to_csv(src, index=False)
    with pytest.raises(DatasetError, match="missing public column"):
        load_measurements([src])
    configs = tmp_path / "configs.csv"
    configs.write_text("gpu,num_layers,tp\nH100,2,2\n")
    with pytest.raises(DatasetError, match="missing public column"):
        read_config_csv(configs)


# ---------------------------------------------------- rows that do not line up with the header
def test_predict_reports_rows_that_do_not_line_up_as_the_importer_does(model_dir, tmp_path,
                                                                       capsys):
    unclosed = PUBLIC_ROWS[0].replace(",8B,", ',"8B,')  # opens a quote its line never closes
    closing = PUBLIC_ROWS[4].replace(",full,", ',full",')  # ...which this one closes
    src = tmp_path / "public.csv"
    src.write_text("\n".join([PUBLIC_HEADER, PUBLIC_ROWS[0], unclosed, closing, "x,x,x",
                              "# a note", PUBLIC_ROWS[4]]) + "\n")
    result, printed = _predict(model_dir, src, capsys)
    assert "predicted 2 of 6 rows" in printed
    errors = result["pred_error"].tolist()
    span = ("has 9 cells but the header has 24 columns (its cells span lines 3-4: a quote not "
            "closed on its line?)")
    assert errors == ["", span, span, "has 3 cells but the header has 24 columns",
                      "a '#' comment line after the header is not a data row", ""]
    assert result["source"].tolist()[3:5] == ["x", "# a note"]
    assert result["model"].iloc[1] == PUBLIC_ROWS[0].split(",", 1)[1]
    assert result["source"].iloc[2] == "vtrain_ground_truth_multi_node"
    assert [v == "" for v in result["pred_step_time_s"]] == [False, True, True, True, True,
                                                             False]


def test_predict_own_format_reports_a_comment_line_after_the_header(model_dir, synthetic,
                                                                    tmp_path, capsys):
    lines = synthetic[list(CONFIG_COLUMNS)].head(2).to_csv(index=False).splitlines()
    src = tmp_path / "own.csv"
    src.write_text("\n".join([lines[0], lines[1], "# a note, with a comma", lines[2]]) + "\n")
    result, printed = _predict(model_dir, src, capsys)
    assert "predicted 2 of 3 rows" in printed
    assert result["pred_error"].tolist() == [
        "", "a '#' comment line after the header is not a data row", ""]


def test_a_quote_never_closed_keeps_every_line_as_a_row(tmp_path):
    src = tmp_path / "public.csv"
    src.write_text("\n".join([PUBLIC_HEADER, PUBLIC_ROWS[0].replace(",8B,", ',"8B,'),
                              PUBLIC_ROWS[4], "", PUBLIC_ROWS[0]]) + "\n")
    raw, _, errors = read_config_csv(src)
    assert len(raw) == 3
    assert all("its cells span lines 2-5: a quote not closed" in e for e in errors)


# ------------------------------------------------------------------- a file given twice
@pytest.mark.parametrize("command", ["fit", "evaluate"])
def test_fit_and_evaluate_refuse_a_file_given_twice(synthetic, tmp_path, capsys, command):
    data = tmp_path / "d" / "rows.csv"
    data.parent.mkdir()
    synthetic.to_csv(data, index=False)
    again = tmp_path / "d" / ".." / "d" / "rows.csv"
    with pytest.raises(DatasetError, match="given twice"):
        load_measurements([data, again])
    args = ["--out", str(tmp_path / "model")] if command == "fit" else []
    assert main([command, str(data), str(again), *args, "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert f"{again}: given twice (as {data} too)" in err
    assert not (tmp_path / "model").exists()


# ------------------------------------------------------- values of the own format's fields
@pytest.mark.parametrize(("column", "value", "message"), [
    ("tie_embeddings", "maybe", "tie_embeddings='maybe' must be true or false (or 1/0, "
                                "yes/no; empty: false)"),
    ("rope_theta", "abc", "rope_theta='abc' must be a positive number"),
    ("norm_eps", "abc", "norm_eps='abc' must be a positive number"),
    ("norm_eps", "-1", "norm_eps='-1' must be a positive number"),
    ("norm_eps", "inf", "norm_eps='inf' must be a positive number"),
    ("num_microbatches", "7", "num_microbatches=7 contradicts "
                              "global_batch_size/(dp*micro_batch_size) = 8"),
])
def test_predict_own_format_names_an_invalid_field(model_dir, synthetic, tmp_path, capsys,
                                                   column, value, message):
    frame = synthetic[list(CONFIG_COLUMNS)].head(3).astype(object)
    assert (frame["num_microbatches"] == 8).all()
    frame.loc[frame.index[1], column] = value
    src = tmp_path / "own.csv"
    frame.to_csv(src, index=False)
    result, printed = _predict(model_dir, src, capsys)
    assert "predicted 2 of 3 rows" in printed
    assert result["pred_error"].tolist() == ["", message, ""]
    assert result["pred_step_time_s"].iloc[1] == ""
    assert result[column].iloc[1] == value


def test_own_format_takes_the_spellings_of_a_flag_and_numbers(synthetic, tmp_path):
    frame = synthetic[list(CONFIG_COLUMNS)].head(5).astype(object)
    frame["tie_embeddings"] = ["TRUE", "no", "", "1", "Yes"]
    frame["rope_theta"] = ["10000", "", "5e5", "1e6", "500000.0"]
    frame["norm_eps"] = ["1e-6", "", "0.00001", "1E-5", " 1e-5 "]
    src = tmp_path / "own.csv"
    frame.to_csv(src, index=False)
    _, configs, errors = read_config_csv(src)
    assert errors.tolist() == [""] * 5
    assert configs["tie_embeddings"].tolist() == [True, False, False, True, True]
    assert configs["rope_theta"].tolist() == [1e4, 5e5, 5e5, 1e6, 5e5]
    assert configs["norm_eps"].tolist() == [1e-6, 1e-5, 1e-5, 1e-5, 1e-5]


def test_config_identity_is_the_row_join_of_its_columns():
    """One string per row, the identity columns' values joined by '|' as ``str`` writes
    them (NaN, booleans and floats included); rows equal in those columns share it, and a
    frame without them gives empty strings."""
    import numpy as np
    import pandas as pd

    from paratune.models._data import IDENTITY_COLUMNS, config_identity, feasibility_table

    columns = list(IDENTITY_COLUMNS)
    values = [[8, np.nan, True, 1.5, "1f1b"], [8, np.nan, True, 1.5, "1f1b"],
              [4, 2.0, False, 1.0, "gpipe"]]
    frame = pd.DataFrame({c: [row[i % 5] for row in values] for i, c in enumerate(columns)})
    frame["status"] = ["ok", "oom", "ok"]  # not part of a configuration
    identity = config_identity(frame)
    expected = ["|".join(str(frame[c].iloc[r]) for c in columns) for r in range(3)]
    assert identity.tolist() == expected
    assert identity.iloc[0] == identity.iloc[1] != identity.iloc[2]
    assert "nan" in identity.iloc[0] and "True" in identity.iloc[0]
    assert config_identity(pd.DataFrame({"status": ["ok"]})).tolist() == [""]
    # an empty cell keeps its row in the configuration table (a missing identity dropped
    # out of the grouping, and the table failed on the NaN it left)
    table = feasibility_table(frame)
    assert len(table) == 2 and table["feasible"].tolist() == [1, 1]
