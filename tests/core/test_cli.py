from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_every_command_that_logs_to_mlflow_takes_both_spellings_of_its_opt_out():
    """``--no-track`` (the commands') and ``--no-mlflow`` (the experiments' scripts) are one
    flag wherever a command logs to MLflow."""
    from paratune.cli import build_parser

    spellings = {}
    for command, parser in _parsers(build_parser()):
        for action in parser._actions:
            names = sorted({"--no-track", "--no-mlflow"} & set(action.option_strings))
            if names:
                spellings[command] = names
                assert action.dest == "no_track", command
    assert {"profile", "gns", "tune", "plan", "fit", "evaluate", "quickstart"} <= {
        c.split()[-1] for c in spellings}
    assert all(s == ["--no-mlflow", "--no-track"] for s in spellings.values()), spellings


def test_quickstart_help_reads_as_plain_text(capsys):
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
    assert capsys.readouterr().err == ("paratune datasets: error: latin.csv: line 2 is not "
                                       "UTF-8 text (byte 0xe9); save the file as UTF-8\n")
    assert not (tmp_path / "D").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["profile", "--warmup", "-1"], "--warmup=-1: must be an integer >= 0"),
    (["profile", "--steps", "0"], "--steps=0: must be an integer >= 1"),
    (["profile", "--timeout", "0"], "--timeout=0.0: must be a finite positive number of seconds"),
    (["profile", "--hardware", "TPU-v9"], "--hardware='TPU-v9': is not a known device"),
    (["profile", "--resume"], "out='run': holds no campaign.json: nothing to resume"),
    (["gns", "--ema", "1.5"], "--ema=1.5: must be in [0, 1)"),
    (["gns", "--mode", "accumulate", "--small-batches", "1"], "--small-batches=1: must be >= 2"),
    (["gns", "--model", "config.json"], "--model='config.json': is not valid JSON"),
])
def test_errors_name_the_flag_not_the_library_argument(tmp_path, capsys, monkeypatch, flags,
                                                        message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    common = (["--device", "cpu", "--print-command", "--no-progress"] if flags[0] == "profile"
              else ["--steps", "1", "--checkpoint-every", "0"])
    assert main([*flags, *common, "--out", "run", "--no-track"]) == 2
    command = flags[0]
    assert capsys.readouterr().err.startswith(f"paratune {command}: error: {message}")
    assert list(tmp_path.iterdir()) == [tmp_path / "config.json"]


@pytest.mark.parametrize(("flags", "message"), [
    (["profile", "--nproc-per-node", "0"], "argument --nproc-per-node: must be an integer >= 1, "
                                           "not '0'"),
    (["profile", "--devices-per-node", "0"], "argument --devices-per-node: must be an integer "
                                             ">= 1, not '0'"),
    (["profile", "--world-sizes", "1,x"], "argument --world-sizes: must be comma-separated "
                                          "positive integers such as 1,2,4, not '1,x'"),
    (["gns", "--lr", "-0.001"], "argument --lr: must be a finite number >= 0, not '-0.001'"),
    (["gns", "--lr", "inf"], "argument --lr: must be a finite number >= 0, not 'inf'"),
    (["gns", "--corpus-mb", "0.001"], "argument --corpus-mb: must be a finite number >= "
                                      "0.00390625, not '0.001'"),
])
def test_flags_out_of_range_are_refused_by_the_parser(tmp_path, capsys, monkeypatch, flags,
                                                      message):
    monkeypatch.chdir(tmp_path)
    common = (["--device", "cpu", "--print-command", "--no-progress"] if flags[0] == "profile"
              else ["--steps", "1", "--checkpoint-every", "0"])
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, *common, "--out", "run", "--no-track"])
    assert exit_info.value.code == 2
    assert f"paratune {flags[0]}: error: {message}\n" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("flags", "message"), [
    (["--warmup", "-1"], "--warmup=-1: must be an integer >= 0"),
    (["--steps", "0"], "--steps=0: must be an integer >= 1"),
    (["--verify", "-1"], "--verify=-1: must be a number of configs >= 0"),
    (["--gpus", "0"], "--gpus=0: must be a positive number of processes"),
    (["--gpus", "8"], "--gpus=8: must be one of the profiled world sizes [1, 2, 4]"),
])
def test_quickstart_errors_name_its_flags(tmp_path, capsys, monkeypatch, flags, message):
    """Refused before the first stage starts: nothing printed, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert main(["quickstart", *flags, "--out", "run", "--no-track"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"paratune quickstart: error: {message}")
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("flags", "make", "message"), [
    (["datasets", "import", "D", "--out", "X"], "D/", "D: is a directory"),
    (["profile", "--grid", "D", "--device", "cpu", "--print-command", "--out", "run",
      "--no-track"], "D/", "--grid D: is a directory, not a file"),
    (["quickstart", "--out", "f.csv", "--no-track"], "f.csv",
     "--out f.csv: is a file, not a directory"),
    (["datasets", "import", "in.csv", "--out", "f.csv/sub"], "f.csv",
     "--out f.csv/sub: f.csv is a file, not a directory"),
])
def test_a_directory_for_a_file_or_the_reverse_is_a_one_line_error(tmp_path, capsys,
                                                                   monkeypatch, flags, make,
                                                                   message):
    monkeypatch.chdir(tmp_path)
    if make.endswith("/"):
        (tmp_path / make).mkdir()
    else:
        (tmp_path / make).write_text("x\n")
    (tmp_path / "in.csv").write_text(
        "source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
        "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,tokens_per_sec,"
        "step_time_s,tokens_per_sec_per_gpu,precision,notes\n"
        "ultrascale_playbook_nanotron,8B,8,32,4096,32,4096,H100-80GB,16,2,1,8,1,1,256,1,,,,,"
        "15,,bf16,\n")
    assert main(flags) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"paratune {flags[0]}: error: ")
    assert message in captured.err and len(captured.err.splitlines()) == 1
    assert "[1/4]" not in captured.out


def test_os_errors_without_a_path_stay_tracebacks(capsys):
    """Only errors about a path are the user's; anything else is a bug to see whole."""
    import argparse
    import errno

    from paratune.cli import _run

    def broken(_args):
        raise ConnectionResetError("peer went away")

    def bug(_args):
        raise KeyError("internal")

    for func, kind in ((broken, ConnectionResetError), (bug, KeyError)):
        with pytest.raises(kind):
            _run(argparse.Namespace(func=func, command="x"), [])
    assert capsys.readouterr().err == ""

    def denied(_args):
        raise PermissionError(errno.EACCES, "Permission denied", "shared/model/model.json")

    args = argparse.Namespace(func=denied, command="fit", out="shared/model")
    assert _run(args, [], flags={"out": "--out"}) == 2
    assert capsys.readouterr().err == ("paratune fit: error: --out shared/model: "
                                       "shared/model/model.json: permission denied\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize(("command", "resume"), [("profile", True), ("fit", False)])
def test_a_full_disk_is_one_line(capsys, command, resume):
    """A write that finds no space names no file (the journal's append here): one line that
    says what to do, not a traceback."""
    import argparse

    from paratune.cli import _run
    from paratune.fileio import append_jsonl

    def journal(_args):
        append_jsonl("/dev/full", {"config": "dp2"})  # every write to it fails with ENOSPC

    assert _run(argparse.Namespace(func=journal, command=command), []) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"paratune {command}: error: no space left on device: free some "
                          "space and run it again")
    assert len(err.splitlines()) == 1 and ("--resume" in err) == resume


def test_log_messages_print_as_plain_lines(capsys):
    """INFO reads as output, a warning says so; -v keeps level and logger name."""
    import logging

    from paratune.cli import _configure_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    try:
        _configure_logging(verbose=False)
        log = logging.getLogger("paratune.tuner._verify")
        log.info("verified 1 configs")
        log.warning("slow")
        log.debug("hidden")
        logging.getLogger("somelib").info("theirs")
        _configure_logging(verbose=True)
        log.debug("detail")
    finally:
        root.handlers, root.level = handlers, level
    assert capsys.readouterr().err.splitlines() == [
        "verified 1 configs", "warning: slow", "somelib: theirs",
        "DEBUG paratune.tuner._verify: detail"]


def test_quickstart_world_sizes_are_parsed_like_profiles(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["quickstart", "--world-sizes", "1,x", "--out", "run", "--no-track"])
    assert exit_info.value.code == 2
    assert ("argument --world-sizes: must be comma-separated positive integers such as 1,2,4, "
            "not '1,x'") in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("flags", "message"), [
    (["tune", "--seq-len", "0"], "argument --seq-len: must be an integer >= 1, not '0'"),
    (["tune", "--top-k", "0"], "argument --top-k: must be an integer >= 1, not '0'"),
    (["tune", "--devices-per-node", "0"],
     "argument --devices-per-node: must be an integer >= 1, not '0'"),
    (["tune", "--gpus", "abc"], "argument --gpus: must be an integer, not 'abc'"),
    (["plan", "--smooth", "0"], "argument --smooth: must be an integer >= 1, not '0'"),
    (["plan", "--threshold", "x"], "argument --threshold: must be a number, not 'x'"),
    (["gns", "--lr", "-1"], "argument --lr: must be a finite number >= 0, not '-1'"),
    (["gns", "--corpus-mb", "0"],
     "argument --corpus-mb: must be a finite number >= 0.00390625, not '0'"),
    (["profile", "--world-sizes", "0"], "argument --world-sizes: must be comma-separated "
                                        "positive integers such as 1,2,4, not '0'"),
])
def test_a_bad_value_is_one_line_without_the_usage(tmp_path, capsys, monkeypatch, flags,
                                                    message):
    """As a value the command refuses (``--gpus 0``): one line naming the flag and the rule,
    exit 2; the usage block is for a command line of the wrong shape."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--no-track"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"paratune {flags[0]}: error: {message}\n"
    with pytest.raises(SystemExit) as exit_info:  # a missing value keeps the usage
        main([flags[0], flags[1]])
    assert exit_info.value.code == 2
    assert "usage: paratune" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_misspelt_command_keeps_the_usage(capsys):
    """A command that does not exist is a command line of the wrong shape: the usage shows
    the commands there are (a bad value of an option is one line)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["tnue"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: paratune") and "invalid choice: 'tnue'" in err
    with pytest.raises(SystemExit):
        main(["tune", "--search", "foo"])
    assert capsys.readouterr().err == ("paratune tune: error: argument --search: invalid "
                                       "choice: 'foo' (choose from 'optuna', 'exhaustive')\n")


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """``paratune datasets show DIR | head -1``: the reader leaves before the output is
    written; the command ends with the shell's SIGPIPE status, no traceback on stderr."""
    csv = tmp_path / "runs.csv"
    csv.write_text(
        "source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,micro_batch,"
        "global_batch,step_time_s,status\n"
        "mine_h100,1B,1.2,16,2048,32,4096,H100-80GB,8,1,1,8,1,256,2.5,ok\n")
    assert main(["datasets", "import", str(csv), "--out", str(tmp_path / "ds")]) == 0
    process = subprocess.Popen([sys.executable, "-m", "paratune", "datasets", "show",
                                str(tmp_path / "ds")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # long before the interpreter has started and written
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
