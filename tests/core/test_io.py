from __future__ import annotations

import json
import os
import stat

import pytest

from paratune.fileio import append_jsonl, atomic_write_bytes, atomic_write_text, read_jsonl


def test_a_torn_last_line_survives_the_next_appends(tmp_path):
    journal = tmp_path / "journal.jsonl"
    append_jsonl(journal, {"key": "a"})
    with open(journal, "a") as handle:  # a kill in the middle of the second write
        handle.write('{"key": "b", "row": {"sta')
    assert [r["key"] for r in read_jsonl(journal)] == ["a"]
    # the resumed writer appends: its record is kept, and so is every later one
    append_jsonl(journal, {"key": "c"})
    assert [r["key"] for r in read_jsonl(journal)] == ["a", "c"]
    append_jsonl(journal, {"key": "d"})
    assert [r["key"] for r in read_jsonl(journal)] == ["a", "c", "d"]
    lines = journal.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1]) == {"key": "d"}


def test_read_jsonl_of_a_missing_file_is_empty(tmp_path):
    assert list(read_jsonl(tmp_path / "none.jsonl")) == []


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_text(tmp_path / "a.txt", "two")
    assert (tmp_path / "a.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_a_filesystem_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch,
                                                                 caplog):
    import errno
    import fcntl

    from paratune.fileio import exclusive_lock

    def no_locks(fd, operation):  # as some NFS, Lustre and FUSE mounts answer
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with exclusive_lock(tmp_path / ".lock", field="out", value="o", what="profiling it") as held:
        ran.append(held)
    assert ran == [False]  # the block is told it runs unlocked
    assert "cannot lock (No locks available)" in caplog.text
    # the same lock again (a model loaded in a loop): told once is enough
    with exclusive_lock(tmp_path / ".lock", field="out", value="o", what="profiling it") as held:
        assert held is False
    assert caplog.text.count("cannot lock") == 1
    with exclusive_lock(tmp_path / ".other", field="out", value="o", what="x") as held:
        assert held is False
    monkeypatch.undo()
    with exclusive_lock(tmp_path / ".lock", field="out", value="o", what="profiling it") as held:
        assert held is True


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_atomic_writes_get_the_mode_open_gives_and_scripts_stay_executable(tmp_path, umask):
    """A dataset or model on a shared filesystem is as readable as any file written there:
    0o666 less the umask (not mkstemp's 0o600), 0o777 less the umask for a script."""
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "card.json", "{}")
        atomic_write_text(tmp_path / "card.json", "{}")  # replacing keeps the rule
        atomic_write_bytes(tmp_path / "data.parquet", b"PAR1")
        atomic_write_text(tmp_path / "torchrun.sh", "#!/bin/sh\ntrue\n")
        atomic_write_text(tmp_path / "run.txt", "#!/bin/sh\n", executable=False)
        with open(tmp_path / "plain.txt", "w") as handle:
            handle.write("x")
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode["card.json"] == mode["data.parquet"] == mode["run.txt"] == mode["plain.txt"]
    assert mode["plain.txt"] == 0o666 & ~umask
    assert mode["torchrun.sh"] == 0o777 & ~umask


def test_atomic_write_onto_a_directory_names_it(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_text(tmp_path / "out", "x")
    assert info.value.filename == str(tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_file_that_cannot_be_created_is_named_not_its_temporary():
    """/proc takes no new file: the error names the file asked for, which the user typed,
    not the hidden temporary beside it."""
    with pytest.raises(OSError) as info:
        atomic_write_text("/proc/paratune-out.csv", "x")
    assert info.value.filename == "/proc/paratune-out.csv"


def test_a_lock_file_gets_the_mode_its_umask_allows(tmp_path):
    # a group-writable dataset's lock must be group-writable too, or a colleague's write fails
    from paratune.fileio import exclusive_lock

    old = os.umask(0o002)
    try:
        with exclusive_lock(tmp_path / ".lock", field="out", value="o", what="writing"):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / ".lock").stat().st_mode & 0o777 == 0o664
