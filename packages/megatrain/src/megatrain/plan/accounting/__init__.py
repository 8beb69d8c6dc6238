"""Parameters, FLOPs and memory of a model, from its config alone: every formula in one place.

The training loop's MFU/HFU logging (`run/loop.py`), the memory estimate (`megatrain.plan.memory`),
`megatrain plan`'s cost model, the benchmarks and megaeval all count with these functions;
nothing here builds a model or imports the training loop.

Which module counts what (each imports only modules above it in this list):

- parameters.py: parameters of a layer, of the whole model, of one GPU of a pipeline stage,
  a mixture of experts' (all and active), multi-token prediction's depths;
- gemms.py: the weight GEMMs of a layer (`layer_gemms`, each a `Gemm`), which the FLOP count
  sums and the time model times, and which of them run in float8 (`float8_gemm`);
- recompute.py: the recompute policies published runs ran that megatrain does not offer
  (`RECOMPUTE_IMPLEMENTATIONS`: what "op_selective" reruns and keeps);
- flops.py: FLOPs of a forward pass and of an iteration, model (MFU) and hardware (HFU, with
  what recomputation runs again), GPT's and BERT's;
- kinds.py: each model kind's counts (`KINDS`) and the counts by kind (`parameter_count`,
  `flops_per_iteration`);
- state.py: bytes per parameter of weights, gradients and optimizer state, FSDP's gathered
  bytes, a background checkpoint save's host copy;
- attention.py: which kernel the attention core runs as, and what the attention keeps and
  holds under context parallelism;
- activations.py: the bytes one layer keeps per microbatch under each recompute mode (a MoE
  layer's MLP and token dispatch, multi-latent attention's tensors, ZB-H1's weight-gradient
  inputs).

`kind` is a run config's `model.kind`: "gpt", "bert" or "llama" (`KINDS`).

Every name is imported from here: `megatrain.plan.accounting` re-exports them all.
"""

from megatrain.plan.accounting.activations import (
    activations_per_layer,
    expert_layout,
    mla_activations,
    moe_dispatch_bytes,
    moe_mlp_activations,
    weight_grad_inputs_per_layer,
)
from megatrain.plan.accounting.attention import (
    ATTENTION_IMPLEMENTATIONS,
    ATTENTION_KERNELS,
    attention_kernel,
    attention_kernel_for,
    attention_widths,
    context_parallel_attention_per_layer,
    context_parallel_attention_working,
    context_parallel_masks,
    context_parallel_numbers,
    flash_attention,
)
from megatrain.plan.accounting.flops import (
    MASKED_LM_PROB,
    active_ffn_width,
    attention_core_flops,
    bert_forward_flops,
    bert_hardware_flops_per_iteration,
    bert_model_flops_per_iteration,
    gpt_forward_flops,
    gpt_hardware_flops_per_iteration,
    gpt_model_flops_per_iteration,
    recomputed_flops,
    transformer_forward_flops,
)
from megatrain.plan.accounting.gemms import FLOAT8_ALIGN as FLOAT8_ALIGN
from megatrain.plan.accounting.gemms import Gemm, layer_gemms
from megatrain.plan.accounting.gemms import float8_gemm as float8_gemm
from megatrain.plan.accounting.kinds import (
    BERT,
    GPT,
    KINDS,
    ModelKind,
    flops_per_iteration,
    parameter_count,
)
from megatrain.plan.accounting.parameters import (
    active_parameters,
    attention_parameters,
    attention_parameters_per_rank,
    bert_parameters,
    expert_ffn_size,
    expert_parameters_per_gpu,
    gpt_parameters,
    layer_parameters,
    layer_parameters_per_rank,
    moe_layer_count,
    moe_mlp_parameters,
    mtp_layer_numbers,
    mtp_parameters,
    parameters_per_gpu,
    stage_layer_ids,
    stage_layers,
)
from megatrain.plan.accounting.recompute import OP_SELECTIVE_RERUN as OP_SELECTIVE_RERUN
from megatrain.plan.accounting.recompute import (
    RECOMPUTE_IMPLEMENTATIONS as RECOMPUTE_IMPLEMENTATIONS,
)
from megatrain.plan.accounting.recompute import (
    op_selective_activations_per_token as op_selective_activations_per_token,
)
from megatrain.plan.accounting.state import (
    checkpoint_copy_bytes_per_parameter as checkpoint_copy_bytes_per_parameter,
)
from megatrain.plan.accounting.state import fsdp_gathered_bytes, state_bytes_per_parameter

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "ATTENTION_KERNELS",
    "BERT",
    "GPT",
    "KINDS",
    "MASKED_LM_PROB",
    "Gemm",
    "ModelKind",
    "activations_per_layer",
    "active_ffn_width",
    "active_parameters",
    "attention_core_flops",
    "attention_kernel",
    "attention_kernel_for",
    "attention_parameters",
    "attention_parameters_per_rank",
    "attention_widths",
    "bert_forward_flops",
    "bert_hardware_flops_per_iteration",
    "bert_model_flops_per_iteration",
    "bert_parameters",
    "context_parallel_attention_per_layer",
    "context_parallel_attention_working",
    "context_parallel_masks",
    "context_parallel_numbers",
    "expert_ffn_size",
    "expert_layout",
    "expert_parameters_per_gpu",
    "flash_attention",
    "flops_per_iteration",
    "fsdp_gathered_bytes",
    "gpt_forward_flops",
    "gpt_hardware_flops_per_iteration",
    "gpt_model_flops_per_iteration",
    "gpt_parameters",
    "layer_gemms",
    "layer_parameters",
    "layer_parameters_per_rank",
    "mla_activations",
    "moe_dispatch_bytes",
    "moe_layer_count",
    "moe_mlp_activations",
    "moe_mlp_parameters",
    "mtp_layer_numbers",
    "mtp_parameters",
    "parameter_count",
    "parameters_per_gpu",
    "recomputed_flops",
    "stage_layer_ids",
    "stage_layers",
    "state_bytes_per_parameter",
    "transformer_forward_flops",
    "weight_grad_inputs_per_layer",
]
