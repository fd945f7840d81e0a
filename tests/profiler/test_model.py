from __future__ import annotations

import pytest
import torch

from paratune import MODEL_PRESETS, ParallelConfig, get_model
from paratune.errors import ConfigError
from paratune.profiler.model import Transformer, build_model
from paratune.profiler.parallelize import apply_activation_checkpointing
from paratune.profiler.pipeline import cross_entropy_loss, layer_ranges, split_model


def _small_spec(**changes):
    return get_model("tiny").replace(seq_len=16, **changes)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_parameter_count_matches_spec(name):
    spec = MODEL_PRESETS[name]
    with torch.device("meta"):  # no memory: llama3-405b has 4e11 parameters
        model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


@pytest.mark.parametrize("changes", [dict(mlp="gelu"), dict(tie_embeddings=True),
                                     dict(mlp="gelu", tie_embeddings=True, num_kv_heads=8)])
def test_parameter_count_variants(changes):
    spec = _small_spec(**changes)
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params
    if spec.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    assert (model.layers["0"].feed_forward.w3 is None) == (spec.mlp == "gelu")


def test_init_is_deterministic_and_seeded():
    spec = _small_spec()
    a, b, c = build_model(spec, seed=3), build_model(spec, seed=3), build_model(spec, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # every tensor gets its own stream: two layers of the same shape differ
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    std = a.layers["0"].attention.wq.weight.std().item()
    assert 0.015 < std < 0.025


def test_forward_shapes_and_loss_near_log_vocab():
    spec = _small_spec()
    model = build_model(spec)
    # seeded tokens: the loss of an untrained model on random tokens scatters around
    # log(vocab) by a few hundredths from one draw to the next
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    assert logits.shape == (3, spec.seq_len, spec.vocab_size)
    loss = cross_entropy_loss(logits, tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(float(spec.vocab_size))).item()) < 0.1


def test_attention_is_causal():
    spec = _small_spec()
    model = build_model(spec)
    tokens = torch.randint(0, spec.vocab_size, (1, spec.seq_len))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % spec.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_grouped_query_attention_shares_kv_heads():
    """With kv heads = heads / 2 the model equals a multi-head model whose k/v weights
    repeat each kv head twice."""
    spec = _small_spec()  # 8 heads, 4 kv heads
    gqa = build_model(spec)
    mha_spec = spec.replace(num_kv_heads=spec.num_heads)
    mha = build_model(mha_spec)
    shared = {k: v for k, v in gqa.state_dict().items()
              if not k.endswith(("wk.weight", "wv.weight"))}
    mha.load_state_dict(shared, strict=False)
    with torch.no_grad():
        for name, layer in gqa.layers.items():
            for proj in ("wk", "wv"):
                w = getattr(layer.attention, proj).weight.view(spec.num_kv_heads, spec.head_dim, -1)
                full = w.repeat_interleave(2, dim=0).reshape(spec.hidden_size, -1)
                getattr(mha.layers[name].attention, proj).weight.copy_(full)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients(mode):
    spec = _small_spec()
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len + 1))
    grads = []
    for recompute in ("none", mode):
        model = apply_activation_checkpointing(build_model(spec), mode=recompute)
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_recomputes():
    """Full recompute runs each block's forward twice per step, selective only attention."""
    spec = _small_spec()
    tokens = torch.randint(0, spec.vocab_size, (1, spec.seq_len))
    counts = {}
    for mode in ("none", "full", "selective"):
        model = apply_activation_checkpointing(build_model(spec), mode=mode)
        calls = {"attention": 0, "mlp": 0}

        def counter(key, calls=calls):
            return lambda *_: calls.__setitem__(key, calls[key] + 1)

        model.layers["0"].attention.register_forward_pre_hook(counter("attention"))
        model.layers["0"].feed_forward.register_forward_pre_hook(counter("mlp"))
        model(tokens).sum().backward()
        counts[mode] = dict(calls)
    assert counts == {"none": {"attention": 1, "mlp": 1}, "full": {"attention": 2, "mlp": 2},
                      "selective": {"attention": 2, "mlp": 1}}


def test_layer_ranges():
    assert layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_ranges(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ConfigError, match="at least as many layers"):
        layer_ranges(2, 4)


def test_pipeline_stages_compose_to_the_full_model_with_its_names():
    spec = _small_spec()
    full = build_model(spec, seed=1)
    config = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                            global_batch_size=4)
    stages = {}
    for pp_rank in range(2):
        for stage_id, stage in zip((pp_rank, pp_rank + 2), split_model(full, config, pp_rank)):
            stages[stage_id] = stage
    assert [list(stages[i].layers.keys()) for i in range(4)] == [["0"], ["1"], ["2"], ["3"]]
    assert stages[0].tok_embeddings is not None and stages[1].tok_embeddings is None
    assert stages[3].output is not None and stages[2].output is None
    names = [n for i in range(4) for n, _ in stages[i].named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    h = tokens
    for i in range(4):
        h = stages[i](h)
    torch.testing.assert_close(h, full(tokens))


def test_pipeline_rejects_tied_embeddings():
    spec = _small_spec(tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(spec)
    with pytest.raises(ConfigError, match="untied embeddings"):
        split_model(model, ParallelConfig(pp=2, global_batch_size=2), 0)
