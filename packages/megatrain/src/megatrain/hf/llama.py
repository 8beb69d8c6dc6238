"""Hugging Face Llama export and import (`megatrain export-hf`, `megatrain import-hf`).

Our Llama (model.kind "llama": `GPTModel` with RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases) and `transformers.LlamaForCausalLM` compute the same
function; only the storage differs:

- with grouped-query attention our queries are `attention.q` (HF's q_proj) and the keys and
  values one `attention.kv`, laid out per group [k, v] (so a contiguous tensor-parallel
  slice is whole groups); without it one `attention.qkv` per head [q k v], as GPT-2's; HF's
  are three matrices q_proj, k_proj, v_proj;
- our SwiGLU's gate and up projections are `mlp.gate` and `mlp.fc1`, HF's gate_proj and
  up_proj; down_proj is our `mlp.fc2`;
- our vocabulary is padded to a multiple of 128 x tp (padding logits masked out); HF's has
  exactly the tokenizer's rows.

Both use HF's rotary convention (the two halves of each head rotate together), so no
weight is permuted.  Import reads config.json as JSON (transformers 4's `rope_theta` and
`rope_scaling`, or 5's `rope_parameters`), the weights as safetensors, never unpickled, and
refuses, before any weight is read, a config field this model cannot represent (a rope type
other than default or llama3, biases, an odd head_dim), naming the field; a head_dim other
than hidden_size / heads is our `model.kv_channels`.  Mistral is a Llama with a sliding window
on every layer (`hf.windows`: our model.window_size; exported as Mistral when one is set).

The Llama-like families (`hf.qwen`: Qwen2's q, k, v biases, Qwen3's per-head q/k norms; and
the mixtures of experts, `hf.moe`) share the reader (`decoder_fields`, `checked_headers`), the
map of where each tensor lies (`decoder_map`, read both ways) and the streamed import
(`import_decoder`) with it, in `hf.decoder`; `export_llama` writes each of them, as the
`Family` (`hf.families`) its resolved switches pick, in shards (`hf.shards`).
"""

from pathlib import Path

from megatrain.checkpoint.convert import dtype_of
from megatrain.checkpoint.dcp import STATE_BUFFERS
from megatrain.checkpoint.files import CheckpointError
from megatrain.hf.common import layer_is_moe, refuse_switches, run_model_config, write_hf_tokenizer
from megatrain.hf.decoder import (
    decoder_fields,
    decoder_map,
    import_decoder,
    load_hf_config,
    refuser,
)
from megatrain.hf.families import ANY, decoder_family
from megatrain.hf.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    ShardWriter,
    export_parallel,
    parse_shard_size,
    plan_shards,
)
from megatrain.hf.tensor_map import hf_shapes_of
from megatrain.hf.windows import window_fields

MODEL_TYPES = ("llama", "mistral")
# The resolved [model] switches LlamaForCausalLM computes (its tie is read from the config).
LLAMA_SWITCHES = {"normalization": "rmsnorm", "position_embedding_type": "rope",
                  "swiglu": True, "add_bias_linear": False, "quick_geglu": False,
                  "glu_linear_offset": 0.0, "activation_func_clamp_value": None}  # fmt: skip


def read_hf_config(hf_dir: Path) -> dict:
    """config.json as this import reads it, refusing, by field, what our Llama cannot compute
    (`decoder_fields`' dict)."""
    config_file, c = load_hf_config(hf_dir)
    refuse = refuser(config_file, c)
    if c.get("model_type") not in MODEL_TYPES:
        refuse("model_type", f"expected one of {MODEL_TYPES}")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            refuse(field, "biases in the Llama linears are not supported")
    return decoder_fields(config_file, c, required=("intermediate_size",))


def import_llama(
    hf_dir: Path, out_ckpt: str | Path, tokenizer_file: str | Path | None, **kw
) -> Path:
    """Write the LlamaForCausalLM of `hf_dir` as a megatrain checkpoint (iteration 0, weights
    only) under `out_ckpt`; returns the iteration directory (`kw`: `import_decoder`'s)."""
    return import_decoder(hf_dir, out_ckpt, tokenizer_file, read_hf_config(hf_dir), **kw)


def llama_config_fields(m: dict, vocab: int, bos: int, eos: int, dtype: str) -> dict:
    """transformers.LlamaConfig's fields for our [model] section `m` (switches resolved), in
    the rope spelling of the installed transformers (5: `rope_parameters`; 4: `rope_theta`
    and `rope_scaling`); the Llama-like families' configs take the same."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": m["rotary_base"]}
    if m.get("rope_type") == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": m["rotary_base"],
            "factor": m["rotary_scaling_factor"],
            "original_max_position_embeddings": m["original_max_position_embeddings"],
            "beta_fast": m["beta_fast"],
            "beta_slow": m["beta_slow"],
            "truncate": m["correction_range_round_to_int"],
        }
        rope |= {k: m[k] for k in ("mscale", "mscale_all_dim") if m[k]}
    if m["rope_scaling_factor"]:
        rope = {
            "rope_type": "llama3",
            "rope_theta": m["rotary_base"],
            "factor": m["rope_scaling_factor"],
            "low_freq_factor": m["rope_low_freq_factor"],
            "high_freq_factor": m["rope_high_freq_factor"],
            "original_max_position_embeddings": m["rope_original_max_position_embeddings"],
        }
    fields = {
        "vocab_size": vocab,
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["ffn_hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_query_groups"],
        "head_dim": m["kv_channels"] or m["hidden_size"] // m["num_attention_heads"],
        "max_position_embeddings": m["max_position_embeddings"],
        "rms_norm_eps": m["layernorm_epsilon"],
        "initializer_range": m["init_method_std"],
        "attention_dropout": m["attention_dropout"],
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
        "bos_token_id": bos,
        "eos_token_id": eos,
        "architectures": ["LlamaForCausalLM"],
    }
    if int(transformers.__version__.split(".")[0]) >= 5:
        fields["rope_parameters"] = rope
        fields["dtype"] = dtype
    else:
        fields["rope_theta"] = rope.pop("rope_theta")
        fields["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        fields["torch_dtype"] = dtype
    return fields


def map_fields(m: dict, vocab: int, model_type: str) -> dict:
    """The fields `decoder.decoder_map` reads (config.json's, as `decoder_fields` and
    `moe.read_moe_config` give them) of our resolved [model] section `m`."""
    heads = m["num_attention_heads"]
    c = {
        "model_type": model_type,
        "layers": m["num_layers"],
        "hidden": m["hidden_size"],
        "heads": heads,
        "groups": m["num_query_groups"],
        "head_dim": m["kv_channels"] or m["hidden_size"] // heads,
        "ffn": m["ffn_hidden_size"],
        "vocab": vocab,
        "tied": not m["untie_embeddings_and_output_weights"],
        "qkv_bias": m["add_qkv_bias"],
        "qk_norm": m["qk_layernorm"],
    }
    if model_type == "gpt_oss":  # biases on q, k, v and the output projection; sinks
        c |= {"qkv_bias": True, "o_bias": True, "sinks": True}
    if m.get("multi_latent_attention"):  # DeepSeek's latent sizes, shared experts, bias
        from megatrain.hf.deepseek import map_fields as deepseek_map_fields

        c |= deepseek_map_fields(m)
    if m.get("num_moe_experts"):
        c |= {
            "moe_layers": layer_is_moe(m),
            "experts": m["num_moe_experts"],
            "expert_ffn": m["moe_ffn_hidden_size"] or m["ffn_hidden_size"],
            "shared_ffn": m["moe_shared_expert_intermediate_size"],
        }
    return c


def export_llama(
    meta: dict,
    directory: Path,
    out: str | Path,
    dtype: str,
    max_shard_size=DEFAULT_MAX_SHARD_SIZE,
    progress: bool = False,
    workers: int = 1,
):
    """Write the Llama-kind checkpoint iteration `directory` (its `meta`) as a transformers
    directory `out`, in `dtype`, in safetensors shards of at most `max_shard_size`: a
    LlamaForCausalLM, or the family its resolved switches make (`families.decoder_family`:
    Qwen2 with q, k, v biases, Qwen3 with q/k norms, ...).  Streamed: the checkpoint's saved
    pieces are read a group at a time and each HF tensor written once it is whole, by
    `workers` processes (each its share of the shard files) when more than one."""
    import transformers

    from megacommon.progress import progress_bar

    tokenizer_file = directory / "tokenizer.json"
    max_bytes = parse_shard_size(max_shard_size)

    meta_file = tokenizer_file.parent / "meta.json"
    m = run_model_config(meta)
    family = decoder_family(m)
    required = LLAMA_SWITCHES | family.switches
    refuse_switches(meta_file, m, family.name, {k: v for k, v in required.items() if v is not ANY})
    vocab = int(meta["vocab_size"])
    tok_info = meta.get("tokenizer") or {}
    if "eod_id" not in tok_info:
        raise CheckpointError(f"{meta_file}: tokenizer has no eod_id")
    eos = int(tok_info["eod_id"])
    bos = (meta.get("imported_from") or {}).get("bos_token_id", eos)
    fields = llama_config_fields(m, vocab, bos, eos, dtype) | family.fields(m)
    fields |= window_fields(family, m)
    fields["architectures"] = [family.architecture]
    config = getattr(transformers, family.config_class)(**fields)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    model_type = getattr(transformers, family.config_class).model_type
    targets = decoder_map(map_fields(m, vocab, model_type), int(meta["padded_vocab_size"]))
    shapes = hf_shapes_of(targets)
    torch_dtype = dtype_of(dtype)
    # DeepSeek's expert biases stay float32, as transformers holds them (and as ours are).
    fp32 = frozenset(
        s.hf for n, t in targets.items() if n.endswith(STATE_BUFFERS) for s in t.sources
    )
    writer = ShardWriter(
        out, plan_shards(list(shapes.items()), torch_dtype, max_bytes, fp32), torch_dtype,
        fp32=fp32,
    )  # fmt: skip
    bar = progress_bar(writer.total, f"writing {out}", "B", enabled=progress, unit_scale=True)
    with bar:
        export_parallel(directory / "model", targets, writer, workers, bar)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    bos_token = tok.id_to_token(bos) if isinstance(bos, int) else None
    positions = m["max_position_embeddings"]
    write_hf_tokenizer(tokenizer_file, out, bos_token, tok.id_to_token(eos), None, positions)
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(str(out))
    return out
