"""Data parallelism with contiguous gradient buffers equals one process over the global batch."""

import torch
import torch.distributed as dist
from tiny_stack import TinyConfig, TinyStack, full_tensor

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.distributed import DistributedDataParallel
from megacore.testing import run_distributed

SEQ, MICRO_BATCH, MICROBATCHES, STEPS, LR = 8, 2, 3, 5, 0.3


def _global_batch(cfg, dp, step):
    g = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(
        0, cfg.vocab_size, (dp * MICROBATCHES, MICRO_BATCH, SEQ + 1), generator=g
    )
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(cfg, tp_size, dp, overlap=None, fusion=False):
    """STEPS SGD steps; overlap=None is one process over the whole global batch.  `fusion`:
    gradient-accumulation fusion (the linears' GEMMs write main_grad)."""
    ps.initialize_model_parallel(tp_size)
    tp.model_parallel_manual_seed(0)
    model = TinyStack(cfg)
    ddp = None
    if overlap is not None:
        ddp = DistributedDataParallel(
            model,
            overlap_grad_reduce=overlap,
            bucket_size=3000,
            gradient_accumulation_fusion=fusion,
        )
    # Which parameters got a param.grad from autograd (the rest went straight to main_grad).
    through_autograd = set()
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: through_autograd.add(name))
    rank = ps.get_data_parallel_rank() if ddp else 0
    real_all_reduce, calls, forwards, finalizing = dist.all_reduce, [], [0], [False]

    def counting(tensor, *args, group=None, **kwargs):
        if group is ps.get_data_parallel_group():
            calls.append((forwards[0], "finalize" if finalizing[0] else "backward"))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def finalize(chunks):
        finalizing[0] = True
        pipe.finalize_model_grads(chunks)
        finalizing[0] = False

    def forward_step(data_iterator, m):
        forwards[0] += 1
        return m(*next(data_iterator)), lambda loss: (loss, {"loss": loss.detach()})

    losses = []
    dist.all_reduce = counting
    try:
        for step in range(STEPS):
            data = _global_batch(cfg, dp, step)
            count = MICROBATCHES if ddp else dp * MICROBATCHES
            mine = data[rank * count : (rank + 1) * count]
            infos = pipe.get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(mine),
                model=ddp or model,
                num_microbatches=count,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                finalize_model_grads_func=finalize,
            )
            losses.append(sum(i["loss"].item() for i in infos) / count)
            for p in model.parameters():
                grad = p.main_grad if ddp else p.grad
                p.data.add_(grad, alpha=-LR)
            if ddp:
                ddp.zero_grad_buffer()
            else:
                model.zero_grad(set_to_none=True)
            forwards[0] = 0
    finally:
        dist.all_reduce = real_all_reduce
    weights = {n: full_tensor(p) for n, p in model.named_parameters()}
    ps.destroy_model_parallel()
    return {
        "losses": losses,
        "weights": weights,
        "calls": calls,
        "buckets": len(ddp.buckets) if ddp else 0,
        "through_autograd": through_autograd,
        "linear_weights": {
            n
            for n, m in model.named_modules()
            if isinstance(m, tp.ColumnParallelLinear | tp.RowParallelLinear)
            and m.weight is not None  # not an output layer handed the tied embeddings
            for n in [f"{n}.weight"]
        },
    }


def _data_parallel_layouts():
    cfg = TinyConfig(layers=2)
    out = {}
    for tp_size, dp in ((1, 4), (2, 2)):
        reference = _train(cfg, 1, dp)
        for overlap, fusion in ((False, False), (True, False), (False, True), (True, True)):
            got = _train(cfg, tp_size, dp, overlap, fusion)
            # Each rank has the mean over its own microbatches; 4 ranks = tp x dp copies.
            losses = torch.tensor(got["losses"])
            dist.all_reduce(losses)
            out[(tp_size, dp, overlap, fusion)] = {
                "loss_diff": (losses / 4 - torch.tensor(reference["losses"])).abs().max().item(),
                "weight_diff": max(
                    (w - reference["weights"][n]).abs().max().item()
                    for n, w in got["weights"].items()
                ),
                "calls": sorted(set(got["calls"])),
                "n_calls": len(got["calls"]),
                "buckets": got["buckets"],
                "linear_weights": got["linear_weights"],
                "through_autograd": got["through_autograd"],
            }
    return out


def test_data_parallel_equals_one_process():
    for out in run_distributed(_data_parallel_layouts, world_size=4, timeout=300):
        for (tp_size, dp, overlap, fusion), r in out.items():
            where = f"tp={tp_size} dp={dp} overlap={overlap} fusion={fusion}"
            assert r["loss_diff"] < 1e-5, where
            assert r["weight_diff"] < 1e-5, where
            assert r["buckets"] > 1, where  # the test exercises several buckets
            # Communication only in the last microbatch of each step: one all-reduce per bucket,
            # launched during backward when overlapping, at the end otherwise.
            assert r["calls"] == [(MICROBATCHES, "backward" if overlap else "finalize")], where
            assert r["n_calls"] == STEPS * r["buckets"], where
            # Fused, no linear layer's weight gradient goes through autograd (the others do).
            assert r["linear_weights"] and r["through_autograd"], where
            if fusion:
                assert not r["through_autograd"] & r["linear_weights"], where
            else:
                assert r["through_autograd"] >= r["linear_weights"], where
