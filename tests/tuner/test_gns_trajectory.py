from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from paratune import ConfigError
from paratune.tuner import Trajectory, effective_b_noise, load_trajectory
from paratune.tuner._tune import resolve_gns
from tests.tuner.conftest import run_with_trajectory


def _rows():
    return [{"step": s, "tokens": s * 4096, "loss": 5 - s / 100, "b_simple": 10 + s}
            for s in range(0, 100, 10)]


def test_csv_and_json_forms_read_the_same(tmp_path):
    rows = _rows()
    rows[3]["b_simple"] = -2.0  # a negative estimate is clamped, not dropped
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
        assert len(traj) == 10 and traj.num_clamped == 1
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


def _write_csv(path, rows):
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _gns_rows(seq_len=None, *, seqs_per_step=16, n=20):
    """Rows as ``paratune gns`` writes them (the current format ends with ``seq_len``)."""
    rows = []
    for s in range(1, n + 1):
        g2, trace = 1.0 / s, 20.0
        row = {"step": s, "tokens": s * seqs_per_step * (seq_len or 128), "loss": 5 - s / 10,
               "b_simple": trace / g2, "g2_ema": g2, "trace_ema": trace}
        if seq_len is not None:
            row["seq_len"] = seq_len
        rows.append(row)
    return rows


def test_seq_len_column_converts_b_simple_to_the_planned_models_sequences(tmp_path):
    traj = load_trajectory(_write_csv(tmp_path / "gns.csv", _gns_rows(128)))
    assert traj.seq_len == 128 and traj.reference_batch() == 16
    np.testing.assert_allclose(traj.b_noise_in(8192), traj.b_noise * 128 / 8192)
    np.testing.assert_allclose(traj.b_noise_tokens(), traj.b_noise * 128)
    # the measured B_noise, in tokens, is what the tuner uses whatever the target seq_len
    assert resolve_gns(str(tmp_path / "gns.csv"), seq_len=8192) * 8192 == pytest.approx(
        effective_b_noise(traj, seq_len=128) * 128)
    assert traj.to_rows()[0]["seq_len"] == 128


def test_gns_is_a_number_or_a_trajectory_given_as_text_or_path(tmp_path):
    path = _write_csv(tmp_path / "gns.csv", _gns_rows(128))
    assert resolve_gns(path, seq_len=128) == resolve_gns(str(path), seq_len=128) > 0
    assert resolve_gns("2000", seq_len=128) == resolve_gns(2000, seq_len=128) == 2000.0
    with pytest.raises(ConfigError, match=r"^gns=True: must be a number \(B_noise\) or a "
                                          r"trajectory file$"):
        resolve_gns(True, seq_len=128)


@pytest.mark.parametrize(("b_noise", "rule"), [
    ([10.0, np.nan, 12.0], "point 1 is nan"),
    ([10.0, -5.0, 12.0], "point 1 is -5.0"),
    ([0.0, 11.0, 12.0], "point 0 is 0.0"),
])
def test_a_trajectory_built_in_code_refuses_a_noise_scale_that_is_not_positive(b_noise, rule):
    """load_trajectory clamps a file's bad rows; one built directly would have ended as a NaN
    noise scale or a bare assertion in the planner."""
    step = np.arange(3.0)
    with pytest.raises(ConfigError, match=rf"^trajectory='Trajectory': b_noise must be a "
                                          rf"positive number at every point; {rule}$"):
        Trajectory(step=step, tokens=step * 1024, b_noise=np.array(b_noise),
                   loss=np.full(3, np.nan), seq_len=128)
    with pytest.raises(ConfigError, match="tokens must be finite and sorted"):
        Trajectory(step=step, tokens=np.array([0.0, 2048.0, 1024.0]),
                   b_noise=np.array([10.0, 11.0, 12.0]), loss=np.full(3, np.nan))


def test_old_file_needs_the_measuring_seq_len(tmp_path):
    path = _write_csv(tmp_path / "old.csv", _gns_rows(None))
    old = load_trajectory(path)  # still readable ...
    assert old.seq_len is None
    with pytest.raises(ConfigError, match=r"trajectory=.*old.csv.*needs a seq_len column or "
                                          r"--trajectory-seq-len"):
        effective_b_noise(old, seq_len=8192)  # ... but not convertible by a guess
    with pytest.raises(ConfigError, match="--trajectory-seq-len"):
        resolve_gns(str(path), seq_len=2048)
    given = load_trajectory(path, seq_len=128)
    assert given.seq_len == 128
    assert resolve_gns(str(path), seq_len=8192, trajectory_seq_len=128) == pytest.approx(
        effective_b_noise(given, seq_len=8192))


def test_bad_seq_len_is_a_named_error(tmp_path):
    path = _write_csv(tmp_path / "gns.csv", _gns_rows(128))
    with pytest.raises(ConfigError, match=r"seq_len=256: disagrees with the seq_len column"):
        load_trajectory(path, seq_len=256)
    assert load_trajectory(path, seq_len=128).seq_len == 128
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ConfigError, match=r"seq_len=.*: must be a positive integer"):
            load_trajectory(path, seq_len=bad)
    rows = _gns_rows(128)
    rows[4]["seq_len"] = 256
    with pytest.raises(ConfigError, match=r"seq_len column must hold one positive integer"):
        load_trajectory(_write_csv(tmp_path / "mixed.csv", rows))



def _rows_at(tokens_per_step, seq_len, *, noise=0.0, n=10):
    return [{"step": s, "tokens": s * tokens_per_step + (noise if s % 2 else 0.0),
             "loss": 5 - s / 10, "b_simple": 100.0 + s, "seq_len": seq_len}
            for s in range(1, n + 1)]


def test_seq_len_must_divide_a_large_batch_exactly(tmp_path):
    # 524,288 tokens per step are 524.288 sequences of 1000 tokens: not the measuring run's
    wrong = load_trajectory(_write_csv(tmp_path / "wrong.csv", _rows_at(524288, 1000)))
    with pytest.raises(ConfigError, match=r"seq_len=1000: must divide the 524288 tokens per "
                                          r"step .* into whole sequences"):
        wrong.reference_batch()
    right = load_trajectory(_write_csv(tmp_path / "right.csv", _rows_at(524288, 4096)))
    assert right.reference_batch() == 128
    # token counts written with float rounding noise still divide
    path = tmp_path / "noisy.csv"
    rows = _rows_at(524288, 4096, noise=1e-7)
    path.write_text("step,tokens,loss,b_simple,seq_len\n" + "".join(
        f"{r['step']},{r['tokens']!r},{r['loss']},{r['b_simple']},{r['seq_len']}\n"
        for r in rows))
    assert "524288.0000001" in path.read_text()
    assert load_trajectory(path).reference_batch() == pytest.approx(128)
    # a batch of many short sequences: a remainder of one token is still refused
    odd = load_trajectory(_write_csv(tmp_path / "odd.csv", _rows_at(2 * 1_000_001 + 1, 2)))
    with pytest.raises(ConfigError, match=r"seq_len=2: must divide"):
        odd.reference_batch()

def test_non_positive_estimates_are_clamped_and_counted(tmp_path, caplog):
    rows = _gns_rows(128)
    valid = [r["b_simple"] for r in rows]
    # noise dominates: the smoothed |G|^2 is not positive, b_simple is NaN
    for i in (12, 13, 14):
        rows[i]["g2_ema"], rows[i]["b_simple"] = -0.01, float("nan")
    # signal dominates: the smoothed trace is not positive
    rows[2]["trace_ema"], rows[2]["b_simple"] = -1.0, -1.0 / rows[2]["g2_ema"]
    # a b_simple lost while both parts are positive is rebuilt from them
    rows[5]["b_simple"] = float("nan")
    # the larger of the nearest valid rows before (11) and after (15)
    high = max(valid[11], valid[15])
    low = min(v for i, v in enumerate(valid) if i not in (2, 5, 12, 13, 14))
    with caplog.at_level(logging.WARNING, logger="paratune.tuner.gns_trajectory"):
        traj = load_trajectory(_write_csv(tmp_path / "gns.csv", rows))
    assert len(traj) == 20 and traj.num_clamped == 5
    np.testing.assert_allclose(traj.b_noise[[12, 13, 14]], high)
    assert traj.b_noise[2] == pytest.approx(low)
    assert traj.b_noise[5] == pytest.approx(valid[5])
    assert "5 of 20 rows" in caplog.text and "3 noise-dominated" in caplog.text
    assert f"before and after ({high:g})" in caplog.text
    # dropping the noise-dominated rows would have biased B_noise low
    dropped = load_trajectory(_write_csv(tmp_path / "dropped.csv",
                                         [r for i, r in enumerate(rows)
                                          if i not in (12, 13, 14)]))
    assert effective_b_noise(traj, seq_len=128) > effective_b_noise(dropped, seq_len=128)


def test_without_parts_nan_is_noise_and_non_positive_is_signal_dominated(tmp_path):
    # gns writes NaN where the smoothed |G|^2 is not positive; a finite value <= 0 comes
    # from a negative trace
    rows = [{k: r[k] for k in ("step", "tokens", "loss", "b_simple", "seq_len")}
            for r in _gns_rows(128)]
    rows[7]["b_simple"] = float("nan")
    rows[8]["b_simple"] = -3.0
    positive = [r["b_simple"] for r in rows if r["b_simple"] > 0]
    traj = load_trajectory(_write_csv(tmp_path / "gns.csv", rows))
    assert len(traj) == 20 and traj.num_clamped == 2
    # the nearest valid rows are 6 and 9 (8 is signal-dominated)
    assert traj.b_noise[7] == pytest.approx(max(rows[6]["b_simple"], rows[9]["b_simple"]))
    assert traj.b_noise[8] == pytest.approx(min(positive))


def test_noise_dominated_rows_take_a_bound_from_their_neighbours_not_the_run(tmp_path):
    # B_noise grows 100-fold over the run; the noise dominates at the start, early on and
    # late, and the file is not in step order
    rows = _gns_rows(128, n=40)
    for i in (0, 5, 6, 30):
        rows[i]["g2_ema"], rows[i]["b_simple"] = -0.01, float("nan")
    valid = {i: r["b_simple"] for i, r in enumerate(rows) if i not in (0, 5, 6, 30)}
    shuffled = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    traj = load_trajectory(_write_csv(tmp_path / "gns.csv", shuffled))
    assert traj.num_clamped == 4 and np.all(np.diff(traj.step) > 0)
    assert traj.b_noise[0] == pytest.approx(valid[1])  # nothing valid before it
    np.testing.assert_allclose(traj.b_noise[[5, 6]], max(valid[4], valid[7]))
    assert traj.b_noise[30] == pytest.approx(max(valid[29], valid[31]))
    # far below the run's largest value, which the early rows used to take
    assert traj.b_noise[[0, 5, 6]].max() < max(valid.values()) / 4
    # a row rebuilt from its parts is a valid neighbour
    rows[7]["b_simple"] = float("nan")
    rebuilt = load_trajectory(_write_csv(tmp_path / "rebuilt.csv", rows))
    np.testing.assert_allclose(rebuilt.b_noise[[5, 6]], max(valid[4], valid[7]))


def test_a_row_cut_short_while_written_is_dropped(tmp_path):
    path = _write_csv(tmp_path / "gns.csv", _gns_rows(128))
    text = path.read_text().rstrip("\n")
    path.write_text(text + "\n21,43008,2.9\n")  # torn: no b_simple, parts or seq_len
    traj = load_trajectory(path)
    assert len(traj) == 20 and traj.num_clamped == 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_smoothing_window_must_be_a_positive_integer(tmp_path, bad):
    """A window of 2.5 used to fail inside pandas with its own message; 0 and -3 silently
    meant no smoothing."""
    path = _write_csv(tmp_path / "gns.csv", _rows())
    with pytest.raises(ConfigError, match="smooth"):
        load_trajectory(path, smooth=bad)
    assert len(load_trajectory(path, smooth=3)) == 10


@pytest.mark.parametrize("command", ["tune", "plan"])
def test_a_trajectory_with_only_its_header_is_named(tmp_path, capsys, command):
    """A gns run stopped before its first step leaves the header alone: the error names the
    file and says it has no rows (not a numpy TypeError)."""
    from paratune.profiler.gns import TRAJECTORY_COLUMNS

    path = tmp_path / "gns.csv"
    path.write_text(",".join(TRAJECTORY_COLUMNS) + "\n")
    with pytest.raises(ConfigError, match=r"trajectory=.*gns.csv.*has no rows"):
        load_trajectory(path)
    code, flag = run_with_trajectory(command, path, tmp_path)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"paratune {command}: error: {flag}=") and "has no rows" in err
    assert len(err.splitlines()) == 1


def test_the_missing_seq_len_message_names_the_flag_not_library_syntax(tmp_path):
    path = _write_csv(tmp_path / "old.csv", _gns_rows(None))
    with pytest.raises(ConfigError) as info:
        effective_b_noise(load_trajectory(path), seq_len=8192)
    assert "--trajectory-seq-len N" in info.value.rule
    assert "load_trajectory(" not in info.value.rule


def test_published_laws_give_a_trajectory_in_the_planned_sequences():
    from paratune import get_model
    from paratune.tuner.gns_trajectory import (
        NOISE_LAWS,
        chinchilla_loss_curve,
        get_law,
        law_trajectory,
    )

    kaplan = NOISE_LAWS["kaplan2020"]
    assert kaplan.b_crit_tokens(2.0) == pytest.approx(2e8 / 2.0 ** (1 / 0.21))
    assert get_law("MiniCPM2024").b_crit_tokens(1.0) == pytest.approx(1.21e9)
    assert get_law("constant:4e6").b_crit_tokens([3.0, 2.0]).tolist() == [4e6, 4e6]
    model = get_model("llama3-8b")
    curve = chinchilla_loss_curve(model.num_params, tokens_from=2e8, tokens_to=2e11)
    # Chinchilla's fit: E + A / N^alpha + B / D^beta
    assert curve.loss[-1] == pytest.approx(1.69 + 406.4 / model.num_params ** 0.34
                                           + 410.7 / 2e11 ** 0.28)
    traj = law_trajectory("kaplan2020", curve, seq_len=model.seq_len)
    assert traj.reference_batch() == pytest.approx(1.0)
    np.testing.assert_allclose(traj.b_noise_tokens(), kaplan.b_crit_tokens(curve.loss))
    assert np.all(np.diff(traj.b_noise) > 0)  # the loss falls, the critical batch grows
    for bad in ("kaplan", "constant:-1", "constant:x"):
        with pytest.raises(ConfigError, match="law"):
            get_law(bad)


def test_a_loss_curve_file(tmp_path):
    from paratune.tuner.gns_trajectory import load_loss_curve

    path = tmp_path / "curve.csv"
    path.write_text("tokens,loss\n1e9,3.0\n1e10,2.5\n1e11,2.2\n")
    curve = load_loss_curve(path)
    assert curve.loss_at(1e10) == pytest.approx(2.5)
    path.write_text("tokens,loss\n1e9,3.0\n1e10,-1\n")
    with pytest.raises(ConfigError, match="loss"):
        load_loss_curve(path)
    with pytest.raises(ConfigError, match="missing column"):
        (tmp_path / "x.csv").write_text("tokens\n1\n")
        load_loss_curve(tmp_path / "x.csv")


def test_the_writer_and_the_reader_share_one_record():
    """``paratune gns`` writes and the tuner reads the columns of one definition: what the
    reader needs or uses is written, and ``seq_len`` comes last (a row cut short lacks it)."""
    from paratune import trajectory
    from paratune.profiler import gns
    from paratune.tuner import gns_trajectory

    assert gns.TRAJECTORY_COLUMNS is trajectory.TRAJECTORY_COLUMNS
    assert gns_trajectory.REQUIRED_COLUMNS is trajectory.REQUIRED_TRAJECTORY_COLUMNS
    read = trajectory.REQUIRED_TRAJECTORY_COLUMNS + trajectory.OPTIONAL_TRAJECTORY_COLUMNS
    assert set(read) <= set(trajectory.TRAJECTORY_COLUMNS)
    assert trajectory.TRAJECTORY_COLUMNS[-1] == "seq_len"
