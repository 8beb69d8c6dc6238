"""Fully sharded data parallelism (parallel.data_parallel_sharding = "full", torch's FSDP2):
every layout takes the one-process steps, for GPT-2, Llama and BERT.

One 1-rank spawn trains the references (fp32, bf16, fp8 emulated, fp8 with compiled layers);
one 4-rank spawn trains the layouts: dp 4 (ZeRO-3 and ZeRO-2), tp 2 x dp 2 with sequence
parallelism, pp 2 x dp 2 under 1F1B (tied embeddings over the stages) and interleaved,
selective and full recompute, bf16, fp8 and fp8 with compiled layers (torchtitan's usual
FSDP run), each
with 2-4 microbatches a step (the reduce-scatter once a step; every microbatch with
parallel.reduce_every_microbatch) and clipping active (the norm
over the shards).  Every rank runs under the NCCL-semantics checker, and every layout runs
with gloo's ReduceOp.AVG turned into a silent SUM, the bug of pytorch#162338 (torch 2.13's
gloo averages correctly; the trap is put back on purpose): the layouts still equal one
process because our reduce-scatters never ask for AVG, and a negative control with FSDP's
own reduction (AVG) comes out wrong and is caught by the same comparison.  The same spawn
saves "full", "optimizer" and "none" checkpoints after two steps and takes the third step at
another sharding and layout (at "full" again: bitwise), and measures the bytes a dp 4 run
holds at each sharding ("none", "optimizer", "full") and the unsharded gradients FSDP holds
between microbatches (with and without parallel.reduce_every_microbatch) against
megatrain.plan.accounting; and a
"full" checkpoint of a corpus with a tokenizer goes through `megatrain export-hf` as the
distributed optimizer's does."""

from dataclasses import replace

import pytest

from megacore.testing import run_distributed
from megatrain.config import ConfigError, load_config, validate
from megatrain.run.loop import train
from megatrain.testing import (
    QUIET_LOGGING,
    TINY_MODEL,
    assert_same_steps,
    english_texts,
    write_bert_text_corpus,
    write_counting_corpus,
    write_text_corpus,
)

VOCAB = 200
STEPS = 3
FP32_TOL = 2e-5
BF16_TOL = 2e-2
COMMON = [
    *TINY_MODEL,
    *QUIET_LOGGING,
    "training.micro_batch_size=1",
    "training.global_batch_size=8",
    f"training.train_iters={STEPS}",
    f"training.eval_interval={STEPS}",
    "training.eval_iters=1",
    "optimizer.lr=0.003",
    "optimizer.lr_warmup_iters=1",
    "optimizer.clip_grad=0.5",  # below every step's norm: clipping acts on each
]
MODELS = {
    "gpt": ["training.seq_length=16"],
    "llama": [
        "training.seq_length=16",
        'model.kind="llama"',
        "model.num_query_groups=2",
        "model.normalization='rmsnorm'",
        "model.position_embedding_type='rope'",
    ],
    "bert": ['model.kind="bert"', "training.seq_length=32"],
}
FULL = ['parallel.data_parallel_sharding="full"']
SHARDINGS = ("none", "optimizer", "full")  # parallel.data_parallel_sharding
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
PP2 = ["parallel.pipeline_model_parallel_size=2"]
VPP2 = [*PP2, "parallel.virtual_pipeline_model_parallel_size=2"]
BF16 = ['training.precision="bf16"']
FP8 = ['training.precision="fp8"', "training.fp8_emulate=true"]  # torchao's casts, any device
# The precisions a reference trains in: the overrides each adds.
PRECISIONS = {
    "fp32": [],
    "bf16": BF16,
    "fp8": FP8,
    "fp8-compiled": [*FP8, "training.compile=true"],  # fp8 and compile under FSDP (torchtitan's)
}
# name: (model, precision, overrides); 4 ranks each (dp fills the rest).
LAYOUTS = {
    "gpt-dp4": ("gpt", "fp32", FULL),
    "gpt-dp4-zero2-one-sync": (
        "gpt", "fp32",
        [*FULL, "parallel.reshard_after_forward=false", "training.one_sync_per_iteration=true"]),
    "gpt-tp2-seqpar-dp2-selective": (
        "gpt", "fp32", [*FULL, *TP2_SP, 'model.recompute="selective"']),
    "gpt-pp2-dp2-1f1b-full": ("gpt", "fp32", [*FULL, *PP2, 'model.recompute="full"']),
    "gpt-dp4-bf16": ("gpt", "bf16", [*FULL, *BF16]),
    # a reduce-scatter every microbatch, the shards accumulating (torchtitan's, Composer's way)
    "gpt-dp4-bf16-reduce-every-microbatch": (
        "gpt", "bf16", [*FULL, *BF16, "parallel.reduce_every_microbatch=true"]),
    "gpt-cp2-dp2": ("gpt", "fp32", [*FULL, "parallel.context_parallel_size=2"]),  # over dp x cp
    # float8 GEMMs (torchao's emulation) on FSDP's gathered bf16 weights; and compiled layers
    "gpt-dp4-fp8": ("gpt", "fp8", [*FULL, *FP8]),
    "llama-tp2-seqpar-dp2-fp8-compiled": (
        "llama", "fp8-compiled", [*FULL, *TP2_SP, *PRECISIONS["fp8-compiled"]]),
    "llama-pp2-vpp2-dp2": ("llama", "fp32", [*FULL, *VPP2]),
    "llama-tp2-seqpar-dp2-full-bf16": (
        "llama", "bf16", [*FULL, *TP2_SP, 'model.recompute="full"', *BF16]),
    "bert-tp2-dp2": ("bert", "fp32", [*FULL, "parallel.tensor_model_parallel_size=2"]),
    "bert-pp2-dp2": ("bert", "fp32", [*FULL, *PP2]),
}  # fmt: skip
REFERENCES = sorted({(model, precision) for model, precision, _ in LAYOUTS.values()})


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    gpt = write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB)
    bert = tmp_path_factory.mktemp("bert-corpus")
    write_bert_text_corpus(bert, english_texts(), vocab_size=1000)
    text, _ = write_text_corpus(tmp_path_factory.mktemp("text-corpus"), english_texts())
    return {"gpt": str(gpt), "llama": str(gpt), "bert": str(bert), "text": str(text)}


def _config(corpora, out, model, precision, overrides=()):
    return load_config(
        None,
        [
            f"data.corpus={corpora[model]!r}",
            f"training.output_dir={out!r}",
            *COMMON,
            *MODELS[model],
            *PRECISIONS[precision],
            *overrides,
        ],
    )


def _references(corpora, out):
    return {
        (model, precision): train(_config(corpora, f"{out}/{model}-{precision}", model, precision))
        for model, precision in REFERENCES
    }


def _gloo_average_as_sum(seen: list):
    """dist.reduce_scatter_single as pytorch#162338 found gloo: ReduceOp.AVG silently summed
    (torch 2.13's gloo averages correctly; the trap is put back so the tests can see it).
    Every op asked for goes into `seen`."""
    import torch.distributed as dist

    original = dist.reduce_scatter_single

    def reduce_scatter_single(*args, op=dist.ReduceOp.SUM, **kwargs):
        seen.append(op)
        if op == dist.ReduceOp.AVG:
            op = dist.ReduceOp.SUM
        return original(*args, op=op, **kwargs)

    dist.reduce_scatter_single = reduce_scatter_single
    return original


def _measured_bytes(config) -> dict:
    """Bytes this layout's ranks hold in weights, gradients (after a step's backward) and
    optimizer state (after its update: fp32 masters apart from the weights, Adam's moments),
    summed over the ranks' local shards; and the model's parameter count.  Under "full"
    (FSDP) the weights are fp32 DTensor shards, the masters themselves, and the gradients
    their shards; under "none" and "optimizer" the 16-bit weights and megacore DDP's fp32
    gradient buffer are whole on every rank and the masters are the optimizer's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from megacore import parallel_state as ps
    from megatrain.run.distributed import init_distributed
    from megatrain.run.setup import build_run
    from megatrain.run.step import forward_backward, to_device

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    device, _ = init_distributed(60)
    run = build_run(config, device)
    try:
        params = list(dict.fromkeys(p for c in run.chunks for p in c.parameters()))
        micro = [to_device(next(run.train_data), device) for _ in range(run.num_microbatches)]
        forward_backward(run, micro)
        weights = sum(local(p).nbytes for p in params)
        grads = [getattr(p, "main_grad", None) for p in params]
        grads = [p.grad if g is None else g for p, g in zip(params, grads, strict=True)]
        gradients = sum(local(g).nbytes for g in grads)
        run.optimizer.step()
        optimizer = run.optimizer
        masters = sum(
            s.master.nbytes
            for s in optimizer.shards
            if s.master.untyped_storage().data_ptr() != local(s.param).untyped_storage().data_ptr()
        )
        moments = sum(
            state[k].nbytes
            for state in optimizer.optimizer.state.values()
            for k in ("exp_avg", "exp_avg_sq")
        )
        totals = torch.tensor([weights, gradients, masters + moments], dtype=torch.float64)
        dist.all_reduce(totals)
        names = ("weights", "gradients", "optimizer_state")
        return {
            **dict(zip(names, totals.tolist(), strict=True)),
            "parameters": sum(p.numel() for p in params),
            "dtypes": sorted({str(p.dtype) for p in params}),
        }
    finally:
        ps.destroy_model_parallel()


def _unsharded_gradient_bytes(config) -> dict:
    """Bytes of unsharded gradients rank 0's FSDP holds after a microbatch that is not a step's
    last (its backward inside `chunk.no_sync()`, as the schedules run it): FSDP2's fp32
    accumulated gradients or its unsharded parameters' gradients; and the rank's parameter
    count (its whole TP-local model)."""
    from torch.distributed.fsdp import FSDPModule

    from megacore import parallel_state as ps
    from megatrain.run.distributed import init_distributed
    from megatrain.run.setup import build_run
    from megatrain.run.step import to_device

    device, _ = init_distributed(60)
    run = build_run(config, device)
    try:
        (chunk,) = run.chunks
        batch = to_device(next(run.train_data), device)
        with chunk.no_sync():
            chunk(batch["tokens"], batch["labels"]).float().mean().backward()
        held = 0
        for module in chunk.modules():
            if not isinstance(module, FSDPModule):
                continue
            for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                grad = fsdp_param.unsharded_accumulated_grad
                if grad is None:
                    grad = fsdp_param._unsharded_param.grad
                held += 0 if grad is None else grad.nbytes
        return {"bytes": held, "parameters": sum(p.numel() for p in chunk.parameters())}
    finally:
        ps.destroy_model_parallel()


def _gather_order(config) -> list:
    """One step's events in order: ("gather", i) when FSDP all-gathers layer i's parameters,
    ("forward", i) when layer i's attention starts its forward, ("backward", i) when its
    backward is done."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from megacore import parallel_state as ps
    from megatrain.run.distributed import init_distributed
    from megatrain.run.setup import build_run
    from megatrain.run.step import forward_backward, to_device

    device, _ = init_distributed(60)
    run = build_run(config, device)
    events, original = [], FSDPParamGroup.unshard
    layers = {id(layer): i for i, layer in enumerate(run.chunks[0].layers.values())}

    def unshard(group, *args, **kwargs):
        index = layers.get(id(group.modules[0]))
        # A gather issued already (a prefetch) or done makes this call a no-op.
        if index is not None and not group.is_unsharded and group._all_gather_result is None:
            events.append(("gather", index))
        return original(group, *args, **kwargs)

    hooks = []
    for layer in run.chunks[0].layers.values():
        i = layers[id(layer)]
        hooks.append(
            layer.attention.register_forward_pre_hook(lambda *_, i=i: events.append(("forward", i)))
        )
        hooks.append(
            layer.attention.register_full_backward_hook(
                lambda *_, i=i: events.append(("backward", i))
            )
        )
    FSDPParamGroup.unshard = unshard
    try:
        micro = [to_device(next(run.train_data), device)]
        forward_backward(run, micro)
        return events
    finally:
        FSDPParamGroup.unshard = original
        for hook in hooks:
            hook.remove()
        ps.destroy_model_parallel()


def _layouts(corpora, out):
    import torch.distributed as dist

    import megatrain.parallelize as parallelize
    from megatrain.parallelize import apply_fsdp

    seen: list = []
    original = _gloo_average_as_sum(seen)
    try:
        runs = {
            name: train(_config(corpora, f"{out}/{name}", model, precision, o))
            for name, (model, precision, o) in LAYOUTS.items()
        }
        runs["ops"] = sorted({str(op) for op in seen})
        # The negative control: FSDP's own reduction (ReduceOp.AVG) meets the trap.
        seen.clear()
        parallelize.apply_fsdp = lambda *args, **kwargs: apply_fsdp(
            *args, **kwargs, sum_then_divide=False
        )
        runs["avg"] = train(_config(corpora, f"{out}/avg", "gpt", "fp32", FULL))
        runs["avg-ops"] = sorted({str(op) for op in seen})
    finally:
        parallelize.apply_fsdp = apply_fsdp
        dist.reduce_scatter_single = original
    for sharding in SHARDINGS:
        overrides = [f"parallel.data_parallel_sharding={sharding!r}"]
        runs[f"bytes-{sharding}"] = _measured_bytes(
            _config(corpora, f"{out}/bytes-{sharding}", "gpt", "bf16", overrides)
        )
    for every in (False, True):  # what a microbatch under no_sync leaves unsharded
        overrides = [*FULL, *BF16, f"parallel.reduce_every_microbatch={str(every).lower()}"]
        runs[f"unsharded-every-{every}"] = _unsharded_gradient_bytes(
            _config(corpora, f"{out}/unsharded-{every}", "gpt", "bf16", overrides)
        )
    one = ["training.global_batch_size=4"]  # one microbatch a rank
    runs["order"] = _gather_order(_config(corpora, f"{out}/order", "gpt", "fp32", [*FULL, *one]))
    _checkpoints(corpora, out, runs)
    _exports(corpora, out, runs)
    return runs


OPTIMIZER = ['parallel.data_parallel_sharding="optimizer"']
# name: (sharding and layout that saves after 2 steps, those that take the third step)
CHECKPOINTS = {
    "full-at-full": (FULL, FULL),
    # Saved right after an evaluation, whose forwards leave the chunk's own parameters
    # gathered (FSDP frees them in a backward): the save reshards them first.
    "full-after-eval-at-full": ([*FULL, "training.eval_interval=2"], FULL),
    # The background writer (issue 49) takes FSDP's shards as they are: the same files.
    "full-async-at-full": ([*FULL, "checkpoint.async_save=true"], FULL),
    "full-at-optimizer-tp2": (FULL, [*OPTIMIZER, "parallel.tensor_model_parallel_size=2"]),
    "full-at-none-pp2": (FULL, PP2),
    "optimizer-at-full-pp2": (OPTIMIZER, [*FULL, *PP2]),
    "none-tp2-at-full": (["parallel.tensor_model_parallel_size=2"], FULL),
}


def _checkpoints(corpora, out, runs):
    """Stopped after 2 steps with a save, the third step after loading at another sharding
    or layout; in bf16 (16-bit weights and fp32 masters saved apart)."""
    for name, (first, then) in CHECKPOINTS.items():
        ckpt = f"{out}/ckpt-{name}"
        save = ["training.exit_interval=2", f"checkpoint.save={ckpt!r}"]
        load = [f"checkpoint.load={ckpt!r}"]
        runs[f"{name}/first"] = train(
            _config(corpora, f"{out}/{name}-1", "gpt", "bf16", [*first, *save])
        )
        runs[name] = train(_config(corpora, f"{out}/{name}-2", "gpt", "bf16", [*then, *load]))
        runs[f"{name}/ckpt"] = ckpt


def _exports(corpora, out, runs):
    """The same three steps at "full" and at "optimizer" (fp32) on a corpus with a real
    tokenizer, each saved and exported by `megatrain export-hf` on rank 0."""
    import torch.distributed as dist
    from click.testing import CliRunner

    from megatrain.cli import main

    for sharding in ("full", "optimizer"):
        ckpt, hf = f"{out}/export-{sharding}-ckpt", f"{out}/export-{sharding}-hf"
        overrides = [
            f"parallel.data_parallel_sharding={sharding!r}",
            f"data.corpus={corpora['text']!r}",
            f"checkpoint.save={ckpt!r}",
        ]
        train(_config(corpora, f"{out}/export-{sharding}", "gpt", "fp32", overrides))
        if dist.get_rank() == 0:
            result = CliRunner().invoke(main, ["export-hf", "--ckpt", ckpt, "--out", hf])
            runs[f"export-{sharding}"] = (result.exit_code, result.output, hf)
        dist.barrier()


@pytest.fixture(scope="module")
def references(corpora, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp-one"))
    return run_distributed(_references, 1, args=(corpora, out), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(corpora, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp-layouts"))
    return run_distributed(_layouts, 4, args=(corpora, out), timeout=500)[0]


def test_every_fully_sharded_layout_equals_one_process(references, layouts):
    for name, (model, precision, _) in LAYOUTS.items():
        reference = references[(model, precision)]
        # Clipping acted on every step, so the norm over the shards decided each update.
        assert min(reference["grad_norm"]) > 0.5, (name, reference["grad_norm"])
        tolerance = FP32_TOL if precision == "fp32" else BF16_TOL
        assert_same_steps(layouts[name], reference, name, tolerance)


def test_no_reliance_on_gloo_average_and_the_trap_is_caught(references, layouts):
    """Every layout above ran with gloo's AVG turned into SUM (pytorch#162338's silent bug)
    and still equals one process: our reduce-scatters ask for SUM and divide by the DP size.
    FSDP's own choice, ReduceOp.AVG, under the same trap gives dp x the gradients, and the
    comparison with one process sees it (the gradient norm)."""
    assert layouts["ops"] == ["RedOpType.SUM"], layouts["ops"]
    assert "RedOpType.AVG" in layouts["avg-ops"], layouts["avg-ops"]
    with pytest.raises(AssertionError):
        assert_same_steps(layouts["avg"], references[("gpt", "fp32")], "avg", FP32_TOL)


def test_full_checkpoints_load_at_every_sharding_and_layout(references, layouts):
    """A "full" checkpoint goes on at "full" (bitwise: the uninterrupted run's steps exactly),
    at "optimizer" with tp 2 and at "none" with pp 2; "optimizer" and "none" checkpoints go on
    at "full"; every one takes the one-process run's third step."""
    reference = references[("gpt", "bf16")]
    for name in CHECKPOINTS:
        first, run = layouts[f"{name}/first"], layouts[name]
        assert first["stopped_at"] == 2, name
        steps = {k: first[k] + run[k] for k in ("loss", "grad_norm")}
        steps["valid"] = run["valid"]
        assert_same_steps(steps, reference, name, BF16_TOL)
    uninterrupted = layouts["gpt-dp4-bf16"]
    first, resumed = layouts["full-at-full/first"], layouts["full-at-full"]
    assert first["loss"] + resumed["loss"] == uninterrupted["loss"]
    assert first["grad_norm"] + resumed["grad_norm"] == uninterrupted["grad_norm"]
    assert resumed["valid"] == uninterrupted["valid"]
    background = layouts["full-async-at-full"]
    assert all(background[k] == resumed[k] for k in ("loss", "grad_norm", "valid"))


def test_a_background_save_of_fsdp_shards_writes_the_same_tensors(layouts):
    """`checkpoint.async_save` at "full": each rank's host copy of its FSDP shards, written by
    the background thread, holds bitwise what the synchronous save wrote."""
    import torch

    from megatrain.checkpoint.load import read_full_state

    sync = read_full_state(layouts["full-at-full/ckpt"], with_optimizer=True, progress=False)
    background = read_full_state(
        layouts["full-async-at-full/ckpt"], with_optimizer=True, progress=False
    )
    assert sorted(sync[1]) == sorted(background[1])
    for name, tensor in sync[1].items():
        assert torch.equal(tensor, background[1][name]), name


def test_a_full_checkpoint_holds_what_any_layout_saves(layouts):
    """The same tensors on disk as a checkpoint of the distributed optimizer at the same step
    (names, global shapes, dtypes: bf16 weights, fp32 masters and moments; values to bf16's and
    the summation order's precision), read offline by `read_full_state`, what export-hf and
    convert read."""
    import torch

    from megatrain.checkpoint.load import read_full_state

    _, full = read_full_state(layouts["full-at-full/ckpt"], with_optimizer=True, progress=False)
    ckpt = layouts["optimizer-at-full-pp2/ckpt"]
    _, other = read_full_state(ckpt, with_optimizer=True, progress=False)
    assert sorted(full) == sorted(other)
    for name, tensor in full.items():
        assert (tensor.shape, tensor.dtype) == (other[name].shape, other[name].dtype), name
        torch.testing.assert_close(tensor.float(), other[name].float(), atol=2e-3, rtol=0)


def test_export_hf_reads_a_full_checkpoint(layouts):
    """`megatrain export-hf` of a "full" checkpoint writes the GPT-2 (weights, config,
    tokenizer) that the distributed optimizer's checkpoint of the same steps exports."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    exported = {}
    for sharding in ("full", "optimizer"):
        code, output, hf = layouts[f"export-{sharding}"]
        assert code == 0, output
        exported[sharding] = Path(hf)
    full, optimizer = exported["full"], exported["optimizer"]
    assert sorted(p.name for p in full.iterdir()) == sorted(p.name for p in optimizer.iterdir())
    for name in ("config.json", "tokenizer.json"):
        assert (full / name).read_text() == (optimizer / name).read_text(), name
    weights = load_file(full / "model.safetensors")
    other = load_file(optimizer / "model.safetensors")
    assert sorted(weights) == sorted(other) and len(weights) > 4
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, other[name], atol=1e-4, rtol=0)


def test_each_layers_gather_is_issued_before_the_layer_ahead_computes(layouts):
    """Prefetch by event order (ZeRO-3, dp 4): in the forward layer i+1's all-gather is issued
    before layer i computes, in the backward layer i-1's before layer i's backward is done;
    every layer is gathered once for the forward and once again for the backward."""
    events = layouts["order"]
    layers = 1 + max(i for _, i in events)
    last_forward = events.index(("forward", layers - 1))
    forward, backward = events[:last_forward], events[last_forward + 1 :]
    for i in range(layers - 1):
        assert forward.index(("gather", i + 1)) < forward.index(("forward", i)), events
    for i in range(1, layers):
        assert ("gather", i - 1) in backward, events
        assert backward.index(("gather", i - 1)) < backward.index(("backward", i)), events
    assert sorted(e for e in events if e[0] == "gather") == sorted(
        [("gather", i) for i in range(layers)] * 2
    )


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_state_bytes_are_the_accounting_figures(layouts, sharding):
    """dp 4 in bf16, each sharding: the bytes the four ranks hold after a step are
    accounting's bytes per parameter on each rank, of the parameter count megatrain.plan.memory
    plans with.  "full": every parameter once in fp32 over the ranks, its fp32 gradient and
    Adam's two moments (16/d a rank); "optimizer": 16-bit weights (2) and fp32 gradients (4)
    on every rank, the fp32 masters and moments sharded (12/d); "none": 2 + 4 + 12."""
    from megatrain.plan.accounting import state_bytes_per_parameter
    from megatrain.plan.memory import memory_breakdown

    measured = layouts[f"bytes-{sharding}"]
    # fp32 shards under FSDP (bf16 only when gathered), else the bf16 model
    assert measured["dtypes"] == ["torch.float32" if sharding == "full" else "torch.bfloat16"]
    overrides = [f"parallel.data_parallel_sharding={sharding!r}"]
    config = _config({"gpt": "unused"}, "unused", "gpt", "bf16", overrides)
    validate(config, 4)
    planned = memory_breakdown(config, vocab_size=VOCAB, data_parallel_size=4)
    assert planned["parameters"] == measured["parameters"]
    per_rank = state_bytes_per_parameter("bf16", sharding == "optimizer", 4, sharding)
    for part in ("weights", "gradients", "optimizer_state"):
        assert measured[part] == 4 * per_rank[part] * measured["parameters"], part
        assert planned[part] == per_rank[part] * measured["parameters"], part


def test_unsharded_gradients_are_the_accounting_figures(layouts):
    """What FSDP2 holds unsharded between a step's microbatches (dp 4, bf16), as
    accounting.fsdp_gathered_bytes counts it: by default every parameter's fp32 gradient
    (4 bytes each, on every rank), accumulated for the reduce-scatter after the last
    microbatch; with parallel.reduce_every_microbatch none, each microbatch's gradients
    reduce-scattered into the shards as its backward makes them."""
    from megatrain.plan.accounting import fsdp_gathered_bytes

    accumulated = layouts["unsharded-every-False"]
    assert accumulated["bytes"] == 4 * accumulated["parameters"]
    assert layouts["unsharded-every-True"]["bytes"] == 0
    # the formula's gradient term: all of them, or one layer's in flight (here: after it)
    params, layer = accumulated["parameters"], 1000
    with_accumulation = fsdp_gathered_bytes(params, layer, 2, "bf16", True, 2)
    reducing = fsdp_gathered_bytes(params, layer, 2, "bf16", True, 2, reduce_every_microbatch=True)
    assert with_accumulation - reducing == 4 * params - (2 + 4) * layer


def test_plan_fits_llama3_8b_on_8_h100s_without_tp_only_fully_sharded():
    """megatrain plan weighs the three shardings, and considers full sharding without tensor
    parallelism (issue 50 item 5): Llama 3 8B on one node of H100s at tp 1, pp 1, dp 8 (full
    recompute, flash attention's activations) fits 80 GB with "optimizer" and, in less, with
    "full", whose memory is accounting's, and the plan ranks it among the layouts that fit;
    "none" does not fit."""
    from pathlib import Path

    from megatrain.plan import hardware
    from megatrain.plan.accounting import state_bytes_per_parameter
    from megatrain.plan.cost_model import estimate
    from megatrain.plan.layout import Layout, apply_layout
    from megatrain.plan.search import plan

    config = load_config(Path(__file__).parents[3] / "pipelines/models/llama3-8b.toml")
    h100 = hardware.load_gpus()["h100-80gb"]
    result = plan(config, 8, h100, hardware.gpu_profile(h100), 128256, 512)
    assert {e.layout.sharding for e in result.ranked} == {"none", "optimizer", "full"}
    assert [e for e in result.ranked if e.layout.fsdp and e.layout.tp == 1]  # ranked, fitting
    totals = {}
    for sharding in ("none", "optimizer", "full"):
        layout = Layout(1, 1, 8, 1, 1, "full", False, sharding == "optimizer")
        layout = Layout(**{**layout.__dict__, "fsdp": sharding == "full"})
        e = estimate(config, layout, h100, result.profile, 128256)
        totals[sharding] = e.memory["total"]
        assert e.fits == (sharding != "none"), (sharding, e.memory["total"])
        assert (result.position(layout) is not None) == e.fits
        assert f'parallel.data_parallel_sharding="{sharding}"' in layout.overrides() or (
            sharding != "full"
        )
        assert apply_layout(config, layout).parallel.data_parallel_sharding == sharding
    per_parameter = state_bytes_per_parameter("bf16", False, 8, "full")
    assert e.memory["optimizer_state"] == per_parameter["optimizer_state"] * e.memory["parameters"]
    assert totals["full"] < totals["optimizer"] < 80 * 2**30 < totals["none"], totals
    # With gradient accumulation the search tries FSDP both holding the unsharded fp32
    # gradients to the step's end and reduce-scattering every microbatch's: here the second
    # is the #1 (tp 1 dp 8 without recompute), which holding them would not fit
    best = result.ranked[0].layout
    assert best.fsdp and best.tp == 1 and best.reduce_every_microbatch is True
    assert "parallel.reduce_every_microbatch=true" in best.overrides()
    assert "reduce-every-mb" in best.describe()
    assert apply_layout(config, best).parallel.reduce_every_microbatch
    holding = replace(best, reduce_every_microbatch=False)
    assert not apply_layout(config, holding).parallel.reduce_every_microbatch
    held = estimate(config, holding, h100, result.profile, 128256)
    assert not held.fits and result.position(holding) is None
    grads = 4 * held.memory["parameters"] * 7 / 8  # the fp32 gradients not in the rank's shard
    assert held.memory["total"] - result.ranked[0].memory["total"] >= grads
    assert result.position(replace(best, reduce_every_microbatch=None)) is None  # config's: off


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["training.cuda_graphs=true"],
         r"training.cuda_graphs = true: .* use data_parallel_sharding = 'optimizer'"),
        (['training.precision="fp16"'],
         r"training.precision = 'fp16': .* use training.precision = 'bf16'"),
        ([*PP2, 'parallel.pipeline_schedule="zb-h1"'],
         r"parallel.pipeline_schedule = 'zb-h1': .* use pipeline_schedule = '1f1b'"),
        (["training.gradient_accumulation_fusion=true"], "gradient_accumulation_fusion = false"),
        (["parallel.use_distributed_optimizer=true"], "drop use_distributed_optimizer"),
        ([*PP2, "parallel.reshard_after_forward=true"],
         "leave parallel.reshard_after_forward unset"),
    ],
)  # fmt: skip
def test_bad_full_sharding_configs_refused_naming_the_field(overrides, pattern):
    with pytest.raises(
        ConfigError, match=r"parallel.data_parallel_sharding = 'full' with .*" + pattern
    ):
        validate(load_config(None, [*FULL, *overrides]), 8)


def test_optimizer_sharding_is_the_distributed_optimizer():
    config = load_config(None, ['parallel.data_parallel_sharding="optimizer"'])
    validate(config, 8)
    assert config.parallel.use_distributed_optimizer
    config = load_config(None, ["parallel.use_distributed_optimizer=true"])
    validate(config, 8)
    assert config.parallel.data_parallel_sharding == "optimizer"
    with pytest.raises(ConfigError, match=r"parallel\.reshard_after_forward is for"):
        validate(load_config(None, ["parallel.reshard_after_forward=false"]), 8)
    for sharding in ("none", "optimizer"):
        overrides = [f"parallel.data_parallel_sharding={sharding!r}"]
        with pytest.raises(ConfigError, match=r"parallel\.reduce_every_microbatch is for .*"):
            validate(load_config(None, [*overrides, "parallel.reduce_every_microbatch=true"]), 8)
    with pytest.raises(ConfigError, match="expected one of none, optimizer, full"):
        load_config(None, ['parallel.data_parallel_sharding="zero3"'])
