"""Frameworks with no measurement fitted on, predicted as well-tuned ones: Megatron-LM's
published GPT runs (22B to 1T parameters on 8 to 512 A100, and its weak scaling from 1.7B on
32 GPUs to 1T on 3,072, tensor and pipeline parallelism; two DeepSpeed sources are outside
the targets, inside the interval: its ZeRO-3 runs of GPT-3 175B on 384 to 1,536 A100 and
Megatron-DeepSpeed's MT-NLG 530B on 2,240 to 3,360),
torchtitan's (Llama 2 13B to Llama 3 70B on 64 A100) and llm-foundry's (MPT 125M to 70B on
8 to 128 A100 and H100), both FSDP alone, from a model fitted on the public nanotron and
Megatron-DeepSpeed measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "data" / "published_megatron_a100.csv"
TORCHTITAN = REPO / "data" / "published_torchtitan_a100.csv"
MPT = REPO / "data" / "published_llmfoundry_mpt.csv"
WEAK_SCALING = REPO / "data" / "published_megatron_narayanan2021_a100.csv"
ZERO3 = REPO / "data" / "published_deepspeed_zero3_a100.csv"
MTNLG = REPO / "data" / "published_megatron_deepspeed_mtnlg_a100.csv"
ROWS = {PUBLISHED: 8, TORCHTITAN: 3, MPT: 191, WEAK_SCALING: 13, ZERO3: 3, MTNLG: 3}


@pytest.mark.parametrize("path", list(ROWS), ids=lambda p: p.stem)
def test_the_published_runs_import_whole(path):
    from paratune.datasets import parse_public_csv

    records, problems = parse_public_csv(path)
    assert not problems, problems
    assert len(records) == ROWS[path] and all(r.step_time_s > 0 for r in records)


def test_torchtitans_runs_are_fsdp_alone_with_their_stated_shapes():
    """The rows state every shape column (nothing assumed) and the layout FSDP2 runs:
    ZeRO-3 over all 64 ranks, no tensor or pipeline parallelism; the step time derived from
    the published tokens/s per GPU gives back the published MFU under the model FLOPs
    convention."""
    from paratune.models import features as F
    from paratune.models import load_measurements

    rows = load_measurements([TORCHTITAN])
    assert (rows["sharding"] == "zero3").all() and (rows["dp"] == 64).all()
    assert (rows["tp"] == 1).all() and (rows["pp"] == 1).all()
    assert set(rows["mlp"]) == {"swiglu"} and (rows["num_kv_heads"] <= rows["num_heads"]).all()
    mfu = F.step_time_at_mfu(F.Columns(rows)) / rows["step_time_s"].to_numpy(float)
    np.testing.assert_allclose(mfu, rows["mfu"].to_numpy(float), rtol=0.03)


def test_narayanans_rows_give_back_the_papers_figures():
    """The transcribed shapes give the parameter counts the paper states (to its one
    decimal), the layouts fill the stated GPUs, and the step times give back the stated
    teraFLOP/s per GPU under the paper's own FLOPs count (its Eq. 3, recomputation
    counted)."""
    import pandas as pd

    from paratune.models import load_measurements

    rows = load_measurements([WEAK_SCALING, ZERO3]).reset_index(drop=True)
    raw = pd.concat([pd.read_csv(p, comment="#") for p in (WEAK_SCALING, ZERO3)],
                    ignore_index=True)
    assert all(n.startswith(f"{m}-") for m, n in zip(raw["model"], rows["model_name"],
                                                     strict=True))
    # the paper's parameter count (its Eq. 2), to the one decimal its tables give
    lay, wid = rows["num_layers"].to_numpy(float), rows["hidden_size"].to_numpy(float)
    voc, seq = rows["vocab_size"].to_numpy(float), rows["seq_len"].to_numpy(float)
    params = 12 * lay * wid**2 * (1 + 13 / (12 * wid) + (voc + seq) / (12 * lay * wid))
    np.testing.assert_array_equal(np.round(params / 1e9, 1), raw["params_b"].to_numpy(float))
    assert (rows["world_size"].to_numpy() == raw["num_gpus"].to_numpy()).all()
    assert rows["world_size"].min() == 32 and rows["world_size"].max() == 3072
    zero3 = rows["source"].str.startswith("deepspeed").to_numpy()
    assert (rows["sharding"][zero3] == "zero3").all() and (rows["sharding"][~zero3] == "none").all()
    b, s, v = (rows[k].to_numpy(float) for k in ("global_batch_size", "seq_len", "vocab_size"))
    layers, h = rows["num_layers"].to_numpy(float), rows["hidden_size"].to_numpy(float)
    flops = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    tflops = raw["notes"].str.extract(r"(\d+) teraFLOP/s")[0].astype(float).to_numpy()
    achieved = flops / (rows["step_time_s"].to_numpy(float) * rows["world_size"]) / 1e12
    np.testing.assert_allclose(achieved, tflops, rtol=1e-3)


def test_mt_nlgs_rows_give_back_the_papers_figures():
    """MT-NLG's shape gives the stated 530B parameters (Narayanan et al.'s Eq. 2), its 8-way
    tensor and 35-way pipeline layout fills 280, 350 and 420 nodes of eight, and the stated
    iteration times give back the stated teraFLOP/s per GPU under Eq. 3 with recomputation
    counted (to the paper's rounding: 120.4 reads 121)."""
    import pandas as pd

    from paratune.measurement import family_of
    from paratune.models import load_measurements

    rows = load_measurements([MTNLG]).reset_index(drop=True)
    raw = pd.read_csv(MTNLG, comment="#")
    lay, h = rows["num_layers"].to_numpy(float), rows["hidden_size"].to_numpy(float)
    v, s = rows["vocab_size"].to_numpy(float), rows["seq_len"].to_numpy(float)
    params = 12 * lay * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * lay * h))
    np.testing.assert_array_equal(np.round(params / 1e9), raw["params_b"].to_numpy(float))
    assert rows["world_size"].tolist() == [8 * n for n in (280, 350, 420)]
    assert (rows["tp"] == 8).all() and (rows["pp"] == 35).all()
    assert rows["dp"].tolist() == [8, 10, 12] and (rows["sharding"] == "zero1").all()
    b = rows["global_batch_size"].to_numpy(float)
    flops = 96 * b * s * lay * h**2 * (1 + s / (6 * h) + v / (16 * lay * h))
    tflops = raw["notes"].str.extract(r"(\d+) teraFLOP/s")[0].astype(float).to_numpy()
    achieved = flops / (rows["step_time_s"].to_numpy(float) * rows["world_size"]) / 1e12
    np.testing.assert_allclose(achieved, tflops, rtol=0.006)
    # a family of its own: neither Megatron-LM's rows nor vTrain's Megatron-DeepSpeed sweep
    assert {family_of(x) for x in rows["source"]} == {"megatron-deepspeed"}


def test_a_source_meets_the_targets_only_with_both_figures_in_range():
    """``targets_met`` asks for the median predicted / measured in [0.8, 1.25] *and* the
    median APE at most 20%: a source read right on the median but scattered (a third of its
    runs 1.43x too fast, a third 0.71x) misses, as does one read 1.33x too fast throughout;
    one read 1.11x too fast throughout meets them."""
    import sys

    import pandas as pd

    sys.path.insert(0, str(REPO / "experiments"))
    from published_runs import score

    from paratune.models import load_measurements

    rows = load_measurements([MPT]).reset_index(drop=True)
    step = rows["step_time_s"].to_numpy(float)
    thirds = np.arange(len(rows)) % 3
    factors = {"scattered": np.choose(thirds, [0.7, 1.0, 1.4]), "fast": 0.75, "close": 0.9}
    frame = pd.concat([rows.assign(source=name, pred_step_time_s=step * f,
                                   pred_feasible_prob=1.0)
                       for name, f in factors.items()], ignore_index=True)
    got = {row["source"]: row for row in score(frame)}
    assert 0.8 <= got["scattered"]["ratio_median"] <= 1.25 < 1 + got["scattered"]["mdape"] / 100
    assert not got["scattered"]["targets_met"]
    assert got["fast"]["ratio_median"] > 1.25 and not got["fast"]["targets_met"]
    assert got["close"]["targets_met"]


def test_the_published_runs_plot_draws_a_panel_per_source(tmp_path):
    """A panel per source in the order the rows come, titled with the source, its runs and
    their median APE, written as one PNG."""
    import pandas as pd

    from paratune.models import load_measurements
    from paratune.models._evaluate_report import fold_panels, plot_panels

    rows = load_measurements([TORCHTITAN, MPT]).reset_index(drop=True)
    tokens = rows["global_batch_size"] * rows["seq_len"]
    measured = (tokens / (rows["step_time_s"] * rows["world_size"])).to_numpy(float)
    frame = pd.concat([rows, pd.DataFrame({
        "pred_tokens_per_sec_per_gpu": 1.1 * measured,
        "pred_tokens_per_sec_per_gpu_q10": 0.5 * measured,
        "pred_tokens_per_sec_per_gpu_q90": 2.0 * measured})], axis=1)
    panels = fold_panels(frame, by="source")
    assert [p["title"].splitlines() for p in panels] == [
        ["torchtitan_fsdp2", "3 runs, median APE 10.0%"],
        ["llmfoundry_mpt", "191 runs, median APE 10.0%"]]
    path = plot_panels(panels, tmp_path / "published_runs.png", title="published runs")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_llm_foundrys_runs_are_fsdp_alone_with_mpts_shapes():
    """Every GPU one FSDP rank (ZeRO-3), the stated MPT shapes (GeLU MLP of 4x the width,
    vocabulary 50368, tied embeddings), 125M to 70B on 8 to 128 GPUs of three kinds."""
    from paratune.models import load_measurements

    rows = load_measurements([MPT])
    assert (rows["sharding"] == "zero3").all() and (rows["dp"] == rows["world_size"]).all()
    assert (rows["ffn_hidden_size"] == 4 * rows["hidden_size"]).all()
    assert set(rows["mlp"]) == {"gelu"} and set(rows["vocab_size"]) == {50368}
    assert rows["tie_embeddings"].all()
    assert set(rows["hardware"]) == {"H100-80GB", "A100-80GB", "A100-40GB"}
    assert rows["world_size"].min() == 8 and rows["world_size"].max() == 128
    assert set(rows["recompute"]) == {"none", "full"}


def test_the_loss_over_the_vocabulary_weighs_on_small_models_only():
    """The loss's memory-bound work next to the blocks' element-wise work: larger than it
    for MPT-125M (12 layers of width 768 and 50,368 entries), about 1% of it for Llama 2
    70B; split over the tensor-parallel group; nothing on a CPU."""
    from paratune.models import features as F
    from paratune.models import load_measurements

    rows = load_measurements([MPT, TORCHTITAN]).reset_index(drop=True)
    c = F.Columns(rows)
    share = F.loss_s_per_microbatch(c) / F.elementwise_s_per_microbatch(c)
    plain = (rows["recompute"] == "none").to_numpy()
    small = (rows["model_name"] == "MPT-125m").to_numpy()
    assert np.all(share[small] > 1.0)
    llama = (rows["model_name"] == "Llama-2-70B").to_numpy()
    assert np.all(share[llama] < 0.02)
    assert np.all(share[plain & ~small] < share[small].min())
    split = F.Columns(rows.assign(tp=2, dp=rows["dp"] // 2))
    np.testing.assert_allclose(F.loss_s_per_microbatch(split), F.loss_s_per_microbatch(c) / 2)
    assert np.all(F.loss_s_per_microbatch(F.Columns(rows.assign(hardware="cpu"))) == 0.0)


def test_the_elementwise_share_falls_as_the_model_widens():
    """The memory-bound part of a block shrinks next to its matrix products as the model
    widens (same layout family: tensor-parallel 8, one micro-batch's worth of tokens), which
    is what lets the default core predict large models at a higher share of peak."""
    from paratune.models import features as F
    from paratune.models import load_measurements

    rows = load_measurements([PUBLISHED])
    c = F.Columns(rows)
    times = F.analytical_step_time(c)
    per_micro = times["compute_s"] / F.num_microbatches(c)
    share = F.elementwise_s_per_microbatch(c) / per_micro
    order = np.argsort(c.hidden, kind="stable")
    widths, shares = c.hidden[order], share[order]
    for w in np.unique(widths)[1:]:
        assert shares[widths == w].max() < shares[widths < w].min()
    # without a memory bandwidth in the catalogue (the CPU) the part is zero, not NaN
    cpu = F.Columns(rows.assign(hardware="cpu"))
    assert np.all(F.elementwise_s_per_microbatch(cpu) == 0.0)


@pytest.mark.slow
def test_published_runs_of_an_unmeasured_framework_are_predicted_within_target(public_dir):
    """Each source but DeepSpeed's within the targets (median predicted / measured in
    [0.8, 1.25], median APE <= 20%), every row predicted, q10-q90 covering 80% of all the
    runs together, and called feasible. DeepSpeed's ZeRO-3 runs are predicted too fast, the
    more so the more GPUs, and MT-NLG's Megatron-DeepSpeed runs a third too fast (read
    blind), both inside their interval."""
    import sys

    sys.path.insert(0, str(REPO / "experiments"))
    import pandas as pd
    from published_runs import score

    from paratune.measurement import family_of
    from paratune.models import PerformanceModel, load_measurements, metrics
    from paratune.models._estimators import PRED_WARNING

    model = PerformanceModel(n_estimators=200).fit(
        load_measurements(sorted(public_dir.glob("*.csv"))))
    published = load_measurements(list(ROWS)).reset_index(drop=True)
    pred = model.predict(published).reset_index(drop=True)
    assert np.isfinite(pred["pred_step_time_s"].to_numpy(float)).all()
    assert all(f"no measurement of family {family_of(s)}" in w
               for s, w in zip(published["source"], pred[PRED_WARNING], strict=True))
    both = pd.concat([published, pred], axis=1)
    rows = score(both)
    assert [r["source"] for r in rows] == ["deepspeed_zero3_narayanan2021", "llmfoundry_mpt",
                                           "megatron-deepspeed_mtnlg2022",
                                           "megatron_lm_korthikanti2022",
                                           "megatron_lm_narayanan2021", "torchtitan_fsdp2"]
    # DeepSpeed's ZeRO-3 over 48 to 192 nodes ran below the well-tuned pace the model
    # assumes (NCCL's hierarchical gathers), more so the more nodes: predicted too fast,
    # and the unmeasured family's interval holds the runs
    zero3, mtnlg, rows = rows[0], rows[2], rows[1:2] + rows[3:]
    assert zero3["ratio_median"] > 1.25 and zero3["coverage"] == 100.0
    assert not zero3["targets_met"]
    # Megatron-DeepSpeed's MT-NLG 530B ran about a quarter slower per GPU than Megatron-LM
    # alone on the same shape and layout (Narayanan's 2,520-GPU row, read within 10%)
    assert 1.25 < mtnlg["ratio_median"] < 1.45 and mtnlg["coverage"] == 100.0
    assert not mtnlg["targets_met"]
    for row in rows:
        assert 0.8 <= row["ratio_median"] <= 1.25, row
        assert row["mdape"] <= 20.0, row
        assert row["targets_met"], row
    # every one of them ran: a framework without measurements fits by its analytical memory,
    # not by the overheads of the frameworks measured (llm-foundry's tables run the largest
    # micro-batch that fits, a sixth of them over 95% of that estimate, where the memory
    # rule calls half of them out of memory)
    for row in [zero3, mtnlg, *rows]:
        assert row["false_fits"] == 0, row
        least = 80.0 if row["source"].startswith("llmfoundry") else 100.0
        assert row["feasible_right"] >= least, row
    assert metrics(both, both)["coverage"] >= 0.8
    ratio = pred["pred_tokens_per_sec_per_gpu"].to_numpy(float) / (
        published["global_batch_size"].to_numpy(float) * published["seq_len"].to_numpy(float)
        / (published["step_time_s"].to_numpy(float) * published["world_size"].to_numpy(float)))
    # the ZeRO-3 runs' miss grows with the GPUs (384, 768, 1,536)
    assert np.all(np.diff(ratio[published["source"].str.startswith("deepspeed").to_numpy()]) > 0)
    # Megatron-LM's runs one by one, 8 to 3,072 GPUs: none off by more than 35%
    megatron = published["source"].str.startswith("megatron_lm").to_numpy()
    assert np.all(np.abs(ratio[megatron] - 1.0) < 0.35), ratio[megatron]
    # the same 530B shape and layout under Megatron-LM alone (2,520 GPUs) is read within 10%
    alone = megatron & (published["num_layers"] == 105).to_numpy() & (
        published["pp"] == 35).to_numpy() & (published["world_size"] == 2520).to_numpy()
    assert alone.sum() == 1 and abs(ratio[alone][0] - 1.0) < 0.1, ratio[alone]
