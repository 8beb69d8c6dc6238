"""Activation recompute on built chunks (`model.recompute`): selective (the attention core) or
full (each layer)."""

from functools import partial

from megacore import tensor_parallel as tp
from megatrain.config import RECOMPUTE_CHOICES


def apply_recompute(chunk, mode: str, distribute_saved_activations: bool = False):
    """Activation recompute on a built chunk, in place; returns it.

    - "none": every activation kept for the backward.
    - "selective" (Korthikanti et al. 2022): each attention core (QK^T, softmax, dropout,
      scores x V) is run again in the backward instead of keeping its s x s activations,
      which are cheap to redo and costly to keep.
    - "full": each layer keeps only its input and runs again in the backward;
      `distribute_saved_activations` splits that input over the tensor-parallel ranks.
    Recompute replays the dropout masks (megacore's checkpoint restores the generators), so
    every mode computes the same numbers."""
    if mode not in RECOMPUTE_CHOICES:
        raise ValueError(f"model.recompute must be one of {RECOMPUTE_CHOICES}, not {mode!r}")
    for layer in chunk.transformer_layers():
        attention = layer.attention
        attention.core_attention = (
            partial(tp.checkpoint, attention.core, False) if mode == "selective" else attention.core
        )
    chunk.checkpointed_layer = (
        partial(_checkpointed_layer, distribute_saved_activations) if mode == "full" else None
    )
    return chunk


def _checkpointed_layer(distribute_saved_activations: bool, layer, x, mask):
    return tp.checkpoint(layer, distribute_saved_activations, x, mask)
