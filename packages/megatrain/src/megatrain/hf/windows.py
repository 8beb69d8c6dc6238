"""Sliding-window attention in Hugging Face configs, both ways: config.json's window and per-layer
pattern as our [model] window_size and layer_types (`sliding_window_fields`, read by
`decoder.decoder_fields` for every Llama-like family), and back (`window_fields`, written by
`llama.export_llama`).

How each family spells it (transformers 5): Mistral and Mixtral put `sliding_window` on every
layer (null: none); Qwen2, Qwen3 and their MoE only when `use_sliding_window`, on the layers
`layer_types` names "sliding_attention" — made from `max_window_layers` (layers from that index
on slide) when config.json has no list; gpt-oss always, on its `layer_types`.  HF's window:
a query at i sees keys j > i - sliding_window, which is our window_size.
"""

from pathlib import Path

from megatrain.checkpoint.files import CheckpointError
from megatrain.hf.common import HFFormatError

LAYER_TYPES = ("sliding_attention", "full_attention")
# The families whose sliding window is on only with use_sliding_window.
_SWITCHED = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# The families whose window is one for every layer (no layer_types).
_UNIFORM = ("mistral", "mixtral", "llama")


def sliding_window_fields(config_file: Path, c: dict) -> dict:
    """{"window": keys a query sees or None, "layer_types": one name a layer, or None when every
    layer slides} of config.json `c`, refusing by field a window or pattern we cannot read."""
    model_type = c.get("model_type")
    window = c.get("sliding_window")
    if model_type in _SWITCHED and not c.get("use_sliding_window"):
        window = None  # HF ignores the size written beside use_sliding_window = false
    if window is None:
        return {"window": None, "layer_types": None}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise HFFormatError(
            f"{config_file}: sliding_window is {window!r}: expected a positive number of keys"
        )
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is None and model_type in _SWITCHED:
        first = c.get("max_window_layers", 28)
        if not isinstance(first, int) or first < 0:
            raise HFFormatError(
                f"{config_file}: max_window_layers is {first!r}: expected a layer number"
            )
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise HFFormatError(
                f"{config_file}: layer_types must name each of the {layers} layers "
                f"(num_hidden_layers), got {types!r}"
            )
        wrong = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        if wrong:
            raise HFFormatError(
                f"{config_file}: layer_types has {wrong[0]!r}: expected one of {LAYER_TYPES}"
            )
        if "sliding_attention" not in types:
            return {"window": None, "layer_types": None}
        if "full_attention" not in types:
            types = None
    return {"window": window, "layer_types": types}


def configure_windows(m, c: dict) -> None:
    """Our [model] window fields from `sliding_window_fields`'."""
    m.window_size, m.layer_types = c.get("window"), c.get("layer_types")


def window_fields(family, m: dict) -> dict:
    """The config.json fields of our resolved [model] section `m`'s window in `family`'s
    spelling (families.Family); refuses what the family cannot hold, naming the field."""
    window, types = m.get("window_size"), m.get("layer_types")
    model_type = family.config_class.removesuffix("Config").lower()
    if model_type == "gptoss":  # a window and a type for every layer (null: none slide)
        names = types or ["sliding_attention" if window else "full_attention"] * m["num_layers"]
        return {"sliding_window": window, "layer_types": list(names)}
    if m.get("softmax_type", "vanilla") != "vanilla":
        raise CheckpointError(
            f"model.softmax_type is {m['softmax_type']!r} (attention sinks): {family.name} has "
            "none; a model with sinks exports as gpt-oss"
        )
    if model_type.startswith("qwen"):
        if window is None:
            return {"use_sliding_window": False, "sliding_window": None}
        types = types or ["sliding_attention"] * m["num_layers"]
        first = types.index("sliding_attention")
        return {"use_sliding_window": True, "sliding_window": window, "layer_types": list(types),
                "max_window_layers": first}  # fmt: skip
    if types is not None:
        raise CheckpointError(
            f"model.layer_types {types!r}: {family.name} puts its sliding window on every "
            "layer; a per-layer pattern exports as Qwen2/Qwen3 (with their switches) or gpt-oss"
        )
    return {"sliding_window": window}
