from __future__ import annotations

import optuna
import pytest

from paratune import ConfigError, get_model
from paratune.space import ConfigSpace
from paratune.tuner import SearchSpace, parse_batch_sizes
from paratune.tuner._space_moves import work_keeping_moves


@pytest.mark.parametrize(("text", "expected"), [
    ("512", (512,)), (512, (512,)), ("256,128,256", (128, 256)),
    ("256:2048", (256, 512, 1024, 2048)), ("100:900:x3", (100, 300, 900)),
    ("256:1024:256", (256, 512, 768, 1024)), ([64, 32], (32, 64)),
])
def test_parse_batch_sizes(text, expected):
    assert parse_batch_sizes(text) == expected


@pytest.mark.parametrize("text", ["", "a,b", "2048:256", "0", "8:64:x1"])
def test_bad_batch_sizes_are_named(text):
    with pytest.raises(ConfigError, match="global_batch_sizes"):
        parse_batch_sizes(text)


def test_sampled_configs_are_valid_or_pruned_with_the_rule():
    model = get_model("llama3-8b")
    space = SearchSpace.build(model, 64, "H100", global_batch_sizes="64:512",
                              space=ConfigSpace(micro_batch_sizes=(1, 2, 4, 8)))
    valid = set(space.enumerate().valid)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    reasons, seen = [], set()
    for _ in range(300):
        trial = study.ask()
        cfg, reason = space.suggest(trial)
        if cfg is None:
            assert "=" in reason
            reasons.append(reason)
        else:
            cfg.validate(model, 64)
            assert cfg.tp <= 8  # tp stays within a node by default
            assert cfg in valid  # the sampler's space is the enumerated space
            seen.add(cfg)
        study.tell(trial, 0.0)
    assert seen and len(seen) > 100
    assert any("micro_batch_size" in r or "global_batch_size" in r for r in reasons)


def test_layouts_respect_model_shape_and_batch():
    model = get_model("llama3-8b")  # 8 kv heads: tp <= 8
    space = SearchSpace.build(model, 64, "H100", global_batch_sizes=[16],
                              space=ConfigSpace(tp_within_node=False, micro_batch_sizes=(1,)))
    layouts = space.layouts(16)
    assert layouts
    assert all(tp <= 8 and 16 % dp == 0 and dp * tp * pp == 64 for dp, tp, pp in layouts)


def test_impossible_job_is_a_clear_error():
    # 7 devices of tiny (8 heads, 4 layers): tp=7 and pp=7 break its shape, dp=7 the batch;
    # in one node the node size rules nothing out, and the message does not name it
    with pytest.raises(ConfigError, match=r"^gpus=7: .*\(tp must divide the head counts, "
                                          r"pp\*virtual stages <= layers") as info:
        SearchSpace.build(get_model("tiny"), 7, "H100", global_batch_sizes=[4],
                          space=ConfigSpace(micro_batch_sizes=(1,)))
    assert "devices_per_node" not in str(info.value)
    # over two nodes it does: 14 devices, tp=7 would cross them
    with pytest.raises(ConfigError, match=r"^gpus=14: .*tp must divide devices_per_node=7"):
        SearchSpace.build(get_model("tiny"), 14, "H100", global_batch_sizes=[4],
                          space=ConfigSpace(micro_batch_sizes=(1,)))
    # with pipelines allowed, llama3-8b on 7 devices has a layout: the space's pp_degrees
    # rules it out, and is named
    with pytest.raises(ConfigError, match=r"^pp_degrees=\[1\]: .*pp=1 leaves no dp"):
        SearchSpace.build(get_model("llama3-8b"), 7, "H100", global_batch_sizes=[4],
                          space=ConfigSpace(micro_batch_sizes=(1,), pp_degrees=(1,)))


@pytest.mark.parametrize(("options", "message"), [
    ({"tp_degrees": [3]}, r"tp_degrees=[3]: no value gives a valid layout of 64 devices for "
                          r"llama3-8b: tp=3 does not divide 64 devices"),
    ({"tp_degrees": [16]}, "tp_degrees=[16]: no value gives a valid layout of 64 devices for "
                           "llama3-8b: tp=16 does not divide devices_per_node=8 (tp_within_node"),
    ({"tp_degrees": [16], "tp_within_node": False},
     "tp_degrees=[16]: no value gives a valid layout of 64 devices for llama3-8b: tp=16 must "
     "divide num_kv_heads=8"),
    ({"pp_degrees": [128]}, "pp_degrees=[128]: no value gives a valid layout of 64 devices for "
                            "llama3-8b: pp=128 does not divide 64 devices"),
    ({"pp_degrees": [64]}, "pp_degrees=[64]: no value gives a valid layout of 64 devices for "
                           "llama3-8b: pp=64 pp*virtual_stages = 64 pipeline stages need"),
])
def test_a_space_that_rules_out_every_layout_names_its_field(options, message):
    """Not ``gpus``: 64 devices have layouts; the space's degree list rules them out."""
    with pytest.raises(ConfigError) as info:
        SearchSpace.build(get_model("llama3-8b"), 64, "H100", global_batch_sizes=[128],
                          space=ConfigSpace(**options))
    assert str(info.value).startswith(message)


def test_neighbours_change_one_parameter_and_are_valid():
    model = get_model("llama3-8b")
    space = SearchSpace.build(model, 64, "H100", global_batch_sizes="128:512")
    params = {"global_batch_size_index": 1, "tp_index": 2, "pp_index": 0,
              "micro_batch_size_index": 0, "sharding_index": 1, "recompute_index": 0}
    centre, _ = space.suggest(optuna.trial.FixedTrial(params))
    assert centre is not None and centre.pp == 1
    near = space.neighbours(params)
    assert near and centre not in [c for c, _ in near]
    for cfg, p in near:
        cfg.validate(model, 64)
        assert space.suggest(optuna.trial.FixedTrial(p))[0] == cfg
        # one move; options that stop applying (sharding at dp=1) drop out, and a newly
        # active schedule is added
        changed = {k for k in params if k in p and p[k] != params[k]}
        knobs = {"micro_batch_size_index", "schedule", "sharding_index", "recompute_index"}
        keeps_work = (cfg.dp * cfg.micro_batch_size == centre.dp * centre.micro_batch_size
                      and cfg.global_batch_size == centre.global_batch_size
                      and changed in ({"tp_index", "micro_batch_size_index"},
                                      {"pp_index", "micro_batch_size_index"},
                                      {"tp_index", "pp_index"}))
        assert len(changed) == 1 or (len(changed) == 2 and changed <= knobs) or keeps_work
    assert any(c.pp > 1 for c, _ in near)  # pp moves bring in each schedule
    # first the layout moves that keep each rank's micro-batches per step: tp x2 with the
    # micro-batch x2 (dp halves), and tp x2 with pp / 2 (dp stays) ...
    first = {(c.dp, c.tp, c.pp, c.micro_batch_size) for c, _ in near[:4]}
    assert (centre.dp // 2, centre.tp * 2, 1, 2) in first
    assert any(c.dp == centre.dp and c.tp == centre.tp // 2 and c.pp == 2 for c, _ in near[:6])
    # ... then the rest, the fewest index steps away first
    def steps(p):
        return sum(abs(p[k] - params[k]) if isinstance(p.get(k), int) else 1
                   for k in params.keys() | p.keys() if p.get(k) != params.get(k))
    rest = [steps(p) for c, p in near if c.dp * c.micro_batch_size
            != centre.dp * centre.micro_batch_size or c.global_batch_size
            != centre.global_batch_size]
    assert rest == sorted(rest) and rest[0] == 1


def test_probes_put_every_layout_at_its_least_memory_knobs():
    from paratune.parallel import Recompute, Schedule

    model = get_model("llama3-8b")
    space = SearchSpace.build(model, 64, "H100", global_batch_sizes="128:512",
                              space=ConfigSpace(micro_batch_sizes=(1, 2, 4),
                                                virtual_stages=(2, 4)))
    params = {"global_batch_size_index": 0, "tp_index": 2, "pp_index": 0,
              "micro_batch_size_index": 2, "sharding_index": 1, "recompute_index": 0}
    probes = space.probes(params)
    layouts = {(c.dp, c.tp, c.pp) for c, _ in probes}
    assert layouts == set(space.layouts())
    most_sharding = space.shardings()[-1]
    interleaved: dict[tuple[int, int, int], int] = {}  # layout -> smallest batch it runs at
    for c in space.enumerate().valid:
        if c.schedule is Schedule.INTERLEAVED_1F1B and c.micro_batch_size == 1:
            key = (c.dp, c.tp, c.pp)
            interleaved[key] = min(interleaved.get(key, c.global_batch_size),
                                   c.global_batch_size)
    for cfg, p in probes:
        cfg.validate(model, 64)
        assert space.suggest(optuna.trial.FixedTrial(p))[0] == cfg
        assert cfg.micro_batch_size == 1 and cfg.recompute is Recompute.FULL
        if cfg.dp > 1:  # the most sharding, or the sharding of params
            assert cfg.sharding in (most_sharding, space.shardings()[1])
        if (cfg.dp, cfg.tp, cfg.pp) in interleaved:
            # the smallest bubble the layout allows, at the nearest batch that allows it
            assert cfg.schedule is Schedule.INTERLEAVED_1F1B
            assert cfg.global_batch_size == interleaved[(cfg.dp, cfg.tp, cfg.pp)]
        elif cfg.pp > 1:
            assert cfg.schedule is Schedule.ONE_F_ONE_B
    assert len(probes) <= 2 * len(layouts)


def test_unsorted_space_lists_keep_the_sampled_indices_ordinal():
    model = get_model("llama3-8b")
    space = SearchSpace.build(model, 16, "H100", space=ConfigSpace(
        global_batch_sizes=(256, 64, 1024, 128), micro_batch_sizes=(4, 1, 2)))
    base = {"tp_index": 1, "pp_index": 1, "micro_batch_size_index": 0, "recompute_index": 0,
            "sharding_index": 0, "schedule": "1f1b"}
    batches = [space.suggest(optuna.trial.FixedTrial({**base, "global_batch_size_index": i})
                             )[0].global_batch_size for i in range(4)]
    assert batches == [64, 128, 256, 1024]
    # the work-keeping moves read the same micro-batch list as suggest: doubling tp or pp
    # doubles the micro-batch, so dp * micro_batch_size stays
    params = {**base, "global_batch_size_index": 0}
    centre, _ = space.suggest(optuna.trial.FixedTrial(params))
    assert centre.micro_batch_size == 1
    moves = work_keeping_moves(space, params, space.param_choices())
    assert moves
    for move in moves:
        cfg, reason = space.suggest(optuna.trial.FixedTrial({**params, **move}))
        assert cfg is not None, reason
        assert cfg.dp * cfg.micro_batch_size == centre.dp * centre.micro_batch_size


@pytest.mark.parametrize("bad", [[64.5], [True], True, 2.5])
def test_non_integer_batch_sizes_are_refused_not_truncated(bad):
    with pytest.raises(ConfigError, match="global_batch_sizes"):
        parse_batch_sizes(bad)
    assert parse_batch_sizes([64.0, 32]) == (32, 64)  # integral numbers (YAML) are fine


@pytest.mark.parametrize("bad", [0, 2.5, -1, True])
def test_devices_per_node_must_be_a_positive_integer(bad):
    """0 used to fall back to the catalogue's node size and 2.5 to be truncated to 2."""
    with pytest.raises(ConfigError, match="devices_per_node"):
        SearchSpace.build(get_model("llama3-8b"), 16, "H100", global_batch_sizes=[16],
                          devices_per_node=bad)
    assert SearchSpace.build(get_model("llama3-8b"), 16, "H100", global_batch_sizes=[16],
                             devices_per_node=4.0).devices_per_node == 4


def test_batch_sizes_no_layout_reaches_are_named(caplog):
    only_dp = ConfigSpace(tp_degrees=(1,), pp_degrees=(1,), micro_batch_sizes=(1,))
    with caplog.at_level("WARNING", logger="paratune.tuner._space"):
        space = SearchSpace.build(get_model("llama3-8b"), 16, "H100", space=only_dp,
                                  global_batch_sizes=[8, 16, 24, 32])
    assert space.layouts(8) == [] and space.layouts(16)
    assert "[8, 24]" in caplog.text
    with pytest.raises(ConfigError, match="dp\\*micro_batch_size must divide"):
        SearchSpace.build(get_model("llama3-8b"), 16, "H100", space=only_dp,
                          global_batch_sizes=[8, 24])


def test_a_range_is_the_powers_of_two_within_it():
    assert parse_batch_sizes("100:1000") == (128, 256, 512)  # not 100 doubled
    assert parse_batch_sizes("96:1024") == (128, 256, 512, 1024)
    assert parse_batch_sizes("3:4") == (4,)
    assert parse_batch_sizes("256:4096") == (256, 512, 1024, 2048, 4096)
    assert parse_batch_sizes("1:1") == (1,) and parse_batch_sizes("1:7") == (1, 2, 4)


def test_a_range_with_a_factor_or_a_step_starts_at_lo_not_at_a_power_of_two():
    assert parse_batch_sizes("96:1024") != parse_batch_sizes("96:1024:x2")
    assert parse_batch_sizes("96:1024:x2") == (96, 192, 384, 768)  # :xF multiplies from lo
    assert parse_batch_sizes("256:4096:x2") == parse_batch_sizes("256:4096")
    assert parse_batch_sizes("256:1024:256") == (256, 512, 768, 1024)  # :STEP adds from lo
    assert parse_batch_sizes("100:110:3") == (100, 103, 106, 109)


def test_a_range_without_a_power_of_two_is_named():
    with pytest.raises(ConfigError, match=r"^global_batch_sizes='100:120': .*powers of two"):
        parse_batch_sizes("100:120")


def test_too_many_batch_sizes_are_refused_before_they_are_built():
    assert len(parse_batch_sizes("1:64:1")) == 64
    assert len(parse_batch_sizes(f"1:{2 ** 24}")) == 25
    with pytest.raises(ConfigError, match=r"batch size 9223372036854775808 is beyond"):
        parse_batch_sizes(f"1:{2 ** 63}")  # 64 sizes, but batches no job runs
    rule = r"gives {} batch sizes; at most 64 are searched"
    for text, count in [("1:1000:1", 1000), (f"1:{2 ** 64}", 65), (f"1:{3 ** 64}:x3", 65),
                        (",".join(str(v) for v in range(1, 66)), 65),
                        ("1:100000000:1", 100_000_000)]:
        with pytest.raises(ConfigError, match=r"^global_batch_sizes=.*: " + rule.format(count)):
            parse_batch_sizes(text)
    with pytest.raises(ConfigError, match=rule.format(65)):
        parse_batch_sizes(list(range(1, 66)))


def test_the_command_line_names_global_batch_for_too_many_sizes(tmp_path, monkeypatch, capsys):
    from paratune.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["tune", "--model", "llama3-8b", "--gpus", "64", "--hardware", "H100",
            "--predictor", str(tmp_path / "absent"), "--output", "out", "--no-track"]
    assert main([*argv, "--global-batch", "1:1000:1"]) == 2
    assert capsys.readouterr().err.startswith(
        "paratune tune: error: --global-batch='1:1000:1': gives 1000 batch sizes; "
        "at most 64 are searched")


def test_more_sharding_is_the_same_config_one_level_up():
    from paratune.parallel import Sharding

    space = SearchSpace.build(get_model("llama3-8b"), 64, "H100", global_batch_sizes=[256])
    params = {"global_batch_size_index": 0, "tp_index": 1, "pp_index": 1,
              "micro_batch_size_index": 0, "sharding_index": 1, "recompute_index": 0,
              "schedule": "1f1b"}
    base, _ = space.suggest(optuna.trial.FixedTrial(params))
    levels = [base.sharding]
    while (up := space.more_sharding(params)) is not None:
        cfg, params = up
        assert cfg.replace(sharding=base.sharding) == base  # nothing else moved
        assert space.suggest(optuna.trial.FixedTrial(params))[0] == cfg
        levels.append(cfg.sharding)
    assert levels == [Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3]


def test_megatron_lm_is_searched_without_sharding_under_a_pipeline():
    """Megatron-LM shards gradients and parameters (ZeRO-2/3) only with Megatron-FSDP, which
    runs no pipeline: with ``framework="megatron-lm"`` neither the enumeration nor a sampled
    trial holds ZeRO-2/3 with pp > 1 (the rule names why), while ZeRO-1 (its distributed
    optimizer) under a pipeline and ZeRO-3 without one stay; another framework keeps them."""
    model = get_model("llama3-8b")
    shardings = ConfigSpace(shardings=("zero1", "zero2", "zero3"), micro_batch_sizes=(1, 2))
    spaces = {name: SearchSpace.build(model, 64, "H100", global_batch_sizes=256,
                                      space=shardings, framework=name)
              for name in ("megatron-lm", None)}

    def barred(cfg):
        return cfg.pp > 1 and cfg.sharding.value in ("zero2", "zero3")

    megatron = spaces["megatron-lm"].enumerate()
    assert not any(barred(cfg) for cfg in megatron.valid)
    assert any(cfg.pp > 1 and cfg.sharding.value == "zero1" for cfg in megatron.valid)
    assert any(cfg.pp == 1 and cfg.sharding.value == "zero3" for cfg in megatron.valid)
    valid_elsewhere = {cfg for cfg in spaces[None].enumerate().valid if barred(cfg)}
    rules = [rule for cfg, rule in megatron.skipped if cfg in valid_elsewhere]
    assert len(rules) == len(valid_elsewhere) > 0
    assert all("Megatron-FSDP" in rule for rule in rules)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(200):
        cfg, _ = spaces["megatron-lm"].suggest(study.ask())
        assert cfg is None or not barred(cfg), cfg
