from __future__ import annotations

import json

import numpy as np
import pytest

from paratune import ConfigError
from paratune.tuner import load_trajectory


def _rows():
    return [{"step": s, "tokens": s * 4096, "loss": 5 - s / 100, "b_simple": 10 + s}
            for s in range(0, 100, 10)]


def test_csv_and_json_forms_read_the_same(tmp_path):
    rows = _rows()
    rows[3]["b_simple"] = -2.0  # a noisy negative estimate is dropped
    csv = tmp_path / "gns.csv"
    csv.write_text("step,tokens,loss,b_simple\n" + "\n".join(
        f"{r['step']},{r['tokens']},{r['loss']},{r['b_simple']}" for r in rows) + "\n")
    records = tmp_path / "gns.json"
    records.write_text(json.dumps(rows))
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({k: [r[k] for r in rows] for k in rows[0]}))
    wrapped = tmp_path / "rows.json"
    wrapped.write_text(json.dumps({"rows": rows}))
    reads = [load_trajectory(p) for p in (csv, records, columns, wrapped)]
    for traj in reads:
        assert len(traj) == 9
        assert np.all(traj.b_noise > 0)
        np.testing.assert_allclose(traj.b_noise, reads[0].b_noise)
    assert reads[0].reference_batch_tokens() == pytest.approx(4096)


def test_missing_column_and_missing_file_are_named(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("step,tokens,loss\n1,2,3\n")
    with pytest.raises(ConfigError, match="b_simple"):
        load_trajectory(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_trajectory(tmp_path / "absent.csv")
