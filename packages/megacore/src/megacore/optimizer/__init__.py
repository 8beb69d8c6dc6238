"""Optimizer side of the runtime: AdamW on fp32 masters (optionally sharded over DP), loss
scaling, model-parallel gradient clipping, and a guard against a loss that stays nan."""

from megacore.optimizer.clip_grads import clip_grad_norm, counts_once, get_grad_norm
from megacore.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megacore.optimizer.loss_guard import NonFiniteLossError, NonFiniteLossGuard
from megacore.optimizer.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    Shard,
    get_megatron_optimizer,
)

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MegatronOptimizer",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "OptimizerConfig",
    "Shard",
    "clip_grad_norm",
    "counts_once",
    "get_grad_norm",
    "get_megatron_optimizer",
]
