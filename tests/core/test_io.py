from __future__ import annotations

import json

from paratune._io import append_jsonl, atomic_write_text, read_jsonl


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

    from paratune._io import exclusive_lock

    def no_locks(fd, operation):  # as some NFS, Lustre and FUSE mounts answer
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with exclusive_lock(tmp_path / ".lock", field="out", value="o", what="profiling it"):
        ran.append(True)
    assert ran == [True]
    assert "cannot lock (No locks available)" in caplog.text
