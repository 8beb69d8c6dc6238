"""`training.cuda_graphs` (issue 33): each transformer layer captured forward and backward.

On a CPU megacore's emulation of make_graphed_callables stands in for the capture (its static
memory, NaN warm-up gradients); with CUDA the same checks run on the real capture.  What the
training layouts cannot see is checked here: the fused weights' gradients, written inside the
graph, still start their buckets' reductions during the backward (the buffer's callback is
Python, which a replay does not run), and evaluation runs the layers' own forward.
"""

import contextlib

import pytest
import torch
from test_speed_path import VOCAB, B, S, _cfg

from megacore import tensor_parallel as tp
from megacore.distributed import DistributedDataParallel
from megatrain import parallelize
from megatrain.models.gpt import GPTModel
from megatrain.testing import cuda_graphs_on_cpu

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device: str, dropout: float = 0.0):
    cfg = _cfg(dropout)  # test_speed_path's 2-layer GPT
    model = GPTModel(cfg, seed=1234, device=device)
    # Small buckets: several per layer, each holding fused weights and hooked parameters.
    return DistributedDataParallel(
        model, overlap_grad_reduce=True, bucket_size=2000, gradient_accumulation_fusion=True
    )


def _graphed(device: str, dropout: float = 0.0):
    model = _model(device, dropout)
    if device == "cpu":
        with cuda_graphs_on_cpu():
            return parallelize.apply_cuda_graphs(model, S, B, torch.float32)
    return parallelize.apply_cuda_graphs(model, S, B, torch.float32)


def _batch(device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g).to(device)
    return tokens, torch.randint(0, VOCAB, (B, S), generator=g).to(device)


def _microbatches(model, seeds=(0, 1)) -> dict:
    """Two microbatches' forward and backward, the last one outside no_sync: the per-token
    losses, the main_grads, and whether each bucket's reduction had started when the
    backward returned (at dp 1 a started bucket's handle is True)."""
    model.train()
    model.zero_grad_buffer()
    losses = []
    for i, seed in enumerate(seeds):
        last = i == len(seeds) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            out = model(*_batch(next(model.parameters()).device.type, seed))
            out.mean().backward()
        losses.append(out.detach().clone())
    started = [b.handle is True for b in model.buckets]
    model.finish_grad_sync()
    grads = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "grads": grads, "started": started}


def _assert_same(a: dict, b: dict, atol: float) -> None:
    for x, y in zip(a["losses"], b["losses"], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)
    for name in a["grads"]:
        torch.testing.assert_close(a["grads"][name], b["grads"][name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_graphed_layers_train_as_eager_ones_and_start_every_reduction(gloo_world_of_one, device):
    eager, graphed = _model(device), _graphed(device)
    tol = 0.0 if device == "cpu" else 1e-5
    want, got = _microbatches(eager), _microbatches(graphed)
    _assert_same(got, want, tol)
    assert all(want["started"]) and len(want["started"]) > 4, want["started"]
    assert got["started"] == want["started"]  # the fused weights announced after the replay
    _assert_same(_microbatches(graphed, (2, 3)), _microbatches(eager, (2, 3)), tol)
    # Evaluation and no_grad run the layers' own forward, in eval mode: no graph replayed.
    for m in (eager, graphed):
        m.eval()
    tokens, labels = _batch(device, 4)
    with torch.no_grad():
        torch.testing.assert_close(graphed(tokens, labels), eager(tokens, labels), rtol=0, atol=tol)


def test_without_the_announcement_the_fused_weights_buckets_wait(gloo_world_of_one, monkeypatch):
    """The negative control of the check above: with the call after each layer's backward
    removed, the buckets holding fused weights start only at finish_grad_sync."""
    monkeypatch.setattr(parallelize.cuda_graphs._AfterBackward, "apply", lambda x, done: x)
    started = _microbatches(_graphed("cpu"))["started"]
    assert not all(started) and any(started), started


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real capture needs CUDA")
def test_replays_draw_new_dropout_masks_on_cuda(gloo_world_of_one):
    """A replayed graph's dropout draws fresh masks each time (CUDA's generator registered
    with the graph), not the capture's: two replays of one batch differ, and the same seed
    repeats a replay's draws."""
    model = _graphed("cuda", dropout=0.1)
    model.train()
    tokens, labels = _batch("cuda", 0)
    tp.model_parallel_manual_seed(7)
    first = model(tokens, labels).detach().clone()
    second = model(tokens, labels).detach().clone()
    tp.model_parallel_manual_seed(7)
    again = model(tokens, labels).detach().clone()
    assert not torch.equal(first, second)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_on_a_cpu_the_run_is_refused_naming_the_switch():
    with pytest.raises(ValueError, match=r"training.cuda_graphs = true needs a CUDA device"):
        parallelize.check_cuda_graphs(torch.device("cpu"))
