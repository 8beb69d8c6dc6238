"""The cross-field checks of a config, one module per section they guard, run by
`validate` in a fixed order.
"""

from megatrain.config.checks.attention import _check_attention
from megatrain.config.checks.checkpoint import _check_checkpoint
from megatrain.config.checks.data import _check_data, _check_masking
from megatrain.config.checks.model import _check_dropout, _check_model
from megatrain.config.checks.mtp import _check_mtp
from megatrain.config.checks.optimizer import _check_optimizer
from megatrain.config.checks.parallel import (
    _check_expert_parallel,
    _check_layout,
    _data_parallel_size,
)
from megatrain.config.checks.sizes import _check_sizes
from megatrain.config.checks.training import _check_training
from megatrain.config.sections import Config


def validate(config: Config, world_size: int | None = None) -> int:
    """Check every size the layout depends on; return the data-parallel size.

    `world_size` is the number of processes the job has (None: the config's own
    data_parallel_size, or 1, times tp x pp).

    The checks run section by section in a fixed order: the first refusal is the one a
    config with several faults gets, so the order is part of the messages' contract.
    """
    _check_sizes(config)
    _check_model(config)
    _check_attention(config)
    _check_mtp(config)
    _check_training(config)
    _check_data(config)
    _check_masking(config)
    _check_layout(config)
    dp = _data_parallel_size(config, world_size)
    _check_expert_parallel(config, world_size)
    _check_checkpoint(config)
    _check_optimizer(config)
    _check_dropout(config)
    return dp
