"""Optimizer-side pieces of the runtime: loss scaling, gradient clipping, Adam parameter groups."""

from megacore.optimizer.clip_grads import clip_grad_norm, get_grad_norm
from megacore.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megacore.optimizer.param_groups import adamw, get_param_groups

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "adamw",
    "clip_grad_norm",
    "get_grad_norm",
    "get_param_groups",
]
