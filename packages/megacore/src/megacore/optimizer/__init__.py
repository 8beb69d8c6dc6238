"""Optimizer-side pieces of the runtime: loss scaling (more to come with issue 5)."""

from megacore.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

__all__ = ["ConstantGradScaler", "DynamicGradScaler"]
