"""Models built from megacore's parallel pieces."""

from megatrain.models.gpt import (
    GPTConfig,
    GPTModel,
    build_gpt_chunks,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    num_parameters,
)

__all__ = [
    "GPTConfig",
    "GPTModel",
    "build_gpt_chunks",
    "hardware_flops_per_iteration",
    "model_flops_per_iteration",
    "num_parameters",
]
