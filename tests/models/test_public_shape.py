"""Public rows that state their model's shape (the optional shape columns, the GPT-style
default) are predicted, and the shape they state is the one the model is predicted for."""

from __future__ import annotations

import pandas as pd
import pytest

from paratune.cli import main
from paratune.models._predict_io import read_config_csv

HEADER = ("source,model,params_b,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,dp,cp,"
          "micro_batch,global_batch,zero_stage,recompute,tflops_per_gpu,mfu,tokens_per_sec,"
          "step_time_s,tokens_per_sec_per_gpu,precision,notes")
# a 125M GPT-2-sized model from a source that is neither nanotron nor Megatron: its params_b
# is far too small for the Llama vocabulary (131072, untied) that such sources default to
SMALL = "fsdp_benchmark,small-125m,0.125,12,768,12,1024,H100-80GB,8,1,1,8,1,8,64,3,,,,,,,bf16,"


def _csv(tmp_path, rows, extra_header="", name="in.csv"):
    path = tmp_path / name
    path.write_text(HEADER + extra_header + "\n" + "\n".join(rows) + "\n")
    return path


def _predict(model_dir, src):
    out = src.with_name(src.stem + "_out.csv")
    assert main(["predict", "--model", str(model_dir), str(src), "--out", str(out)]) == 0
    return pd.read_csv(out, keep_default_na=False)


def test_a_row_whose_params_b_does_not_fit_the_vocabulary_is_predicted_gpt_style(
        model_dir, tmp_path):
    result = _predict(model_dir, _csv(tmp_path, [SMALL, SMALL.replace(",0.125,", ",,")]))
    assert result["pred_error"].tolist() == ["", ""]
    assert (result["pred_tokens_per_sec_per_gpu"] > 0).all()
    _, configs, errors = read_config_csv(tmp_path / "in.csv")
    assert list(errors) == ["", ""]
    row = configs.iloc[0]
    assert (row["mlp"], row["ffn_hidden_size"], row["vocab_size"], bool(row["tie_embeddings"])) \
        == ("gelu", 3072, 51200, True)


def test_stated_shape_columns_are_the_predicted_model(model_dir, tmp_path):
    columns = ",vocab_size,ffn_hidden_size,num_kv_heads,mlp"
    rows = [SMALL + ",,,,", SMALL + ",256000,,,", SMALL + ",,12288,,", SMALL + ",,,4,swiglu"]
    src = _csv(tmp_path, rows, columns)
    _, configs, errors = read_config_csv(src)
    assert list(errors) == [""] * 4
    assert configs["vocab_size"].tolist() == [51200, 256000, 51200, 51200]
    assert configs["ffn_hidden_size"].tolist()[:3] == [3072, 3072, 12288]
    assert configs["num_kv_heads"].tolist() == [12, 12, 12, 4]
    assert configs["mlp"].tolist() == ["gelu", "gelu", "gelu", "swiglu"]
    result = _predict(model_dir, src)
    assert result["pred_error"].tolist() == [""] * 4
    memory = result["pred_peak_mem_gb"].tolist()
    time = result["analytical_step_time_s"].tolist()
    # a 5x vocabulary and a 4x MLP are more weights and more FLOPs than the default shape
    assert memory[1] > memory[0] and memory[2] > memory[0]
    assert time[1] > time[0] and time[2] > time[0]


@pytest.mark.parametrize(("column", "value", "reason"), [
    ("vocab_size", "0", "vocab_size='0' must be a positive integer"),
    ("ffn_hidden_size", "3072.5", "ffn_hidden_size='3072.5' must be a positive integer"),
    ("num_kv_heads", "5", "invalid num_kv_heads=5: must divide num_heads=12"),
    ("mlp", "relu", "mlp='relu' must be swiglu or gelu"),
    ("tie_embeddings", "maybe", "tie_embeddings='maybe' must be true or false"),
])
def test_bad_shape_values_are_one_line_errors_naming_the_column(
        model_dir, tmp_path, column, value, reason):
    result = _predict(model_dir, _csv(tmp_path, [SMALL + f",{value}"], f",{column}"))
    (error,) = result["pred_error"].tolist()
    assert reason in error and "\n" not in error
    assert result["pred_tokens_per_sec_per_gpu"].tolist() == [""]


def test_a_row_in_a_precision_the_model_does_not_price_gets_its_reason(tmp_path):
    """An FP8 run on a GPU is not predicted as the bf16 job it is not: its row gets the
    reason in pred_error; a CPU row computes in 32 bits, which its core prices."""
    cpu = SMALL.replace(",H100-80GB,8,1,1,8,", ",cpu,8,1,1,8,").replace(",bf16,", ",fp32,")
    src = _csv(tmp_path, [SMALL.replace(",bf16,", ",fp8,"), SMALL, cpu])
    _, configs, errors = read_config_csv(src)
    assert errors[0].startswith("precision='fp8' is not bf16 or fp16: on H100-80GB")
    assert list(errors[1:]) == ["", ""]
    assert configs["hardware"].tolist()[1:] == ["H100-80GB", "cpu"]


def test_a_layout_no_framework_can_run_gets_its_reason_not_a_number(tmp_path):
    """The public format's rows meet the layout's rules against the model, as the config
    columns' do: tensor parallelism over 8 ranks of a model with 12 heads is refused."""
    src = _csv(tmp_path, [SMALL, SMALL.replace(",8,1,1,8,1,8,64,", ",8,8,1,1,1,8,64,")])
    _, _, errors = read_config_csv(src)
    assert list(errors) == ["", "tp=8: must divide num_heads=12"]
