"""The integers of [model], [parallel] and [training]: every one positive."""

import dataclasses
import functools

from megatrain.config.errors import ConfigError
from megatrain.config.sections import Config


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _check_sizes(config: Config) -> None:
    """Every integer of model, parallel and training is positive (vocab_size may be 0: the
    tokenizer's; seed is any)."""
    for section in ("model", "parallel", "training"):
        obj = getattr(config, section)
        for name in _field_names(type(obj)):  # (fields() once a class: the plan checks many)
            value = getattr(obj, name)
            if type(value) is int and value <= 0 and name != "seed":
                allowed_zero = name == "vocab_size"
                if allowed_zero and value == 0:
                    continue
                raise ConfigError(
                    f"{section}.{name} must be {'>= 0' if allowed_zero else '> 0'}, got {value}"
                )
