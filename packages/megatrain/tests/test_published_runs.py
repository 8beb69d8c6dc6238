"""The published runs the planner is checked against (published_runs.toml): the table is
read and checked whole, and a malformed row is refused naming the row and the field."""

import re
import sys
from dataclasses import replace

import pytest

from megatrain.models import model_config
from megatrain.plan.accounting import activations_per_layer, layer_gemms, recomputed_flops
from megatrain.plan.attention_time import attention_core_seconds
from megatrain.plan.cost_model import layer_seconds
from megatrain.plan.costs import Costs
from megatrain.plan.hardware import builtin_profile
from megatrain.plan.layout import apply_layout
from megatrain.plan.memory import memory_breakdown
from megatrain.plan.published import (
    METRICS,
    PublishedError,
    load_runs,
    predict,
    predicted,
    run_gpu,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROW = """
[[run]]
name = "tiny"
use = "check"
source = "a paper"
where = "Table 1, row 1"
[run.model]
kind = "llama"
layers = 4
hidden = 256
heads = 8
query_groups = 2
ffn = 704
vocab = 1024
[run.layout]
gpu = "h100-80gb"
gpus = 8
tp = 2
pp = 2
dp = 2
micro_batch = 1
global_batch = 8
seq_length = 128
precision = "bf16"
recompute = "selective"
sequence_parallel = true
sharding = "optimizer"
[run.published]
metric = "tokens_per_s_per_gpu"
value = 1000.0
definition = "tokens per second per GPU"
"""


def test_the_table_parses_and_every_row_is_a_valid_run():
    runs = load_runs()
    assert len(runs) >= 20
    assert len({r.name for r in runs}) == len(runs)
    assert {r.use for r in runs} == {"fit", "check"}
    # the rows used for fitting are the 2019 paper's alone; every other one only checks
    assert all(r.name.startswith("megatron2019") for r in runs if r.use == "fit")
    for run in runs:
        assert run.source and run.where, run.name
        assert run.metric in METRICS and run.value > 0, run.name
        assert run.layout.gpus == run.gpus, run.name
        if run.layout.pipeline_layout is None:  # else its stages' layers were checked
            assert run.model["layers"] % (run.layout.pp * run.layout.vpp) == 0, run.name
        assert run.model["heads"] % run.layout.tp == 0, run.name
        assert run.global_batch % (run.layout.micro_batch * run.layout.dp) == 0, run.name


def test_a_row_read_back_as_written(tmp_path):
    path = tmp_path / "runs.toml"
    path.write_text(ROW)
    (run,) = load_runs(path)
    assert (run.layout.tp, run.layout.pp, run.layout.dp) == (2, 2, 2)
    assert run.layout.sequence_parallel and run.layout.distributed_optimizer
    assert not run.layout.fsdp and run.layout.recompute == "selective"
    config = run.config()
    assert config.model.num_query_groups == 2 and config.model.ffn_hidden_size == 704
    assert config.training.global_batch_size == 8 and config.training.precision == "bf16"


def test_model_fields_reach_the_config_and_the_estimate(tmp_path):
    """[run.model.fields] sets megatrain [model] fields beyond the row's shape: experts are
    counted in the estimate's memory, a window in its model FLOPs."""
    path = tmp_path / "runs.toml"
    path.write_text(ROW)
    (plain,) = load_runs(path)
    fields = "[run.model.fields]\nnum_moe_experts = 4\nmoe_router_topk = 2\nwindow_size = 32"
    path.write_text(ROW.replace("vocab = 1024", f"vocab = 1024\n{fields}"))
    (run,) = load_runs(path)
    model = run.config().model
    assert (model.num_moe_experts, model.moe_router_topk, model.window_size) == (4, 2, 32)
    assert plain.config().model.num_moe_experts is None
    (_, a), (_, b) = predict(plain), predict(run)
    assert b.memory["weights"] > a.memory["weights"]
    assert b.mfu != a.mfu


def test_the_fit_rows_are_the_built_in_profiles_fit():
    """The 2019 rows are what gpus.toml's [profile] was fitted to: the planner at their layouts
    within 5% (a row typed wrong, or the V100 path moved, shows here)."""
    for run in [r for r in load_runs() if r.use == "fit"]:
        value, _ = predict(run)
        assert abs(value / run.value - 1) < 0.05, (run.name, value, run.value)


def test_the_metrics_are_one_estimate_counted_three_ways(tmp_path):
    """tokens/s per GPU x model FLOPs per token = model TFLOP/s per GPU (MFU x peak), and the
    hardware TFLOP/s exceed it by the recompute's share."""
    from megatrain.models import model_config
    from megatrain.plan.accounting import flops_per_iteration
    from megatrain.plan.hardware import load_gpus

    path = tmp_path / "runs.toml"
    path.write_text(ROW)
    (run,) = load_runs(path)
    tokens, result = predict(run)
    gpu = load_gpus()[run.gpu]
    config = run.config()
    model, hardware = flops_per_iteration(
        "llama", model_config(config, run.model["vocab"]), run.global_batch, run.seq_length
    )
    per_token = model / (run.global_batch * run.seq_length)
    by_metric = {}
    for metric in METRICS:
        by_metric[metric] = predicted(replace(run, metric=metric), result, gpu)
    assert by_metric["tokens_per_s_per_gpu"] == tokens
    assert by_metric["model_tflops_per_gpu"] == pytest.approx(tokens * per_token / 1e12)
    assert by_metric["hardware_tflops_per_gpu"] == pytest.approx(
        by_metric["model_tflops_per_gpu"] * hardware / model
    )
    assert hardware > model  # selective recompute reruns the attention core


def test_the_optional_fields_reach_the_config_and_the_estimate(tmp_path):
    """dropout, the data-parallel overlaps and FSDP's reduction every microbatch become the
    run's config (and so the estimate's), and so does tp_comm_overlap (its TP collectives
    behind the GEMMs); gpu_memory_gib decides whether it fits."""
    path = tmp_path / "runs.toml"
    path.write_text(ROW)
    (plain,) = load_runs(path)
    assert plain.config().model.hidden_dropout == 0.0
    assert not plain.config().parallel.tp_comm_overlap
    assert plain.config().parallel.overlap_grad_reduce  # megatrain's defaults
    assert not plain.config().parallel.overlap_param_gather
    model = "vocab = 1024\ndropout = 0.1"
    layout = (
        'sharding = "optimizer"\noverlap_grad_reduce = false\noverlap_param_gather = true\n'
        "tp_comm_overlap = true"
    )
    path.write_text(ROW.replace("vocab = 1024", model).replace('sharding = "optimizer"', layout))
    (run,) = load_runs(path)
    config = run.config()
    assert (config.model.hidden_dropout, config.model.attention_dropout) == (0.1, 0.1)
    assert not config.parallel.overlap_grad_reduce and config.parallel.overlap_param_gather
    assert config.parallel.tp_comm_overlap
    # the masks cost memory; the parameters' gather waits for no forward, the reduction for
    # no backward: the data-parallel time changes
    (_, a), (_, b) = predict(plain), predict(run)
    assert b.memory["activations"] > a.memory["activations"]
    assert b.time["dp_comm"] != a.time["dp_comm"]
    plain_tp = replace(run, parallel={**run.parallel, "tp_comm_overlap": False})
    assert predict(plain_tp)[1].time["tp_comm"] > b.time["tp_comm"] > 0
    # FSDP: reduce-scatter every microbatch (2 of them here) instead of holding the gradients
    full = ROW.replace('sharding = "optimizer"', 'sharding = "full"').replace(
        "sequence_parallel = true\n", ""
    )
    path.write_text(full)
    (once,) = load_runs(path)
    path.write_text(
        full.replace('sharding = "full"', 'sharding = "full"\nreduce_every_microbatch = true')
    )
    (every,) = load_runs(path)
    assert every.config().parallel.reduce_every_microbatch
    (_, a), (_, b) = predict(once), predict(every)
    assert b.memory["total"] < a.memory["total"] and b.time["dp_comm"] > a.time["dp_comm"]
    # the attention implementation the run ran: FlashAttention in Triton takes longer than
    # FlashAttention-2, the H100 entry's, and keeps the same
    triton_row = 'sharding = "full"\nattention = "flash_triton"'
    path.write_text(full.replace('sharding = "full"', triton_row))
    (triton,) = load_runs(path)
    (_, a), (_, b) = predict(once), predict(triton)
    assert triton.attention == "flash_triton" and once.attention is None
    assert b.time["compute"] > a.time["compute"] and b.memory == a.memory
    # the run's own GPUs' memory, where it is not the GPU entry's, decides whether it fits
    assert predict(once)[1].fits
    path.write_text(full.replace('sharding = "full"', 'sharding = "full"\ngpu_memory_gib = 0.01'))
    (small,) = load_runs(path)
    assert small.gpu_memory_gib == 0.01 and not predict(small)[1].fits


# Runs whose layout megatrain cannot take as they ran, so that the plan's memory for them is
# not theirs: torchtitan's "selective" is its op-level policy (every other GEMM's output kept),
# which keeps less than megatrain's (everything but the attention core).
def test_every_run_that_ran_fits_the_plans_memory():
    """Each row ran, so the plan's memory estimate at its layout must fit its GPUs (torchtitan's
    rows with their own recompute policy, "op_selective", which keeps less than megatrain's
    selective: at megatrain's they did not)."""
    over = []
    for run in load_runs():
        _, result = predict(run)
        if run.plan_memory_over:  # said to be over: it must be (a better model drops the field)
            assert not result.fits, run.name
            over.append(run.name)
            continue
        assert result.fits, (run.name, result.memory["total"] / 2**30)
    assert over == [
        "megatron-bridge-deepseek-v3-256xgb200-bf16",
        "megatron-bridge-deepseek-v3-1024xh100-fp8",
        "automodel-deepseek-v3-256xh100-bf16",
    ]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('use = "check"', 'use = "train"', "run 'tiny': use = 'train'; expected one of fit, check"),
        ("heads = 8\n", "", "run 'tiny': model.heads is missing"),
        ("layers = 4", 'layers = "four"', "model.layers = 'four' is not a whole number"),
        ("value = 1000.0", "value = -1.0", "published.value = -1.0 must be positive"),
        ("vocab = 1024", "vocab = 1024\ndropout = 1.0", "model.dropout = 1.0 must be in [0, 1)"),
        (
            "sharding =",
            "reduce_every_microbatch = true\nsharding =",
            "layout.reduce_every_microbatch = true is for sharding = 'full', not 'optimizer'",
        ),
        ('metric = "tokens_per_s_per_gpu"', 'metric = "mfu"', "published.metric = 'mfu'"),
        ('gpu = "h100-80gb"', 'gpu = "tpu"', "layout.gpu = 'tpu'"),
        (
            'gpu = "h100-80gb"',
            'gpu = "v100-32gb"\nattention = "flash_triton"',
            "layout.attention = 'flash_triton' is a flash kernel, which profile volta",
        ),
        (
            "sharding =",
            'attention = "xformers"\nsharding =',
            "layout.attention = 'xformers'; expected one of flash, unfused, flash_triton",
        ),
        ("gpus = 8", "gpus = 16", "layout.gpus = 16 but tp x cp x pp x dp = 8"),
        (
            'recompute = "selective"',
            'recompute = "op_selective"',
            "layout.recompute = 'op_selective' is torchtitan's policy for its Llama block at tp 1",
        ),
        ("tp = 2", "tp = 2\ntp_size = 2", "unknown field layout.tp_size"),
        # a model megatrain's own checks refuse: hidden 256 over 6 heads
        ("heads = 8", "heads = 6", "not a valid layout for its model"),
        # [model] fields beyond the shape: known ones, of their types, not the shape again
        (
            "vocab = 1024",
            "vocab = 1024\n[run.model.fields]\nnum_heads = 4",
            "run 'tiny': model.fields: unknown field model.num_heads",
        ),
        (
            "vocab = 1024",
            'vocab = 1024\n[run.model.fields]\nwindow_size = "wide"',
            "model.fields: model.window_size: expected int or NoneType, got 'wide'",
        ),
        (
            "vocab = 1024",
            "vocab = 1024\n[run.model.fields]\nnum_layers = 2",
            "model.fields.num_layers is the row's own shape or layout",
        ),
        ("vocab = 1024", "vocab = 1024\nfields = 2", "model.fields = 2 is not a table"),
    ],
)
def test_a_malformed_row_is_refused_naming_the_field(tmp_path, old, new, message):
    assert old in ROW
    path = tmp_path / "runs.toml"
    path.write_text(ROW.replace(old, new, 1))
    with pytest.raises(PublishedError, match=re.escape(message)):
        load_runs(path)


def test_a_row_in_a_precision_its_gpu_cannot_run_is_refused(tmp_path):
    path = tmp_path / "runs.toml"
    row = ROW.replace('gpu = "h100-80gb"', 'gpu = "a100-80gb"').replace('"bf16"', '"fp8"')
    path.write_text(row)
    with pytest.raises(PublishedError, match=r"layout.precision = 'fp8': a100-80gb has no fp8"):
        load_runs(path)
    path.write_text(ROW.replace('"bf16"', '"fp8"'))  # an H100 has float8 GEMMs
    (run,) = load_runs(path)
    assert run.precision == "fp8"


def test_a_file_without_runs_is_refused(tmp_path):
    path = tmp_path / "runs.toml"
    path.write_text("# nothing\n")
    with pytest.raises(PublishedError, match="no \\[\\[run\\]\\] tables"):
        load_runs(path)
    path.write_text(ROW + ROW)
    with pytest.raises(PublishedError, match="run name 'tiny' appears twice"):
        load_runs(path)
    assert tomllib.loads(ROW)  # the template itself is valid TOML


def test_published_runs_op_level_recompute_by_hand():
    """torchtitan's op-level selective recompute ("op_selective", a published row's): each
    layer keeps its input, wq's, wv's, w1's and w2's outputs and the attention's (16-bit) and
    the attention's fp32 log-sum-exp; the backward reruns wk, wo and w3 (kv's first half,
    proj, fc1) and every non-GEMM op of the forward, and not the attention kernel; the layer
    being recomputed holds its whole activations once, as under full recompute."""
    (run,) = [r for r in load_runs() if r.name == "torchtitan-llama3.1-8b-8xh100-fsdp"]
    assert run.layout.recompute == "op_selective"
    layout = run.layout
    config = apply_layout(run.config(), layout, run.global_batch)
    assert config.model.recompute == "selective"  # megatrain's nearest, for its own checks
    h, a, g, d, f = 4096, 32, 8, 128, 14336
    s, b = run.seq_length, layout.micro_batch
    per_token = 2 * (h + a * d + g * d + a * d + f + h) + 4 * a
    assert per_token == 63616  # 15.5 s b h
    assert activations_per_layer(config, "op_selective", False, "flash") == s * b * per_token
    kept = {
        mode: memory_breakdown(
            config, mode, vocab_size=128256, data_parallel_size=8, attention="flash"
        )["activations"]
        for mode in ("selective", "op_selective")
    }  # fmt: skip
    sel = activations_per_layer(config, "selective", False, "flash")
    whole = activations_per_layer(config, "none", False, "flash")
    assert kept["op_selective"] - kept["selective"] == pytest.approx(
        32 * (s * b * per_token - sel) + whole
    )
    # time: what the backward reruns beyond megatrain's selective (which reruns the kernel)
    gpu = run_gpu(run)
    costs = Costs(gpu, builtin_profile(gpu.profile), "bf16")
    cfg = model_config(config, 128256)
    tokens = s * b
    times = {}
    for mode in ("selective", "op_selective"):
        times[mode] = layer_seconds(config, replace(layout, recompute=mode), costs, 450e9, cfg=cfg)
    forward = {gm.name: costs.gemm(tokens, gm.n, gm.k) for gm in layer_gemms(cfg)}
    ops = costs.elementwise(sel)
    kernel = attention_core_seconds(config, cfg, layout, costs)[0][0]
    rerun = forward["kv"] / 2 + forward["proj"] + forward["fc1"] + ops
    assert times["op_selective"]["compute"] - times["selective"]["compute"] == pytest.approx(
        rerun - kernel
    )
    # and the FLOPs it reruns: 2 (h x h g / a + h x h + h x f) a token a layer
    flops = recomputed_flops(cfg, b, s, "op_selective")
    assert flops == 2 * (h * g * d + h * a * d + h * f) * tokens * 32
    _, result = predict(run)
    assert result.fits  # at megatrain's selective it did not (109 GiB on a 96 GB GPU)
    # the estimate's hardware FLOP/s count what the policy reruns
    model = result.mfu * result.time["total"] * run.gpus * gpu.base_peak_flops("bf16")
    hardware = result.tflops_per_gpu * 1e12 * result.time["total"] * run.gpus
    assert hardware - model == pytest.approx(
        recomputed_flops(cfg, run.global_batch, s, "op_selective")
    )
