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
refuses, before any weight is read, a config field this model cannot represent (a sliding
window, a rope type other than default or llama3, biases, a head_dim that is not
hidden_size / heads), naming the field.  Mistral without a sliding window is a Llama and is
read as one.
"""

import json
from pathlib import Path

import torch

from megatrain.checkpoint.convert import dtype_of
from megatrain.checkpoint.files import CheckpointError
from megatrain.config import Config
from megatrain.hf.common import (
    HFFormatError,
    checked_padding,
    qkv_from_hf,
    qkv_to_hf,
    read_json,
    refuse_switches,
    run_model_config,
    save_weights,
    write_hf_tokenizer,
    write_imported,
)

MODEL_TYPES = ("llama", "mistral")
# Llama-family model types refused by name (`read_hf_config` says why).
REFUSED_TYPES = ("qwen2",)
ROPE_TYPES = ("default", "llama3")
# The resolved [model] switches LlamaForCausalLM computes (its tie is read from the config).
LLAMA_SWITCHES = {"normalization": "rmsnorm", "position_embedding_type": "rope",
                  "swiglu": True, "add_bias_linear": False}  # fmt: skip

LAYER_PARAMS = {  # ours -> HF's, under model.layers.N.
    "ln1.weight": "input_layernorm.weight",
    "attention.proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.fc1.weight": "mlp.up_proj.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def kv_from_hf(k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF's k and v [groups d, h] -> our `kv` rows, per group [k, v]."""
    h = k.shape[1]
    return torch.stack([k.reshape(groups, -1, h), v.reshape(groups, -1, h)], dim=1).reshape(-1, h)


def kv_to_hf(kv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `kv_from_hf`: (k, v)."""
    h = kv.shape[1]
    grouped = kv.reshape(groups, 2, -1, h)
    return grouped[:, 0].reshape(-1, h), grouped[:, 1].reshape(-1, h)


def _attention_from_hf(q, k, v, heads: int, groups: int) -> dict[str, torch.Tensor]:
    """Our attention weights from HF's q, k, v: per head [q k v] rows in one `qkv` without
    grouped-query attention, else `q` as HF's and `kv` per group [k v]."""
    if groups == heads:
        return {"qkv.weight": qkv_from_hf(torch.cat([q, k, v]), heads)}
    return {"q.weight": q, "kv.weight": kv_from_hf(k, v, groups)}


def _attention_to_hf(weights: dict, prefix: str, heads: int, groups: int):
    """The inverse of `_attention_from_hf`: (q, k, v)."""
    if groups == heads:
        return qkv_to_hf(weights[prefix + "qkv.weight"], heads).chunk(3)
    return (weights[prefix + "q.weight"], *kv_to_hf(weights[prefix + "kv.weight"], groups))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])


def read_hf_config(hf_dir: Path) -> dict:
    """config.json as this import reads it, refusing, by field, what our Llama cannot compute:
    {layers, hidden, heads, groups, ffn, positions, vocab, eps, std, theta, scaling, tied,
    dropout, eos}."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise HFFormatError(f"{config_file} does not exist: expected a Hugging Face model")
    c = read_json(config_file)

    def refuse(field: str, why: str):
        raise HFFormatError(f"{config_file}: {field} is {c.get(field)!r}: {why}")

    if c.get("model_type") == "qwen2":
        refuse("model_type", "Qwen2's biases on q, k and v alone are not supported")
    if c.get("model_type") not in MODEL_TYPES:
        refuse("model_type", f"expected one of {MODEL_TYPES}")
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size")  # fmt: skip
    missing = [f for f in required if not isinstance(c.get(f), int)]
    if missing:
        raise HFFormatError(
            f"{config_file}: no integer {', '.join(missing)}: a {c['model_type']} config.json "
            f"needs {', '.join(required)}"
        )
    if c.get("sliding_window") is not None:
        refuse("sliding_window", "sliding-window attention is not supported; only full attention")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            refuse(field, "biases in the Llama linears are not supported")
    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "expected 'silu' (SwiGLU)")
    if c.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", "expected 1")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    if hidden % heads or c.get("head_dim", hidden // heads) != hidden // heads:
        refuse("head_dim", f"expected hidden_size / num_attention_heads = {hidden // heads}")
    groups = int(c.get("num_key_value_heads") or heads)
    if heads % groups:
        refuse("num_key_value_heads", f"num_attention_heads ({heads}) is not a multiple of it")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        field = "rope_parameters" if "rope_parameters" in c else "rope_scaling"
        raise HFFormatError(
            f"{config_file}: {field} has rope type {rope_type!r}; supported: {ROPE_TYPES}"
        )
    scaling = None
    if rope_type == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor")
        fields += ("original_max_position_embeddings",)
        absent = [f for f in fields if not isinstance(rope.get(f), int | float)]
        if absent:
            raise HFFormatError(
                f"{config_file}: rope type llama3 without a number for {', '.join(absent)}"
            )
        scaling = (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    eos = c.get("eos_token_id")
    return {
        "layers": int(c["num_hidden_layers"]),
        "hidden": hidden,
        "heads": heads,
        "groups": groups,
        "ffn": int(c["intermediate_size"]),
        "positions": int(c.get("max_position_embeddings", 2048)),
        "vocab": int(c["vocab_size"]),
        "eps": float(c.get("rms_norm_eps", 1e-6)),
        "std": float(c.get("initializer_range", 0.02)),
        "theta": theta,
        "scaling": scaling,
        "tied": bool(c.get("tie_word_embeddings", False)),
        "dropout": float(c.get("attention_dropout", 0.0)),
        "eos": eos[0] if isinstance(eos, list) else eos,
        "bos": c.get("bos_token_id"),
    }


def _hf_shapes(c: dict) -> dict[str, tuple]:
    h, f, v, d = c["hidden"], c["ffn"], c["vocab"], c["hidden"] // c["heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c["tied"]:
        shapes["lm_head.weight"] = (v, h)
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (c["groups"] * d, h),
        "self_attn.v_proj.weight": (c["groups"] * d, h), "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }  # fmt: skip
    for i in range(c["layers"]):
        shapes |= {f"model.layers.{i}.{k}": s for k, s in per_layer.items()}
    return shapes


def _read_weights(hf_dir: Path, c: dict) -> dict[str, torch.Tensor]:
    """The safetensors of `hf_dir` (sharded or not): names and shapes checked against
    config.json's from the files' headers, before any tensor is read."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFFormatError(
            f"{hf_dir}: no model.safetensors (or model.safetensors.index.json); a Llama is "
            "read from safetensors only, never unpickled"
        )
    skipped = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if c["tied"] else ())
    shapes, where = {}, {}
    for name in files:
        try:
            with safe_open(str(hf_dir / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    if not key.endswith(skipped):  # a tied file may store lm_head: it is
                        shapes[key] = tuple(f.get_slice(key).get_shape())  # embed_tokens
                        where[key] = name
        except Exception as e:
            raise HFFormatError(f"{hf_dir / name}: cannot be read as safetensors ({e})") from e
    expected = _hf_shapes(c)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        raise HFFormatError(
            f"{hf_dir}: the weights are not those of the Llama its config.json describes"
            + (f"; missing {missing[:5]}" if missing else "")
            + (f"; unexpected {extra[:5]}" if extra else "")
            + (
                " (config.json says tie_word_embeddings false: an output layer of its own)"
                if "lm_head.weight" in missing
                else ""
            )
        )
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise HFFormatError(
                f"{hf_dir}: {name} has shape {shapes[name]}, config.json says {shape}"
            )
    tensors = {}
    for name in files:
        with safe_open(str(hf_dir / name), framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k, file in where.items() if file == name}
    return tensors


def from_hf_state(hf: dict, c: dict, padded_vocab: int) -> dict[str, torch.Tensor]:
    out = {
        "embedding.weight": _pad_rows(hf["model.embed_tokens.weight"], padded_vocab),
        "final_layernorm.weight": hf["model.norm.weight"],
    }
    if not c["tied"]:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], padded_vocab)
    for i in range(c["layers"]):
        layer = f"model.layers.{i}."
        for ours, theirs in LAYER_PARAMS.items():
            out[f"layers.{i}.{ours}"] = hf[layer + theirs]
        q, k, v = (hf[layer + name] for name in QKV)
        for name, t in _attention_from_hf(q, k, v, c["heads"], c["groups"]).items():
            out[f"layers.{i}.attention.{name}"] = t
    return {n: t.contiguous() for n, t in out.items()}


def to_hf_state(weights: dict, m: dict, vocab: int) -> dict[str, torch.Tensor]:
    groups = m["num_query_groups"] or m["num_attention_heads"]
    out = {
        "model.embed_tokens.weight": weights["embedding.weight"][:vocab],
        "model.norm.weight": weights["final_layernorm.weight"],
    }
    if "output_layer.weight" in weights:
        out["lm_head.weight"] = weights["output_layer.weight"][:vocab]
    for i in range(m["num_layers"]):
        layer = f"model.layers.{i}."
        for ours, theirs in LAYER_PARAMS.items():
            out[layer + theirs] = weights[f"layers.{i}.{ours}"]
        qkv = _attention_to_hf(weights, f"layers.{i}.attention.", m["num_attention_heads"], groups)
        for name, t in zip(QKV, qkv, strict=True):
            out[layer + name] = t
    return {n: t.contiguous() for n, t in out.items()}


def import_llama(hf_dir: Path, out_ckpt: str | Path, tokenizer_file: str | Path | None) -> Path:
    """Write the LlamaForCausalLM of `hf_dir` as a megatrain checkpoint (iteration 0, weights
    only) under `out_ckpt`; returns the iteration directory."""
    from tokenizers import Tokenizer

    c = read_hf_config(hf_dir)
    source = Path(tokenizer_file) if tokenizer_file is not None else hf_dir / "tokenizer.json"
    if not source.is_file():
        raise HFFormatError(f"{source} does not exist: a Llama import needs its tokenizer.json")
    tokenizer_bytes = source.read_bytes()
    try:
        vocab = Tokenizer.from_str(tokenizer_bytes.decode()).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own exception types
        raise HFFormatError(f"{source}: not a Hugging Face tokenizers file ({e})") from None
    if vocab != c["vocab"]:
        raise HFFormatError(
            f"{hf_dir / 'config.json'}: vocab_size is {c['vocab']}, but {source} has {vocab} "
            "tokens; our vocabulary is the tokenizer's"
        )
    eos = c["eos"]
    if not isinstance(eos, int) or not 0 <= eos < c["vocab"]:
        raise HFFormatError(
            f"{hf_dir / 'config.json'}: eos_token_id is {eos!r}; expected an id below "
            f"vocab_size {c['vocab']}"
        )
    config = Config(name=hf_dir.name)
    m = config.model
    m.kind = "llama"
    m.num_layers, m.hidden_size, m.num_attention_heads = c["layers"], c["hidden"], c["heads"]
    m.num_query_groups = c["groups"] if c["groups"] != c["heads"] else None
    m.ffn_hidden_size, m.max_position_embeddings = c["ffn"], c["positions"]
    # The model's vocabulary is config.json's (Llama 3 pads its embeddings past the tokenizer).
    m.vocab_size = c["vocab"]
    m.hidden_dropout, m.attention_dropout = 0.0, c["dropout"]  # Llama has no residual dropout
    m.init_method_std, m.layernorm_epsilon = c["std"], c["eps"]
    m.rotary_base = c["theta"]
    if c["scaling"] is not None:
        factor, low, high, original = c["scaling"]
        m.rope_scaling_factor, m.rope_low_freq_factor = factor, low
        m.rope_high_freq_factor, m.rope_original_max_position_embeddings = high, original
    m.untie_embeddings_and_output_weights = not c["tied"]
    padded = checked_padding(config, hf_dir)
    weights = from_hf_state(_read_weights(hf_dir, c), c, padded)
    imported = {"hf_dir": str(hf_dir.resolve()), "bos_token_id": c["bos"]}
    return write_imported(out_ckpt, config, weights, tokenizer_bytes, eos, imported)


def llama_config_fields(m: dict, vocab: int, bos: int, eos: int, dtype: str) -> dict:
    """transformers.LlamaConfig's fields for our [model] section `m` (switches resolved), in
    the rope spelling of the installed transformers (5: `rope_parameters`; 4: `rope_theta`
    and `rope_scaling`)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": m["rotary_base"]}
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


def export_llama(meta: dict, state: dict, tokenizer_file: Path, out: str | Path, dtype: str):
    """Write a Llama checkpoint's `meta` and full `state` as a transformers LlamaForCausalLM
    directory `out`, in `dtype`."""
    import transformers

    m = run_model_config(meta)
    refuse_switches(tokenizer_file.parent / "meta.json", m, "Llama", LLAMA_SWITCHES)
    vocab = int(meta["vocab_size"])
    tok_info = meta.get("tokenizer") or {}
    if "eod_id" not in tok_info:
        raise CheckpointError(f"{tokenizer_file.parent / 'meta.json'}: tokenizer has no eod_id")
    eos = int(tok_info["eod_id"])
    bos = (meta.get("imported_from") or {}).get("bos_token_id", eos)
    config = transformers.LlamaConfig(**llama_config_fields(m, vocab, bos, eos, dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_weights(to_hf_state(state, m, vocab), dtype_of(dtype), out / "model.safetensors")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    bos_token = tok.id_to_token(bos) if isinstance(bos, int) else None
    positions = m["max_position_embeddings"]
    write_hf_tokenizer(tokenizer_file, out, bos_token, tok.id_to_token(eos), None, positions)
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(str(out))
    return out
