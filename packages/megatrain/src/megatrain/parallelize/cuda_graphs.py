"""CUDA graphs of every transformer layer, forward and backward (`training.cuda_graphs`)."""

import contextlib

import torch
from torch.cuda import make_graphed_callables

from megacore import tensor_parallel as tp


def check_cuda_graphs(device: torch.device) -> None:
    """`training.cuda_graphs` needs a CUDA device: refused before any weight is built."""
    if device.type != "cuda":
        raise ValueError(
            f"training.cuda_graphs = true needs a CUDA device; this run is on {device.type}: "
            "set training.cuda_graphs = false"
        )


class _AfterBackward(torch.autograd.Function):
    """Identity; its backward calls `done()` first.  Put on a graphed layer's input, it runs
    once the layer's backward graph has replayed (the input's gradient comes out of it)."""

    @staticmethod
    def forward(ctx, x, done):
        ctx.done = done
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.done()
        return grad, None


def apply_cuda_graphs(ddp_chunk, seq_length: int, micro_batch_size: int, dtype: torch.dtype):
    """Capture every transformer layer of a DDP-wrapped chunk as CUDA graphs, forward and
    backward (`training.cuda_graphs`), with torch.cuda.make_graphed_callables, all in one
    memory pool; returns the chunk.

    A layer's input is [s, b, h] (s / tp under sequence parallelism); a bidirectional model
    (BERT) also takes its key-padding mask [b, 1, 1, s].  The layers' Python runs at
    capture only, so what must run on every pass stays outside the graphs:

    - gradient-accumulation fusion adds the weight gradients into `main_grad` inside the
      captured backward, but the data-parallel buffer's "written" callback, which starts a
      bucket's reduction, is Python: inside the graph it only records which parameters the
      graph writes, and `_AfterBackward` on the layer's input makes the real calls once the
      layer's backward graph has replayed (so reductions still overlap the backward);
    - other parameters get their gradients from the graph's backward through autograd and
      the buffer's usual hook.

    Warm-up and capture run the layers' forward and backward on samples (after the caller
    seeded the generators): their gradients are cleared from the buffer after, and the
    caller seeds the generators again, so the first step draws what it would have without
    graphs.  A layer in eval mode, under no_grad, or asked for a KV cache runs its own eager
    forward.
    """
    chunk = ddp_chunk.module
    cfg, layers = chunk.config, list(chunk.layers.values())
    written: set = set()
    callbacks = {}
    for layer in layers:
        for p in layer.parameters():
            if getattr(p, "main_grad_written", None) is not None:
                callbacks[p] = p.main_grad_written
                p.main_grad_written = written.add
    device = next(chunk.parameters()).device
    local = seq_length // chunk.parallel.tp_size if cfg.sequence_parallel else seq_length
    shape = (local, micro_batch_size, cfg.hidden_size)
    mask = torch.ones(micro_batch_size, 1, 1, seq_length, device=device, dtype=torch.bool)

    def sample() -> tuple:
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        return (x,) if cfg.causal else (x, mask.clone())

    # The layers' draws all per rank (sequence parallelism): captured inside the fork that
    # `in_rank_stream` puts around each graphed layer in training, so none swaps inside.
    forked = chunk.in_rank_stream(layers[0]) is not layers[0]
    with (
        ddp_chunk.no_sync(),  # the warm-up's gradients start no reduction
        tp.get_rng_tracker().fork() if forked else contextlib.nullcontext(),
    ):
        make_graphed_callables(
            tuple(layers), tuple(sample() for _ in layers), allow_unused_input=True
        )
    ddp_chunk.zero_grad_buffer()
    for layer in layers:
        fused = [(p, callbacks[p]) for p in layer.parameters() if p in written]
        layer.forward = _graphed_layer_forward(layer, layer.forward, fused)
    return ddp_chunk


def _graphed_layer_forward(layer, graphed, fused: list):
    """The forward a graphed layer gets: the graph in training, with the fused parameters'
    "written" callbacks after its backward; the layer's own forward otherwise."""
    eager = type(layer).forward.__get__(layer)

    def done() -> None:
        for p, callback in fused:
            callback(p)

    def forward(x, mask=None, cache=None, layer_id=0):
        if cache is not None or not (layer.training and torch.is_grad_enabled()):
            return eager(x, mask, cache, layer_id)
        if fused:
            x = _AfterBackward.apply(x, done)
        # The graph takes its sample's arguments exactly (None would count as one).
        return graphed(x) if mask is None else graphed(x, mask)

    return forward
