"""The optimizer (fp32 masters, loss scaling, clipping, ZeRO-1 sharding) under real gloo groups.

Every run trains the same tiny stack (tiny_stack.py) for a few Adam steps on the same global
batches; one process over the whole batch is the reference.
"""

import math

import pytest
import torch
import torch.distributed as dist
from tiny_stack import TinyConfig, build_chunks, full_tensor

from megacore import moe
from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.distributed import DistributedDataParallel
from megacore.distributed import data_parallel as ddp_module
from megacore.optimizer import MegatronOptimizer, OptimizerConfig
from megacore.testing import run_distributed

SEQ, MICRO_BATCH, GLOBAL_MICROBATCHES, STEPS = 8, 2, 8, 5
CFG = TinyConfig(vocab_size=64, hidden=32, ffn=64, layers=4)
LR = 0.01
# Parallel fp32 runs against one process: losses and gradient norms within FP32_TOL
# (relative for norms), weights within lr / 20: Adam's first step is about lr * g / |g|, so
# elements whose gradient is rounding noise (the key biases' is exactly 0 in exact math) move
# by up to ~lr / 70 between summation orders; a wrong shard or a lost contribution moves by ~lr.
# Adam does not see a wrong gradient scale; the norms do.
FP32_TOL, FP32_WEIGHT_TOL = 2e-5, LR / 20
# The speed path off: torch's per-tensor AdamW, a norm and a host sync per tensor.
PLAIN_PATH = {"fused_adam": False, "fused_grad_norm": False}
# bf16/fp16 against fp32 after 5 steps: the loss (about 4.2) within LOSS_TOL, and the mean
# absolute weight difference within WEIGHT_TOL times the mean absolute change of the weights
# over the 5 steps (measured: bf16 9e-4 and 0.05, fp16 1.2e-4 and 0.01).
LOW_PRECISION = {  # dtype: (LOSS_TOL, WEIGHT_TOL)
    "torch.bfloat16": (5e-3, 0.15),
    "torch.float16": (1e-3, 0.04),
}


def _batches(step, microbatches=GLOBAL_MICROBATCHES):
    """The global batch of a step: `microbatches` microbatches, split over DP ranks."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (microbatches, MICRO_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _strict_reduce_scatter(output, input, group=None, async_op=False):
    """Reduce-scatter that leaves nan outside the output shard, as NCCL may leave garbage.

    gloo computes a reduce-scatter as an all-reduce, so the whole input would hold
    the sums and code reading outside its shard would pass here and fail on GPUs.
    """
    work = _REAL_REDUCE_SCATTER(output, input, group=group, async_op=True)
    work.wait()
    start = (output.data_ptr() - input.data_ptr()) // input.element_size()
    input[:start] = math.nan
    input[start + output.numel() :] = math.nan
    return work if async_op else None


class _LateGather:
    """The handle of `_late_all_gather`: the gather happens at wait()."""

    def __init__(self, output, input, group):
        self.args = output, input, group

    def wait(self):
        output, input, group = self.args
        _REAL_ALL_GATHER(output, input, group=group)
        return True


def _late_all_gather(output, input, group=None, async_op=False):
    """All-gather whose async form leaves nan outside this rank's part until wait().

    On gloo an async all-gather is usually done by the time anyone looks; on a GPU
    it may still be running, so code that reads parameters before waiting (a
    forward under overlap_param_gather without its hook) reads nan here.
    """
    if not async_op:
        return _REAL_ALL_GATHER(output, input, group=group)
    start = (input.data_ptr() - output.data_ptr()) // output.element_size()
    output[:start] = math.nan
    output[start + input.numel() :] = math.nan
    return _LateGather(output, input, group)


_REAL_REDUCE_SCATTER = ddp_module.reduce_scatter_flat
_REAL_ALL_GATHER = ddp_module.all_gather_flat
# In every rank importing this module.
ddp_module.reduce_scatter_flat = _strict_reduce_scatter
ddp_module.all_gather_flat = _late_all_gather

# The ways Python code reads a tensor's value on the host: each is a device sync on a GPU.
_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _step_counting_host_reads(optimizer):
    """optimizer.step()'s result and how many tensor values it read on the host.

    torch's AdamW itself is left out: it reads its step counters with .item(), but
    they live on the CPU (or, fused, stay on the device), so no device sync.
    """
    count, counting = [0], [True]

    def wrap(real):
        def read(self, *args, **kwargs):
            count[0] += counting[0]
            return real(self, *args, **kwargs)

        return read

    def adam_step(*args, **kwargs):
        counting[0] = False
        try:
            return type(optimizer.optimizer).step(optimizer.optimizer, *args, **kwargs)
        finally:
            counting[0] = True

    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    optimizer.optimizer.step = adam_step
    for name, real in originals.items():
        setattr(torch.Tensor, name, wrap(real))
    try:
        result = optimizer.step()
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)
        del optimizer.optimizer.step
    return result, count[0]


def _forward_step(inject_inf):
    def forward_step(data_iterator, model):
        out = model(*next(data_iterator))

        def loss_func(loss):
            if inject_inf[0]:  # once, in this rank's first microbatch
                loss, inject_inf[0] = loss * math.inf, False
            return loss, {"loss": loss.detach().float()}

        return out, loss_func

    return forward_step


def _train(
    *,
    cfg=CFG,
    tp_size=1,
    pp=1,
    vpp=None,
    dp_groups=None,
    dist_opt=False,
    dtype=torch.float32,
    steps=STEPS,
    inject_at=(),
    grad_reduce_in_fp32=True,
    bucket_size=700,  # several buckets, some parameters split between ranks
    state=None,
    start=0,
    overlap_param_gather=False,
    microbatches=GLOBAL_MICROBATCHES,
    **opt,
):
    """Train `steps` steps from step `start` and report losses, weights and optimizer facts.

    dp_groups=None is one process over the whole global batch (dp counts as 1).
    dp_groups='world' uses the data-parallel group of the layout; a list of rank
    lists makes explicit data-parallel groups (pure data parallelism on part of
    the world).  `state` resumes from an earlier run's `state`.
    """
    ps.initialize_model_parallel(tp_size, pp, vpp)
    tp.model_parallel_manual_seed(0)
    chunks = [c.to(dtype) for c in build_chunks(cfg, pp, vpp)]
    group = None
    if isinstance(dp_groups, list):
        made = [dist.new_group(ranks) for ranks in dp_groups]
        group = next(g for g, r in zip(made, dp_groups, strict=True) if dist.get_rank() in r)
    if dp_groups is not None:
        chunks = [
            DistributedDataParallel(
                c,
                grad_reduce_in_fp32=grad_reduce_in_fp32,
                overlap_grad_reduce=True,
                use_distributed_optimizer=dist_opt,
                bucket_size=bucket_size,
                data_parallel_group=group,
                overlap_param_gather=overlap_param_gather,
            )
            for c in chunks
        ]
        group = chunks[0].group
    dp = dist.get_world_size(group) if group else 1
    dp_rank = dist.get_rank(group) if group else 0
    config = OptimizerConfig(
        lr=LR,
        clip_grad=1.0,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=dist_opt,
        initial_loss_scale=2.0**10,
        **opt,
    )
    optimizer = MegatronOptimizer(config, chunks)
    if state is not None:
        for c, weights in zip(chunks, state["model"], strict=True):
            c.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
    losses, results, scales, host_reads = [], [], [], []
    for step in range(start, start + steps):
        count = microbatches // dp
        mine = _batches(step, microbatches)[dp_rank * count : (dp_rank + 1) * count]
        inject = [step in inject_at and dp_rank == dp - 1]
        infos = pipe.get_forward_backward_func()(
            forward_step_func=_forward_step(inject),
            data_iterator=[iter(mine) for _ in chunks] if vpp else iter(mine),
            model=chunks if vpp else chunks[0],
            num_microbatches=len(mine),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            hidden_size=cfg.hidden,
            dtype=dtype,
            grad_scale_func=optimizer.scale_loss,
            finalize_model_grads_func=pipe.finalize_model_grads,
        )
        if infos:  # the last pipeline stage: the mean loss over the global batch
            loss = torch.stack([i["loss"] for i in infos]).mean().reshape(1)
            if group is not None:
                dist.all_reduce(loss, group=group)
            losses.append(loss.item() / dp)
        result, reads = _step_counting_host_reads(optimizer)
        results.append(result)
        host_reads.append(reads)
        scales.append(optimizer.get_loss_scale())
        optimizer.zero_grad()
    # The last step's overlapped all-gather has no forward after it to wait for it.
    optimizer.finish_param_sync()
    module = lambda c: c.module if isinstance(c, DistributedDataParallel) else c  # noqa: E731
    weights, unaligned = {}, []
    for c in chunks:
        for name, p in module(c).named_parameters():
            for what, t in (("", p), (" main_grad", getattr(p, "main_grad", None))):
                if t is not None and t.data_ptr() % 16:
                    unaligned.append(f"{name}{what}")
            name = "embedding.weight" if name == "output_weight" else name
            weights[name] = full_tensor(p).float()
    out = {
        "losses": losses,
        "weights": weights,
        "ok": [r[0] for r in results],
        "grad_norms": [r[1] for r in results],
        "scales": scales,
        "skipped": optimizer.num_skipped_steps,
        "host_reads": host_reads,
        "state": {
            "model": [{k: v.clone() for k, v in c.state_dict().items()} for c in chunks],
            "optimizer": optimizer.state_dict(),
        },
        "owned": _owned_elements(optimizer, group),
        "unaligned": unaligned,  # parameters or gradients not starting on 16 bytes
    }
    ps.destroy_model_parallel()
    return out


def _owned_elements(optimizer, group):
    """(elements this rank keeps masters of, the same summed over DP, elements of the model)."""
    owned = sum(s.end - s.start for s in optimizer.shards)
    total = torch.tensor([owned])
    if group is not None:
        dist.all_reduce(total, group=group)
    return (
        owned,
        total.item(),
        sum(p.numel() for c in optimizer.model_chunks for p in c.parameters()),
    )


def _diff(run, reference):
    """Of a run against the reference: (max loss difference, max and mean weight difference)."""
    losses = run["losses"] or reference["losses"]  # stages before the last have none
    pairs = zip(losses, reference["losses"], strict=True)
    loss = max((abs(a - b) for a, b in pairs), default=0.0)
    diffs = [(w - reference["weights"][n]).abs() for n, w in run["weights"].items()]
    mean = sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs)
    return loss, max(d.max().item() for d in diffs), mean


def _world_of_4():
    reference = _train()
    initial = _train(steps=0)
    out = {"reference_norms": reference["grad_norms"], "update": _diff(initial, reference)[2]}
    # fp32: pure data parallelism at dp=4 and dp=2, and tp=2 x dp=2, with and without sharding.
    layouts = {"dp4": (1, "world"), "dp2": (1, [[0, 1], [2, 3]]), "tp2dp2": (2, "world")}
    runs = {}
    for name, (tp_size, groups) in layouts.items():
        for dist_opt in (False, True):
            run = runs[(name, dist_opt)] = _train(
                tp_size=tp_size, dp_groups=groups, dist_opt=dist_opt
            )
            out[("fp32", name, dist_opt)] = {
                "diff": _diff(run, reference),
                "ok": run["ok"],
                "norms": run["grad_norms"],
                "owned": run["owned"],
                "host_reads": run["host_reads"],
            }
    # The speed path (the default) against the plain one: TP-duplicated parameters
    # unsharded; and the tied embedding over two interleaved stages, sharded over DP.
    # Then overlap_param_gather against the blocking all-gather on the latter.
    pipelined = {"pp": 2, "vpp": 2, "dp_groups": "world", "dist_opt": True}
    runs["pp2dp2", True] = _train(**pipelined)
    for name, dist_opt, kw in (("tp2dp2", False, {"tp_size": 2}), ("pp2dp2", True, pipelined)):
        kw = {"dp_groups": "world", "dist_opt": dist_opt, **kw}
        plain = _train(**kw, **PLAIN_PATH)
        fast = runs[name, dist_opt]
        norms = zip(fast["grad_norms"], plain["grad_norms"], strict=True)
        out[("plain", name)] = {
            "diff": _diff(fast, plain),
            "norms": max(abs(a - b) / b for a, b in norms),
            "host_reads": (fast["host_reads"], plain["host_reads"]),
        }
    overlapped = _train(**pipelined, overlap_param_gather=True)
    out["overlap"] = {
        "diff": _diff(overlapped, runs["pp2dp2", True]),
        "host_reads": overlapped["host_reads"],
    }
    # bf16 and fp16 (fp32 gradient buffers and fp16 ones) against fp32.
    for dtype in (torch.bfloat16, torch.float16):
        for dist_opt in (False, True):
            for fp32_grads in (True, False):
                run = _train(
                    dp_groups=[[0, 1], [2, 3]],
                    dist_opt=dist_opt,
                    dtype=dtype,
                    grad_reduce_in_fp32=fp32_grads,
                )
                out[(str(dtype), dist_opt, fp32_grads)] = {
                    "diff": _diff(run, reference),
                    "skipped": run["skipped"],
                }
    # An inf in fp16 on one rank, at steps 1 and 2: hysteresis 2 keeps the scale once,
    # then halves it; both steps are skipped on every rank and change no weight.
    for dist_opt in (False, True):
        runs = [
            _train(
                dp_groups="world",
                dist_opt=dist_opt,
                dtype=torch.float16,
                steps=n,
                inject_at=(1, 2),
            )
            for n in (1, 2, 3, 4)
        ]
        same = [
            max(
                (runs[i]["weights"][k] - runs[0]["weights"][k]).abs().max().item()
                for k in runs[0]["weights"]
            )
            for i in (1, 2, 3)
        ]
        out[("inf", dist_opt)] = {
            "ok": runs[3]["ok"],
            "scales": runs[3]["scales"],
            "skipped": runs[3]["skipped"],
            "weight_change_after": same,
            "losses": runs[3]["losses"],
            "host_reads": runs[3]["host_reads"],
        }
    # The same on the plain path: the same steps skipped, the same scales.
    plain = _train(
        dp_groups="world",
        dist_opt=True,
        dtype=torch.float16,
        steps=4,
        inject_at=(1, 2),
        **PLAIN_PATH,
    )
    out["inf", "plain"] = {
        "ok": plain["ok"],
        "scales": plain["scales"],
        "diff": _diff(runs[3], plain),
    }
    # State: 3 steps, save, a fresh optimizer loads and goes on for 2: the same as 5 in a row.
    for dist_opt in (False, True):
        kw = {"dp_groups": "world", "dist_opt": dist_opt, "dtype": torch.float16}
        whole = _train(**kw)
        first = _train(**kw, steps=3)
        rest = _train(**kw, steps=2, start=3, state=first["state"])
        out[("resume", dist_opt)] = {
            "losses": (first["losses"] + rest["losses"], whole["losses"]),
            "weights": max(
                (rest["weights"][k] - whole["weights"][k]).abs().max().item()
                for k in whole["weights"]
            ),
        }
    return out


@pytest.fixture(scope="module")
def world_of_4():
    return run_distributed(_world_of_4, world_size=4, timeout=600)


def test_fp32_data_parallel_layouts_equal_one_process(world_of_4):
    for out in world_of_4:
        for name in ("dp4", "dp2", "tp2dp2"):
            for dist_opt in (False, True):
                got = out[("fp32", name, dist_opt)]
                where = f"{name} dist_opt={dist_opt}"
                assert got["diff"][0] < FP32_TOL, where
                assert got["diff"][1] < FP32_WEIGHT_TOL, where
                assert all(got["ok"]), where
                # Clipping was active (norm > 1.0) so the equality covers it too.
                assert max(got["norms"]) > 1.0, where
                for a, b in zip(got["norms"], out["reference_norms"], strict=True):
                    assert abs(a - b) < FP32_TOL * b, where
                mine, over_dp, model = got["owned"]
                if dist_opt:  # each rank keeps about 1/dp of the masters, together all once
                    dp = 4 if name == "dp4" else 2
                    assert over_dp == model, where
                    assert abs(mine - model / dp) < 0.1 * model / dp, where
                else:
                    assert mine == model, where


def test_low_precision_stays_near_fp32(world_of_4):
    for out in world_of_4:
        for dtype in ("torch.bfloat16", "torch.float16"):
            for dist_opt in (False, True):
                for fp32_grads in (True, False):
                    got = out[(dtype, dist_opt, fp32_grads)]
                    where = f"{dtype} dist_opt={dist_opt} fp32 grads={fp32_grads}"
                    loss_tol, weight_tol = LOW_PRECISION[dtype]
                    assert got["diff"][0] < loss_tol, where
                    assert got["diff"][2] < weight_tol * out["update"], where
                    assert got["diff"][1] > 0, where  # it did run in low precision
                    assert got["skipped"] == 0, where


def test_injected_inf_skips_step_and_backs_off_scale(world_of_4):
    for out in world_of_4:
        for dist_opt in (False, True):
            got = out[("inf", dist_opt)]
            assert got["ok"] == [True, False, False, True], dist_opt
            assert got["scales"] == [2.0**10, 2.0**10, 2.0**9, 2.0**9], dist_opt
            assert got["skipped"] == 2, dist_opt
            # Weights after steps 1 and 2 equal those after step 0; step 3 moves them.
            assert got["weight_change_after"][0] == 0.0, dist_opt
            assert got["weight_change_after"][1] == 0.0, dist_opt
            assert got["weight_change_after"][2] > 0.0, dist_opt
            assert math.isinf(got["losses"][1]) or math.isnan(got["losses"][1])


def test_optimizer_state_resumes_exactly(world_of_4):
    for out in world_of_4:
        for dist_opt in (False, True):
            got = out[("resume", dist_opt)]
            assert got["losses"][0] == got["losses"][1], dist_opt
            assert got["weights"] == 0.0, dist_opt


def test_speed_path_equals_plain_path(world_of_4):
    for out in world_of_4:
        for name in ("tp2dp2", "pp2dp2"):
            got = out[("plain", name)]
            assert got["diff"][0] < FP32_TOL, name
            assert got["diff"][1] < FP32_WEIGHT_TOL, name
            assert got["norms"] < 1e-6, name
        # fp16 with inf at steps 1 and 2: both paths skip them and back off alike.
        fast, plain = out[("inf", True)], out[("inf", "plain")]
        assert plain["ok"] == fast["ok"] and plain["scales"] == fast["scales"]
        loss_tol, weight_tol = LOW_PRECISION["torch.float16"]
        assert plain["diff"][0] < loss_tol
        assert plain["diff"][2] < weight_tol * out["update"]


def test_one_host_sync_per_step(world_of_4):
    for out in world_of_4:
        for name in ("dp4", "dp2", "tp2dp2"):
            for dist_opt in (False, True):
                assert out[("fp32", name, dist_opt)]["host_reads"] == [1] * STEPS, name
        for dist_opt in (False, True):  # fp16: loss scaling, two skipped steps
            assert out[("inf", dist_opt)]["host_reads"] == [1] * 4, dist_opt
        assert out["overlap"]["host_reads"] == [1] * STEPS
        for name in ("tp2dp2", "pp2dp2"):
            fast, plain = out[("plain", name)]["host_reads"]
            assert fast == [1] * STEPS, name
            assert min(plain) > 2, name  # the count sees the plain path's per-tensor reads


def test_overlapped_param_gather_equals_blocking(world_of_4):
    for out in world_of_4:
        # The same all-gathers, only waited for later: bit for bit the same training.
        assert out["overlap"]["diff"] == (0.0, 0.0, 0.0)


def _world_of_8():
    # With vpp=2, one bucket per chunk and word embeddings larger than the rest of the
    # chunk, the tied copies straddle the DP shard boundary at different points of
    # differently sized buffers on the first and last stage: the case that needs them in
    # buckets of their own.
    big_vocab = TinyConfig(**{**CFG.__dict__, "vocab_size": 512})
    out = {}
    for cfg, vpp, bucket_size in ((CFG, None, 700), (big_vocab, 2, 10**9)):
        reference = _train(cfg=cfg)
        for dist_opt in (False, True):
            run = _train(
                cfg=cfg,
                tp_size=2,
                pp=2,
                vpp=vpp,
                dp_groups="world",
                dist_opt=dist_opt,
                bucket_size=bucket_size,
            )
            out[(vpp, dist_opt)] = {
                "diff": _diff(run, reference),
                "n_losses": len(run["losses"]),
                "norm_diff": max(
                    math.inf if a is None else abs(a - b) / b  # None: a skipped step
                    for a, b in zip(run["grad_norms"], reference["grad_norms"], strict=True)
                ),
            }
    return out


def test_tp2_pp2_dp2_equals_one_process():
    for rank, out in enumerate(run_distributed(_world_of_8, world_size=8, timeout=600)):
        last_stage = ps_layout_is_last_stage(rank)
        for (vpp, dist_opt), got in out.items():
            where = f"rank {rank} vpp={vpp} dist_opt={dist_opt}"
            assert got["n_losses"] == (STEPS if last_stage else 0), where
            assert got["diff"][0] < FP32_TOL, where
            assert got["diff"][1] < FP32_WEIGHT_TOL, where
            assert got["norm_diff"] < FP32_TOL, where


def ps_layout_is_last_stage(rank, world=8, tp_size=2, pp=2):
    """Pipeline stage = the outermost coordinate of the Megatron layout."""
    return rank // (world // pp) == pp - 1


# Sizes that are no multiple of 16 bytes (LayerNorms of 30, fc1's bias of 66, 67 x 30
# embeddings): packed back to back in a flat buffer, every parameter after the first would
# start off a 16-byte boundary; dp 3 pads each bucket by a length that is no power of two.
ODD = TinyConfig(vocab_size=67, hidden=30, ffn=66, layers=2)
ODD_MICROBATCHES = 6  # divisible by dp 3


class _OddExperts(torch.nn.Module):
    """Two experts' 3-D weights (fp32 rows of 96 and 32 bytes, which the grouped GEMM takes)
    with an expert parameter of 5 elements laid out between them, and a dense LayerNorm."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.norm = torch.nn.LayerNorm(8)
        self.w1 = torch.nn.Parameter(torch.randn(2, 8, 24, generator=g) / 3)
        self.scale = torch.nn.Parameter(torch.rand(5, generator=g) + 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(2, 12, 8, generator=g) / 3)
        for p in (self.w1, self.scale, self.w2):
            p.allreduce = False  # expert parameters: their buffer is over expert DP

    def forward(self, x, counts):
        # grouped=True: torch's grouped GEMM or an error where grouped_gemm_available says no.
        return moe.grouped_mlp(self.norm(x), counts, self.w1, self.w2, grouped=True) * (
            self.scale.sum()
        )


def _expert_step(dp_size):
    """One Adam step of `_OddExperts` on this rank's tokens (over expert DP = DP = the world
    when dp_size > 1, sharded, in buckets of about one parameter), or on every rank's in one
    process (dp_size 1): (weights after the step, parameters or gradients off 16 bytes)."""
    ps.initialize_model_parallel(1, 1)
    model = _OddExperts()
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randn(9, 8, generator=g), torch.tensor([4, 5])) for _ in range(3)]
    chunk = model
    if dp_size > 1:
        chunk = DistributedDataParallel(model, use_distributed_optimizer=True, bucket_size=100)
        batches = batches[dist.get_rank() :: dp_size]
    optimizer = MegatronOptimizer(
        OptimizerConfig(lr=LR, use_distributed_optimizer=dp_size > 1), [chunk]
    )
    loss = sum(chunk(x, counts).square().mean() for x, counts in batches) / len(batches)
    loss.backward()
    if dp_size > 1:
        chunk.finish_grad_sync()
    optimizer.step()
    optimizer.finish_param_sync()
    unaligned = [
        f"{name}{what}"
        for name, p in model.named_parameters()
        for what, t in (("", p), (" main_grad", getattr(p, "main_grad", None)))
        if t is not None and t.data_ptr() % 16
    ]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    ps.destroy_model_parallel()
    return weights, unaligned


def _world_of_3():
    reference = _train(cfg=ODD, microbatches=ODD_MICROBATCHES)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for dist_opt in (False, True):
            run = _train(
                cfg=ODD,
                dp_groups="world",
                dist_opt=dist_opt,
                dtype=dtype,
                microbatches=ODD_MICROBATCHES,
            )
            out[(str(dtype), dist_opt)] = {
                "diff": _diff(run, reference),
                "norm_diff": max(
                    abs(a - b) / b
                    for a, b in zip(run["grad_norms"], reference["grad_norms"], strict=True)
                ),
                "owned": run["owned"],
                "unaligned": run["unaligned"],
            }
    out["update"] = _diff(_train(cfg=ODD, steps=0), reference)[2]
    (one, _), (sharded, unaligned) = _expert_step(1), _expert_step(3)
    initial = _OddExperts().state_dict()
    out["experts"] = {
        "diff": max((sharded[n] - w).abs().max().item() for n, w in one.items()),
        "moved": min((w - initial[n]).abs().max().item() for n, w in one.items()),
        "unaligned": unaligned,
    }
    return out


def test_odd_sizes_at_dp_3_aligned_and_equal_one_process():
    """dp 3 (as an expert data-parallel size of 3 is: Mixtral 8x7B at pp 4 x ep 8 on 96 GPUs)
    with parameters of sizes that are no multiple of 16 bytes: every parameter and gradient
    starts on 16 bytes in fp32 and bf16, with and without the distributed optimizer, the
    grouped GEMM takes expert weights sharded over expert DP 3, and training equals one
    process."""
    for rank, out in enumerate(run_distributed(_world_of_3, world_size=3, timeout=300)):
        for dist_opt in (False, True):
            where = f"rank {rank} dist_opt={dist_opt}"
            got = out[("torch.float32", dist_opt)]
            assert got["unaligned"] == [], where
            assert got["diff"][0] < FP32_TOL and got["diff"][1] < FP32_WEIGHT_TOL, where
            assert got["norm_diff"] < FP32_TOL, where
            mine, over_dp, model = got["owned"]
            # Sharded, each element's master on one rank, none on the padding between.
            assert (over_dp == model and mine < model) if dist_opt else mine == model, where
            low = out[("torch.bfloat16", dist_opt)]
            assert low["unaligned"] == [], where
            loss_tol, weight_tol = LOW_PRECISION["torch.bfloat16"]
            assert low["diff"][0] < loss_tol, where
            assert low["diff"][2] < weight_tol * out["update"], where
        experts = out["experts"]
        assert experts["unaligned"] == [], rank
        assert experts["moved"] > LR / 10, rank  # the step moved every weight
        assert experts["diff"] < 1e-6, rank
