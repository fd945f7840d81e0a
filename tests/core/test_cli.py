from __future__ import annotations

import subprocess
import sys

from paratune.cli import main


def test_help_does_not_import_heavy_libraries():
    code = ("import sys; from paratune.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'xgboost', 'mlflow', 'optuna', 'pandas') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""


def test_help_lists_subcommands(capsys):
    assert main([]) == 2
    text = capsys.readouterr().out
    for command in ("profile", "datasets", "fit", "predict", "evaluate", "tune", "plan", "gns",
                    "quickstart"):
        assert command in text


def _parsers(parser, name="paratune"):
    """``(command, parser)`` for the top level and every subcommand, nested ones included."""
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_has_help_without_markup():
    import argparse

    from paratune.cli import build_parser

    missing, markup = [], []
    for command, parser in _parsers(build_parser()):
        texts = [parser.description or ""]
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if isinstance(action, argparse._SubParsersAction):
                texts += [choice.help or "" for choice in action._choices_actions]
                continue
            if not action.help:
                missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
            texts.append(action.help or "")
        markup += [f"{command}: {t[:50]}" for t in texts
                   if "``" in t or ":class:" in t or ":func:" in t]
    assert missing == []
    assert markup == []


def test_quickstart_help_reads_as_plain_text(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    text = capsys.readouterr().out
    assert "paratune quickstart: the whole loop on this machine" in text
    assert "``" not in text and " tiny model" in text


def test_plain_text_drops_rst_markup():
    from paratune.cli import plain_text

    assert plain_text("``paratune quickstart``: the loop") == "paratune quickstart: the loop"
    assert plain_text("a :class:`~paratune.space.ConfigSpace` and :func:`paratune.tuner.tune`"
                      ) == "a ConfigSpace and paratune.tuner.tune"
    assert plain_text(":func:`the tuner <paratune.tuner.tune>`") == "the tuner"
    assert plain_text("don't change 95%% or it's") == "don't change 95%% or it's"
    assert plain_text(None) is None


def test_missing_and_undecodable_inputs_are_named_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["datasets", "import", "nosuch.csv", "--out", "D"]) == 2
    assert capsys.readouterr().err == "paratune datasets: error: nosuch.csv: no such file\n"
    (tmp_path / "latin.csv").write_bytes("source,model\ncaf\xe9,x\n".encode("latin-1"))
    assert main(["datasets", "import", "latin.csv", "--out", "D"]) == 2
    assert capsys.readouterr().err == "paratune datasets: error: latin.csv is not UTF-8 text\n"
    assert not (tmp_path / "D").exists()
