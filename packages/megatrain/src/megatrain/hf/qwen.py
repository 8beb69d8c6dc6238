"""Hugging Face Qwen2 and Qwen3 (dense) export and import: our Llama kind with the attention
switches these families add, through the decoders' reader (`hf.decoder`) and
`llama.export_llama`.

- Qwen2 (`Qwen2ForCausalLM`) is a Llama with biases on the query, key and value projections
  alone: our `model.add_qkv_bias` (the biases laid out with the rows of our `qkv`, or `q`
  and `kv`, as the weights are).
- Qwen3 (`Qwen3ForCausalLM`) is a Llama with an RMSNorm over each head of the queries and
  keys before the rotary embedding (`self_attn.q_norm` / `k_norm`, our `model.qk_layernorm`:
  `attention.q_layernorm` / `k_layernorm`) and heads of their own width (`head_dim`, our
  `model.kv_channels`; 128 by default, whatever hidden_size / num_attention_heads is).

Import refuses, naming the field, before any weight is read: sliding-window attention
(`use_sliding_window`, or a `layer_types` entry other than full_attention), Qwen3's
`attention_bias` (biases on the output projection too), and what `decoder.decoder_fields`
refuses (`decoder.read_qwen_config`).  Export picks the class from the resolved [model]
switches (`families.decoder_family`: `families.QWEN2`, `QWEN3`).
"""

from pathlib import Path

from megatrain.hf.common import HFFormatError
from megatrain.hf.decoder import import_decoder, load_hf_config, read_qwen_config

MODEL_TYPES = ("qwen2", "qwen3")


def import_qwen(hf_dir: Path, out_ckpt, tokenizer_file, **kw) -> Path:
    """Write the Qwen2ForCausalLM or Qwen3ForCausalLM of `hf_dir` as a megatrain checkpoint of
    kind llama (iteration 0, weights only) under `out_ckpt`; returns the iteration
    directory."""
    config_file, c = load_hf_config(hf_dir)
    if c.get("model_type") not in MODEL_TYPES:
        raise HFFormatError(
            f"{config_file}: model_type is {c.get('model_type')!r}: expected one of {MODEL_TYPES}"
        )
    return import_decoder(hf_dir, out_ckpt, tokenizer_file, read_qwen_config(hf_dir), **kw)
