from __future__ import annotations

import json
import tomllib

import yaml

from paratune import ParallelConfig, get_hardware, get_model
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
                               "seq_len": MODEL.seq_len}
    assert doc["activation_checkpoint"]["mode"] == "selective"
    ddp = tomllib.loads(torchtitan_toml(MODEL, cfg.replace(sharding="none", pp=1, dp=16,
                                                          schedule="1f1b", virtual_stages=1)))
    assert ddp["parallelism"]["data_parallel_replicate_degree"] == 16


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
