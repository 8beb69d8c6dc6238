"""`AttentionInputs`: what a causal attention needs of a batch beyond its activations."""

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionInputs:
    """What every layer's causal attention needs of a batch beyond its activations, made once
    per forward (`LanguageModel.attention_inputs`) and handed down in the place of BERT's
    padding mask: the position of each token (rotary angles; None: 0, 1, ... in order), the
    document of each token (packed documents attend within their own; None: one sequence),
    and `seq_len`, the length of the whole sequence (the rotary table's size)."""

    position_ids: torch.Tensor | None = None  # [b, s] int64
    segments: torch.Tensor | None = None  # [b, s] int64
    seq_len: int = 0
    # FlexAttention's block masks of `segments` by sliding window (None: none), each made by
    # the first layer that needs it and shared by the others (the same documents in every
    # layer; sliding and full layers differ).
    block_masks: dict = field(default_factory=dict)
