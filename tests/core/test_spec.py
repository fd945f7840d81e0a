from __future__ import annotations

import json

import pytest

from paratune import ConfigError, ModelSpec, get_model
from paratune.spec import MODEL_PRESETS


def test_llama3_8b_parameter_count_matches_published():
    # Meta reports 8.03B parameters for Llama 3 8B.
    assert get_model("llama3-8b").num_params == pytest.approx(8.03e9, rel=0.002)


def test_llama3_70b_parameter_count_matches_published():
    assert get_model("llama3-70b").num_params == pytest.approx(70.6e9, rel=0.005)


def test_flops_per_token_reproduces_published_mfu():
    # Ultra-Scale Playbook 1B row: 40150 tokens/s/GPU on H100 (989 TFLOP/s) reported as 39.2% MFU.
    spec = ModelSpec(name="1B", num_layers=16, hidden_size=2048, num_heads=32,
                     ffn_hidden_size=8192, vocab_size=131072, seq_len=4096)
    assert spec.flops_per_token() * 40150 / 989e12 == pytest.approx(0.392, abs=0.001)


def test_recompute_adds_one_forward():
    spec = get_model("tiny")
    fwd = spec.flops_per_token(training=False)
    assert spec.flops_per_token() == pytest.approx(3 * fwd)
    # full recomputation repeats the blocks' forward, not the output projection's
    head = 2 * spec.vocab_size * spec.hidden_size
    assert spec.flops_per_token(recompute=True) == pytest.approx(4 * fwd - head)


def test_tied_embeddings_counted_once():
    spec = get_model("tiny")
    tied = spec.replace(tie_embeddings=True)
    assert spec.num_params - tied.num_params == spec.vocab_size * spec.hidden_size


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("num_heads", 7, "must divide hidden_size"),
    ("num_kv_heads", 3, "must divide num_heads"),
    ("num_layers", 0, "positive integer"),
    ("mlp", "relu", "must be one of"),
])
def test_invalid_shapes_name_field_and_rule(field, value, rule):
    base = get_model("tiny").to_dict()
    base[field] = value
    with pytest.raises(ConfigError, match=rule) as info:
        ModelSpec.from_dict(base)
    assert info.value.field == field


def test_from_hf_config_reads_llama_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert spec.num_params == get_model("llama3-8b").num_params
    assert spec.num_kv_heads == 8 and spec.mlp == "swiglu"


def test_from_hf_config_missing_key_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelSpec.from_hf_config(tmp_path / "config.json")


@pytest.mark.parametrize(("extra", "field", "rule"), [
    ({"head_dim": 128}, "head_dim", "must be hidden_size / num_attention_heads = 4096/64"),
    ({"num_local_experts": 8}, "num_local_experts", "mixture-of-experts models are not"),
])
def test_from_hf_config_refuses_shapes_it_would_misread(tmp_path, extra, field, rule):
    cfg = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 40,
           "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 131072, "max_position_embeddings": 8192, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rule) as info:
        ModelSpec.from_hf_config(tmp_path)
    assert info.value.field == field
    # a head_dim that is hidden / heads is the same model
    cfg.pop(field)
    cfg["head_dim"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelSpec.from_hf_config(tmp_path).hidden_size == 4096


def test_a_zero_sequence_length_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="seq_len=0"):
        get_model("tiny", seq_len=0)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="tiny"):
        get_model("gpt-9")


def test_roundtrip_all_presets():
    for spec in MODEL_PRESETS.values():
        assert ModelSpec.from_dict(spec.to_dict()) == spec


def _hf_config(path, **extra):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
           "vocab_size": 256, "max_position_embeddings": 131072, **extra}
    path.write_text(json.dumps(cfg))
    return path


def test_a_config_json_without_seq_len_warns_which_length_it_assumed(tmp_path, caplog):
    path = _hf_config(tmp_path / "config.json")
    with caplog.at_level("WARNING", logger="paratune.spec"):
        assert get_model(path).seq_len == 131072
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    message = record.getMessage()
    assert "max_position_embeddings=131072" in message and "--seq-len" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="paratune.spec"):
        assert get_model(path, seq_len=2048).seq_len == 2048
        assert get_model("tiny", seq_len=64).seq_len == 64
    assert caplog.records == []


def _profile_spec(*argv):
    """``paratune profile``'s campaign spec for a command line (nothing is run)."""
    import argparse

    from paratune.profiler._cli import build_spec, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return build_spec(parser.parse_args(["profile", "--device", "cpu", "--hardware", "cpu",
                                         *argv]))


def test_profile_takes_a_seq_len_for_presets_and_config_json(tmp_path):
    assert _profile_spec().model.seq_len == get_model("tiny").seq_len
    assert _profile_spec("--seq-len", "64").model.seq_len == 64
    path = _hf_config(tmp_path / "config.json")
    assert _profile_spec("--model", str(path), "--seq-len", "512").model.seq_len == 512


@pytest.mark.parametrize("value", ["inf", "-inf"])
def test_profile_refuses_an_infinite_timeout_naming_the_flag(tmp_path, capsys, value):
    from paratune.cli import main

    code = main(["profile", f"--timeout={value}", "--device", "cpu", "--hardware", "cpu",
                 "--world-sizes", "1", "--out", str(tmp_path / "c"), "--print-command"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"paratune profile: error: --timeout={float(value)}: must be a finite positive number "
        "of seconds (a config that hangs must be stopped)\n")
    assert not (tmp_path / "c").exists()


def test_a_null_in_config_json_counts_as_absent(tmp_path):
    nulls = dict.fromkeys(("rope_theta", "rms_norm_eps", "tie_word_embeddings",
                           "num_key_value_heads", "head_dim", "intermediate_size"))
    spec = get_model(_hf_config(tmp_path / "config.json", **nulls), seq_len=2048)
    assert (spec.rope_theta, spec.norm_eps, spec.tie_embeddings) == (500000.0, 1e-5, False)
    assert (spec.num_kv_heads, spec.ffn_hidden_size) == (4, 4 * 256)


def test_a_null_norm_eps_falls_back_to_the_layer_norm_key(tmp_path):
    path = _hf_config(tmp_path / "config.json", rms_norm_eps=None, layer_norm_epsilon=1e-6)
    assert get_model(path, seq_len=2048).norm_eps == 1e-6


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "max_position_embeddings"])
def test_a_required_key_that_is_null_is_named(tmp_path, key):
    path = _hf_config(tmp_path / "config.json", **{key: None})
    with pytest.raises(ConfigError, match=rf"^{key}=None: missing \(or null\) from ") as info:
        get_model(path)
    assert info.value.field == key


@pytest.mark.parametrize(("key", "value", "rule"), [
    ("hidden_size", "abc", "must be an integer"),
    ("num_hidden_layers", 2.5, "must be an integer"),
    ("num_attention_heads", True, "must be an integer"),
    ("vocab_size", [256], "must be an integer"),
    ("intermediate_size", "wide", "must be an integer"),
    ("num_key_value_heads", "two", "must be an integer"),
    ("head_dim", "sixty-four", "must be an integer"),
    ("max_position_embeddings", "long", "must be an integer"),
    ("rope_theta", "abc", "must be a finite number"),
    ("rope_theta", True, "must be a finite number"),
    ("rms_norm_eps", {"eps": 1e-5}, "must be a finite number"),
    ("rms_norm_eps", 1e400, "must be a finite number"),  # json writes Infinity
    ("tie_word_embeddings", "false", "must be true or false"),
    ("tie_word_embeddings", 0, "must be true or false"),
])
def test_a_config_json_value_of_the_wrong_type_is_named(tmp_path, key, value, rule):
    path = _hf_config(tmp_path / "config.json", **{key: value})
    with pytest.raises(ConfigError, match=rf"^{key}=.*: {rule}.* in .*config.json") as info:
        get_model(path)
    assert info.value.field == key


def test_config_json_numbers_must_be_whole_but_may_be_written_as_strings(tmp_path):
    path = _hf_config(tmp_path / "config.json", num_hidden_layers=2.5)
    with pytest.raises(ConfigError, match=r"^num_hidden_layers=2.5: must be an integer"):
        get_model(path, seq_len=2048)  # not truncated to 2
    path = _hf_config(tmp_path / "config.json", hidden_size="256", num_hidden_layers=2.0,
                      rope_theta="10000", rms_norm_eps=1e-6, tie_word_embeddings=True)
    spec = get_model(path, seq_len=2048)
    assert (spec.hidden_size, spec.num_layers) == (256, 2)
    assert (spec.rope_theta, spec.norm_eps, spec.tie_embeddings) == (10000.0, 1e-6, True)


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object") as info:
        get_model(tmp_path / "config.json")
    assert info.value.field == "path"


@pytest.mark.parametrize(("cfg", "mlp", "tied", "published"), [
    # phi-2: GeLU MLP (two matrices), untied
    ({"model_type": "phi", "hidden_size": 2560, "num_hidden_layers": 32,
      "num_attention_heads": 32, "intermediate_size": 10240, "vocab_size": 51200,
      "hidden_act": "gelu_new", "tie_word_embeddings": False}, "gelu", False, 2.78e9),
    # gemma-2b: a gated MLP whatever its GeLU, and tied embeddings its file does not state
    ({"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18,
      "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
      "intermediate_size": 16384, "vocab_size": 256000, "hidden_act": "gelu"},
     "swiglu", True, 2.506e9),
    # bloom-560m: 4h GeLU MLP, tied
    ({"model_type": "bloom", "hidden_size": 1024, "n_layer": 24, "num_attention_heads": 16,
      "vocab_size": 250880}, "gelu", True, 0.559e9),
])
def test_hf_configs_are_read_as_their_released_models(tmp_path, cfg, mlp, tied, published):
    """The MLP by the model type (then the activation), the tie by the config class's
    default: phi-2 read as SwiGLU counted 3.6B, bloom-560m 0.92B, gemma-2b untied 3.0B."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048,
                                                      **cfg}))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert (spec.mlp, spec.tie_embeddings) == (mlp, tied)
    assert spec.num_params == pytest.approx(published, rel=0.01)


def test_an_unknown_model_type_goes_by_its_activation_and_says_what_it_took(tmp_path,
                                                                            caplog):
    path = _hf_config(tmp_path / "config.json", model_type="newarch", hidden_act="relu")
    with caplog.at_level("WARNING", logger="paratune.spec"):
        spec = ModelSpec.from_hf_config(path, seq_len=128)
    assert spec.mlp == "gelu" and spec.tie_embeddings is False
    assert "states no tie_word_embeddings: taken as untied for model_type 'newarch'" in (
        caplog.text)


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("tie_embeddings", "false", "must be true or false"),
    ("tie_embeddings", 2, "must be true or false"),
    ("rope_theta", float("nan"), "must be a positive, finite number"),
    ("norm_eps", "x", "must be a positive, finite number"),
    ("name", "", "must be a non-empty text"),
])
def test_every_model_field_is_checked(field, value, rule):
    """A text 'false' was read as tied by the batch arithmetic and as a TypeError by the
    parameter count; a missing field of a stored model was a TypeError too."""
    with pytest.raises(ConfigError, match=f"^{field}=.*: {rule}"):
        get_model("tiny").replace(**{field: value})
    with pytest.raises(ConfigError, match=r"^hidden_size=None: is missing: a model needs "
                                          r"hidden_size, num_heads"):
        ModelSpec.from_dict({"num_layers": 2})
