"""Model-parallel gradient clipping equals torch's on the gathered model."""

import math

import torch
from tiny_stack import TinyConfig, TinyStack, build_chunks, full_tensor

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.optimizer import clip_grad_norm, get_grad_norm
from megacore.testing import run_distributed

SEQ, MICRO_BATCH, MICROBATCHES = 8, 2, 4


def _data(cfg):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (MICROBATCHES, MICRO_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _forward_step(data_iterator, model):
    out = model(*next(data_iterator))
    return out, lambda loss: (loss, {})


def _backward(cfg, chunks):
    pipe.get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(_data(cfg)),
        model=chunks[0],
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        hidden_size=cfg.hidden,
        finalize_model_grads_func=pipe.finalize_model_grads,
    )


def _clip_at_each_layout():
    cfg = TinyConfig(layers=4, sequence_parallel=False)
    ps.initialize_model_parallel(1, 1)
    tp.model_parallel_manual_seed(0)
    reference = TinyStack(cfg)
    _backward(cfg, [reference])
    ref_inf = max(p.grad.abs().max().item() for p in reference.parameters())
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    max_norm = 0.5 * ref_norm.item()  # so that clipping scales every gradient
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ps.destroy_model_parallel()

    out = {"ref_norm": ref_norm.item(), "ref_inf": ref_inf}
    for tp_size, pp in ((2, 2), (4, 1), (1, 4)):
        ps.initialize_model_parallel(tp_size, pp)
        tp.model_parallel_manual_seed(0)
        (chunk,) = build_chunks(cfg, pp, None)
        _backward(cfg, [chunk])
        params = list(chunk.parameters())
        inf_norm = get_grad_norm(params, math.inf)
        # The plain per-tensor path, before clipping changes the gradients.
        plain = get_grad_norm(params, foreach=False), get_grad_norm(params, math.inf, foreach=False)
        norm = clip_grad_norm(params, max_norm)
        diff = 0.0
        for name, p in chunk.named_parameters():
            ref = ref_grads["embedding.weight" if name == "output_weight" else name]
            diff = max(diff, (full_tensor(p, p.grad) - ref).abs().max().item())
        out[(tp_size, pp)] = {"norm": norm, "inf": inf_norm, "grad_diff": diff, "plain": plain}
        ps.destroy_model_parallel()
    return out


def test_clip_grad_norm_equals_torch_on_gathered_model():
    for out in run_distributed(_clip_at_each_layout, world_size=4, timeout=300):
        for layout in ((2, 2), (4, 1), (1, 4)):
            got = out[layout]
            assert abs(got["norm"] - out["ref_norm"]) < 1e-5 * out["ref_norm"], layout
            assert abs(got["inf"] - out["ref_inf"]) < 1e-7, layout
            assert got["grad_diff"] < 1e-6, layout
            assert abs(got["plain"][0] - got["norm"]) < 1e-6 * got["norm"], layout
            assert got["plain"][1] == got["inf"], layout
