"""Learning rate: linear warm-up, then cosine (the paper) or linear decay to a minimum.

A function of the iteration alone, so resuming needs only the iteration number.
"""

import math


def learning_rate(
    iteration: int,
    *,
    lr: float,
    min_lr: float,
    warmup_iters: int,
    decay_iters: int,
    style: str = "cosine",
) -> float:
    """The rate for `iteration` (0-based): lr x (it+1)/warmup during warm-up, then from lr down to
    min_lr over the iterations up to `decay_iters`, and min_lr after."""
    if warmup_iters and iteration < warmup_iters:
        return lr * (iteration + 1) / warmup_iters
    if style == "constant":
        return lr
    if iteration >= decay_iters:
        return min_lr
    progress = (iteration - warmup_iters) / max(1, decay_iters - warmup_iters)
    if style == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif style == "linear":
        coeff = 1.0 - progress
    else:
        raise ValueError(f"lr_decay_style: expected cosine, linear or constant, got {style!r}")
    return min_lr + coeff * (lr - min_lr)
