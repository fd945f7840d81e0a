"""A plan's phases as launch files: torchtitan TOML and Megatron-LM arguments per phase, and
Megatron-LM's step batch schedule per layout, checked by Megatron-LM's own code where it
installs."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import shlex
import tomllib
import warnings

import numpy as np
import pytest

from paratune import ConfigError, get_model
from paratune.space import ConfigSpace
from paratune.tuner import SearchSpace, Trajectory, plan_phases
from paratune.tuner._plan_export import megatron_step_schedule, plan_launch, write_plan_launch
from tests.tuner._frameworks import CUDA_MAJOR, megatron_arguments

MODEL = get_model("llama3-8b")
SEQ = MODEL.seq_len


def _plan(closed_form, shardings=("none", "zero1"), **options):
    step = np.arange(200, dtype=float) * 100
    traj = Trajectory(step=step, tokens=step * 256 * SEQ, b_noise=np.geomspace(40, 4000, 200),
                      loss=np.linspace(4.0, 2.0, 200), seq_len=SEQ)
    space = SearchSpace.build(MODEL, 64, "H100", global_batch_sizes="64:4096",
                              space=ConfigSpace(micro_batch_sizes=(1, 2),
                                                shardings=shardings,
                                                recomputes=("none",), schedules=("1f1b",)))
    return plan_phases(closed_form, space, traj, reconfig_cost_s=60, threshold=0.0,
                       **options), space


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_phase_gets_a_torchtitan_config_that_resumes_the_last(closed_form, tmp_path):
    plan, space = _plan(closed_form)
    assert len(plan.phases) >= 2
    files = write_plan_launch(plan, MODEL, space.hardware, tmp_path)
    steps, previous_dump = 0, None
    for i, phase in enumerate(plan.phases, 1):
        toml = tomllib.loads(files[f"phase_{i:02d}/torchtitan.toml"].read_text())
        assert toml["training"]["global_batch_size"] == phase["config"]["global_batch_size"]
        assert toml["training"]["steps"] > steps  # counted over the whole run
        assert toml["optimizer"]["lr"] == pytest.approx(phase["lr"])
        assert toml["checkpoint"]["enable"] is True
        if previous_dump is None:
            assert "initial_load_path" not in toml["checkpoint"]
        else:
            assert toml["checkpoint"]["initial_load_path"] == (
                f"{previous_dump}/checkpoints/step-{steps}")
            # nor the scheduler's state, which holds the previous phase's learning rate
            assert toml["checkpoint"]["exclude_from_loading"] == ["dataloader", "lr_scheduler"]
        _check_constant_lr(toml, phase["steps"])
        steps = toml["training"]["steps"]
        previous_dump = toml["job"]["dump_folder"]
        assert (phase["steps"] == steps - sum(p["steps"] for p in plan.phases[:i - 1]))
    launch = json.loads(files["launch.json"].read_text())
    assert [p["end_step"] for p in launch["phases"]][-1] == steps
    readme = files["README"].read_text()
    assert "phase 01" in readme
    # each layout's line names the batch flag its arguments hold, and no phase's TOML
    # points at a torchtitan.sh its folder does not have
    for i, layout in enumerate(launch["layouts"], 1):
        flag = ("--step-batch-size-schedule" if "--step-batch-size-schedule"
                in layout["megatron_args"] else "--global-batch-size")
        line = next(x for x in readme.splitlines() if x.startswith(f"megatron_layout_{i:02d}"))
        assert flag in line
    for i in range(1, len(plan.phases) + 1):
        if f"phase_{i:02d}/torchtitan.sh" not in files:
            assert "beside this file" not in files[f"phase_{i:02d}/torchtitan.toml"].read_text()
    # paratune's trainer takes the whole plan in one launch where it can hand each phase's
    # state over to the next (its own test trains one); ZeRO-1's it cannot reshard
    zero1 = [p["phase"] for p in launch["phases"]
             if p["config"]["sharding"] == "zero1" and p["config"]["dp"] > 1]
    assert zero1, "the plan has no ZeRO-1 phase"
    assert "run_plan.sh" not in files and not (tmp_path / "run_plan.sh").exists()
    assert any(note.startswith(f"paratune's trainer cannot run this plan (phase {zero1[0]}: "
                               "sharding='zero1'") for note in launch["notes"])
    unsharded, space = _plan(closed_form, shardings=("none",))
    files = write_plan_launch(unsharded, MODEL, space.hardware, tmp_path)
    script = files["run_plan.sh"].read_text()
    assert "-m paratune.profiler.train" in script and "--plan launch.json" in script
    assert "--nproc-per-node=8" in script and "--nnodes=8" in script  # 64 H100s
    # a later plan written over it: the files of phases it does not have are gone, and
    # their folders where nothing else is in them (a run's outputs there stay)
    assert len(unsharded.phases) >= 2
    (tmp_path / "phase_02" / "outputs").mkdir()
    one_phase = dataclasses.replace(unsharded, phases=unsharded.phases[:1])
    files = write_plan_launch(one_phase, MODEL, space.hardware, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("phase_*")) == ["phase_01", "phase_02"]
    assert [p.name for p in (tmp_path / "phase_02").iterdir()] == ["outputs"]
    assert sorted(p.name for p in tmp_path.glob("megatron_layout_*")) == ["megatron_layout_01"]
    assert "a 1-phase plan" in files["README"].read_text()


def _check_constant_lr(toml: dict, steps: int) -> None:
    """The phase's learning rate at its first, middle and last step, by torchtitan's own
    scheduler built from the TOML's [lr_scheduler] (its default warms up over 200 steps and
    decays to 0 by the last)."""
    import torch
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    lr = toml["optimizer"]["lr"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedulers = LRSchedulersContainer.Config(**toml["lr_scheduler"]).build(
        optimizers=[optimizer], training_steps=toml["training"]["steps"])
    seen = []
    for step in range(steps):
        if step in (0, steps // 2, steps - 1):
            seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedulers.step()
    assert seen == pytest.approx([lr] * len(seen), rel=1e-9)


def test_megatron_phases_count_samples_over_the_run_and_carry_the_lr(closed_form, tmp_path):
    plan, space = _plan(closed_form, lr_rule="linear", base_lr=1e-4, base_batch=64)
    files = write_plan_launch(plan, MODEL, space.hardware, tmp_path)
    end = 0
    for i, phase in enumerate(plan.phases, 1):
        args = json.loads(files[f"phase_{i:02d}/megatron_args.json"].read_text())
        assert shlex.split(files[f"phase_{i:02d}/megatron_args.txt"].read_text()) == args
        batch = phase["config"]["global_batch_size"]
        assert int(_value(args, "--global-batch-size")) == batch
        assert args.count("--global-batch-size") == 1
        assert float(_value(args, "--lr")) == pytest.approx(1e-4 * batch / 64, rel=1e-5)
        samples = int(_value(args, "--train-samples"))
        assert samples == end + phase["steps"] * batch
        end = samples
        assert ("--override-opt_param-scheduler" in args) == (i > 1)
        assert _value(args, "--load") == _value(args, "--save")


def test_step_schedule_spelling():
    assert megatron_step_schedule([(0, 768), (250e9, 1536), (500e9, 3072)],
                                  seq_len=1000) == "0:768 250B:1536 500B:3072"
    # thresholds fall on whole sequences; a repeated batch is dropped
    assert megatron_step_schedule([(0, 64), (10_000, 64), (20_500, 128)],
                                  seq_len=1000) == "0:64 20K:128"
    with pytest.raises(ConfigError, match="increase"):
        megatron_step_schedule([(0, 64), (0, 128)], seq_len=1000)


def _megatron_calculator():
    """Megatron-LM's step-schedule calculator, loaded from the installed megatron-core's own
    file (importing ``megatron.core`` pulls GPU-only packages)."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed")
    path = dist.locate_file("megatron/core/num_microbatches_calculator.py")
    if not path.exists():
        pytest.skip(f"megatron-core {dist.version} ships no num_microbatches_calculator.py")
    spec = importlib.util.spec_from_file_location("_megatron_num_microbatches", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "StepBatchsizeNumMicroBatchesCalculator"):
        pytest.skip(f"megatron-core {dist.version} has no --step-batch-size-schedule "
                    "(0.19.2 has it, and needs Python >= 3.12)")
    return module.StepBatchsizeNumMicroBatchesCalculator


def test_megatron_reads_the_layout_schedule_as_planned(closed_form):
    calculator = _megatron_calculator()
    plan, space = _plan(closed_form, batch_change_cost_s=0.0)
    launch = plan_launch(plan, MODEL, space.hardware)
    checked = 0
    for layout in launch["layouts"]:
        args = layout["megatron_args"]
        if "--step-batch-size-schedule" not in args:
            continue
        assert "--global-batch-size" not in args  # Megatron-LM refuses both
        cfg = layout["layout"]
        calc = calculator(micro_batch_size=cfg["micro_batch_size"],
                          data_parallel_size=cfg["dp"], decrease_batch_size_if_needed=False,
                          rank=0, schedule=_value(args, "--step-batch-size-schedule"),
                          seq_length=SEQ)
        for number in layout["phases"]:
            phase = launch["phases"][number - 1]
            calc.update(phase["start_samples"], consistency_check=True)
            assert calc.get_current_global_batch_size() == phase["global_batch_size"]
            checked += 1
    if not checked:
        pytest.skip("the plan changes no batch within a layout")


def test_megatron_parses_a_phase_with_its_own_parser(closed_form, monkeypatch):
    arguments = megatron_arguments()
    plan, space = _plan(closed_form)
    launch = plan_launch(plan, MODEL, space.hardware)
    extra = ["--mock-data", "--tokenizer-type", "NullTokenizer"]
    # validate_args asks CUDA for the device's generation: told the planned hardware's
    monkeypatch.setattr(arguments, "get_device_arch_version",
                        lambda: CUDA_MAJOR[space.hardware.name])
    monkeypatch.setenv("RANK", "0")

    def parse(argv, world_size, *, validate, env):
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv, *extra])
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        # the environment the plan names for the launch, and nothing else
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = arguments.parse_args()
            if validate:
                arguments.validate_args(args, {})
        return args

    for phase in launch["phases"]:
        config = phase["config"]
        world = config["dp"] * config["tp"] * config["pp"]
        assert "--num-layers" in phase["megatron_args"]  # a complete model shape
        args = parse(phase["megatron_args"], world, validate=True, env=phase["megatron_env"])
        assert args.lr_decay_style == "constant"
        assert args.global_batch_size == phase["global_batch_size"]
        assert args.train_samples == phase["end_samples"]
        assert args.lr == pytest.approx(phase["lr"], rel=1e-5)
        assert args.num_layers == MODEL.num_layers
    steps_checked = 0
    for layout in launch["layouts"]:
        config = layout["layout"]
        args = parse(layout["megatron_args"], config["dp"] * config["tp"] * config["pp"],
                     validate=True, env=layout["megatron_env"])
        assert args.num_layers == MODEL.num_layers
        if "--step-batch-size-schedule" in layout["megatron_args"]:
            steps_checked += 1
            assert args.step_batch_size_schedule == layout["step_batch_size_schedule"]
    assert steps_checked, "the plan changes no batch within a layout"
