"""The training loop under real gloo process groups, against the same run in one process.

Every rank runs under `nccl_semantics` (run_distributed's default), so each layout's
pipeline schedule, in training and in evaluation, also meets NCCL's matching rules.

One 8-rank spawn trains the same tiny GPT on the same corpus for 3 steps at
several (tp, pp, vpp, dp) layouts; one 1-rank spawn gives the reference, and
also shows the model learns and that bf16 follows fp32.
"""

import json
import math

import pytest

from megacore.testing import run_distributed
from megatrain.config import load_config
from megatrain.run.loop import train
from megatrain.testing import (
    TINY_MODEL,
    assert_same_steps,
    cuda_graphs_on_cpu,
    write_counting_corpus,
)

VOCAB = 200  # padded to 256 at tp 1 and 2, 512 at tp 4: the padding logits are masked
STEPS = 3
# fp32 summation order only: losses and valid loss absolute, gradient norms relative.
FP32_TOL = 2e-5
# The speed levers that change how, not what, a step computes (issue 33).
LEVERS = [
    "training.fused_linear_cross_entropy=true",
    "training.gradient_accumulation_fusion=true",
    "training.one_sync_per_iteration=true",
]
# torchao's float8 training through its emulation (float8 casts and scales, high-precision
# matmuls): the numbers of training.precision = "fp8" on a CPU.
FP8 = ["training.precision='fp8'", "training.fp8_emulate=true"]
FP8_TP2 = [*FP8, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
# Sequence parallelism's collectives as rings overlapped with the GEMMs, the output layer's
# too (no fused loss), with the weight gradients fused into main_grad.
TP_COMM_OVERLAP = [
    *LEVERS[1:],
    "parallel.tensor_model_parallel_size=2",
    "parallel.pipeline_model_parallel_size=2",
    "parallel.sequence_parallel=true",
    "parallel.tp_comm_overlap=true",
]
# Packed documents: positions restart, attention stays within a document, no loss at EODs.
PACKED = [
    "data.reset_position_ids=true",
    "data.reset_attention_mask=true",
    "data.eod_mask_loss=true",
]
PACKED_LAYOUT = [
    *PACKED,
    "parallel.tensor_model_parallel_size=2",
    "parallel.pipeline_model_parallel_size=2",
    "parallel.sequence_parallel=true",
    'model.recompute="selective"',
]
LAYOUTS = {
    # name: overrides; every layout sees the same global batch of 16 sequences per step
    # The levers at tp 2, sequence-parallel, on a last stage holding the tied embeddings' copy.
    "levers-tp2-pp2-dp2-seqpar-distopt": [
        *LEVERS,
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.use_distributed_optimizer=true",
    ],
    # Each layer a CUDA graph (megacore's emulation of the capture's static memory on the CPU),
    # with the weight gradients fused into main_grad and reductions overlapping the backward.
    "graphs-levers-tp2-dp4-seqpar-distopt-overlap": [
        *LEVERS,
        "training.cuda_graphs=true",
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.use_distributed_optimizer=true",
        "parallel.overlap_grad_reduce=true",
    ],
    "tp2-pp2-dp2-distopt-overlap": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.use_distributed_optimizer=true",
        "parallel.overlap_param_gather=true",
    ],
    "tp2-pp2-vpp2-dp2-seqpar-recompute": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        'model.recompute="full"',
    ],
    "dp8-selective": ['model.recompute="selective"'],
    # 1F1B over four stages with data parallelism: middle stages talk to both neighbours.
    "pp4-dp2": ["parallel.pipeline_model_parallel_size=4"],
    # ZB-H1: backwards split into B and W, under TP with sequence parallelism, the
    # distributed optimizer's overlapped gradient hooks, clipping and recompute.
    "tp2-pp2-dp2-zb-h1-seqpar-distopt-selective": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        'parallel.pipeline_schedule="zb-h1"',
        "parallel.sequence_parallel=true",
        "parallel.use_distributed_optimizer=true",
        'model.recompute="selective"',
    ],
    "tp2-pp4-zb-h1": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=4",
        'parallel.pipeline_schedule="zb-h1"',
    ],
    "pp4-dp2-zb-h1-full": [
        "parallel.pipeline_model_parallel_size=4",
        'parallel.pipeline_schedule="zb-h1"',
        'model.recompute="full"',
    ],
    # Interleaved over four stages needs 8 layers: checked against an 8-layer reference.
    "pp4-vpp2-dp2-8-layers": [
        "model.num_layers=8",
        "parallel.pipeline_model_parallel_size=4",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ],
    "tp4-pp2-distopt-recompute-distributed": [
        "parallel.tensor_model_parallel_size=4",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.use_distributed_optimizer=true",
        'model.recompute="full"',
        "parallel.distribute_saved_activations=true",
    ],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


@pytest.fixture(scope="module")
def blend(corpus, tmp_path_factory):
    """data.blend of `corpus` (30%) and a second counting corpus of the same tokenizer (70%)."""
    other = write_counting_corpus(tmp_path_factory.mktemp("corpus-b"), VOCAB, seed=1)
    return json.dumps([[0.3, corpus], [0.7, str(other)]])


def _config(corpus, out, overrides=()):
    """The tiny run; `corpus` is a directory or, as JSON, a data.blend value."""
    data = f"data.blend={corpus}" if corpus.startswith("[") else f"data.corpus={corpus!r}"
    return load_config(
        None,
        [
            data,
            f"training.output_dir={out!r}",
            *TINY_MODEL,
            "training.seq_length=16",
            "training.micro_batch_size=2",
            "training.global_batch_size=16",
            f"training.train_iters={STEPS}",
            f"training.eval_interval={STEPS}",
            "training.eval_iters=2",
            "optimizer.lr=0.01",
            "optimizer.min_lr=0.001",
            "optimizer.lr_warmup_iters=1",
            "logging.log_interval=1",
            "logging.tensorboard=false",
            "logging.peak_tflops=1.0",
            *overrides,
        ],
    )


def _blend_runs(blend, out):
    """A blend: uninterrupted, and stopped after 2 steps with a save and resumed; with the
    blend_samples of each log record."""
    ckpt = f"{out}/blend-ckpt"
    runs = {
        "reference": train(_config(blend, f"{out}/blend")),
        "first": train(_config(blend, f"{out}/blend-first", ["training.exit_interval=2",
                                                             f"checkpoint.save={ckpt!r}"])),
        "second": train(_config(blend, f"{out}/blend-first", [f"checkpoint.load={ckpt!r}"])),
    }  # fmt: skip
    with open(f"{out}/blend/log.jsonl") as f:
        runs["logged"] = [r["blend_samples"] for r in map(json.loads, f) if "loss" in r]
    return runs


def _one_process(corpus, blend, out):
    reference = train(_config(corpus, f"{out}/reference"))
    bf16 = train(_config(corpus, f"{out}/bf16", ['training.precision="bf16"']))
    fp16 = train(
        _config(
            corpus,
            f"{out}/fp16",
            ['training.precision="fp16"', "optimizer.initial_loss_scale=1024"],
        )
    )
    deep = train(_config(corpus, f"{out}/reference-8-layers", ["model.num_layers=8"]))
    learn = train(
        _config(
            corpus,
            f"{out}/learn",
            ["training.train_iters=80", "training.eval_interval=40", "optimizer.lr=0.01"],
        )
    )
    levers = train(_config(corpus, f"{out}/levers", LEVERS))
    # fp16 from a loss scale of 2^20: the first steps overflow and are skipped, on the host's
    # word (plain) and on the device's (one sync per iteration).
    overflow = [
        "training.precision='fp16'",
        "training.train_iters=6",
        "optimizer.initial_loss_scale=1048576",
        "optimizer.hysteresis=1",
    ]
    skipping = {
        name: train(_config(corpus, f"{out}/overflow-{name}", [*overflow, *extra]))
        for name, extra in (("plain", []), ("one_sync", [LEVERS[-1]]))
    }
    reads = _host_reads_per_step(corpus, out)
    fp8 = train(_config(corpus, f"{out}/fp8", FP8))
    # With dropout: the graphed layers draw the masks eager layers draw (the capture's draws
    # are undone by seeding after it), and the fused weights' gradients overlap as without.
    dropout = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", *LEVERS[:2]]
    dropout += ["parallel.overlap_grad_reduce=true"]
    ckpt = f"{out}/dropout-ckpt"
    stop = ["training.exit_interval=2", f"checkpoint.save={ckpt!r}"]
    load = [f"checkpoint.load={ckpt!r}"]
    with cuda_graphs_on_cpu():
        graphs = {
            name: train(_config(corpus, f"{out}/dropout-{name}", [*dropout, *extra]))
            for name, extra in (
                ("eager", []),
                ("graphs", ["training.cuda_graphs=true"]),
                # Stopped after 2 steps with a save, then resumed: graphs captured anew.
                ("first", ["training.cuda_graphs=true", *stop]),
                ("second", ["training.cuda_graphs=true", *load]),
            )
        }
    blended = _blend_runs(blend, out)
    packed = train(_config(corpus, f"{out}/packed", PACKED))
    return reference, bf16, fp16, learn, deep, levers, reads, skipping, fp8, graphs, blended, packed


def _host_reads_per_step(corpus, out) -> dict:
    """How often a step reads a tensor's value on the host (item, tolist, bool, float, int:
    each a device sync on a GPU), the loop's stop flag included: plain, and with
    training.one_sync_per_iteration."""
    import contextlib

    import torch

    from megacore import parallel_state as ps
    from megatrain.run.loop import StopSignal
    from megatrain.run.setup import build_run
    from megatrain.run.step import train_step

    reads, counts = [], {}
    methods = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def counting(name, original):
        def method(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return method

    for name, extra in (("plain", []), ("one_sync", ["training.one_sync_per_iteration=true"])):
        run = build_run(_config(corpus, f"{out}/reads-{name}", extra), torch.device("cpu"))
        stop = StopSignal()
        try:
            train_step(run, stop.flag(run.device))  # a first step builds the optimizer state
            flag = stop.flag(run.device)
            with contextlib.ExitStack() as patches:
                for m in methods:
                    original = getattr(torch.Tensor, m)
                    setattr(torch.Tensor, m, counting(m, original))
                    patches.callback(setattr, torch.Tensor, m, original)
                step = train_step(run, flag)
            counts[name] = (list(reads), step["stop"])
            reads.clear()
        finally:
            stop.restore()
            ps.destroy_model_parallel()
    return counts


def _layouts(corpus, blend, out):
    with cuda_graphs_on_cpu():
        runs = {name: train(_config(corpus, f"{out}/{name}", o)) for name, o in LAYOUTS.items()}
    blended = train(
        _config(blend, f"{out}/blend-tp2-pp2-dp2", LAYOUTS["tp2-pp2-dp2-distopt-overlap"])
    )
    packed = train(_config(corpus, f"{out}/packed-tp2-pp2-dp2", PACKED_LAYOUT))
    fp8_tp2 = train(_config(corpus, f"{out}/fp8-tp2", FP8_TP2))
    return runs, fp8_tp2, blended, packed, _with_ring_steps_counted(corpus, out)


def _with_ring_steps_counted(corpus, out):
    """The TP_COMM_OVERLAP run, and how many ring steps (send + receive) this rank took."""
    from megacore.tensor_parallel import comm_overlap

    steps, shift = [], comm_overlap._shift
    comm_overlap._shift = lambda *args: steps.append(1) or shift(*args)
    try:
        run = train(_config(corpus, f"{out}/tp-comm-overlap", TP_COMM_OVERLAP))
    finally:
        comm_overlap._shift = shift
    return run, len(steps)


@pytest.fixture(scope="module")
def one_process(corpus, blend, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run_distributed(_one_process, 1, args=(corpus, blend, str(out)), timeout=300)[0]


def test_layouts_match_one_process(corpus, blend, one_process, tmp_path):
    reference, deep = one_process[0], one_process[4]
    runs, fp8_tp2, blended, packed, (overlap, ring_steps) = run_distributed(
        _layouts, 8, args=(corpus, blend, str(tmp_path)), timeout=420
    )[0]
    # tp 2 x pp 2 x dp 2, sequence-parallel, the collectives as overlapped rings (one step each
    # at tp 2), the weight gradients fused into main_grad.
    assert_same_steps(overlap, reference, "tp2-pp2-dp2-seqpar-tp-comm-overlap", FP32_TOL)
    assert ring_steps > 0
    # A blend takes the same samples, so the same steps, at tp 2 x pp 2 x dp 2.
    assert_same_steps(blended, one_process[10]["reference"], "blend tp2-pp2-dp2", FP32_TOL)
    # Packed documents at tp 2 (sequence-parallel) x pp 2 x dp 2, selective recompute.
    assert_same_steps(packed, one_process[11], "packed documents tp2-pp2-dp2", FP32_TOL)
    assert one_process[11]["loss"] != reference["loss"]  # the switches change the steps
    assert len(reference["loss"]) == STEPS
    assert reference["valid"][-1][0] == STEPS
    for name, run in runs.items():
        assert_same_steps(run, deep if "8-layers" in name else reference, name, FP32_TOL)
    # The steps did something: a wrong gradient would show in the losses after step 0.
    assert reference["loss"][-1] < reference["loss"][0] - 0.02
    _assert_follows(fp8_tp2, reference, one_process[1], "fp8 at tp 2, sequence-parallel")


def _assert_follows(run, reference, bf16, name, tol=0.05):
    """A low-precision run takes fp32's steps within `tol`, and is not bf16's (it is active)."""
    for a, b in zip(run["loss"], reference["loss"], strict=True):
        assert abs(a - b) < tol, (name, run["loss"], reference["loss"])
    assert run["loss"] != bf16["loss"], name


def test_levers_take_the_same_steps_in_one_process(one_process):
    assert_same_steps(one_process[5], one_process[0], "levers", FP32_TOL)


def test_one_sync_per_iteration_reads_the_device_once(one_process):
    reads = one_process[6]
    # Plain: the loss and the optimizer's norm and inf/nan flag (tolist), the stop agreement
    # (item); torch's fused AdamW (on the CPU too) reads nothing.
    plain, stop = reads["plain"]
    assert plain == ["tolist", "tolist", "item"] and stop == 0.0, plain
    assert reads["one_sync"] == (["tolist"], 0.0), reads
    plain, one_sync = one_process[7]["plain"], one_process[7]["one_sync"]
    skipped = [g is None for g in plain["grad_norm"]]
    assert any(skipped) and not skipped[-1], plain["grad_norm"]  # skips, then steps again
    assert [g is None for g in one_sync["grad_norm"]] == skipped, one_sync["grad_norm"]
    for a, b in zip(one_sync["grad_norm"], plain["grad_norm"], strict=True):
        assert a is b is None or abs(a - b) < 2e-4 * b, (one_sync["grad_norm"], plain)
    for a, b in zip(one_sync["loss"], plain["loss"], strict=True):
        assert abs(a - b) < 2e-4, (one_sync["loss"], plain["loss"])  # fp16: 5e-5 seen


def test_cuda_graphs_take_the_same_steps_with_dropout(one_process):
    graphs = one_process[9]
    # Bitwise: the same kernels in the same order, and the same masks.
    assert graphs["graphs"]["loss"] == graphs["eager"]["loss"], graphs
    assert graphs["graphs"]["grad_norm"] == graphs["eager"]["grad_norm"], graphs
    assert graphs["graphs"]["valid"] == graphs["eager"]["valid"], graphs
    assert graphs["eager"]["loss"] != one_process[5]["loss"]  # the dropout is on
    first, second = graphs["first"], graphs["second"]
    assert first["stopped_at"] == 2 and len(first["loss"]) == 2
    assert first["loss"] + second["loss"] == graphs["graphs"]["loss"]  # resumed bitwise
    assert first["grad_norm"] + second["grad_norm"] == graphs["graphs"]["grad_norm"]


def test_blend_resumes_bitwise_and_logs_its_shares(one_process):
    runs = one_process[10]
    reference, first, second = runs["reference"], runs["first"], runs["second"]
    assert first["stopped_at"] == 2
    assert first["loss"] + second["loss"] == reference["loss"]
    assert first["grad_norm"] + second["grad_norm"] == reference["grad_norm"]
    assert second["valid"] == reference["valid"]
    assert reference["loss"] != one_process[0]["loss"]  # other samples than one corpus's
    # Every log step (log_interval 1, 16 samples a step): within a sample of 30/70.
    names = list(runs["logged"][0])
    assert len(runs["logged"]) == STEPS and len(names) == 2
    for step, drawn in enumerate(runs["logged"], start=1):
        assert sum(drawn.values()) == 16 * step
        assert abs(drawn[names[0]] - 0.3 * 16 * step) < 1, runs["logged"]


def test_fp8_follows_fp32_as_bf16_does(one_process):
    reference, bf16 = one_process[0], one_process[1]
    _assert_follows(one_process[8], reference, bf16, "fp8 (torchao's emulation)")


def test_tiny_gpt_learns_and_bf16_fp16_follow_fp32(one_process):
    reference, bf16, fp16, learn, *_ = one_process
    # Uniform over the 200 real tokens is ln 200 = 5.3; a sequence is predictable after its
    # first two tokens, so a model that learns goes far below.  Measured at step 80: valid 2.20,
    # the last 10 training losses about 2.3 on average.
    assert learn["loss"][0] > math.log(VOCAB)
    assert learn["valid"][-1][1] < 2.6, learn["valid"]
    assert sum(learn["loss"][-10:]) / 10 < 2.6
    for run in (bf16, fp16):
        for a, b in zip(run["loss"], reference["loss"], strict=True):
            assert abs(a - b) < 0.05, (run["loss"], reference["loss"])
    assert fp16["valid"][-1][1] < reference["valid"][-1][1] + 0.05
    assert learn["plot"].endswith("loss.png")
