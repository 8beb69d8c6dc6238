"""What fills the two slots of a `TransformerLayer` (megatron-core's layer specs, as two
functions): its attention, of the kind the config names (`attention.ATTENTION_KINDS`), and its
MLP, the routed experts on the layers `moe_layer_freq` names and the dense MLP elsewhere.

The layer calls these and knows neither kind; the kinds know nothing of the layer.  Both
take `layer_number` (the model's 0-based layer id), so a per-layer pattern (MoE layers;
sliding-window layers when they come) is decided here.
"""

from torch import nn

from megatrain.models.attention import build_attention
from megatrain.models.layout import ParallelContext
from megatrain.models.mlp import ParallelMLP
from megatrain.models.moe import MoELayer, is_moe_layer
from megatrain.models.transformer_config import TransformerConfig


def attention_for(
    cfg: TransformerConfig, place: dict, parallel: ParallelContext, layer_number: int
) -> nn.Module:
    """Layer `layer_number`'s attention (its weights drawn from `place`'s generator first)."""
    return build_attention(cfg, place, parallel)


def mlp_for(
    cfg: TransformerConfig, place: dict, parallel: ParallelContext, layer_number: int
) -> nn.Module:
    """Layer `layer_number`'s MLP: `MoELayer` on a MoE layer, else `ParallelMLP`."""
    kind = MoELayer if is_moe_layer(cfg, layer_number) else ParallelMLP
    return kind(cfg, place, parallel)
