"""Run configuration: TOML sections as dataclasses, overrides, and checks before any worker starts.

A config file (`pipelines/models/<name>.toml`) has the sections below; every
field has Megatron-LM's name (snake case).  `section.field=value` on the
command line overrides a field (the value is read as TOML, so `3e-4`, `true`
and `"bf16"` keep their types).  An unknown section or field, a value of the
wrong type, or a layout the model cannot be split into is refused here, with
the field and the numbers, so no worker starts on a config that would fail later.

Which module holds what (every name is imported from here, `megatrain.config`):

- `sections`: the sections as dataclasses (`ModelConfig`, `ParallelConfig`, ..., `Config`
  holding one of each), their defaults, and the choices their fields take (`CHOICES`,
  `RECOMPUTE_CHOICES`, `KIND_DEFAULTS`, ...).
- `load`: `load_config`, reading a TOML file and `section.field=value` overrides, each value
  checked against its field's type and choices.
- `errors`: `ConfigError`, which every refusal raises.
- `checks`: `validate`, the cross-field checks in their fixed order, one module per section
  they guard (`checks.model`, `checks.parallel` with the pipeline layout's parse
  `pipeline_layer_counts`, `checks.training`, `checks.data` with the
  blends' rules `check_blend`, `checks.checkpoint`, `checks.optimizer`, `checks.sizes`).
"""

from megatrain.config.checks import validate
from megatrain.config.checks.data import check_blend
from megatrain.config.checks.parallel import pipeline_layer_counts
from megatrain.config.errors import ConfigError
from megatrain.config.load import load_config
from megatrain.config.sections import (
    BLOCK_ORDERS,
    CAUSAL_KINDS,
    CHOICES,
    DATA_PARALLEL_SHARDINGS,
    DEFAULT_CORPUS,
    KIND_DEFAULTS,
    MODEL_KINDS,
    MODEL_SWITCHES,
    MOE_DROP_POLICIES,
    MOE_FIELDS,
    MOE_LOAD_BALANCING_TYPES,
    MOE_SCORE_FUNCTIONS,
    MOE_TOKEN_DISPATCHER_TYPES,
    NORMALIZATIONS,
    PACKING_SWITCHES,
    PIPELINE_SCHEDULES,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_CHOICES,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimizerSection,
    ParallelConfig,
    TrainingConfig,
)

__all__ = [
    "BLOCK_ORDERS",
    "CAUSAL_KINDS",
    "CHOICES",
    "DATA_PARALLEL_SHARDINGS",
    "DEFAULT_CORPUS",
    "KIND_DEFAULTS",
    "MODEL_KINDS",
    "MODEL_SWITCHES",
    "MOE_DROP_POLICIES",
    "MOE_FIELDS",
    "MOE_LOAD_BALANCING_TYPES",
    "MOE_SCORE_FUNCTIONS",
    "MOE_TOKEN_DISPATCHER_TYPES",
    "NORMALIZATIONS",
    "PACKING_SWITCHES",
    "PIPELINE_SCHEDULES",
    "POSITION_EMBEDDING_TYPES",
    "RECOMPUTE_CHOICES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerSection",
    "ParallelConfig",
    "TrainingConfig",
    "check_blend",
    "load_config",
    "pipeline_layer_counts",
    "validate",
]
