"""Each model kind's counts (`ModelKind`: its parameters and FLOPs) and the two by kind:
`parameter_count` and `flops_per_iteration`.

`kind` is a run config's `model.kind`: "gpt", "bert" or "llama" (`KINDS`).
"""

from collections.abc import Callable
from dataclasses import dataclass

from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting.flops import (
    bert_forward_flops,
    bert_hardware_flops_per_iteration,
    bert_model_flops_per_iteration,
    gpt_forward_flops,
    gpt_hardware_flops_per_iteration,
    gpt_model_flops_per_iteration,
)
from megatrain.plan.accounting.parameters import bert_parameters, gpt_parameters


@dataclass(frozen=True)
class ModelKind:
    """One model kind's counts (cfg, global batch, sequence length -> number)."""

    num_parameters: Callable[[TransformerConfig], int]
    forward_flops: Callable[..., tuple[float, float, float]]
    model_flops_per_iteration: Callable[..., float]
    hardware_flops_per_iteration: Callable[..., float]


GPT = ModelKind(
    gpt_parameters,
    gpt_forward_flops,
    gpt_model_flops_per_iteration,
    gpt_hardware_flops_per_iteration,
)
BERT = ModelKind(
    bert_parameters,
    bert_forward_flops,
    bert_model_flops_per_iteration,
    bert_hardware_flops_per_iteration,
)
KINDS = {"gpt": GPT, "bert": BERT, "llama": GPT}  # a Llama is GPTModel with its switches


def parameter_count(kind: str, cfg: TransformerConfig) -> int:
    """Parameters of the whole `kind` model, tied embeddings counted once."""
    return KINDS[kind].num_parameters(cfg)


def flops_per_iteration(
    kind: str,
    cfg: TransformerConfig,
    global_batch: int,
    seq_length: int,
    recompute: str | None = None,
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one training iteration of the `kind` model: the
    numerators of MFU and HFU (recompute as `cfg.recompute`, or a published run's policy)."""
    formulas = KINDS[kind]
    recompute = recompute or cfg.recompute
    return (
        formulas.model_flops_per_iteration(cfg, global_batch, seq_length),
        formulas.hardware_flops_per_iteration(cfg, global_batch, seq_length, recompute),
    )
