"""[model]: sliding windows and attention sinks (`models.attention`)."""

from megatrain.config.errors import _need
from megatrain.config.sections import Config

LAYER_TYPES = ("sliding_attention", "full_attention")  # HF's names
SOFTMAX_TYPES = ("vanilla", "learnable")


def _check_attention(config: Config) -> None:
    m = config.model
    _need(
        m.softmax_type in SOFTMAX_TYPES,
        f"model.softmax_type must be one of {SOFTMAX_TYPES}, got {m.softmax_type!r}",
    )
    mla = getattr(m, "multi_latent_attention", False)
    if m.softmax_type == "learnable":
        _need(
            not mla,
            "model.softmax_type = 'learnable' (attention sinks) with "
            "model.multi_latent_attention: only the multi-head attention kind carries sinks",
        )
        _need(
            m.attention_dropout == 0,
            "model.softmax_type = 'learnable' (attention sinks) needs model.attention_dropout "
            f"= 0 (the sink softmax is computed from the kernel's log-sum-exp), got "
            f"{m.attention_dropout}",
        )
    if m.layer_types is not None:
        _need(
            m.window_size is not None,
            "model.layer_types names sliding layers but model.window_size is not set",
        )
        _need(
            isinstance(m.layer_types, list) and len(m.layer_types) == m.num_layers,
            f"model.layer_types must list one type a layer ({m.num_layers} for "
            f"model.num_layers), got {m.layer_types!r}",
        )
        wrong = sorted({t for t in m.layer_types if t not in LAYER_TYPES}, key=str)
        _need(not wrong, f"model.layer_types entries must be one of {LAYER_TYPES}, got {wrong}")
    if m.window_size is None:
        return
    _need(
        isinstance(m.window_size, int) and m.window_size > 0,
        f"model.window_size must be a positive number of keys (a query sees itself and the "
        f"window_size - 1 before it), got {m.window_size!r}",
    )
    _need(
        m.kind != "bert",
        "model.window_size with model.kind = 'bert': sliding windows are causal attention's "
        "(gpt, llama)",
    )
    _need(
        not mla,
        "model.window_size with model.multi_latent_attention: only the multi-head attention "
        "kind takes sliding windows",
    )
