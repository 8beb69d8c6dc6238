"""What fills the two slots of a `TransformerLayer` (megatron-core's layer specs, as two
functions): its attention, of the kind the config names (`attention.ATTENTION_KINDS`), and its
MLP, the routed experts on the layers `moe_layer_freq` names and the dense MLP elsewhere.

The layer calls these and knows neither kind; the kinds know nothing of the layer.  Both
take `layer_number` (the model's 0-based layer id), so a per-layer pattern (MoE layers,
sliding-window layers) is decided here.
"""

import dataclasses

from torch import nn

from megatrain.models.attention import build_attention
from megatrain.models.layout import ParallelContext
from megatrain.models.mlp import ParallelMLP
from megatrain.models.moe import MoELayer, is_moe_layer
from megatrain.models.transformer_config import TransformerConfig


def attention_for(
    cfg: TransformerConfig, place: dict, parallel: ParallelContext, layer_number: int
) -> nn.Module:
    """Layer `layer_number`'s attention (its weights drawn from `place`'s generator first); a
    full layer among sliding ones (`layer_types`) gets the config without its window."""
    if cfg.window_size is not None and not is_sliding_layer(cfg, layer_number):
        cfg = dataclasses.replace(cfg, window_size=None)
    return build_attention(cfg, place, parallel)


def is_sliding_layer(cfg: TransformerConfig, layer_number: int) -> bool:
    """Whether layer `layer_number` (0-based) attends through `cfg.window_size`: every layer,
    or those `layer_types` names "sliding_attention" (a layer past the list, multi-token
    prediction's, as the last layer)."""
    if cfg.window_size is None:
        return False
    if cfg.layer_types is None:
        return True
    return cfg.layer_types[min(layer_number, len(cfg.layer_types) - 1)] == "sliding_attention"


def mlp_for(
    cfg: TransformerConfig, place: dict, parallel: ParallelContext, layer_number: int
) -> nn.Module:
    """Layer `layer_number`'s MLP: `MoELayer` on a MoE layer, else `ParallelMLP`."""
    kind = MoELayer if is_moe_layer(cfg, layer_number) else ParallelMLP
    return kind(cfg, place, parallel)
