from __future__ import annotations

import json
import re
import shlex
import tomllib

import pytest
import yaml

from paratune import ConfigError, ParallelConfig, get_hardware, get_model
from paratune.space import ConfigSpace
from paratune.tuner import megatron_args, recommendation, torchrun_command, torchtitan_toml
from paratune.tuner._export import write_recommendation

MODEL = get_model("llama3-8b")
H100 = get_hardware("H100")


def test_torchtitan_sections_carry_the_degrees():
    cfg = ParallelConfig(dp=4, tp=2, pp=4, micro_batch_size=2, global_batch_size=64,
                         schedule="interleaved_1f1b", virtual_stages=2, sharding="zero3",
                         recompute="selective")
    doc = tomllib.loads(torchtitan_toml(MODEL, cfg))
    par = doc["parallelism"]
    assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] == 4
    assert par["tensor_parallel_degree"] == 2 and par["pipeline_parallel_degree"] == 4
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["fsdp_reshard_after_forward"] == "always"
    assert par["pipeline_parallel_layers_per_stage"] == 32 // 8
    assert doc["training"] == {"local_batch_size": 16, "global_batch_size": 64,
                               "seq_len": MODEL.seq_len, "mixed_precision_param": "bfloat16"}
    assert doc["activation_checkpoint"]["mode"] == "selective"
    ddp = tomllib.loads(torchtitan_toml(MODEL, cfg.replace(sharding="none", pp=1, tp=1, dp=32,
                                                          schedule="1f1b", virtual_stages=1)))
    assert ddp["parallelism"]["data_parallel_replicate_degree"] == 32
    assert ddp["parallelism"]["data_parallel_shard_degree"] == 1


def _comments(text: str) -> str:
    """The comment lines of a TOML text, joined into one string."""
    return " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))


@pytest.mark.parametrize("config", [
    ParallelConfig(dp=16, tp=2, global_batch_size=64),
    ParallelConfig(dp=4, pp=4, global_batch_size=64),
    ParallelConfig(dp=2, tp=4, pp=4, global_batch_size=32, schedule="interleaved_1f1b",
                   virtual_stages=2),
], ids=lambda c: c.key())
def test_torchtitan_never_combines_ddp_with_tensor_or_pipeline_parallelism(config):
    # torchtitan's llama3 parallelize raises "DDP has not supported > 1D parallelism" when
    # data_parallel_replicate_degree runs alongside tp or pp: FSDP2 without resharding instead
    text = torchtitan_toml(MODEL, config)
    par = tomllib.loads(text)["parallelism"]
    assert par["data_parallel_replicate_degree"] == 1
    assert par["data_parallel_shard_degree"] == config.dp
    assert par["fsdp_reshard_after_forward"] == "never"
    assert "DDP (data_parallel_replicate_degree) cannot be combined" in _comments(text)


def test_torchtitan_plain_ddp_stays_replicated():
    for config in (ParallelConfig(dp=32, global_batch_size=128),
                   ParallelConfig(dp=1, tp=8, global_batch_size=8)):
        text = torchtitan_toml(MODEL, config)
        par = tomllib.loads(text)["parallelism"]
        assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (
            config.dp, 1)
        assert "fsdp_reshard_after_forward" not in par
        assert "cannot be combined" not in _comments(text)


def test_torchtitan_toml_names_the_versions_it_is_for():
    from paratune.tuner import _export

    text = torchtitan_toml(MODEL, ParallelConfig(dp=8, global_batch_size=8))
    first = text.splitlines()[0]
    assert first.startswith("# torchtitan job config") and "v0.2.2" in first
    comments = _comments(text)
    assert "v0.2.x up to v0.2.2" in comments and "--parallelism." in comments
    assert "reads no TOML" in comments
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "v0.2.2" in _export.__doc__ and "--parallelism." in _export.__doc__
    assert tomllib.loads(text)["parallelism"]["data_parallel_replicate_degree"] == 8


def test_torchtitan_selective_recompute_is_noted_as_different():
    cfg = ParallelConfig(dp=8, global_batch_size=8, recompute="selective")
    text = torchtitan_toml(MODEL, cfg)
    ac = tomllib.loads(text)["activation_checkpoint"]
    assert ac == {"mode": "selective", "selective_ac_option": "op"}
    comments = _comments(text)
    assert "no attention-only option" in comments and "will differ" in comments
    for other in ("none", "full"):
        assert "attention-only" not in torchtitan_toml(MODEL, cfg.replace(recompute=other))


def test_one_data_parallel_rank_gets_no_sharding_flags():
    for sharding in ("zero1", "zero2", "zero3"):
        cfg = ParallelConfig(dp=1, tp=8, global_batch_size=8, sharding=sharding)
        args = " ".join(megatron_args(MODEL, cfg))
        assert "--use-megatron-fsdp" not in args and "--use-distributed-optimizer" not in args
        assert "--data-parallel-sharding-strategy" not in args and "--ckpt-format" not in args
        text = torchtitan_toml(MODEL, cfg)
        assert "fsdp_reshard_after_forward" not in tomllib.loads(text)["parallelism"]
        assert "ZeRO-1" not in text


def _torchtitan_batches(doc: dict, config: ParallelConfig) -> tuple[int, int, int]:
    """(sequences per forward, micro-batches per pipeline step, accumulation steps) as
    torchtitan's trainer and pipeline builder derive them from the TOML."""
    training, par = doc["training"], doc["parallelism"]
    local = training["local_batch_size"]
    assert training["global_batch_size"] % (local * config.dp) == 0
    accumulation = training["global_batch_size"] // (local * config.dp)
    if par["pipeline_parallel_degree"] == 1:
        return local, 1, accumulation
    microbatch = par.get("pipeline_parallel_microbatch_size", 1)
    assert local % microbatch == 0
    return microbatch, local // microbatch, accumulation


@pytest.mark.parametrize("config", [
    ParallelConfig(dp=32, micro_batch_size=1, global_batch_size=128),
    ParallelConfig(dp=8, tp=4, micro_batch_size=2, global_batch_size=256, sharding="zero3"),
    ParallelConfig(dp=4, tp=2, pp=4, micro_batch_size=2, global_batch_size=64),
    ParallelConfig(dp=2, tp=4, pp=4, micro_batch_size=1, global_batch_size=32,
                   schedule="interleaved_1f1b", virtual_stages=2),
], ids=lambda c: c.key())
def test_torchtitan_runs_the_micro_batch_and_accumulation_of_the_config(config):
    doc = tomllib.loads(torchtitan_toml(MODEL, config))
    forward, microbatches, accumulation = _torchtitan_batches(doc, config)
    assert forward == config.micro_batch_size
    assert microbatches * accumulation == config.num_microbatches
    if config.pp == 1:  # dp32 gb128 mb1: micro-batch 1, 4 accumulation steps
        assert doc["training"]["local_batch_size"] == config.micro_batch_size
        assert accumulation == config.num_microbatches
    else:  # the schedule runs every micro-batch of the step, no accumulation on top
        assert doc["training"]["local_batch_size"] == config.global_batch_size // config.dp
        assert accumulation == 1


def _torchtitan_layers_per_stage(num_layers: int, num_stages: int, first_less: int,
                                 last_less: int) -> list[int]:
    """Transformer layers per stage of torchtitan's own split (the embedding and the output
    weighing ``first_less`` and ``last_less`` layers)."""
    effective = num_layers + first_less + last_less
    base, extra = divmod(effective, num_stages)
    counts = [base + (stage < extra) for stage in range(num_stages)]
    counts[0] -= first_less
    counts[-1] -= last_less
    return counts


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1),
                                              ("interleaved_1f1b", 2)])
def test_torchtitan_splits_an_even_pipeline_as_measured(schedule, virtual):
    config = ParallelConfig(dp=2, tp=4, pp=4, micro_batch_size=1, global_batch_size=32,
                            schedule=schedule, virtual_stages=virtual)
    par = tomllib.loads(torchtitan_toml(MODEL, config))["parallelism"]
    first = par.get("pipeline_parallel_first_stage_less_layers", 1)
    last = par.get("pipeline_parallel_last_stage_less_layers", 1)
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    num_stages = config.num_stages
    if per_stage is not None:  # torchtitan derives the stage count from it
        num_stages = -(-(MODEL.num_layers + first + last) // per_stage)
    assert num_stages == config.num_stages
    assert _torchtitan_layers_per_stage(MODEL.num_layers, num_stages, first, last) == \
        [MODEL.num_layers // config.num_stages] * config.num_stages


def test_megatron_arguments():
    cfg = ParallelConfig(dp=8, tp=4, pp=2, micro_batch_size=1, global_batch_size=256,
                         sharding="zero1", recompute="full")
    args = " ".join(megatron_args(MODEL, cfg))
    for expected in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 2",
                     "--micro-batch-size 1", "--global-batch-size 256",
                     "--use-distributed-optimizer", "--recompute-granularity full",
                     f"--seq-length {MODEL.seq_len}"):
        assert expected in args
    assert "virtual" not in args


# what Megatron-LM's validate_args and TransformerConfig check of the options exported
# (megatron/training/arguments.py, megatron/core/transformer/transformer_config.py, 2025)
_MEGATRON_RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                               "shared_experts"}


def _megatron_options(args: list[str]) -> dict[str, list[str]]:
    """A list of arguments (``--flag``, then its values) as {flag: values}."""
    options: dict[str, list[str]] = {}
    flag = None
    for arg in args:
        assert " " not in arg or not arg.startswith("--"), f"{arg!r} is not one argument"
        if arg.startswith("--"):
            assert arg not in options, arg
            flag = arg
            options[flag] = []
        else:
            assert flag is not None, arg
            options[flag].append(arg)
    return options


def _megatron_validate(args: list[str]) -> None:
    """Raise AssertionError where Megatron-LM would refuse ``args`` at launch."""
    opts = _megatron_options(args)
    ckpt_format = opts.get("--ckpt-format", ["torch_dist"])[0]
    if "--use-megatron-fsdp" in opts:
        assert ckpt_format == "fsdp_dtensor", "Megatron FSDP only supports fsdp_dtensor"
        assert opts["--data-parallel-sharding-strategy"][0] in (
            "no_shard", "optim", "optim_grads", "optim_grads_params")
    if ckpt_format == "fsdp_dtensor":
        assert "--use-megatron-fsdp" in opts
    if opts.get("--recompute-granularity") == ["selective"]:
        assert "--recompute-method" not in opts
        assert set(opts.get("--recompute-modules", ["core_attn"])) <= _MEGATRON_RECOMPUTE_MODULES


@pytest.mark.parametrize("sharding,strategy", [("zero2", "optim_grads"),
                                               ("zero3", "optim_grads_params")])
def test_megatron_fsdp_gets_its_required_flags(sharding, strategy):
    cfg = ParallelConfig(dp=8, tp=2, global_batch_size=64, sharding=sharding)
    args = megatron_args(MODEL, cfg)
    _megatron_validate(args)
    opts = _megatron_options(args)
    assert opts["--data-parallel-sharding-strategy"] == [strategy]
    for flag in ("--use-megatron-fsdp", "--no-gradient-accumulation-fusion",
                 "--use-distributed-optimizer"):
        assert opts[flag] == []
    assert opts["--ckpt-format"] == ["fsdp_dtensor"]
    notes = recommendation(MODEL, cfg, H100)["launch"]["notes"]
    assert any("CUDA_DEVICE_MAX_CONNECTIONS" in n for n in notes)
    assert not any("not pipeline parallelism" in n for n in notes)
    # pipelining: kept, with a note naming the fallback
    piped = cfg.replace(tp=1, pp=2)
    notes = recommendation(MODEL, piped, H100)["launch"]["notes"]
    assert any("not pipeline parallelism" in n and "--use-distributed-optimizer" in n
               for n in notes)


@pytest.mark.parametrize("config", [
    ParallelConfig(dp=8, tp=4, pp=2, global_batch_size=256, sharding=s, recompute=r)
    for s in ("none", "zero1", "zero2", "zero3") for r in ("none", "selective", "full")
], ids=lambda c: c.key())
def test_megatron_arguments_pass_its_launch_checks(config):
    _megatron_validate(megatron_args(MODEL, config))


def test_megatron_selective_recompute_names_the_closest_modules():
    cfg = ParallelConfig(dp=8, global_batch_size=8, recompute="selective")
    opts = _megatron_options(megatron_args(MODEL, cfg))
    assert opts["--recompute-granularity"] == ["selective"]
    assert opts["--recompute-modules"] == ["core_attn", "layernorm"]
    notes = recommendation(MODEL, cfg, H100)["launch"]["notes"]
    assert any("--recompute-modules core_attn layernorm" in n
               and "QKV and output projections" in n for n in notes)
    full = recommendation(MODEL, cfg.replace(recompute="full"), H100)["launch"]["notes"]
    assert not any("recompute-modules" in n for n in full)


def test_torchrun_nodes_and_recommendation_files(tmp_path):
    cfg = ParallelConfig(dp=8, tp=4, pp=2, micro_batch_size=1, global_batch_size=256)
    cmd = torchrun_command(MODEL, cfg, H100)
    assert "--nnodes=8" in cmd and "--nproc-per-node=8" in cmd and "MASTER_ADDR" in cmd
    single = torchrun_command(MODEL, cfg.replace(dp=1, global_batch_size=32), H100)
    assert "--standalone" in single and "--nnodes=1" in single
    rec = recommendation(MODEL, cfg, H100, predicted={"tokens_per_s": 1.0})
    paths = write_recommendation(rec, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["config"] == cfg.to_dict()
    assert yaml.safe_load(paths["yaml"].read_text())["config_key"] == cfg.key()
    assert "--tensor-model-parallel-size 4" in paths["megatron"].read_text()
    assert tomllib.loads(paths["torchtitan"].read_text())["parallelism"]


def test_torchrun_launches_exactly_the_world_size(tmp_path):
    for world, per_node, shape in ((12, 8, (2, 6)), (64, 8, (8, 8)), (4, 8, (1, 4)),
                                   (24, 8, (3, 8)), (10, 4, (3, None))):
        cfg = ParallelConfig(dp=world, global_batch_size=4 * world)
        if shape[1] is None:  # 10 ranks cannot fill 3 nodes evenly
            with pytest.raises(ConfigError, match="devices_per_node"):
                torchrun_command(MODEL, cfg, H100, devices_per_node=per_node)
            rec = recommendation(MODEL, cfg, H100, devices_per_node=per_node)
            assert rec["launch"]["torchrun"] is None
            assert any("torchrun" in note for note in rec["launch"]["notes"])
            paths = write_recommendation(rec, tmp_path / "uneven")
            assert "torchrun" not in paths and not (tmp_path / "uneven" / "torchrun.sh").exists()
            continue
        cmd = torchrun_command(MODEL, cfg, H100, devices_per_node=per_node)
        nodes = int(re.search(r"--nnodes=(\d+)", cmd).group(1))
        nproc = int(re.search(r"--nproc-per-node=(\d+)", cmd).group(1))
        assert (nodes, nproc) == shape and nodes * nproc == world
        assert f"--model {MODEL.name} " in cmd


def test_a_launch_that_splits_tensor_parallel_groups_over_nodes_is_noted():
    # 12 ranks on 8-GPU nodes launch as 2 nodes of 6: groups of tp=4 straddle the nodes
    split = ParallelConfig(dp=3, tp=4, global_batch_size=12)
    notes = recommendation(MODEL, split, H100, devices_per_node=8)["launch"]["notes"]
    assert any("tensor-parallel groups of 4 span two nodes" in note for note in notes)
    # tp=2 groups fit in 6 ranks per node; full nodes never split them
    for cfg in (ParallelConfig(dp=6, tp=2, global_batch_size=12),
                ParallelConfig(dp=4, tp=4, global_batch_size=16)):
        notes = recommendation(MODEL, cfg, H100, devices_per_node=8)["launch"]["notes"]
        assert not any("span two nodes" in note for note in notes)


def test_uneven_pipeline_split_is_spelled_out_as_measured():
    from paratune.profiler import pipeline
    cfg = ParallelConfig(dp=1, pp=3, global_batch_size=12, schedule="interleaved_1f1b",
                         virtual_stages=2)
    cfg.validate(MODEL, 3)
    measured = [len(r) for r in pipeline.layer_ranges(MODEL.num_layers, cfg.num_stages)]
    assert sum(measured) == MODEL.num_layers == 32 and len(set(measured)) > 1
    # torchtitan: every stage's modules, each layer exactly once, in order
    par = tomllib.loads(torchtitan_toml(MODEL, cfg))["parallelism"]
    assert "pipeline_parallel_layers_per_stage" not in par
    stages = par["module_fqns_per_model_part"]
    assert [len([m for m in s if m.startswith("layers.")]) for s in stages] == measured
    layers = [m for s in stages for m in s if m.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(MODEL.num_layers)]
    assert stages[0][0] == "tok_embeddings" and stages[-1][-2:] == ["norm", "output"]
    # Megatron-LM: a layout naming each (virtual) stage, instead of a per-stage count
    args = megatron_args(MODEL, cfg)
    assert not any("virtual-pipeline-stage" in a for a in args)
    (layout,) = _megatron_options(args)["--pipeline-model-parallel-layout"]
    parts = layout.split("|")
    assert [int(p.split("t*")[1].split(",")[0]) for p in parts] == measured
    assert parts[0].startswith("E,") and parts[-1].endswith(",L")
    rec = recommendation(MODEL, cfg, H100)
    assert any("do not divide evenly" in note for note in rec["launch"]["notes"])
    # a plain 1F1B pipeline with an uneven split is spelled out too
    plain = cfg.replace(schedule="1f1b", virtual_stages=1)
    assert "module_fqns_per_model_part" in tomllib.loads(torchtitan_toml(MODEL, plain))[
        "parallelism"]
    assert any(a.startswith("--pipeline-model-parallel-layout") for a in megatron_args(
        MODEL, plain))


def test_no_torchrun_command_for_a_layout_the_trainer_cannot_run(tmp_path):
    runnable = recommendation(MODEL, ParallelConfig(dp=8, global_batch_size=8), H100)
    assert "torchrun" in write_recommendation(runnable, tmp_path)
    cfg = ParallelConfig(dp=2, tp=4, global_batch_size=8, sharding="zero1")
    rec = recommendation(MODEL, cfg, H100, devices_per_node=8)
    # written over the earlier winner: no torchrun.sh of that one is left behind
    assert "torchrun" not in write_recommendation(rec, tmp_path)
    assert not (tmp_path / "torchrun.sh").exists()
    assert rec["launch"]["torchrun"] is None
    assert any("no torchrun command: sharding='zero1'" in n for n in rec["launch"]["notes"])
    assert "--use-distributed-optimizer" in rec["launch"]["megatron_args"]


def _launched_model(command: str):
    """The model paratune's trainer builds from an exported torchrun command: its options
    read back by the trainer's own command line and model resolution."""
    from paratune.profiler import train

    argv = shlex.split(command)
    start = argv.index("-m")
    assert argv[start + 1] == "paratune.profiler.train"
    args = train.parse_args(argv[start + 2:])
    return train.resolve_model(args.model, args.seq_len), args


def test_torchrun_launches_a_preset_at_the_sequence_length_tuned():
    model = get_model("llama3-8b", seq_len=2048)
    cfg = ParallelConfig(dp=4, tp=2, global_batch_size=64)
    rec = recommendation(model, cfg, H100)
    launched, args = _launched_model(rec["launch"]["torchrun"])
    assert launched == model and launched.seq_len == 2048
    assert ParallelConfig.from_dict(json.loads(args.config)) == cfg
    # the same sequence length as the other exports
    assert _megatron_options(rec["launch"]["megatron_args"])["--seq-length"] == ["2048"]
    assert tomllib.loads(rec["launch"]["torchtitan_toml"])["training"]["seq_len"] == 2048
    # a preset at its own length
    assert _launched_model(torchrun_command(MODEL, cfg, H100))[0] == MODEL


def _write_hf_config(directory) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))


def test_torchrun_launches_a_config_json_model_as_tuned(closed_form, tmp_path, monkeypatch):
    from paratune.tuner import tune

    monkeypatch.chdir(tmp_path)
    _write_hf_config(tmp_path / "my-llama")
    for given in ("my-llama/config.json", "my-llama", str(tmp_path / "my-llama")):
        model = get_model(given, seq_len=4096)  # `paratune tune --model X --seq-len 4096`
        assert model.name == "my-llama" and model.seq_len == 4096
        command = recommendation(model, ParallelConfig(dp=8, global_batch_size=64),
                                 H100)["launch"]["torchrun"]
        launched, args = _launched_model(command)
        assert launched == model and args.seq_len == 4096
        assert args.model == str(tmp_path / "my-llama" / "config.json")
    # the command a tuning run writes, run from another directory
    out = tmp_path / "out"
    tune(model, 8, "H100", closed_form, search="exhaustive", track=False, output_dir=out,
         space=ConfigSpace(recomputes=("none",), micro_batch_sizes=(1,)))
    command = (out / "torchrun.sh").read_text().splitlines()[1]
    monkeypatch.chdir(out)
    assert _launched_model(command)[0] == model


def test_no_torchrun_command_for_a_model_the_trainer_cannot_build(tmp_path):
    from paratune import ModelSpec

    cfg = ParallelConfig(dp=8, global_batch_size=64)
    custom = ModelSpec(name="mine", num_layers=4, hidden_size=256, num_heads=8,
                       ffn_hidden_size=688, vocab_size=256, seq_len=512)
    for model, rule in ((custom, "model='mine': is neither a preset nor read from a "
                                 "config.json"),
                        (MODEL.replace(num_layers=16), "model='llama3-8b': differs in shape "
                                                       "from what --model llama3-8b builds")):
        with pytest.raises(ConfigError, match=re.escape(rule)):
            torchrun_command(model, cfg, H100)
        rec = recommendation(model, cfg, H100)
        assert rec["launch"]["torchrun"] is None
        assert any(note.startswith(f"no torchrun command: {rule}")
                   for note in rec["launch"]["notes"])
    # a config.json that is gone since the model was read from it
    _write_hf_config(tmp_path / "gone")
    model = get_model(tmp_path / "gone", seq_len=1024)
    (tmp_path / "gone" / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"model=.*gone/config\.json': is neither a preset"):
        torchrun_command(model, cfg, H100)


def test_tune_exits_non_zero_for_a_winner_predicted_not_to_run(saved_model, tmp_path,
                                                               monkeypatch, capsys):
    from paratune.cli import main

    monkeypatch.chdir(tmp_path)
    command = ["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
               "--predictor", str(saved_model), "--no-track", "--no-progress", "--trials", "6",
               "--memory-limit-gb", "0.001"]  # nothing fits in 1 MB
    launch_files = ("torchrun.sh", "torchtitan.sh", "torchtitan.toml", "megatron.sh",
                    "megatron_args.txt")
    assert main([*command, "--output", "out"]) == 1
    captured = capsys.readouterr()
    assert "PREDICTED NOT TO RUN" in captured.out
    assert "error: the winner is predicted not to run" in captured.err
    assert "--export-infeasible" in captured.err
    rec = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert rec["predicted"]["feasible"] is False and rec["launch"]["infeasible"]
    assert not any((tmp_path / "out" / name).exists() for name in launch_files)
    # asked for: written, each saying it is predicted not to run
    assert main([*command, "--output", "forced", "--export-infeasible"]) == 0
    for name in ("torchtitan.toml", "megatron_args.txt"):
        assert (tmp_path / "forced" / name).read_text().startswith("# PREDICTED NOT TO RUN")
