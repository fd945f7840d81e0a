"""Campaigns around their runs: the grid and its skipped configs, plans, what a resume or a
launch refuses, torchrun commands and restart budgets."""

from __future__ import annotations

import csv
import json
import os
import re

import pytest

from paratune import ConfigError, ParallelConfig, Status, get_model
from paratune.cli import main
from paratune.datasets import read_dataset
from paratune.profiler._journal import (
    EventLog,
    append_record,
    failure_record,
    journal_keys,
    read_plan,
    resolve_unfinished,
)
from paratune.profiler._worker import parse_faults
from paratune.profiler.campaign import (
    CampaignResult,
    LaunchOptions,
    enumerate_campaign,
    materialise,
    prepare_campaign,
    run_campaign,
    torchrun_commands,
)
from paratune.profiler.launcher import restart_budget
from paratune.space import ConfigSpace
from tests.profiler._campaign import KEYS_WS2, SMALL_SPACE, TINY
from tests.profiler._campaign import campaign_spec as _spec

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- planning
def test_enumeration_reports_skipped_configs_with_reasons():
    spec = _spec(world_sizes=(1, 2, 4), space=ConfigSpace(micro_batch_sizes=[1, 4],
                                                          shardings=["none", "zero1"],
                                                          recomputes=["none"]))
    result = enumerate_campaign(spec)
    assert [c.key() for c in result[2].valid if c.pp == 1 and c.tp == 1 and
            c.micro_batch_size == 1] == ["dp2-tp1-pp1-mb1-gb8-1f1b-v1-none-none",
                                         "dp2-tp1-pp1-mb1-gb8-1f1b-v1-zero1-none"]
    reasons = {c.key(): r for c, r in result[4].skipped}
    # dp=4 * mb=4 does not divide the global batch of 8; zero1 cannot shard tp parameters.
    assert "global_batch_size=8: must be divisible by dp*micro_batch_size" in \
        reasons["dp4-tp1-pp1-mb4-gb8-1f1b-v1-none-none"]
    assert "sharding='zero1': needs tp=1" in reasons["dp2-tp2-pp1-mb1-gb8-1f1b-v1-zero1-none"]
    for world_size, enumeration in result.items():
        for config in enumeration.valid:
            config.validate(TINY, world_size)


def test_a_campaign_whose_stored_grid_is_unsorted_resumes(tmp_path):
    # campaigns written before the space kept its options sorted stored them as given
    spec = _spec(world_sizes=(1, 2), space=ConfigSpace(micro_batch_sizes=[1, 2, 4]))
    paths, meta = prepare_campaign(spec, tmp_path / "c")
    stored = json.loads(paths.campaign.read_text())
    stored["identity"]["grid"]["micro_batch_sizes"] = [4, 2, 1]
    paths.campaign.write_text(json.dumps(stored))
    _, again = prepare_campaign(spec, tmp_path / "c", resume=True)
    assert again["campaign_id"] == meta["campaign_id"]


def test_prepare_writes_plans_and_refuses_to_mix_campaigns(tmp_path):
    spec = _spec(world_sizes=(1, 4), space=ConfigSpace(micro_batch_sizes=[4]))
    paths, meta = prepare_campaign(spec, tmp_path / "c")
    plan = read_plan(paths.plan(4))
    assert plan["world_size"] == 4 and plan["warmup_steps"] == 1
    assert len(plan["configs"]) == meta["num_valid"]["4"] > 0
    with open(paths.skipped) as handle:
        skipped = list(csv.DictReader(handle))
    assert len(skipped) == meta["num_skipped"]["4"] + meta["num_skipped"]["1"] > 0
    assert all(row["reason"] for row in skipped)
    with pytest.raises(ConfigError, match="already holds a campaign"):
        prepare_campaign(spec, tmp_path / "c")
    with pytest.raises(ConfigError, match=r"measured_steps=5: differs from the campaign"):
        prepare_campaign(_spec(world_sizes=(1, 4), space=ConfigSpace(micro_batch_sizes=[4]),
                               measured_steps=5), tmp_path / "c", resume=True)
    with pytest.raises(ConfigError, match="nothing to resume"):
        prepare_campaign(spec, tmp_path / "empty", resume=True)
    _, again = prepare_campaign(spec, tmp_path / "c", resume=True)
    assert again["campaign_id"] == meta["campaign_id"]


def test_a_campaign_is_not_started_over_a_dataset_it_would_replace(tmp_path):
    from paratune.datasets import write_dataset

    imported = write_dataset(tmp_path / "d", _imported_rows())
    spec = _spec(world_sizes=(1,), space=ConfigSpace(micro_batch_sizes=[4]))
    with pytest.raises(ConfigError, match=r"out=.*already holds a dataset"):
        prepare_campaign(spec, tmp_path / "d")
    assert len(read_dataset(tmp_path / "d").frame) == len(imported.frame) > 0
    assert not (tmp_path / "d" / "campaign.json").exists()


def _imported_rows():
    from paratune.measurement import Measurement

    return [Measurement(model=TINY, config=ParallelConfig(dp=1, micro_batch_size=4,
                                                          global_batch_size=4),
                        hardware="cpu", source="imported", step_time_s=0.1).to_row()]


@pytest.mark.parametrize(("measured", "resumed"), [("text", "synthetic"),
                                                   ("synthetic", "text")])
def test_a_resume_on_other_tokens_is_refused(tmp_path, measured, resumed):
    model = TINY.replace(vocab_size=256)
    prepare_campaign(_spec(model=model, data=measured), tmp_path / "c")
    plans = {p.name: p.read_text() for p in (tmp_path / "c").glob("plan-ws*.json")}
    with pytest.raises(ConfigError, match=rf"^data='{resumed}': differs from the campaign "
                                          rf".*\('{measured}'\)$"):
        prepare_campaign(_spec(model=model, data=resumed), tmp_path / "c", resume=True)
    assert {p.name: p.read_text() for p in (tmp_path / "c").glob("plan-ws*.json")} == plans


def test_a_campaign_another_process_is_profiling_is_refused(tmp_path):
    from paratune.fileio import exclusive_lock

    spec = _spec()
    paths, _ = prepare_campaign(spec, tmp_path / "c")
    files = {p.name: p.read_bytes() for p in paths.root.iterdir()}
    lock = dict(field="out", value="x", what="profiling this campaign")
    busy = (r"^out='.*': is in use: another process "
            rf"\(pid {os.getpid()}\) is profiling this campaign")
    # the lock a running campaign holds
    with exclusive_lock(paths.root / ".lock", **lock), pytest.raises(ConfigError, match=busy):
        # another timeout would rewrite campaign.json and the plans the running one reads
        run_campaign(_spec(timeout_s=5.0), tmp_path / "c", resume=True, track=False,
                     progress=False)
    with exclusive_lock(paths.root / ".lock", **lock), pytest.raises(ConfigError, match=busy):
        torchrun_commands(_spec(timeout_s=5.0), tmp_path / "c", resume=True)
    # nothing was measured or rewritten
    assert {p.name: p.read_bytes() for p in paths.root.iterdir() if p.name != ".lock"} == files
    with exclusive_lock(paths.root / ".lock", **lock):  # released when its holder ends
        pass


def test_a_grid_with_no_valid_config_is_refused_before_anything_is_written(tmp_path, capsys):
    grid = tmp_path / "g2.yaml"
    grid.write_text("tp_degrees: [3]\nglobal_batch_sizes: [8]\n")
    out = tmp_path / "c"
    assert main(["profile", "--model", "tiny", "--world-sizes", "4", "--grid", str(grid),
                 "--out", str(out), "--device", "cpu", "--no-track", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratune profile: error: world_sizes=[4]: no config of 4 devices "
                          "can be profiled for tiny")
    assert "tp_degrees=[3]" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(ConfigError, match="nothing to profile"):
        run_campaign(_spec(world_sizes=(2, 4), space=ConfigSpace(tp_degrees=[3])), out,
                     track=False, progress=False)
    with pytest.raises(ConfigError, match="nothing to profile"):
        torchrun_commands(_spec(world_sizes=(4,), space=ConfigSpace(tp_degrees=[3])), out)
    assert not out.exists()


def test_materialise_a_campaign_whose_records_all_lack_step_times(tmp_path):
    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    with pytest.raises(ConfigError, match="no config of this campaign has finished yet"):
        materialise(paths.root)
    plan = read_plan(paths.plan(2))
    for config in plan["configs"]:
        append_record(paths.journal(2), failure_record(
            plan, ParallelConfig.from_dict(config), Status.OOM, "out of memory"))
    dataset = materialise(paths.root)
    assert dataset.frame["status"].tolist() == ["oom"] * len(KEYS_WS2)
    assert dataset.frame["step_times_s"].map(list).tolist() == [[]] * len(KEYS_WS2)
    assert read_dataset(paths.root).frame["step_times_s"].map(list).tolist() == \
        [[]] * len(KEYS_WS2)


def test_summary_of_a_run_that_measured_nothing_new(tmp_path):
    paths, meta = prepare_campaign(_spec(), tmp_path / "c")
    plan = read_plan(paths.plan(2))
    for config in plan["configs"]:
        append_record(paths.journal(2), failure_record(
            plan, ParallelConfig.from_dict(config), Status.ERROR, "failed"))
    dataset = materialise(paths.root)
    counts = {2: {"valid": len(KEYS_WS2), "skipped": 0, "ok": 0, "oom": 0,
                  "error": len(KEYS_WS2), "timeout": 0}}
    resumed = CampaignResult(out=paths.root, campaign_id=meta["campaign_id"], dataset=dataset,
                             counts=counts, wall_s=4.6, num_measured=0, in_step_s=0.0,
                             worker_cpu_s=0.0)
    assert resumed.footer() == "nothing new to measure: 5 configs already measured " \
                               "(4.6 s this run)"
    assert "nan" not in resumed.summary()
    fresh = CampaignResult(out=paths.root, campaign_id=meta["campaign_id"], dataset=dataset,
                           counts=counts, wall_s=10.0, num_measured=5, in_step_s=5.0,
                           worker_cpu_s=12.0)
    assert fresh.footer() == "5 configs in 10.0 s this run (workers used 12 CPU s); " \
                             "1.00 s per config outside warm-up and measured steps"


def test_spec_and_fault_validation():
    with pytest.raises(ConfigError, match="world_sizes=0"):
        _spec(world_sizes=(0,))
    with pytest.raises(ConfigError, match="measured_steps=0"):
        _spec(measured_steps=0)
    with pytest.raises(ConfigError, match="timeout_s=-1"):
        _spec(timeout_s=-1)
    with pytest.raises(ConfigError, match="gpu='TPUv9'"):
        _spec(hardware="TPUv9")
    assert parse_faults("hang:k1, raise:k2:1") == [("hang", "k1", None), ("raise", "k2", 1)]
    with pytest.raises(ValueError, match="kind:config-key"):
        parse_faults("explode:k1")


def test_cuda_campaigns_need_a_warmup_and_a_gpu_per_rank(tmp_path, monkeypatch):
    """Checked before anything is written, for either launcher; the message points to what
    helps (this needs no GPU: the count is what CUDA reports)."""
    import torch

    with pytest.raises(ConfigError, match=r"warmup_steps=0: must be >= 1 on CUDA"):
        _spec(device="cuda", hardware="H100-80GB", warmup_steps=0)
    assert _spec(warmup_steps=0).warmup_steps == 0  # on the CPU a warm-up is optional
    spec = _spec(device="cuda", hardware="H100-80GB", world_sizes=(1, 2))
    out = tmp_path / "c"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for launcher in ("local", "torchrun"):
        with pytest.raises(ConfigError) as info:
            run_campaign(spec, out, track=False, progress=False,
                         launch=LaunchOptions(launcher=launcher))
        assert (info.value.field, info.value.value) == ("world_sizes", 2)
        assert "up to 1 here" in str(info.value) and "--print-command" in str(info.value)
        assert "use --launcher torchrun" not in str(info.value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="no CUDA device is visible") as info:
        run_campaign(spec, out, track=False, progress=False)
    assert info.value.field == "device"
    assert not out.exists()


def test_profile_on_cuda_without_a_gpu_or_hardware_is_a_named_error(tmp_path, capsys,
                                                                      monkeypatch):
    """Detecting the GPU of a machine without one names --device and what to do instead
    (not torch's 'Torch not compiled with CUDA enabled' AssertionError)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["profile", "--device", "cuda", "--out", str(tmp_path / "c"), "--no-track",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratune profile: error: --device='cuda': ")
    assert len(err.splitlines()) == 1
    assert "no CUDA device is visible" in err and "--device cpu" in err
    assert "--hardware" in err and "--print-command" in err
    assert not (tmp_path / "c").exists()


def test_worker_threads_default_like_torchrun(monkeypatch):
    """Local workers get torchrun's OMP_NUM_THREADS=1 on CUDA (more than one rank), the
    cores shared among the ranks on CPU, and a value already set is kept."""
    from paratune.profiler.launcher import _worker_env

    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _worker_env(2, "cuda", None)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in _worker_env(1, "cuda", None)  # torchrun leaves it too
    assert _worker_env(2, "cpu", None)["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))
    assert _worker_env(4, "cuda", {"OMP_NUM_THREADS": "6"})["OMP_NUM_THREADS"] == "6"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _worker_env(2, "cuda", None)["OMP_NUM_THREADS"] == "3"


def _max_restarts(command: str) -> int:
    (value,) = [part.split("=")[1] for part in command.split()
                if part.startswith("--max-restarts=")]
    return int(value)


def test_torchrun_commands(tmp_path):
    commands = torchrun_commands(_spec(world_sizes=(2, 4)), tmp_path / "c",
                                 nproc_per_node=2, rdzv_endpoint="head:29500")
    plan4 = (tmp_path / "c" / "plan-ws4.json").resolve()
    restarts = restart_budget(len(read_plan(plan4)["configs"]))
    assert commands[1] == (
        "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
        f"--rdzv-endpoint=head:29500 --rdzv-id={read_plan(plan4)['campaign_id']}-ws4 "
        f"--max-restarts={restarts} -m paratune.profiler._worker --plan {plan4}")
    slurm = torchrun_commands(_spec(world_sizes=(4,)), tmp_path / "c", nproc_per_node=2,
                              slurm=True)[0]
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in slurm
    assert "srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2" in slurm
    assert _max_restarts(slurm) == restarts
    with pytest.raises(ConfigError, match="nproc_per_node=3: must divide"):
        torchrun_commands(_spec(world_sizes=(4,)), tmp_path / "c", nproc_per_node=3)


def test_a_refused_node_layout_prepares_nothing(tmp_path, capsys):
    """--nproc-per-node or --nnodes that cannot hold a world size is refused before the
    campaign is prepared: nothing is written, and the corrected command then runs (a
    campaign left behind with the refused node size would refuse it)."""
    out = tmp_path / "c"
    with pytest.raises(ConfigError, match=r"^nproc_per_node=3: must divide the world size 4$"):
        torchrun_commands(_spec(world_sizes=(4,)), out, nproc_per_node=3)
    with pytest.raises(ConfigError, match=r"^nnodes=3: .* must equal the world size 4$"):
        torchrun_commands(_spec(world_sizes=(4,)), out, nnodes=3)
    with pytest.raises(ConfigError, match=r"^devices_per_node=3: must divide the world size 4"):
        torchrun_commands(_spec(world_sizes=(4,), devices_per_node=3), out)
    assert not out.exists()
    common = ["profile", "--world-sizes", "4", "--out", str(out), "--device", "cpu",
              "--print-command", "--no-track"]
    for flags, message in ((["--nproc-per-node", "3"], "--nproc-per-node=3: must divide"),
                           (["--nnodes", "3"], "--nnodes=3: nnodes*nproc_per_node"),
                           (["--devices-per-node", "3"], "--devices-per-node=3: must divide")):
        assert main(common + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"paratune profile: error: {message}") and len(err.splitlines()) == 1
        assert not out.exists()
    assert main(common + ["--nproc-per-node", "2"]) == 0
    assert "--nnodes=2 --nproc-per-node=2" in capsys.readouterr().out
    assert read_plan(out / "plan-ws4.json")["devices_per_node"] == 2


def test_a_resume_with_another_model_or_grid_names_the_fields_that_differ(tmp_path, capsys):
    out = tmp_path / "c"
    prepare_campaign(_spec(), out)
    where = f"differs from the campaign being resumed in {re.escape(str(out))}"
    with pytest.raises(ConfigError, match=rf"^seq_len=64: {where} \(128\)$"):
        prepare_campaign(_spec(model=TINY.replace(seq_len=64)), out, resume=True)
    with pytest.raises(ConfigError, match=rf"^micro_batch_sizes=\[1\]: {where} \(\[2\]\)$"):
        prepare_campaign(_spec(space=SMALL_SPACE.replace(micro_batch_sizes=[1])), out,
                         resume=True)
    # several fields: each named with both values; a model's name as the model
    with pytest.raises(ConfigError, match=rf"^model='small': {where} \('tiny'\); \w+=.* "
                                          r"differs too \("):
        prepare_campaign(_spec(model=get_model("small")), out, resume=True)
    assert main(["profile", "--out", str(out), "--resume", "--seq-len", "64", "--no-track",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"paratune profile: error: --seq-len=64: differs from "
                                       f"the campaign being resumed in {out} (128)\n")


@pytest.mark.parametrize("sizes", ["1,,2", "1,2,", ",2", " "])
def test_world_sizes_with_an_empty_entry_are_refused(tmp_path, capsys, sizes):
    with pytest.raises(SystemExit) as info:
        main(["profile", "--world-sizes", sizes, "--out", str(tmp_path / "c"), "--device",
              "cpu", "--print-command", "--no-track"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"paratune profile: error: argument --world-sizes: must be comma-separated "
                   f"positive integers such as 1,2,4, not {sizes!r} (it has an empty entry)\n")
    assert not (tmp_path / "c").exists()


def test_torchrun_restarts_cover_every_config_of_the_plan(tmp_path):
    """Each failed config ends its group, and torchrun counts every end as a restart (a
    clean OOM included): the budget covers every config of the world size's plan failing,
    each recorded after one restart, or two where the group died without a report."""
    spec = _spec(world_sizes=(2, 4), space=ConfigSpace(micro_batch_sizes=[1, 2]))
    commands = torchrun_commands(spec, tmp_path / "c")
    for world_size, command in zip(spec.world_sizes, commands):
        num_configs = len(read_plan(tmp_path / "c" / f"plan-ws{world_size}.json")["configs"])
        assert num_configs > 3
        assert _max_restarts(command) >= 2 * num_configs


def test_restart_resolution_from_events(tmp_path):
    """What a torchrun restart records for configs a dead launch left unfinished."""
    paths, _ = prepare_campaign(_spec(), tmp_path / "c")
    plan = read_plan(paths.plan(2))
    journal = paths.journal(2)
    config = ParallelConfig.from_dict(plan["configs"][0])
    append_record(journal, failure_record(plan, config, Status.ERROR, "earlier"))
    for rank in (0, 1):
        log = EventLog(paths.events(2, rank), rank=rank, attempt="a1")
        for key in KEYS_WS2[:4]:
            log.write("start", key)
    EventLog(paths.events(2, 1), rank=1, attempt="a1").write(
        "fail", KEYS_WS2[1], status="oom", error="rank 1: OutOfMemoryError: CUDA out of memory")
    EventLog(paths.events(2, 0), rank=0, attempt="a1").write("timeout", KEYS_WS2[2],
                                                            timeout_s=20.0)
    EventLog(paths.events(2, 0), rank=0, attempt="a2").write("start", KEYS_WS2[3])
    records = {r.config.key(): r for r in resolve_unfinished(paths, plan)}
    # finished: untouched; failed on a rank: oom with its text; timed out: timeout;
    # started in two launches that both died: error; never started: left to be measured.
    assert KEYS_WS2[0] not in records
    assert records[KEYS_WS2[1]].status is Status.OOM
    assert "CUDA out of memory" in records[KEYS_WS2[1]].error
    assert records[KEYS_WS2[2]].status is Status.TIMEOUT
    assert records[KEYS_WS2[3]].status is Status.ERROR
    assert "in 2 launches" in records[KEYS_WS2[3]].error
    assert KEYS_WS2[4] not in records
    assert journal_keys(journal) == set(KEYS_WS2[:4])
    assert resolve_unfinished(paths, plan) == []  # idempotent


@pytest.mark.parametrize(("changes", "message"), [
    # a CPU's timings recorded as an H100's would be fitted as the H100's
    (dict(hardware="H100-80GB"), r"^hardware='H100-80GB': is a cuda device and the campaign "
                                 r"runs on cpu"),
    (dict(seed=-1), r"^seed=-1: must be an integer from 0 to 4294967295$"),
    (dict(seed=10**14), r"^seed=100000000000000: must be an integer from 0"),
    (dict(world_sizes=(2, 4), devices_per_node=3), r"^devices_per_node=3: must divide the "
                                                   r"world size 4$"),
])
def test_a_campaign_that_would_record_wrong_rows_is_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        _spec(**{"device": "cpu", "hardware": "cpu", **changes})


def test_a_world_smaller_than_the_node_size_sits_in_one_node():
    assert _spec(device="cpu", hardware="cpu", world_sizes=(1, 2, 8),
                 devices_per_node=4).world_sizes == (1, 2, 8)


@pytest.mark.parametrize("flags", [["--slurm"], ["--nnodes", "2"],
                                   ["--rdzv-endpoint", "host:29500"]])
def test_cluster_flags_without_print_command_are_refused(tmp_path, capsys, flags):
    assert main(["profile", "--world-sizes", "1", "--out", str(tmp_path / "c"), "--device",
                 "cpu", "--no-track", *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {flags[0]}" in err and "only goes with --print-command" in err
    assert not (tmp_path / "c").exists()


def test_a_gns_seed_out_of_range_is_refused_before_a_process_starts(tmp_path):
    from paratune.profiler.gns import GNSJob

    job = GNSJob(model=get_model("tiny"), config=ParallelConfig(global_batch_size=8),
                 steps=2, out=str(tmp_path / "t.csv"), seed=-1, device="cpu")
    with pytest.raises(ConfigError, match=r"^seed=-1: must be an integer from 0"):
        job.validate()
