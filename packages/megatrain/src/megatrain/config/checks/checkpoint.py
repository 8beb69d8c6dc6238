"""[checkpoint]: the save interval, how many are kept, the background write's timeout, one
source to start from (`load` or `load_hf`)."""

from megatrain.config.errors import ConfigError
from megatrain.config.sections import Config


def _check_checkpoint(config: Config) -> None:
    c = config.checkpoint
    if not (c.save_interval is None or c.save_interval > 0):
        raise ConfigError(f"checkpoint.save_interval must be > 0, got {c.save_interval}")
    if not c.keep >= 0:
        raise ConfigError(f"checkpoint.keep must be >= 0 (0 keeps all), got {c.keep}")
    if not c.async_save_timeout > 0:
        raise ConfigError(
            f"checkpoint.async_save_timeout must be > 0 seconds, got {c.async_save_timeout}"
        )
    if c.load and c.load_hf:
        raise ConfigError(
            f"checkpoint.load ({c.load}) and checkpoint.load_hf ({c.load_hf}): give one; load_hf "
            "starts from a Hugging Face model's files, load from a megatrain checkpoint"
        )
