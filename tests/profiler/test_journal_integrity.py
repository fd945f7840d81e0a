"""A journal entry that cannot be trusted (no row, or a key that is not its row's config) is
rejected at resume like a torn line: its config is measured again and reported, never kept
twice or under another config's key."""

from __future__ import annotations

import json
import logging

import pytest

from paratune import ParallelConfig, Status, get_model
from paratune.profiler._journal import (
    CampaignPaths,
    append_record,
    failure_record,
    journal_keys,
    read_journal,
    read_plan,
)
from paratune.profiler.campaign import CampaignSpec, materialise, prepare_campaign, run_campaign
from paratune.space import ConfigSpace

SPACE = ConfigSpace(micro_batch_sizes=[2], shardings=["none"], recomputes=["none"])


pytestmark = pytest.mark.usefixtures("one_thread")


def _spec() -> CampaignSpec:
    return CampaignSpec(model=get_model("tiny"), world_sizes=(2,), space=SPACE,
                        warmup_steps=1, measured_steps=2, timeout_s=60.0)


def _journaled(tmp_path) -> tuple[CampaignPaths, list[str]]:
    """A campaign whose every config is journaled (as failures: nothing to run)."""
    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    plan = read_plan(paths.plan(2))
    for config in plan["configs"]:
        append_record(paths.journal(2), failure_record(
            plan, ParallelConfig.from_dict(config), Status.ERROR, "failed"))
    return paths, [ParallelConfig.from_dict(c).key() for c in plan["configs"]]


def _rewrite(path, edit):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    edit(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_entries_without_a_row_or_under_another_key_are_not_records(tmp_path, caplog):
    paths, keys = _journaled(tmp_path)
    journal = paths.journal(2)

    def edit(lines):
        del lines[0]["row"]  # a line without its row
        lines[1]["key"] = keys[2]  # a row under another config's key

    _rewrite(journal, edit)
    with caplog.at_level(logging.WARNING):
        assert journal_keys(journal) == set(keys[2:])
    assert "rejected 2 journal entries" in caplog.text
    entries = read_journal(journal)
    assert [e["key"] for e in entries] == keys[2:]
    # the dataset holds one row per config it has a record of, under its own config
    frame = materialise(paths.root).frame
    assert len(frame) == len(keys) - 2
    assert frame.apply(lambda r: ParallelConfig(**{
        f: r[f] for f in ("dp", "tp", "pp", "micro_batch_size", "global_batch_size",
                          "schedule", "virtual_stages", "sharding", "recompute")}).key(),
        axis=1).tolist() == keys[2:]


@pytest.mark.slow
def test_resume_measures_the_rejected_configs_again_and_keeps_one_row_each(tmp_path, caplog):
    paths, keys = _journaled(tmp_path)

    def edit(lines):
        del lines[0]["row"]
        lines[1]["key"] = keys[2]

    _rewrite(paths.journal(2), edit)
    with caplog.at_level(logging.WARNING):
        result = run_campaign(_spec(), paths.root, resume=True, track=False, progress=False)
    assert "rejected 2 journal entries" in caplog.text
    frame = result.dataset.frame
    assert len(frame) == len(keys)  # one row per planned config, none twice
    rows = {e["key"]: e["row"] for e in read_journal(paths.journal(2))}
    assert sorted(rows) == sorted(keys)
    for key in keys[:2]:  # measured again, not the planted failure records
        assert rows[key]["error"] != "failed", rows[key]
    assert result.num_measured == 2
