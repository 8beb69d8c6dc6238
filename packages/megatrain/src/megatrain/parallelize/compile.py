"""What changes how the layers' kernels run, without changing what they compute: torch.compile
per layer, float8 GEMMs in the column- and row-parallel linears, and sequence parallelism's
collectives overlapped with those linears' GEMMs."""

from megacore import tensor_parallel as tp


def apply_compile(chunk):
    """torch.compile each TransformerLayer of `chunk` in place (`training.compile`).

    Per layer, not the whole model: the graph is one block (LayerNorms, bias + GeLU, bias +
    dropout + residual fused; the matmuls and attention stay library kernels), compiled once
    and reused by every layer, and full recompute's `tp.checkpoint` stays outside it, calling
    the compiled layer in forward and again in backward.  Dynamo breaks the graph at what it
    cannot trace, the RNG tracker's fork (generator state swaps: at tp > 1 without sequence
    parallelism; with it the fork is around the layer, outside the graph), selective
    recompute's checkpoint, and runs those eagerly, so the dropout masks and the recompute
    are the eager ones.  With tp > 1 the tensor-parallel collectives sit in the same graph.
    `Module.compile` keeps the parameter names (no `_orig_mod.` prefix), so checkpoints do
    not change.  `fallback_random`: dropout draws from torch's generators as in eager, so a
    seed gives the same masks with compile on or off (inductor's own in-kernel random
    numbers would be a little faster and draw other masks).
    """
    for layer in chunk.transformer_layers():
        layer.compile(options={"fallback_random": True})
    return chunk


def apply_tp_comm_overlap(chunk):
    """Every sequence-parallel column- and row-parallel linear inside `chunk` (the layers' and
    the output layer) with its all-gather or reduce-scatter overlapped with its GEMM
    (`parallel.tp_comm_overlap`, megacore's `tensor_parallel.comm_overlap`), in place; returns
    it.  Linears without sequence parallelism (the experts' own, BERT's head) keep theirs."""
    for module in chunk.modules():
        if isinstance(module, tp.ColumnParallelLinear | tp.RowParallelLinear):
            module.tp_comm_overlap = module.sequence_parallel
    return chunk


def apply_float8(chunk, recipe: "tp.Float8Recipe"):
    """The GEMMs of every column- and row-parallel linear inside `chunk`'s transformer layers in
    float8 (`training.precision = "fp8"`), in place; returns it.

    The layers only, as torchtitan's float8 converter leaves the output layer: the logits
    (and the tied embeddings they share a weight with) stay bf16, where float8's few
    mantissa bits would cost the most.  A linear whose dimensions are not multiples of 16
    keeps bf16 (`Float8Recipe.applies_to`)."""
    for layer in chunk.transformer_layers():
        for module in layer.modules():
            if isinstance(module, tp.ColumnParallelLinear | tp.RowParallelLinear):
                module.float8 = recipe
    return chunk
