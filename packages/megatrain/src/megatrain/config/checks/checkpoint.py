"""[checkpoint]: the save interval, how many are kept, the background write's timeout."""

from megatrain.config.errors import _need
from megatrain.config.sections import Config


def _check_checkpoint(config: Config) -> None:
    c = config.checkpoint
    _need(
        c.save_interval is None or c.save_interval > 0,
        f"checkpoint.save_interval must be > 0, got {c.save_interval}",
    )
    _need(c.keep >= 0, f"checkpoint.keep must be >= 0 (0 keeps all), got {c.keep}")
    _need(
        c.async_save_timeout > 0,
        f"checkpoint.async_save_timeout must be > 0 seconds, got {c.async_save_timeout}",
    )
