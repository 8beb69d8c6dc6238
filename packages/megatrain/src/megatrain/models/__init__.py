"""Models built from megacore's parallel pieces: GPT and BERT on one transformer.

`model.kind` of a run config picks the model; the functions here dispatch on it, so the
training loop, checkpoints and loaders take the kind from the config instead of assuming
GPT.
"""

from megatrain.models import bert, gpt
from megatrain.models.bert import BertModel, bert_config, build_bert_chunks
from megatrain.models.gpt import (
    GPTConfig,
    GPTModel,
    build_gpt_chunks,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    num_parameters,
)
from megatrain.models.transformer import TransformerConfig, compile_layers

_MODULES = {"gpt": gpt, "bert": bert}
_BUILDERS = {"gpt": build_gpt_chunks, "bert": build_bert_chunks}


def build_model_chunks(kind: str, cfg: TransformerConfig, seed: int = 1234, **placement) -> list:
    """This rank's chunks of the `kind` model ("gpt" or "bert"); `placement`: device, dtype,
    initialize, as `build_gpt_chunks`."""
    return _BUILDERS[kind](cfg, seed, **placement)


def flops_per_iteration(
    kind: str, cfg: TransformerConfig, global_batch: int, seq_length: int
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one training iteration of the `kind` model: the
    numerators of MFU and HFU (recompute as `cfg.recompute`)."""
    module = _MODULES[kind]
    return (
        module.model_flops_per_iteration(cfg, global_batch, seq_length),
        module.hardware_flops_per_iteration(cfg, global_batch, seq_length, cfg.recompute),
    )


def parameter_count(kind: str, cfg: TransformerConfig) -> int:
    """Parameters of the whole `kind` model, tied embeddings counted once."""
    return _MODULES[kind].num_parameters(cfg)


__all__ = [
    "BertModel",
    "GPTConfig",
    "GPTModel",
    "TransformerConfig",
    "bert_config",
    "build_bert_chunks",
    "build_gpt_chunks",
    "build_model_chunks",
    "compile_layers",
    "flops_per_iteration",
    "hardware_flops_per_iteration",
    "model_flops_per_iteration",
    "num_parameters",
    "parameter_count",
]
