"""Optimizer-side pieces of the runtime: loss scaling and model-parallel gradient clipping."""

from megacore.optimizer.clip_grads import clip_grad_norm, get_grad_norm
from megacore.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "clip_grad_norm", "get_grad_norm"]
