"""Refusals write nothing, and outputs are not overwritten without --force: a study journal
that is a device, a refused tune that leaves no journal, predict and gns on an existing
--out."""

from __future__ import annotations

import pytest

from paratune.cli import main


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from paratune.models import PerformanceModel
    from tests.models.conftest import synthetic_measurements

    model = PerformanceModel(n_estimators=10, aux_estimators=5, n_jobs=1, random_state=0)
    return model.fit(synthetic_measurements()).save(tmp_path_factory.mktemp("pm") / "model")


def _tune(saved_model, *flags):
    return ["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100", "--predictor",
            str(saved_model), "--trials", "8", "--no-track", "--no-progress", *flags]


def test_a_journal_storage_that_is_not_a_regular_file_is_refused(saved_model, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    for storage in ("/dev/null", "adir"):
        assert main(_tune(saved_model, "--storage", storage, "--output", "t")) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"--storage='{storage}': is not a regular file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--risk", "q200"], "--risk='q200'"),
    (["--sampler", "cmaes"], "--sampler='cmaes'"),
])
def test_a_refused_tune_leaves_no_study_journal(saved_model, tmp_path, monkeypatch, capsys,
                                                flags, message):
    monkeypatch.chdir(tmp_path)
    assert main(_tune(saved_model, "--output", "t", *flags)) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no t/, no t/study.journal


def test_a_refusal_keeps_a_journal_that_holds_trials(saved_model, tmp_path, monkeypatch,
                                                     capsys):
    """The clean-up removes only what the refused call created: a study run before stays."""
    monkeypatch.chdir(tmp_path)
    assert main(_tune(saved_model, "--output", "t")) == 0
    before = (tmp_path / "t" / "study.journal").read_bytes()
    assert main(_tune(saved_model, "--output", "t", "--risk", "q200")) == 2
    assert (tmp_path / "t" / "study.journal").read_bytes()[:len(before)] == before


def test_predict_refuses_an_existing_out_without_force(saved_model, tmp_path, monkeypatch,
                                                       capsys):
    from paratune.predictor import CONFIG_COLUMNS
    from tests.models.conftest import synthetic_measurements

    monkeypatch.chdir(tmp_path)
    synthetic_measurements(n_per_model=2)[list(CONFIG_COLUMNS)].head(2).to_csv(
        "in.csv", index=False)
    (tmp_path / "p.csv").write_text("mine\n")
    argv = ["predict", "--model", str(saved_model), "in.csv", "--out", "p.csv"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--out='p.csv': exists: pass --force" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "p.csv").read_text() == "mine\n"
    assert main([*argv, "--force"]) == 0
    assert "pred_step_time_s" in (tmp_path / "p.csv").read_text()


def test_gns_refuses_an_existing_out_without_resume_or_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.csv").write_text("step,tokens\n1,128\n")
    assert main(["gns", "--model", "tiny", "--steps", "2", "--out", "t.csv", "--no-track",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--out='t.csv': exists: give --resume" in err and "--force" in err
    assert (tmp_path / "t.csv").read_text() == "step,tokens\n1,128\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
