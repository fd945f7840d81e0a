"""The records of a campaign directory: plans, journal entries, timing kept in the dataset."""

from __future__ import annotations

import json
import math

import pytest

from paratune import ConfigError, Measurement, ParallelConfig, Status, get_model
from paratune.datasets import read_dataset
from paratune.datasets.journal import (
    CampaignPaths,
    JournalEntry,
    WorldSizePlan,
    append_record,
    load_plan,
    read_journal_entries,
    write_plan,
)
from paratune.datasets.materialise import campaign_progress, materialise
from paratune.datasets.schema import SCHEMA_VERSION, column_types
from paratune.measurement import StepTiming

TINY = get_model("tiny")
DP2 = ParallelConfig(dp=2, micro_batch_size=2, global_batch_size=8)
PP2 = ParallelConfig(pp=2, micro_batch_size=2, global_batch_size=8)


def _plan(**changes):
    fields = dict(campaign_id="c1", world_size=2, model=TINY, hardware="cpu", device="cpu",
                  devices_per_node=2, warmup_steps=1, measured_steps=2, seed=3,
                  timeout_s=60.0, data="synthetic", configs=(DP2, PP2))
    return WorldSizePlan(**{**fields, **changes})


def test_a_plan_round_trips_through_its_file(tmp_path):
    paths = CampaignPaths(tmp_path)
    for plan in (_plan(), _plan(fingerprint={"hostname": "a", "device_count": 2})):
        write_plan(paths, plan)
        assert load_plan(paths.plan(2)) == plan
        assert load_plan(paths.plan(2)).keys() == [DP2.key(), PP2.key()]
    assert "fingerprint" not in _plan().to_dict()


def test_a_plan_written_before_devices_per_node_and_data_reads_with_their_defaults():
    old = {k: v for k, v in _plan(world_size=4).to_dict().items()
           if k not in ("devices_per_node", "data", "seed")}
    plan = WorldSizePlan.from_dict(old)
    assert (plan.devices_per_node, plan.data, plan.seed) == (4, "synthetic", 0)
    with pytest.raises(ConfigError, match=r"plan=.*has no 'timeout_s'"):
        WorldSizePlan.from_dict({k: v for k, v in old.items() if k != "timeout_s"})


def _measured(config, **timing):
    return Measurement(model=TINY, config=config, hardware="cpu", devices_per_node=2,
                       step_times_s=[0.5, 0.7], campaign_id="c1",
                       timing=StepTiming(**timing))


def _campaign(tmp_path):
    paths = CampaignPaths(tmp_path)
    paths.campaign.write_text(json.dumps({"campaign_id": "c1", "identity": {
        "model": TINY.to_dict(), "world_sizes": [2]}, "num_valid": {"2": 2}}))
    write_plan(paths, _plan())
    return paths


def test_timing_is_kept_in_the_dataset_and_read_from_older_journals(tmp_path):
    paths = _campaign(tmp_path)
    append_record(paths.journal(2), _measured(DP2, build_s=1.5, mesh_s=0.25, teardown_s=0.125,
                                              overhead_s=2.0, call_s=3.5), attempt="a1")
    # a line written before rows held their timing: the figures beside the row
    legacy = _measured(PP2).to_row()
    for name in ("timing_build_s", "timing_mesh_s", "timing_teardown_s",
                 "timing_overhead_s", "timing_call_s"):
        legacy.pop(name)
    with open(paths.journal(2), "a") as handle:
        handle.write(json.dumps({"key": PP2.key(), "world_size": 2, "row": legacy,
                                 "call_s": 4.0, "build_s": 1.0, "load_average": 0.5}) + "\n")
    first, second = read_journal_entries(paths.journal(2))
    assert first.timing == StepTiming(build_s=1.5, mesh_s=0.25, teardown_s=0.125,
                                      overhead_s=2.0, call_s=3.5)
    assert first.attempt == "a1" and first.status is Status.OK and first.ok
    assert (second.timing.call_s, second.timing.build_s) == (4.0, 1.0)
    assert math.isnan(second.timing.overhead_s) and second.extra == {"load_average": 0.5}
    assert JournalEntry.from_dict(second.to_dict()).timing.call_s == 4.0

    frame = materialise(paths.root).frame.set_index("dp")
    assert read_dataset(paths.root).card.schema_version == SCHEMA_VERSION == 3
    assert frame.loc[2, "timing_call_s"] == 3.5 and frame.loc[2, "timing_mesh_s"] == 0.25
    assert frame.loc[1, "timing_call_s"] == 4.0 and math.isnan(frame.loc[1, "timing_mesh_s"])
    assert all(column_types()[c] == "float64" for c in StepTiming().to_columns())
    progress = campaign_progress(paths.root)
    assert progress.finished and progress.planned == {2: 2} and progress.num_rows == 2


def test_a_failed_entry_has_its_status_as_the_enum(tmp_path):
    paths = _campaign(tmp_path)
    failed = Measurement(model=TINY, config=DP2, hardware="cpu", status="oom",
                         error="out of memory", timing=StepTiming(call_s=0.5))
    append_record(paths.journal(2), failed, resolved_by="parent")
    (entry,) = read_journal_entries(paths.journal(2))
    assert entry.status is Status.OOM and not entry.ok and entry.resolved_by == "parent"
    assert entry.measurement().timing.call_s == 0.5
    assert not campaign_progress(paths.root).finished
