"""[optimizer]: the learning rates and the warmup against the decay."""

from megatrain.config.errors import _need
from megatrain.config.sections import Config


def _check_optimizer(config: Config) -> None:
    o, t = config.optimizer, config.training
    _need(
        0 <= o.min_lr <= o.lr,
        f"optimizer.min_lr ({o.min_lr}) must be between 0 and optimizer.lr ({o.lr})",
    )
    decay = o.lr_decay_iters or t.train_iters
    _need(
        o.lr_warmup_iters <= decay,
        f"optimizer.lr_warmup_iters ({o.lr_warmup_iters}) is above the decay length "
        f"(optimizer.lr_decay_iters or training.train_iters = {decay})",
    )
