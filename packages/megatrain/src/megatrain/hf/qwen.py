"""Hugging Face Qwen2 and Qwen3 (dense) export and import: our Llama kind with the attention
switches these families add, through `hf.llama`'s reader and writer.

- Qwen2 (`Qwen2ForCausalLM`) is a Llama with biases on the query, key and value projections
  alone: our `model.add_qkv_bias` (the biases laid out with the rows of our `qkv`, or `q`
  and `kv`, as the weights are).
- Qwen3 (`Qwen3ForCausalLM`) is a Llama with an RMSNorm over each head of the queries and
  keys before the rotary embedding (`self_attn.q_norm` / `k_norm`, our `model.qk_layernorm`:
  `attention.q_layernorm` / `k_layernorm`) and heads of their own width (`head_dim`, our
  `model.kv_channels`; 128 by default, whatever hidden_size / num_attention_heads is).

Import refuses, naming the field, before any weight is read: sliding-window attention
(`use_sliding_window`, or a `layer_types` entry other than full_attention), Qwen3's
`attention_bias` (biases on the output projection too), and what `llama.decoder_fields`
refuses.  Export picks the class from the resolved [model] switches (`decoder_family`).
"""

from pathlib import Path

from megatrain.hf.common import HFFormatError
from megatrain.hf.llama import LLAMA, Family, decoder_fields, import_llama, load_hf_config

MODEL_TYPES = ("qwen2", "qwen3")


def _qwen3_fields(m: dict) -> dict:
    return {"attention_bias": False, "use_sliding_window": False}


QWEN2 = Family(
    "Qwen2", "Qwen2ForCausalLM", "Qwen2Config",
    {"qk_layernorm": False, "add_qkv_bias": True, "num_moe_experts": None},
    lambda m: {"use_sliding_window": False},
)  # fmt: skip
QWEN3 = Family(
    "Qwen3", "Qwen3ForCausalLM", "Qwen3Config",
    {"qk_layernorm": True, "add_qkv_bias": False, "num_moe_experts": None},
    _qwen3_fields,
)  # fmt: skip


def decoder_family(m: dict) -> Family:
    """The Hugging Face class a Llama-kind model of resolved [model] section `m` exports as:
    a mixture of experts' (`hf.moe.moe_family`), Qwen3 with q/k norms, Qwen2 with q, k, v
    biases, else Llama.  A switch the chosen class lacks is refused by the exporter."""
    if m.get("num_moe_experts"):
        from megatrain.hf.moe import moe_family

        return moe_family(m)
    if m["qk_layernorm"]:
        return QWEN3
    if m["add_qkv_bias"]:
        return QWEN2
    return LLAMA


def refuse_sliding_window(config_file: Path, c: dict) -> None:
    """Qwen's sliding window, on when `use_sliding_window` (its `sliding_window` size is
    written either way) or when `layer_types` names a sliding layer."""
    if c.get("use_sliding_window"):
        raise HFFormatError(
            f"{config_file}: use_sliding_window is {c['use_sliding_window']!r}: sliding-window "
            "attention is not supported; only full attention"
        )
    sliding = [t for t in c.get("layer_types") or () if t != "full_attention"]
    if sliding:
        raise HFFormatError(
            f"{config_file}: layer_types has {sliding[0]!r}: only full_attention is supported"
        )


def read_qwen_config(hf_dir: Path, required: tuple = ("intermediate_size",)) -> dict:
    """config.json of a Qwen2 or Qwen3 (or their MoE: `required` then names their sizes) as
    `llama.decoder_fields` reads it, with Qwen's switches."""
    config_file, c = load_hf_config(hf_dir)
    refuse_sliding_window(config_file, c)
    qwen3 = c.get("model_type", "").startswith("qwen3")
    if qwen3 and c.get("attention_bias"):
        raise HFFormatError(
            f"{config_file}: attention_bias is True: biases on the output projection are not "
            "supported (only on q, k and v: Qwen2's)"
        )
    return decoder_fields(
        config_file,
        c,
        required=required,
        # Qwen3Config's head_dim is 128 when config.json has none; Qwen2-MoE and Qwen3-MoE
        # read hidden_size / num_attention_heads then.
        head_dim=128 if c.get("model_type") == "qwen3" else None,
        # Qwen2's q, k, v always have biases; Qwen2-MoE's unless qkv_bias is false.
        qkv_bias=not qwen3 and bool(c.get("qkv_bias", True)),
        qk_norm=qwen3,
    )


def import_qwen(hf_dir: Path, out_ckpt, tokenizer_file) -> Path:
    """Write the Qwen2ForCausalLM or Qwen3ForCausalLM of `hf_dir` as a megatrain checkpoint of
    kind llama (iteration 0, weights only) under `out_ckpt`; returns the iteration
    directory."""
    config_file, c = load_hf_config(hf_dir)
    if c.get("model_type") not in MODEL_TYPES:
        raise HFFormatError(
            f"{config_file}: model_type is {c.get('model_type')!r}: expected one of {MODEL_TYPES}"
        )
    return import_llama(hf_dir, out_ckpt, tokenizer_file, read_qwen_config(hf_dir))
