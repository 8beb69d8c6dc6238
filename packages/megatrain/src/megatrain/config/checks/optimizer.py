"""[optimizer]: the learning rates and the warmup against the decay."""

from megatrain.config.errors import ConfigError
from megatrain.config.sections import Config


def _check_optimizer(config: Config) -> None:
    o, t = config.optimizer, config.training
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(
            f"optimizer.min_lr ({o.min_lr}) must be between 0 and optimizer.lr ({o.lr})"
        )
    decay = o.lr_decay_iters or t.train_iters
    if not o.lr_warmup_iters <= decay:
        raise ConfigError(
            f"optimizer.lr_warmup_iters ({o.lr_warmup_iters}) is above the decay length "
            f"(optimizer.lr_decay_iters or training.train_iters = {decay})"
        )
