"""Every export of a matrix of recommendations, loaded by the frameworks themselves.

torchtitan (the installed release: 0.3, or 0.2.x) parses each export with its own
``ConfigManager``, checks the degrees with its ``ParallelDims``, builds the model on the meta
device and splits it with its own ``pipeline_llm`` on a fake process group, rank by rank;
Megatron-LM parses each argument list with its own ``parse_args`` and ``validate_args`` and
builds its ``TransformerConfig``. Each must build the shape, degrees, batch and per-stage
layer split recommended. Both come from ``pip install -e '.[dev,frameworks]'`` plus
``tests/tuner/install_megatron_parser.sh`` (Megatron-LM's parser ships only in megatron-core
wheels for Python 3.12 and later); where one is missing its tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import warnings
from pathlib import Path

import pytest

from paratune import ParallelConfig, get_hardware, get_model
from paratune.profiler import pipeline
from paratune.tuner import (
    megatron_args,
    megatron_env,
    recommendation,
    torchtitan_args,
    torchtitan_config_module,
    torchtitan_toml,
    write_recommendation,
)
from tests.tuner._frameworks import CUDA_MAJOR, megatron_arguments

_FRAMEWORKS = "pip install -e '.[dev,frameworks]'"

# (model, config, hardware): the reproductions of the report (llama3-70b on 1024 and on 2
# H100s, llama3-8b over 13 GPUs), interleaved and uneven pipelines, each sharding and
# recompute mode, dp=1, DDP with tensor and pipeline parallelism, presets torchtitan 0.2.x has
# no flavor of, a shape no framework registers, Blackwell, a sequence split over two ranks
MATRIX = [
    ("llama3-70b", ParallelConfig(dp=32, tp=8, pp=4, micro_batch_size=1, global_batch_size=1024,
                                  sharding="zero1", recompute="full"), "H100"),
    ("llama3-70b", ParallelConfig(dp=16, tp=8, pp=8, micro_batch_size=1, global_batch_size=512,
                                  schedule="interleaved_1f1b", virtual_stages=2,
                                  sharding="zero3", recompute="selective"), "H100"),
    ("llama3-70b", ParallelConfig(dp=1, tp=2, micro_batch_size=1, global_batch_size=8),
     "H100"),
    ("llama3-8b", ParallelConfig(pp=13, micro_batch_size=1, global_batch_size=26), "H100"),
    ("llama3-8b", ParallelConfig(dp=4, tp=2, micro_batch_size=2, global_batch_size=64,
                                 sharding="zero2"), "H100"),
    ("llama3-8b", ParallelConfig(dp=8, micro_batch_size=1, global_batch_size=64), "A100-80GB"),
    ("llama3-8b", ParallelConfig(dp=2, tp=2, pp=2, micro_batch_size=1, global_batch_size=16,
                                 schedule="gpipe", recompute="full"), "H100"),
    ("llama3-8b", ParallelConfig(dp=2, tp=4, pp=3, micro_batch_size=1, global_batch_size=24,
                                 schedule="interleaved_1f1b", virtual_stages=3,
                                 sharding="zero3"), "B200"),
    ("llama3.2-1b", ParallelConfig(dp=4, pp=2, micro_batch_size=1, global_batch_size=64,
                                   schedule="interleaved_1f1b", virtual_stages=3,
                                   sharding="zero1", recompute="selective"), "H100"),
    ("llama3.2-3b", ParallelConfig(dp=8, micro_batch_size=2, global_batch_size=64,
                                   sharding="zero3", recompute="full"), "H200"),
    ("tiny", ParallelConfig(dp=2, tp=2, pp=3, micro_batch_size=1, global_batch_size=6),
     "H100"),
    ("llama3-405b", ParallelConfig(dp=16, tp=8, pp=8, micro_batch_size=1, global_batch_size=512,
                                   schedule="interleaved_1f1b", virtual_stages=2,
                                   sharding="zero3", recompute="full"), "H100"),
    ("llama3-8b", ParallelConfig(dp=2, tp=2, cp=2, micro_batch_size=1, global_batch_size=16,
                                 sharding="zero1", recompute="full"), "H100"),
]
IDS = [f"{name}-{config.key()}-{hw}" for name, config, hw in MATRIX]

# CUDA compute capability (major) of each device, as Megatron-LM's validate_args reads it


def _stage_counts(model, config) -> list[int]:
    """Transformer layers of each (virtual) stage as paratune's workload measured them."""
    return [len(r) for r in pipeline.layer_ranges(model.num_layers, config.num_stages)]


# ------------------------------------------------------------------------------ torchtitan


def _import_hf_datasets() -> None:
    """Import Hugging Face's ``datasets`` (torchtitan's data loaders do): the repository's
    ``datasets/`` folder (the sources of paratune.datasets) shadows it wherever the
    repository's root is on ``sys.path``, as pytest puts it."""
    root = Path(__file__).resolve().parents[2]
    shadow = sys.modules.get("datasets")
    if shadow is not None and Path(shadow.__file__ or "").resolve().parent == root / "datasets":
        del sys.modules["datasets"]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("datasets")
    finally:
        sys.path[:] = saved


def _torchtitan_version() -> tuple[int, int]:
    """The installed torchtitan's ``(major, minor)``, its config and llama3 imported, or a
    skip saying why not."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("torchtitan").split(".")[:2])
        _import_hf_datasets()
        importlib.import_module("torchtitan.config.manager")
        if (major, minor) >= (0, 3):  # its registered configs (these import triton)
            importlib.import_module("torchtitan.models.llama3.config_registry")
    except (ImportError, PackageNotFoundError) as exc:
        pytest.skip(f"torchtitan does not import ({exc}); {_FRAMEWORKS}")
    return major, minor


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int):
    """A fake process group of ``world_size`` in which this process is ``rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _split_rank_by_rank(build_parts, config) -> dict[int, int]:
    """{stage index: transformer layers} of every pipeline rank's part of the model.

    ``build_parts()`` runs torchtitan's ``pipeline_llm`` for the current fake rank and
    returns its model parts; torchtitan's looped schedules give pipeline rank ``r`` the
    stages ``r, r + pp, r + 2 pp, ...``.
    """
    layers: dict[int, int] = {}
    per_pp_rank = config.world_size // config.pp  # the pp axis is the outermost
    for pp_rank in range(config.pp):
        with _fake_rank(pp_rank * per_pp_rank, config.world_size):
            parts = build_parts()
        assert len(parts) == config.virtual_stages
        for i, part in enumerate(parts):
            layers[pp_rank + i * config.pp] = len(part.layers)
    return layers


def _check_titan_03(model, config, hardware, tmp_path, monkeypatch):
    import torch
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    module = torchtitan_config_module(model)
    if module is not None:  # written beside torchtitan.sh, found through PYTHONPATH
        (tmp_path / "torchtitan_config.py").write_text(module)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "torchtitan_config", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = ConfigManager().parse_args(torchtitan_args(model, config, hardware))
    par, training = job.parallelism, job.training
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == config.dp
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (config.tp, config.pp)
    assert par.enable_sequence_parallel  # with tp > 1: as noted
    dims = ParallelDims.from_config(par, config.world_size)
    assert (dims.tp, dims.pp, dims.cp) == (config.tp, config.pp, config.cp)
    assert dims.dp_replicate * dims.dp_shard == config.dp
    assert dims.fsdp_enabled == (par.data_parallel_shard_degree > 1)
    assert training.seq_len == model.seq_len
    assert training.global_batch_size == config.global_batch_size
    assert training.mixed_precision_param == "bfloat16"
    recompute = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}
    assert type(job.activation_checkpoint) is recompute[config.recompute.value]
    # torchtitan's batch: accumulation steps of local_batch_size, split by the pipeline
    accumulation = config.global_batch_size // (training.local_batch_size * config.dp)
    assert accumulation * training.local_batch_size * config.dp == config.global_batch_size
    per_step = (training.local_batch_size // par.pipeline_parallel_microbatch_size
                if config.pp > 1 else 1)
    assert accumulation * per_step == config.num_microbatches
    # the model: its shape, counted on the meta device
    with torch.device("meta"):
        whole = job.model_spec.model.build()
    assert len(whole.layers) == model.num_layers
    assert sum(p.numel() for p in whole.parameters()) == model.num_params
    if config.pp == 1:
        return
    assert training.disable_cuda_graphs  # torchtitan refuses pipelines with CUDA graphs

    def build_parts():
        dims = ParallelDims.from_config(par, config.world_size)
        dims.build_mesh()
        _, parts, _, _ = pipeline_llm(
            whole, parallel_dims=dims, training=training, parallelism=par,
            compile_config=job.compile, ac_config=job.activation_checkpoint,
            dump_folder=str(tmp_path), device=torch.device("cpu"),
            model_config=job.model_spec.model, parallelize_fn=lambda m, **_: m,
            loss_fn=lambda *a, **k: None)
        return parts

    layers = _split_rank_by_rank(build_parts, config)
    assert [layers[s] for s in range(config.num_stages)] == _stage_counts(model, config)


def _check_titan_02(model, config, hardware, tmp_path, monkeypatch):
    import torch
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.protocols.train_spec import get_train_spec

    path = tmp_path / "torchtitan.toml"
    path.write_text(torchtitan_toml(model, config, hardware))
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    par, training = job.parallelism, job.training
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == config.dp
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (config.tp, config.pp)
    assert job.activation_checkpoint.mode == config.recompute.value
    assert (training.seq_len, training.global_batch_size) == (model.seq_len,
                                                              config.global_batch_size)
    dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                        dp_shard=par.data_parallel_shard_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                        pp=par.pipeline_parallel_degree, ep=1, etp=1,
                        world_size=config.world_size)
    assert dims.dp_replicate * dims.dp_shard == config.dp
    spec = get_train_spec(job.model.name)
    if job.model.flavor not in spec.model_args:
        # no flavor of this shape: the TOML says which one to register
        assert "has no llama3 flavor of this shape" in path.read_text()
        return
    model_args = spec.model_args[job.model.flavor]
    model_args.update_from_config(job)
    with torch.device("meta"):
        whole = spec.model_cls(model_args)
    assert len(whole.layers) == model.num_layers
    assert sum(p.numel() for p in whole.parameters()) == model.num_params
    if config.pp == 1:
        return

    def build_parts():
        dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                            dp_shard=par.data_parallel_shard_degree,
                            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                            pp=par.pipeline_parallel_degree, ep=1, etp=1,
                            world_size=config.world_size)
        dims.build_mesh()
        _, parts, _, _ = pipeline_llm(whole, dims, job, torch.device("cpu"), model_args,
                                      lambda m, *a, **k: m, lambda *a, **k: None)
        return parts

    layers = _split_rank_by_rank(build_parts, config)
    assert [layers[s] for s in range(config.num_stages)] == _stage_counts(model, config)


@pytest.mark.slow
@pytest.mark.parametrize("name,config,hardware", MATRIX, ids=IDS)
def test_torchtitan_loads_and_splits_every_export(name, config, hardware, tmp_path,
                                                   monkeypatch):
    version = _torchtitan_version()
    model, hw = get_model(name), get_hardware(hardware)
    check = _check_titan_03 if version >= (0, 3) else _check_titan_02
    check(model, config, hw, tmp_path, monkeypatch)


def test_torchtitan_sh_takes_the_users_overrides(tmp_path):
    """``torchtitan.sh --training.steps 10 ...`` reaches torchtitan 0.3's parser as options
    of the job: the script puts its own arguments before the activation-checkpointing
    subcommand, after which the parser takes every option as the subcommand's and refuses
    them. The script's command line, overrides substituted for ``"$@"``, parses with them."""
    import shlex

    if _torchtitan_version() < (0, 3):
        pytest.skip("torchtitan 0.2.x is launched by its TOML")
    from torchtitan.config.manager import ConfigManager

    model, hw = get_model("llama3-8b"), get_hardware("H100")
    config = ParallelConfig(dp=4, tp=2, micro_batch_size=1, global_batch_size=32,
                            recompute="full")
    paths = write_recommendation(recommendation(model, config, hw), tmp_path)
    line = paths["torchtitan_sh"].read_text().splitlines()[-1]
    words = shlex.split(line.replace('"$@"', "--training.steps 10 --hf_assets_path /tmp/hf"))
    args = words[words.index("torchtitan.train") + 1:]
    assert args[-1] == "activation-checkpoint:full"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = ConfigManager().parse_args(args)
    assert job.training.steps == 10 and job.hf_assets_path == "/tmp/hf"
    assert job.parallelism.tensor_parallel_degree == 2


# ----------------------------------------------------------------------------- Megatron-LM


def _megatron_parse(arguments, model, config, hw, monkeypatch, *, env=None):
    """Megatron-LM's parsed and validated arguments of the export, launched with ``env``
    (default: :func:`megatron_env`) on ``hw``."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for key, value in (megatron_env(config, hw) if env is None else env).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", str(config.world_size))
    monkeypatch.setenv("RANK", "0")
    # validate_args asks CUDA for the device's generation; this machine has none, so it is
    # told the one of the hardware recommended for
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: CUDA_MAJOR[hw.name])
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *megatron_args(model, config, hw)])
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = arguments.parse_args()
        arguments.validate_args(args, {})
    return args


@pytest.mark.slow
@pytest.mark.parametrize("name,config,hardware", MATRIX, ids=IDS)
def test_megatron_parses_and_validates_every_export(name, config, hardware, monkeypatch):
    arguments = megatron_arguments()
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.training.argument_utils import core_transformer_config_from_args

    model, hw = get_model(name), get_hardware(hardware)
    args = _megatron_parse(arguments, model, config, hw, monkeypatch)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        model.num_layers, model.hidden_size, model.num_heads)
    assert args.num_query_groups == model.num_kv_heads
    assert args.ffn_hidden_size == model.ffn_hidden_size and args.swiglu
    assert args.normalization == "RMSNorm" and args.layernorm_epsilon == model.norm_eps
    assert args.position_embedding_type == "rope" and args.rotary_base == model.rope_theta
    assert args.untie_embeddings_and_output_weights == (not model.tie_embeddings)
    assert not args.add_bias_linear and args.bf16
    assert args.seq_length == model.seq_len
    multiple = args.make_vocab_size_divisible_by * config.tp
    assert -(-model.vocab_size // multiple) * multiple == model.vocab_size  # no padding
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.data_parallel_size) == (config.tp, config.pp,
                                                                     config.cp, config.dp)
    assert args.sequence_parallel == config.tp_enabled
    assert args.global_batch_size // (args.micro_batch_size * args.data_parallel_size) == \
        config.num_microbatches
    expected_vp = config.virtual_stages if config.virtual_stages > 1 else None
    assert args.virtual_pipeline_model_parallel_size == expected_vp
    assert args.use_distributed_optimizer == (config.dp_enabled
                                              and config.sharding.value != "none")
    assert args.use_megatron_fsdp == (config.dp_enabled
                                      and config.sharding.value in ("zero2", "zero3"))
    assert args.recompute_granularity == (None if config.recompute.value == "none"
                                          else config.recompute.value)
    # the model's TransformerConfig and each (virtual) stage's layers
    args.apply_rope_fusion = False  # a fused kernel of Transformer Engine, not installed here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = core_transformer_config_from_args(args)
    assert (transformer.num_layers, transformer.hidden_size, transformer.ffn_hidden_size,
            transformer.num_query_groups) == (model.num_layers, model.hidden_size,
                                              model.ffn_hidden_size, model.num_kv_heads)
    assert transformer.gated_linear_unit
    if config.pp == 1:
        return
    layout = transformer.pipeline_model_parallel_layout
    layers = {}
    for pp_rank in range(config.pp):
        for vp in range(config.virtual_stages):
            if layout is not None:  # [pp rank][virtual stage]: the layer types it builds
                count = sum(t.name == "decoder" for t in layout.layout[pp_rank][vp])
            else:
                count = get_num_layers_to_build(
                    transformer, vp_stage=vp if expected_vp else None, pp_rank=pp_rank)
            layers[vp * config.pp + pp_rank] = count
    assert [layers[s] for s in range(config.num_stages)] == _stage_counts(model, config)


@pytest.mark.slow
def test_megatron_refuses_tensor_parallelism_without_its_environment(monkeypatch):
    arguments = megatron_arguments()
    model, hw = get_model("llama3-8b"), get_hardware("H100")
    config = ParallelConfig(dp=4, tp=2, micro_batch_size=1, global_batch_size=32)
    assert megatron_env(config, hw) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        _megatron_parse(arguments, model, config, hw, monkeypatch, env={})
    # Blackwell has no such rule, and Megatron-FSDP the opposite one
    assert megatron_env(config, get_hardware("B200")) == {}
    assert megatron_env(config.replace(sharding="zero3"), hw) == {}


# ------------------------------------------------------------------------- the winner's files


def test_a_winner_predicted_not_to_run_gets_no_launch_files(tmp_path):
    model, hw = get_model("llama3-70b"), get_hardware("H100")
    config = ParallelConfig(dp=1, tp=2, micro_batch_size=1, global_batch_size=8)
    predicted = {"feasible": False, "peak_mem_gb": 2127.4, "feasible_prob": 0.0005}
    good = recommendation(model, config, hw, predicted={"feasible": True})
    assert good["launch"]["infeasible"] is None
    assert {"torchtitan", "torchtitan_sh", "megatron", "megatron_sh"} <= set(
        write_recommendation(good, tmp_path))
    rec = recommendation(model, config, hw, predicted=predicted)
    assert "2,127 GB per GPU" in rec["launch"]["infeasible"]
    assert "p(run) 0.0005" in rec["launch"]["infeasible"]
    paths = write_recommendation(rec, tmp_path)  # the earlier winner's launch files go
    assert set(paths) == {"json", "yaml"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recommendation.json",
                                                          "recommendation.yaml"]
    # asked for: every launch file, each opening with why it is predicted not to run
    paths = write_recommendation(rec, tmp_path, allow_infeasible=True)
    launch_files = set(paths) - {"json", "yaml"}
    assert {"torchtitan", "torchtitan_sh", "megatron", "megatron_sh"} <= launch_files
    for kind in launch_files:
        head = paths[kind].read_text().splitlines()[:4]
        assert any(line.startswith("# PREDICTED NOT TO RUN") and "2,127 GB" in line
                   for line in head), kind


def test_launch_files_hold_the_exports(tmp_path):
    model, hw = get_model("llama3.2-1b"), get_hardware("H100")
    config = ParallelConfig(dp=4, tp=2, micro_batch_size=1, global_batch_size=32)
    rec = recommendation(model, config, hw)
    paths = write_recommendation(rec, tmp_path)
    # torchtitan 0.3: a config module (no registered job has this shape) on PYTHONPATH
    assert paths["torchtitan_config"].read_text() == torchtitan_config_module(model)
    script = paths["torchtitan_sh"].read_text()
    assert 'PYTHONPATH="$(dirname "$0")' in script
    assert "--module torchtitan_config --config paratune_job" in script
    # Megatron-LM: the environment, then the arguments, each one a list entry in the JSON
    script = paths["megatron_sh"].read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun" in script and "pretrain_gpt.py" in script
    import json

    saved = json.loads(paths["json"].read_text())["launch"]
    assert saved["megatron_args"] == megatron_args(model, config, hw)
    assert all(" " not in arg for arg in saved["megatron_args"])
    assert saved["megatron_env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    # a preset torchtitan registers needs no module, and one left from before is removed
    big = recommendation(get_model("llama3-8b"), config, hw)
    paths = write_recommendation(big, tmp_path)
    assert "torchtitan_config" not in paths and not (tmp_path / "torchtitan_config.py").exists()
    assert "--module llama3 --config llama3_8b" in paths["torchtitan_sh"].read_text()
