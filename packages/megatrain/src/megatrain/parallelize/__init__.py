"""Parallelism, recompute and compile applied to a plain model from outside, in one place.

The model classes (`models/`) compute one chunk of the transformer at a layout
(`models.layout.ParallelContext`: their tensor-, pipeline- and expert-parallel slices are
built in); everything else a run does to the built chunks is `parallelize_model`'s, one
step a module here, applied in a fixed order (torchtitan's `parallelize_llama` is the
model):

1. expert parallelism (`expert_parallel`): the MoE layers' token dispatchers, the experts'
   place in the whole expert weights (checkpoints), the router's aux-loss group;
2. context parallelism (`context_parallel`): each layer's attention over the whole
   sequence, split over the CP ranks;
3. tensor-parallel communication overlap (`compile.apply_tp_comm_overlap`);
4. activation recompute (`recompute`): selective or full, the dropout masks replayed;
5. float8 GEMMs in the layers' linears (`compile.apply_float8`) — before compile, so the
   compiled graph holds the float8 casts;
6. torch.compile per layer (`compile.apply_compile`) — after recompute, so full
   recompute's checkpoint calls the compiled layer, and before FSDP, as torchtitan;
7. data parallelism (`data_parallel`): FSDP2 (`data_parallel_sharding = "full"`) or
   megacore's DDP and the distributed optimizer's buffers, over the data x context group;
8. the dropout seeds of the TP ranks (the same masks on a stage's TP ranks, others between
   stages);
9. CUDA graphs (`cuda_graphs`) — last: after DDP, whose distributed optimizer moves the
   parameters, and after the seeds, which the capture's draws are undone to.

Steps 1, 3 and 4 read the chunks' own `TransformerConfig`; the others the run's `Config`.
"""

import torch

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megatrain.config import Config
from megatrain.parallelize.compile import apply_compile, apply_float8, apply_tp_comm_overlap
from megatrain.parallelize.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    split_batch_for_context_parallel,
)
from megatrain.parallelize.cuda_graphs import apply_cuda_graphs, check_cuda_graphs
from megatrain.parallelize.data_parallel import apply_ddp, apply_fsdp, reshard_after_forward
from megatrain.parallelize.expert_parallel import (
    apply_expert_parallel,
    aux_loss_over_layout,
    sum_expert_loads,
)
from megatrain.parallelize.recompute import apply_recompute

# fp8 keeps bf16 parameters and activations; the layers' GEMMs run in float8.
PRECISION_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}


def check_device_support(config: Config, device: torch.device) -> None:
    """What the run's steps need of `device`, refused before any weight is built: float8
    GEMMs (`training.precision = "fp8"`) and CUDA graphs."""
    t = config.training
    if t.precision == "fp8":
        tp.check_float8_available(device, t.fp8_emulate)
    if t.cuda_graphs:
        check_cuda_graphs(device)


def parallelize_model(chunks: list, config: Config | None = None) -> list:
    """This rank's built chunks with every step of the module's list applied in its order;
    returns the chunks as the run trains them (wrapped for data parallelism when `config` is
    given).  `config` None (a model built outside a run: evaluation, tests): the steps the
    chunks' own `TransformerConfig` names (1, 3, 4), nothing else.  Every rank calls it
    (steps 7 and 9 hold collectives)."""
    for chunk in chunks:
        cfg = chunk.config
        apply_expert_parallel(chunk)
        if config is not None:
            apply_context_parallel(chunk, config.parallel.cp_comm_type)
        if cfg.tp_comm_overlap:
            apply_tp_comm_overlap(chunk)
        apply_recompute(chunk, cfg.recompute, cfg.distribute_saved_activations)
    if config is None:
        return chunks
    p, t = config.parallel, config.training
    dtype = PRECISION_DTYPES[t.precision]
    if t.precision == "fp8":
        chunks = [apply_float8(c, tp.Float8Recipe(emulate=t.fp8_emulate)) for c in chunks]
    if t.compile:
        chunks = [apply_compile(c) for c in chunks]
    # Context-parallel ranks hold the whole model too: their gradients are summed.
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    if p.data_parallel_sharding == "full":
        chunks = [
            apply_fsdp(
                c, dp_group, dtype, reshard_after_forward(p),
                reduce_every_microbatch=p.reduce_every_microbatch,
            )
            for c in chunks
        ]  # fmt: skip
    else:
        fusion = t.gradient_accumulation_fusion
        chunks = [apply_ddp(c, p, fusion, dtype, dp_group) for c in chunks]
    # Dropout masks: the same on the TP ranks of a stage, different between stages.
    seed = t.seed + 100 * ps.get_pipeline_model_parallel_rank()
    tp.model_parallel_manual_seed(seed)
    if t.cuda_graphs:
        chunks = [apply_cuda_graphs(c, t.seq_length, t.micro_batch_size, dtype) for c in chunks]
        tp.model_parallel_manual_seed(seed)  # undo the capture's draws
    return chunks


__all__ = [
    "PRECISION_DTYPES",
    "ContextParallel",
    "apply_compile",
    "apply_context_parallel",
    "apply_cuda_graphs",
    "apply_ddp",
    "apply_expert_parallel",
    "apply_float8",
    "apply_fsdp",
    "apply_recompute",
    "apply_tp_comm_overlap",
    "aux_loss_over_layout",
    "check_cuda_graphs",
    "check_device_support",
    "parallelize_model",
    "split_batch_for_context_parallel",
    "sum_expert_loads",
]
