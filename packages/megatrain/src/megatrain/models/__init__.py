"""Models built from megacore's parallel pieces."""

from megatrain.models.gpt import (
    GPTConfig,
    GPTModel,
    build_gpt_chunks,
    model_flops_per_iteration,
    num_parameters,
)

__all__ = [
    "GPTConfig",
    "GPTModel",
    "build_gpt_chunks",
    "model_flops_per_iteration",
    "num_parameters",
]
