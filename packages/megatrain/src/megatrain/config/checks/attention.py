"""[model]: sliding windows and attention sinks (`models.attention`)."""

from megatrain.config.errors import ConfigError
from megatrain.config.sections import Config

LAYER_TYPES = ("sliding_attention", "full_attention")  # HF's names
SOFTMAX_TYPES = ("vanilla", "learnable")


def _check_attention(config: Config) -> None:
    m = config.model
    if m.softmax_type not in SOFTMAX_TYPES:
        raise ConfigError(
            f"model.softmax_type must be one of {SOFTMAX_TYPES}, got {m.softmax_type!r}"
        )
    mla = getattr(m, "multi_latent_attention", False)
    if m.softmax_type == "learnable":
        if mla:
            raise ConfigError(
                "model.softmax_type = 'learnable' (attention sinks) with "
                "model.multi_latent_attention: only the multi-head attention kind carries sinks"
            )
        if m.attention_dropout != 0:
            raise ConfigError(
                "model.softmax_type = 'learnable' (attention sinks) needs model.attention_dropout "
                f"= 0 (the sink softmax is computed from the kernel's log-sum-exp), got "
                f"{m.attention_dropout}"
            )
    if m.layer_types is not None:
        if m.window_size is None:
            raise ConfigError(
                "model.layer_types names sliding layers but model.window_size is not set"
            )
        if not (isinstance(m.layer_types, list) and len(m.layer_types) == m.num_layers):
            raise ConfigError(
                f"model.layer_types must list one type a layer ({m.num_layers} for "
                f"model.num_layers), got {m.layer_types!r}"
            )
        wrong = sorted({t for t in m.layer_types if t not in LAYER_TYPES}, key=str)
        if wrong:
            raise ConfigError(
                f"model.layer_types entries must be one of {LAYER_TYPES}, got {wrong}"
            )
    if m.window_size is None:
        return
    if not (isinstance(m.window_size, int) and m.window_size > 0):
        raise ConfigError(
            f"model.window_size must be a positive number of keys (a query sees itself and the "
            f"window_size - 1 before it), got {m.window_size!r}"
        )
    if m.kind == "bert":
        raise ConfigError(
            "model.window_size with model.kind = 'bert': sliding windows are causal attention's "
            "(gpt, llama)"
        )
    if mla:
        raise ConfigError(
            "model.window_size with model.multi_latent_attention: only the multi-head attention "
            "kind takes sliding windows"
        )
