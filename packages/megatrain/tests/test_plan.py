"""`megatrain plan`: the paper's scaling results reproduced by the time model, the memory
terms equal to what megacore allocates, the pipeline formula equal to megacore's schedule
tables, the GPU table, calibration, the CLI and `megatrain run`'s memory warning."""

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from megacore import parallel_state as ps
from megacore.distributed.data_parallel import BUCKET_ALIGNMENT, PARAM_ALIGNMENT
from megacore.testing import run_distributed
from megatrain.cli import main
from megatrain.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    load_config,
)
from megatrain.plan import calibrate, hardware
from megatrain.plan.accounting import (
    context_parallel_attention_per_layer,
    weight_grad_inputs_per_layer,
)
from megatrain.plan.attention_time import context_parallel_seconds
from megatrain.plan.cost_model import (
    estimate,
    memory_per_gpu,
    pipeline_seconds,
    schedule_seconds,
)
from megatrain.plan.costs import Costs, group_bandwidth
from megatrain.plan.layout import Layout, apply_layout, layout_of
from megatrain.plan.memory import GPU_MEMORY, memory_breakdown
from megatrain.plan.search import _reason, candidates, memory_warning, plan
from megatrain.plan.validation import PAPER, fit_builtin_profile, paper_config, predictions
from megatrain.run import launch

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
V100 = hardware.load_gpus()["v100-32gb"]


def test_the_paper_scaling_results_within_10_percent():
    """The V100 DGX-2H runs: the 1.2B baseline (39 TFLOP/s), Table 8's strong scaling,
    Table 7's heads, and the weak-scaling efficiencies at 8 and 512 GPUs."""
    got = predictions()
    for name, paper in PAPER.items():
        assert got[name] == pytest.approx(paper, rel=0.10), (name, got[name], paper)
    # the shapes the paper describes, not only the numbers
    assert got["speedup_tp2"] < got["speedup_tp4"] < got["speedup_tp8"] < 4
    assert got["heads_16"] > got["heads_24"] > got["heads_32"]
    assert 1 > got["weak_tp2"] > got["weak_tp4"] > got["weak_tp8"] > got["weak_tp8_dp64"]


def test_builtin_constants_are_the_fit():
    """gpus.toml's two fitted constants are the least-squares optimum (to their rounding):
    re-fitting from them moves neither by more than the rounding."""
    stored = hardware.builtin_profile()
    fitted, error = fit_builtin_profile(stored, rounds=2)
    assert abs(fitted.gemm_overhead_us - stored.gemm_overhead_us) <= 10
    assert abs(fitted.elementwise_passes - stored.elementwise_passes) <= 0.2
    assert error < 0.01  # every ratio within a few percent


def test_layer_terms_by_hand():
    """One layer of the 1.2B at tp 8: 4 all-reduces of s b h per microbatch (Fig. 4), 6 with
    full recompute; GEMMs at 80% of peak plus the fixed time."""
    config = paper_config(1)
    profile = hardware.builtin_profile()
    costs = Costs(V100, profile, "fp16")
    s, b, h = 1024, 8, 1536
    one = costs.collective("all_reduce", 2 * s * b * h, 8, 150e9)
    assert one == pytest.approx(20e-6 + 2 * 7 / 8 * 2 * s * b * h / (0.8 * 150e9))
    qkv = costs.gemm(s * b, 3 * h / 8, h)
    assert qkv == pytest.approx(2 * s * b * 3 * h / 8 * h / (0.8 * 125e12) + 320e-6)
    layouts = {r: Layout(tp=8, pp=1, dp=1, micro_batch=8, recompute=r) for r in ("none", "full")}
    runs = {r: estimate(config, lay, V100, profile, 50257, 8) for r, lay in layouts.items()}
    ends = runs["none"].time["tp_comm"] - 40 * 4 * one  # embedding and output layer
    assert 0 < ends < 3 * one
    assert runs["full"].time["tp_comm"] == pytest.approx(40 * 6 * one + ends)
    assert runs["full"].time["compute"] > runs["none"].time["compute"]


def test_tp_comm_overlap_hides_each_collective_behind_its_gemm():
    """Under sequence parallelism with parallel.tp_comm_overlap each of a layer's 4
    all-gathers / reduce-scatters per pass shows only what it takes beyond (tp - 1)/tp of
    its GEMM: the attention's input gather behind qkv, the projection's reduce-scatter
    behind proj, the MLP's behind fc1 and fc2 (the backward's behind half their backward,
    the input-gradient GEMM); the rest of the step is unchanged."""
    config = paper_config(8)  # the 8.3B at tp 8
    profile = hardware.builtin_profile()
    sp = Layout(tp=8, pp=1, dp=1, micro_batch=8, sequence_parallel=True)
    with_sp = apply_layout(config, sp)
    overlap = replace(with_sp, parallel=replace(with_sp.parallel, tp_comm_overlap=True))
    plain = estimate(with_sp, sp, V100, profile, 50257, 8)
    hidden = estimate(overlap, sp, V100, profile, 50257, 8)
    assert hidden.time["compute"] == plain.time["compute"]
    costs = Costs(V100, profile, "fp16")
    s, b, h, layers = 1024, 8, 3072, 72
    one = costs.collective("all_gather", 2 * s * b * h, 8, 150e9)
    gemms = {  # (forward, backward) of each of a layer's GEMMs on one TP rank
        "qkv": costs.gemm_fwd_bwd(s * b, 3 * h / 8, h),
        "proj": costs.gemm_fwd_bwd(s * b, h, h / 8),
        "fc1": costs.gemm_fwd_bwd(s * b, 4 * h / 8, h),
        "fc2": costs.gemm_fwd_bwd(s * b, h, 4 * h / 8),
    }
    layer = sum(
        max(0.0, one - 7 / 8 * g[0]) + max(0.0, one - 7 / 8 * g[1] / 2) for g in gemms.values()
    )
    ends = plain.time["tp_comm"] - layers * 8 * one  # the embedding's and output layer's
    assert hidden.time["tp_comm"] == pytest.approx(layers * layer + ends)
    assert hidden.time["tp_comm"] < 0.5 * plain.time["tp_comm"]
    # A config that asks for the overlap keeps it on the layouts with sequence parallelism
    # and drops it on the others (which the overrides say), refusing none for it.
    asked = replace(config, parallel=replace(config.parallel, tp_comm_overlap=True))
    for layout in (sp, replace(sp, sequence_parallel=False), replace(sp, tp=1, dp=8)):
        at = apply_layout(asked, layout)
        assert at.parallel.tp_comm_overlap == layout.sequence_parallel
        again = load_config(MODELS / "gpt2-8.3b.toml", layout.overrides())
        assert again.parallel.tp_comm_overlap is False  # the default, or set false
    result = plan(asked, 16, V100, profile, 50257, 16)
    assert not any("tp_comm_overlap" in reason for reason in result.rejected)
    assert any(e.layout.sequence_parallel for e in result.ranked)


def test_pipeline_formula_is_megacores_schedule_tables():
    """m max T + (sum T - max T) / vpp equals running the 1F1B and interleaved tables when the
    stages are equal or the last is the heaviest (the output layer and loss), and at most 6%
    pessimistic when the first is 10% heavier (its fill overlaps the others' in the tables)."""
    for pp, vpp, m in [(2, 1, 1), (2, 1, 4), (4, 1, 8), (4, 2, 8), (4, 3, 4), (8, 2, 16)]:
        for heavy, factor, exact in ((None, 1, True), (pp - 1, 1.5, True), (0, 1.1, False)):
            fwd, bwd = [1.0] * pp, [2.0] * pp
            if heavy is not None:
                fwd[heavy], bwd[heavy] = factor, 2 * factor
            table = schedule_seconds(m, fwd, bwd, vpp)
            formula = pipeline_seconds([f + b for f, b in zip(fwd, bwd, strict=True)], m, vpp)
            if exact:
                assert formula == pytest.approx(table), (pp, vpp, m, heavy)
            else:
                assert table * (1 - 1e-9) <= formula <= 1.06 * table, (pp, vpp, m, heavy)
    # ZB-H1 (m >= pp): fill (F + max(0, B - W)) / (F + B + W) of the tables, a third of
    # 1F1B's at F = B = W; never below the forwards' fill, F per stage.
    for pp, m in [(2, 2), (2, 5), (4, 8), (4, 16), (8, 16)]:
        for fwd, bwd, weight in ((1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 2.4, 1.4)):
            table = schedule_seconds(m, [fwd] * pp, [bwd] * pp, weight=[weight] * pp)
            fill = (fwd + max(0.0, bwd - 2 * weight)) / (fwd + bwd)
            assert pipeline_seconds([fwd + bwd] * pp, m, fill=fill) == pytest.approx(table)


def _tiny(kind: str = "gpt", precision: str = "fp32") -> Config:
    return Config(
        model=ModelConfig(
            kind=kind, num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000,
            max_position_embeddings=32,
        ),
        training=TrainingConfig(
            seq_length=32, micro_batch_size=2, global_batch_size=4, precision=precision
        ),
    )  # fmt: skip


# (kind, precision, tp, pp, vpp, dp, distributed optimizer): layouts of 2 ranks
STATE_LAYOUTS = [
    ("gpt", "bf16", 2, 1, 1, 1, False),
    ("gpt", "fp32", 1, 2, 1, 1, False),
    ("gpt", "bf16", 1, 2, 2, 1, False),
    ("gpt", "bf16", 1, 1, 1, 2, True),
    ("gpt", "fp32", 1, 1, 1, 2, True),
    ("bert", "fp32", 2, 1, 1, 1, False),
]


def _storage_bytes(tensors, exclude=()) -> int:
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure_state_bytes() -> list:
    """Each layout built as training builds it (chunks, DDP, optimizer, one step): this
    rank's bytes of weights, gradient buffers and optimizer state, and its stage."""
    from megatrain.models import build_model_chunks, model_config
    from megatrain.run.setup import PRECISION_DTYPES, prepare_training

    out = []
    for kind, precision, tp, pp, vpp, dp, distopt in STATE_LAYOUTS:
        layout = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch=2, distributed_optimizer=distopt)
        config = apply_layout(_tiny(kind, precision), layout)
        ps.initialize_model_parallel(tp, pp, vpp if vpp > 1 else None)
        dtype = PRECISION_DTYPES[precision]
        cfg = model_config(config, 1000)
        chunks = build_model_chunks(kind, cfg, 1, dtype=dtype)
        chunks, optimizer = prepare_training(config, chunks)
        for chunk in chunks:
            for buffer in chunk.buffers:
                buffer.grad_data.zero_()
        optimizer.step()  # Adam's moments exist from the first step
        params = [p for c in chunks for p in c.parameters()]
        weights = {p.untyped_storage().data_ptr() for p in params}
        grads = [b.grad_data for c in chunks for b in c.buffers]
        # megacore aligns each parameter's start (and a sharded bucket's end): the plan counts
        # parameters, so the padding between them is taken out, and bounded.
        buffers = [b for c in chunks for b in c.buffers]
        padding = sum(b.padding for b in buffers)
        tensors = sum(len(b.param_ranges) for b in buffers)
        buckets = sum(len(b.buckets) for b in buffers)
        assert padding < tensors * PARAM_ALIGNMENT + buckets * math.lcm(dp, BUCKET_ALIGNMENT)
        sharded = [b for b in buffers if b.param_data is not None]
        inner = optimizer.optimizer
        masters = [p for g in inner.param_groups for p in g["params"]]
        state = [v for s in inner.state.values() for v in s.values() if v.dim() > 0]
        out.append(
            {
                "stage": ps.get_pipeline_model_parallel_rank(),
                "weights": _storage_bytes(params)
                - sum(b.padding * b.param_data.element_size() for b in sharded),
                "gradients": _storage_bytes(grads)
                - sum(b.padding * b.grad_data.element_size() for b in buffers),
                "optimizer_state": _storage_bytes([*masters, *state], exclude=weights),
            }
        )
        ps.destroy_model_parallel()
    return out


def test_predicted_state_bytes_equal_what_megacore_allocates():
    """Weights, gradient buffers and optimizer state of each rank, measured from the storages
    after a real optimizer step, equal megatrain.plan.memory's terms the plan reports, exactly,
    less the buffers' alignment padding (under 64 elements a tensor and lcm(dp, 128) a
    bucket), which the plan does not count."""
    per_rank = run_distributed(_measure_state_bytes, world_size=2, timeout=240)
    for rank, measured in enumerate(per_rank):
        for case, got in zip(STATE_LAYOUTS, measured, strict=True):
            kind, precision, tp, pp, vpp, dp, distopt = case
            layout = Layout(tp, pp, dp, vpp, 2, "none", False, distopt)
            config = apply_layout(_tiny(kind, precision), layout)
            want = memory_breakdown(
                config, vocab_size=1000, data_parallel_size=dp, stage=got["stage"]
            )
            for part in ("weights", "gradients", "optimizer_state"):
                assert got[part] == want[part], (rank, case, part, got[part], want[part])


def test_plan_ranks_fitting_layouts_and_says_why_others_do_not():
    config = load_config(MODELS / "gpt2-8.3b.toml")
    result = plan(config, 512, V100, hardware.builtin_profile(), 50257, 512)
    assert result.ranked and result.enumerated == len(result.ranked) + sum(
        r["count"] for r in result.rejected.values()
    )
    times = [e.time["total"] for e in result.ranked]
    assert times == sorted(times)
    best = result.ranked[0]
    assert best.fits and best.layout.gpus == 512
    assert sum(best.time[k] for k in best.time if k != "total") == pytest.approx(best.time["total"])
    assert 0.1 < best.mfu < 0.5
    assert "does not fit in memory" in result.rejected
    assert any("num_attention_heads" in reason for reason in result.rejected)
    # reasons add up with their numbers taken out, schedule names kept whole
    said = "pipeline_schedule = 'zb-h1' at pp 4: use '1f1b' (72.1 GiB on h100-80gb)"
    assert _reason(ConfigError(said)) == (
        "pipeline_schedule = 'zb-h1' at pp N: use '1f1b' (N.N GiB on h100-80gb)"
    )
    # the paper's layout fits, and is slower than the best (full recompute, no sp)
    paper = layout_of(config, 64)
    assert result.position(paper) is not None and result.position(paper) > 0
    # sequence parallelism and the distributed optimizer each save memory
    base = estimate(config, replace(paper, recompute="selective"), V100, result.profile, 50257)
    sp = estimate(config, replace(base.layout, sequence_parallel=True), V100, result.profile, 50257)
    dopt = replace(base.layout, distributed_optimizer=True)
    sharded = estimate(config, dopt, V100, result.profile, 50257)
    assert sp.memory["activations"] < base.memory["activations"]
    assert sharded.memory["optimizer_state"] == pytest.approx(base.memory["optimizer_state"] / 64)


def test_bandwidth_inside_and_between_nodes():
    assert group_bandwidth(V100, 8, 1) == 150e9  # tp 8 in a node of 16
    assert group_bandwidth(V100, 32, 1) == 6.25e9 * 16  # over two nodes: all 16 adapters
    assert group_bandwidth(V100, 64, 8) == 6.25e9 * 2  # dp 64 at tp 8: 2 members per node
    # interleaving shrinks the bubble; data parallelism over nodes costs more than within
    config = paper_config(8, global_batch=64)
    profile = hardware.builtin_profile()
    one = Layout(tp=8, pp=2, dp=1, micro_batch=8, recompute="full")
    flat = estimate(config, one, V100, profile, 50257)
    interleaved = estimate(config, replace(one, vpp=4), V100, profile, 50257)
    assert interleaved.time["pp_bubble"] < flat.time["pp_bubble"]


def test_plan_weighs_zero_bubble_against_its_memory():
    """ZB-H1 cuts the bubble (to 0.65 of 1F1B's here: only the dense GEMMs' weight gradients
    move to W, the attention core's and the element-wise backward stay in B), and its last
    stage keeps pp - 1 microbatches' weight-gradient inputs: the plan lists it, and it
    ranks above its 1F1B twin where the memory is there."""
    config = paper_config(8, global_batch=64)
    profile = hardware.builtin_profile()
    base = Layout(tp=8, pp=4, dp=1, micro_batch=2, recompute="selective")
    flat = estimate(config, base, V100, profile, 50257)
    zb = estimate(config, replace(base, schedule="zb-h1"), V100, profile, 50257)
    assert 0.5 < zb.time["pp_bubble"] / flat.time["pp_bubble"] < 0.8
    assert zb.time["compute"] == flat.time["compute"] and zb.time["total"] < flat.time["total"]
    config_zb = apply_layout(config, zb.layout)
    assert config_zb.parallel.pipeline_schedule == "zb-h1"
    last = memory_breakdown(config_zb, vocab_size=50257, data_parallel_size=1, stage=3)
    last_1f1b = memory_breakdown(
        apply_layout(config, base), vocab_size=50257, data_parallel_size=1, stage=3
    )
    per_layer = weight_grad_inputs_per_layer(config_zb)
    layers = config.model.num_layers // 4
    assert last["activations"] - last_1f1b["activations"] == pytest.approx(3 * layers * per_layer)
    first = memory_breakdown(config_zb, vocab_size=50257, data_parallel_size=1, stage=0)
    assert (
        first["activations"]
        == memory_breakdown(
            apply_layout(config, base), vocab_size=50257, data_parallel_size=1, stage=0
        )["activations"]
    )
    assert 'parallel.pipeline_schedule="zb-h1"' in zb.layout.overrides()
    result = plan(config, 32, V100, profile, 50257)
    schedules = {e.layout.schedule for e in result.ranked if e.layout.pp > 1}
    assert {"1f1b", "zb-h1", "interleaved"} <= schedules
    best_zb = next(e for e in result.ranked if e.layout.schedule == "zb-h1")
    twin = result.position(replace(best_zb.layout, schedule="1f1b"))
    assert twin is None or twin > result.position(best_zb.layout)


def test_gpu_table_is_memory_py_s_and_takes_more_gpus(tmp_path):
    table = hardware.load_gpus()
    assert {"v100-32gb", "a100-80gb", "h100-80gb", "h200-141gb", "b200-180gb"} <= set(table)
    assert {k: g.memory_bytes for k, g in table.items()} == GPU_MEMORY
    extra = tmp_path / "gpus.toml"
    extra.write_text(
        "[gpu.mi300x]\nname = 'AMD MI300X'\nmemory_gib = 192\n"
        "peak_tflops = { bf16 = 1307.4, fp16 = 1307.4 }\nhbm_gbps = 5300\n"
        "intra_node_gbps = 64\ninter_node_gbps = 50\ngpus_per_node = 8\n"
    )
    assert hardware.load_gpus(extra)["mi300x"].peak_flops("bf16") == 1307.4e12
    extra.write_text("[gpu.bad]\nname = 'no numbers'\n")
    with pytest.raises(hardware.HardwareError, match="misses memory_gib"):
        hardware.load_gpus(extra)
    with pytest.raises(ValueError, match="no bf16 peak"):
        V100.peak_flops("bf16")


def test_calibration_fits_and_profile_round_trip(tmp_path, monkeypatch):
    """The fits recover known constants; a CPU calibration (small GEMMs, no collectives)
    writes a profile that plans for its own device and says so."""
    gemms = [(n, n, n, 2 * n**3 / 50e9 + 30e-6) for n in (64, 128, 256, 512)]
    rate, overhead = calibrate.fit_gemms(gemms)
    assert rate == pytest.approx(50e9) and overhead == pytest.approx(30e-6)
    reduces = [(n, 40e-6 + n / 2e9) for n in (1 << 14, 1 << 18, 1 << 22)]  # 2 ranks: f = 1
    assert calibrate.fit_collectives(reduces, 2) == pytest.approx((2e9, 40e-6))

    monkeypatch.setattr(calibrate, "GEMM_SIZES_CPU", (32, 64, 128))
    monkeypatch.setattr(calibrate, "COPY_BYTES", {"cpu": 4 << 20})
    monkeypatch.setattr(calibrate, "LAYERS_CPU", ((64, 4, 32, 1), (64, 4, 32, 4), (128, 4, 64, 2)))
    monkeypatch.setattr(calibrate, "ATTENTION_SEQ_CPU", (64, 128))
    out = tmp_path / "cpu.json"
    result = CliRunner().invoke(
        main, ["plan", "--calibrate", "--out", str(out), "--ranks", "1"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    profile = hardware.load_profile(out)
    assert profile.device.key == "cpu" and profile.gemm_efficiency == pytest.approx(1.0)
    # the whole profile measured: GEMMs by size (the 3 square and 2 thin ones), attention by
    # sequence length, the copy being the CPU's bandwidth itself
    assert profile.measured and len(profile.gemm_efficiency_by_size) == 5
    assert [s for s, _ in profile.attention_tflops] == [64, 128]
    assert all(t > 0 for _, t in profile.attention_tflops)
    assert profile.hbm_efficiency == pytest.approx(1.0)
    assert profile.collective_latency_us == hardware.builtin_profile().collective_latency_us
    # no float8 GEMMs measured on a CPU: volta's (none) kept, and the measurements say so
    assert profile.fp8_gemm_efficiency is None
    assert profile.measurements["fp8_gemms"] == "profile volta's, not measured"
    # what a GPU with float8 tensor cores runs, timed here through torch._scaled_mm's CPU path
    fp8 = calibrate.measure_fp8_gemms(torch.device("cpu"), (32, 64), repeats=1)
    assert [n for n, _ in fp8] == [32, 64] and all(t > 0 for _, t in fp8)
    best = max(2 * n**3 / t for n, t in fp8)
    assert calibrate.fp8_gemm_efficiency(fp8, best / 0.5) == pytest.approx(0.5)
    args = ["plan", "--config", str(MODELS / "gpt2-tiny.toml"), "model.vocab_size=1000"]
    result = CliRunner().invoke(main, [*args, "--gpus", "1", "--profile", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["profile"]["name"] == str(out) and data["profile"]["measured"]
    assert data["profile"]["source"].startswith("calibrated on ") and data["gpu"]["key"] == "cpu"
    assert data["layouts"][0]["layout"]["tp"] == 1


def test_cli_plan_text_json_and_bad_input():
    config = str(MODELS / "gpt2-8.3b.toml")
    args = ["plan", "--config", config, "--gpus", "512", "--gpu", "v100-32gb", "--nodes-of", "16"]
    result = CliRunner().invoke(main, [*args, "--global-batch", "512", "--top", "3"])
    assert result.exit_code == 0, result.output
    assert "built-in" in result.output and "refused:" in result.output
    assert "does not fit in memory" in result.output
    assert "checkpoint.async_save" not in result.output
    data = json.loads(CliRunner().invoke(main, [*args, "--json", "--top", "2"]).output)
    assert len(data["layouts"]) == 2 and data["gpus"] == 512
    assert data["layouts"][0]["host_checkpoint_copy_gib"] == 0
    # Saving in the background: the host copy of each rank's state, a line under the table.
    background = [*args, "checkpoint.async_save=true", "--top", "1"]
    copy = json.loads(CliRunner().invoke(main, [*background, "--json"]).output)["layouts"][0]
    assert copy["host_checkpoint_copy_gib"] > 0
    line = f"checkpoint.async_save: #1 keeps {copy['host_checkpoint_copy_gib']:.1f} GiB of host"
    assert line in CliRunner().invoke(main, background).output
    assert set(data["layouts"][0]["time_s"]) >= {"compute", "tp_comm", "pp_bubble", "dp_comm"}
    bert = [
        "plan",
        "--config",
        str(MODELS / "bert-3.9b.toml"),
        "--gpus",
        "64",
        "--gpu",
        "a100-80gb",
    ]
    assert CliRunner().invoke(main, bert).exit_code == 0
    for bad, flag in [
        (["--gpus", "100"], "--gpus 100 is not a whole number of nodes of 16 (--nodes-of)"),
        (["--gpus", "0"], "--gpus"),
        (["--gpus", "8", "--gpu", "tpu-v9"], "--gpu 'tpu-v9' is not in the GPU table"),
        (["--gpus", "8", "--gpu", "v100-32gb", "training.precision=bf16"], "no bf16 peak"),
    ]:
        extra = [] if "--gpu" in bad else ["--gpu", "v100-32gb", "--nodes-of", "16"]
        result = CliRunner().invoke(main, ["plan", "--config", config, *bad, *extra])
        assert result.exit_code == 2 and flag in result.output, (bad, result.output)
    result = CliRunner().invoke(main, ["plan", "--config", config, "--gpus", "8"])
    assert result.exit_code == 2 and "--gpu is required" in result.output


def test_run_warns_when_the_plan_does_not_fit_the_gpu(monkeypatch):
    """On a (pretended) 8 GiB GPU the 1.2B config's layout does not fit: `megatrain run` warns
    before starting workers, unless --no-plan-check; then refuses the missing corpus."""

    class Props:
        total_memory = 8 * 2**30
        major, minor = 9, 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(launch, "launch", None)  # never reached
    args = ["run", "--config", str(MODELS / "gpt2-1.2b.toml"), "--nproc-per-node", "1"]
    args.append("data.corpus=/nonexistent/corpus")
    warned = CliRunner().invoke(main, args)
    assert "warning: the planner predicts" in warned.output and "8.0 GiB" in warned.output
    quiet = CliRunner().invoke(main, [*args, "--no-plan-check"])
    assert "warning" not in quiet.output
    assert warned.exit_code == quiet.exit_code == 2  # the corpus
    # The estimate is of the attention kernel that will run: on Ampere and newer SDPA's fused
    # kernel keeps no s x s scores (23.2 GiB for this layout), on a V100 they are kept (23.9):
    # a 26.2 GiB GPU holds the first within 90%, not the second.
    Props.total_memory = int(26.2 * 2**30)
    for (Props.major, Props.minor), warns in (((7, 0), True), ((8, 0), False), ((9, 0), False)):
        said = CliRunner().invoke(main, args).output
        assert ("warning: the planner predicts" in said) == warns, (Props.major, said)


def test_memory_warning_names_the_parts():
    config = load_config(MODELS / "gpt2-8.3b.toml")
    assert memory_warning(config, 64, 50257, 32 * 2**30) is None  # sized for a 32 GB V100
    small = replace(config, parallel=ParallelConfig(tensor_model_parallel_size=8))
    message = memory_warning(small, 1, 50257, 16 * 2**30)
    assert "optimizer state" in message and "activations" in message


@pytest.mark.parametrize(
    "name",
    sorted(  # the paper's sizes; the Llama and mixture-of-experts configs are not the paper's
        p.stem
        for p in MODELS.glob("*.toml")
        if "tiny" not in p.stem
        and not p.stem.startswith(("llama", "mixtral", "qwen", "deepseek", "moonlight", "gpt-oss"))
    ),
)
def test_shipped_layouts_are_the_plans_choice_at_the_papers_tp(name):
    """Each paper config's `# layout:` comment: the plan it names ranks the config's micro
    batch and recompute first among the layouts at its tp, pp 1, without sequence
    parallelism or the distributed optimizer (or FSDP)."""
    path = MODELS / f"{name}.toml"
    command = next(line for line in path.read_text().splitlines() if "megatrain plan" in line)
    gpus = int(command.split("--gpus ")[1].split()[0])
    assert f"--config pipelines/models/{name}.toml" in command and "--gpu v100-32gb" in command
    config = load_config(path)
    tp, vocab = config.parallel.tensor_model_parallel_size, config.model.vocab_size
    batch = config.training.global_batch_size
    profile = hardware.builtin_profile()
    paper_like = [
        estimate(config, layout, V100, profile, vocab)
        for layout, error in candidates(config, gpus, batch)
        if error is None
        and layout.tp == tp
        and layout.pp == 1
        and not (layout.sequence_parallel or layout.distributed_optimizer or layout.fsdp)
    ]
    best = min((e for e in paper_like if e.fits), key=lambda e: e.time["total"])
    shipped = layout_of(config, gpus // tp)
    assert best.layout == shipped


def test_plan_answers_for_deepseek_v3_on_256_h100s():
    """DeepSeek-V3's 671B on 256 H100s: the plan's first is the shipped config's layout, FSDP
    over all 256 GPUs with the routed experts over ep 256 (tp 1, pp 1, full recompute, every
    microbatch's gradients reduce-scattered).  The shipped micro batch is smaller (its
    unfused estimate fits too), ranked close behind.  Searched here at the shipped split
    (every cp and its communication, micro batch, recompute and sharding): the whole search,
    minutes on a CPU, ranks the same first (docs/planning.md; test_deepseek_plan.py)."""
    config = load_config(MODELS / "deepseek-v3.toml")
    fixed = {"tp": 1, "pp": 1, "ep": 256}
    result = plan(config, 256, H100, hardware.gpu_profile(H100), 129280, fixed=fixed)
    best = result.ranked[0]
    shipped = layout_of(config, 256 // config.ranks_per_replica)
    assert replace(best.layout, micro_batch=shipped.micro_batch) == shipped
    assert shipped.fsdp and shipped.ep == 256 and shipped.reduce_every_microbatch
    ours = next(e for e in result.ranked if e.layout == shipped)
    assert ours.fits and ours.time["total"] < 1.02 * best.time["total"]


def test_plan_answers_for_llama3_8b_on_8_h100s():
    """The Llama's shape (grouped-query K/V, SwiGLU, untied output) in the plan's memory and
    time: every ranked layout fits 80 GB, splits whole key/value groups over tp, and counts
    the model FLOPs accounting gives."""
    from megatrain.models import model_config
    from megatrain.plan.accounting import flops_per_iteration

    config = load_config(MODELS / "llama3-8b.toml")
    h100 = hardware.load_gpus()["h100-80gb"]
    result = plan(config, 8, h100, hardware.gpu_profile(h100), 128256, 512)
    assert result.ranked and all(e.fits and e.layout.gpus == 8 for e in result.ranked)
    assert all(8 % e.layout.tp == 0 for e in result.ranked)  # 8 key/value groups
    best = result.ranked[0]
    cfg = model_config(apply_layout(config, best.layout), 128256)  # the vocabulary padded for tp
    flops, _ = flops_per_iteration("llama", cfg, 512, 8192)
    assert best.mfu == pytest.approx(flops / (best.time["total"] * 8 * h100.peak_flops("bf16")))


H100 = hardware.load_gpus()["h100-80gb"]
LLAMA3_VOCAB = 128256


@functools.cache
def _long_context_plan(name: str, gpus: int):
    config = load_config(MODELS / f"{name}.toml")
    return config, plan(config, gpus, H100, hardware.gpu_profile(H100), LLAMA3_VOCAB)


@pytest.mark.parametrize(
    ("name", "gpus"),
    [("llama3-8b-32k", 8), ("llama3-8b-32k", 64), ("llama3-8b-128k", 8), ("llama3-8b-128k", 64)],
)
def test_long_context_plans_search_context_parallelism(name, gpus):
    """Llama 3 8B at 32k and 128k tokens on 8 and 64 H100s, flash attention (the H100's): the
    plan searches cp with both communications beside tp, pp, dp and FSDP and ranks first a
    layout that splits the sequence over megacore's fused ring ("p2p"), which skips the
    masked half of causal attention as flash does at cp 1; the all-gather layouts, whose
    masked SDPA computes every score, are ranked with their K/V traffic, below the ring."""
    config, result = _long_context_plan(name, gpus)
    wanted = {"cp p2p", "cp allgather", "tp", "pp", "dp", "fsdp"}
    for layout, error in candidates(config, gpus, config.training.global_batch_size):
        if error is None:
            wanted -= {
                *([f"cp {layout.cp_comm}"] if layout.cp > 1 else []),
                *(["tp"] if layout.tp > 1 else []),
                *(["pp"] if layout.pp > 1 else []),
                *(["dp"] if layout.dp > 1 else []),
                *(["fsdp"] if layout.fsdp else []),
            }
        if not wanted:
            break
    assert not wanted, f"never searched: {wanted}"
    best = result.ranked[0]
    assert best.fits and best.layout.gpus == gpus
    assert best.layout.cp > 1 and best.layout.cp_comm == "p2p" and best.time["cp_comm"] > 0
    assert f"parallel.context_parallel_size={best.layout.cp}" in best.layout.overrides()
    gathered = [e for e in result.ranked if e.layout.cp > 1 and e.layout.cp_comm == "allgather"]
    assert gathered and all(e.time["cp_comm"] > 0 for e in gathered)
    assert gathered[0].time["total"] > 1.3 * best.time["total"]  # every score computed
    # Without cp the best is behind (within 1% at 32k on 8 GPUs, 18% at 128k on 64): the
    # ring saves no attention FLOPs over flash, it spreads the per-token work and memory.
    alone = next(e for e in result.ranked if e.layout.cp == 1)
    assert best.time["total"] < alone.time["total"]
    if (name, gpus) == ("llama3-8b-128k", 8):
        # Layouts without cp fit: flash keeps no s x s scores, so under full recompute a
        # layer holds its per-token tensors only (--attention unfused leaves none).
        assert alone.layout.recompute == "full"
        # The fused ring keeps only its log-sum-exp beyond the per-token tensors; the float32
        # ring packed documents take keeps every block's scores, which pass the GPU at every
        # tp x cp of 8 GPUs.
        for tp, cp in ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)):
            at = apply_layout(config, Layout(tp=tp, pp=1, dp=1, cp=cp, cp_comm="p2p"))
            assert context_parallel_attention_per_layer(at) == 4 * 32 / tp * (131072 // cp)
            documents = replace(at, data=replace(at.data, reset_attention_mask=True))
            assert context_parallel_attention_per_layer(documents) > H100.memory_bytes


@pytest.mark.parametrize("name", ["llama3-8b-32k", "llama3-8b-128k"])
def test_long_context_configs_are_the_plans_choice(name):
    """Each long-context config's layout is the 8-GPU plan's fastest among the layouts that
    fit 80 GB with 10% to spare at data parallelism 1 (the configs leave dp to the job) by the
    plan's estimate and by the unfused one (memory_per_gpu's default: what `megatrain run`
    checks before it starts on a GPU older than Ampere; at cp > 1 the two are the same, the
    ring's kernel being megacore's own); it splits the sequence over the fused ring."""
    config = load_config(MODELS / f"{name}.toml")
    command = next(line for line in (MODELS / f"{name}.toml").read_text().splitlines()
                   if "megatrain plan" in line)  # fmt: skip
    assert f"--config pipelines/models/{name}.toml --gpus 8 --gpu h100-80gb" in command
    _, result = _long_context_plan(name, 8)
    usable = 0.9 * H100.memory_bytes
    alone = [
        e
        for e in result.ranked
        if e.layout.dp == 1
        and memory_per_gpu(apply_layout(config, e.layout), LLAMA3_VOCAB, 1)["total"] <= usable
    ]
    shipped = layout_of(config, 8 // config.ranks_per_replica)
    assert alone[0].layout == shipped
    assert shipped.cp > 1 and shipped.cp_comm == "p2p"
    at = apply_layout(config, shipped)
    assert memory_per_gpu(at, LLAMA3_VOCAB, 1, H100.attention)["total"] <= usable


def test_fsdp_gathers_and_reduce_scatters_share_the_link_by_hand():
    """FSDP's exposed communication in a step of 4 microbatches over 10 layers: each forward
    shows its first layer's gather; each backward its first layer's gather again (resharded
    after the forward) and, where it reduces, the last layer's reduce-scatter, unless the
    gathers and reduce-scatters together outlast the backward: they share the link."""
    from megatrain.plan.cost_model import _fsdp_exposed

    # light: a gather 1 s, a reduce-scatter 2 s, behind a 10 s forward and 20 s backward
    gathers, reduces = _fsdp_exposed(1.0, 2.0, 10.0, 20.0, 10, 4, 4, True)
    assert gathers + reduces == pytest.approx(4 * 0.1 + 4 * (0.1 + 0.2))
    assert reduces == pytest.approx(4 * 2 / 3 * 0.3)  # its share of a reducing backward
    # heavy: a 2.5 s backward hides either alone, not both: 1 + 2 - 2.5 shows
    gathers, reduces = _fsdp_exposed(1.0, 2.0, 10.0, 2.5, 10, 4, 4, True)
    assert gathers + reduces == pytest.approx(4 * 0.1 + 4 * 0.5)
    # reducing once a step: three backwards only regather (hidden but the first layer's)
    gathers, reduces = _fsdp_exposed(1.0, 2.0, 10.0, 2.5, 10, 4, 1, True)
    assert gathers + reduces == pytest.approx(4 * 0.1 + 3 * 0.1 + 0.5)
    # kept gathered after the forward: the backward only reduce-scatters
    gathers, reduces = _fsdp_exposed(1.0, 2.0, 10.0, 2.5, 10, 4, 4, False)
    assert (gathers, reduces) == pytest.approx((4 * 0.1, 4 * 0.2))


def test_context_parallel_communication_by_hand():
    """Per layer and microbatch on one TP rank: the all-gather of the other ranks' K/V and the
    reduce-scatter of their gradients, unhidden; the ring's cp - 1 blocks hidden behind the
    attention where it is longer, in the forward and (with their gradients) in the re-run of
    the backward; again in the backward when the attention is recomputed.  The CP group sits
    on NVLink while tp x cp GPUs fit a node, and the gradients are reduced over dp x cp."""
    config = load_config(MODELS / "llama3-8b-32k.toml")
    costs = Costs(H100, hardware.builtin_profile(), "bf16")
    kv = 2 * 2 * 1 * 32768 * (8 / 2) * 128  # bf16 K and V of the sequence, 4 groups a TP rank
    nvlink = group_bandwidth(H100, 4, 2)
    assert nvlink == 450e9 and group_bandwidth(H100, 4, 4) == 2 * 50e9  # 2 per node
    gather = Layout(tp=2, pp=1, dp=1, cp=4, cp_comm="allgather")
    got = context_parallel_seconds(config, gather, costs, 1.0, nvlink)
    forward = costs.collective("all_gather", kv, 4, nvlink)
    assert forward == pytest.approx(20e-6 + 3 / 4 * kv / (0.8 * 450e9))
    assert got == pytest.approx(forward + costs.collective("reduce_scatter", kv, 4, nvlink))
    selective = replace(gather, recompute="selective")
    assert context_parallel_seconds(config, selective, costs, 1.0, nvlink) == pytest.approx(
        got + forward
    )
    # The fused ring: cp - 1 K/V blocks passed on behind the forward's calls; in the backward
    # (the ring run again) cp - 1 blocks and their float32 gradients (twice the bf16 bytes)
    # behind the backward's calls, and the last gradient, going home, exposed.
    ring = replace(gather, cp_comm="p2p", recompute="none")
    step = costs.collective("p2p", kv / 4, 2, nvlink)
    grads = costs.collective("p2p", 2 * kv / 4, 2, nvlink)
    hidden = context_parallel_seconds(config, ring, costs, 1.0, nvlink, 2.5)  # attention, s
    exposed = context_parallel_seconds(config, ring, costs, 0.0, nvlink, 0.0)
    assert hidden == pytest.approx(grads)
    assert exposed == pytest.approx(3 * step + 3 * (step + grads) + grads)
    assert context_parallel_seconds(config, replace(ring, cp=1), costs, 0.0, nvlink) == 0
    # With packed documents the float32 ring: each block's gradient sent back exposed, in the
    # backward of every block.
    documents = replace(config, data=replace(config.data, reset_attention_mask=True))
    hidden = context_parallel_seconds(documents, ring, costs, 1.0, nvlink, 2.5)
    assert hidden == pytest.approx(3 * step)
    # cp 2 against cp 1 at the same tp on the same 8 GPUs: half the tokens per rank in twice
    # the microbatches (the same TP traffic an iteration), the gradients' all-reduce over the
    # same 8 / tp ranks, the K/V on the wire.
    h100 = hardware.with_attention(H100, "unfused")  # volta's profile cannot time flash
    one = estimate(config, Layout(tp=2, pp=1, dp=4, recompute="full"), h100, costs.profile,
                   LLAMA3_VOCAB)  # fmt: skip
    two = estimate(config, Layout(tp=2, pp=1, dp=2, cp=2, cp_comm="allgather",
                                  recompute="full"), h100, costs.profile, LLAMA3_VOCAB)  # fmt: skip
    assert two.memory["activations"] < 0.6 * one.memory["activations"]
    assert two.time["cp_comm"] > 0 == one.time["cp_comm"]
    assert two.time["dp_comm"] == pytest.approx(one.time["dp_comm"])
    assert two.time["tp_comm"] == pytest.approx(one.time["tp_comm"], rel=0.05)


def test_the_search_over_workers_equals_one_process(monkeypatch):
    """`plan(workers=2)` forks its workers (the 8.3B on 512 GPUs: 385 splits, 97 tasks) and
    ranks, refuses and counts exactly as one process, in the same order."""
    from megatrain.plan import search

    pools = []
    real = search._pool
    monkeypatch.setattr(search, "_pool", lambda job, n: pools.append(real(job, n)) or pools[-1])
    config = load_config(MODELS / "gpt2-8.3b.toml", [])
    h100 = hardware.load_gpus()["h100-80gb"]
    one, two = (
        plan(config, 512, h100, hardware.gpu_profile(h100), 50257, workers=w) for w in (1, 2)
    )
    assert pools[0] is None and pools[1] is not None  # the second did fork
    assert len(one.ranked) > 1000 and one.enumerated > len(one.ranked)
    assert [(e.layout, e.time, e.memory) for e in two.ranked] == [
        (e.layout, e.time, e.memory) for e in one.ranked
    ]
    assert (two.rejected, two.enumerated) == (one.rejected, one.enumerated)
