"""Adam with decoupled weight decay: which parameters decay.

As in Megatron-LM and the paper (Adam, weight decay 0.01): matrices decay;
biases and normalization weights (every parameter with one dimension) do not.
"""

from collections.abc import Iterable

import torch
from torch import nn


def get_param_groups(model_chunks: Iterable[nn.Module], weight_decay: float = 0.01) -> list[dict]:
    """Two torch optimizer groups: decayed matrices, and biases/norms with weight_decay=0."""
    decay, no_decay, seen = [], [], set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.dim() <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw(
    model_chunks: Iterable[nn.Module],
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """torch's AdamW (decoupled decay) over `get_param_groups`."""
    return torch.optim.AdamW(
        get_param_groups(model_chunks, weight_decay), lr=lr, betas=betas, eps=eps
    )
