"""What the Hugging Face decoder families (`hf.llama`: Llama and Mistral, `hf.qwen`: Qwen2 and
Qwen3, `hf.moe`: Mixtral, Qwen2-MoE and Qwen3-MoE) share: the names of HF's tensors and ours,
config.json read as JSON and refused by field (`load_hf_config`, `refuser`, `decoder_fields`,
Qwen's switches in `read_qwen_config`), the weights read as safetensors from their headers
first (`hf_shapes`, `weight_shapes`, `read_weights`), the state mapping both ways
(`from_hf_state` / `to_hf_state`, with a family's MLP) and the import of a family's fields as a
megatrain checkpoint of kind llama (`import_decoder`).  The classes an export writes are in
`hf.families`.  This module imports none of the families.
"""

import json
from pathlib import Path

import torch

from megatrain.config import Config
from megatrain.hf.common import (
    HFFormatError,
    checked_padding,
    qkv_from_hf,
    qkv_to_hf,
    read_json,
    write_imported,
)

ROPE_TYPES = ("default", "llama3")

NORMS = {  # ours -> HF's, under model.layers.N.
    "ln1.weight": "input_layernorm.weight",
    "ln2.weight": "post_attention_layernorm.weight",
}
DENSE_MLP = {  # ours -> HF's, under model.layers.N.
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.fc1.weight": "mlp.up_proj.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# Qwen3's per-head norms of the queries and keys (ours -> HF's, under model.layers.N.).
QK_NORMS = {
    "attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "attention.k_layernorm.weight": "self_attn.k_norm.weight",
}

# Per expert: ours (rows of weight1 [gate | up], weight2) -> HF's, by family.
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", "gate.weight", ("w1", "w3", "w2")),
    "qwen": ("mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj")),
}
SHARED = {"gate": "gate_proj", "fc1": "up_proj", "fc2": "down_proj"}  # ours -> Qwen2-MoE's


def expert_names(model_type: str) -> tuple[str, str, tuple[str, str, str]]:
    """(prefix, router, (gate, up, down)): a mixture of experts' HF names, by family."""
    return EXPERT_NAMES["mixtral" if model_type == "mixtral" else "qwen"]


def kv_from_hf(k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF's k and v (weights [groups d, h] or biases [groups d]) -> our `kv` rows, per group
    [k, v]."""
    rest = k.shape[1:]
    stacked = torch.stack([k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1)
    return stacked.reshape(-1, *rest)


def kv_to_hf(kv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `kv_from_hf`: (k, v)."""
    rest = kv.shape[1:]
    grouped = kv.reshape(groups, 2, -1, *rest)
    return grouped[:, 0].reshape(-1, *rest), grouped[:, 1].reshape(-1, *rest)


def _attention_from_hf(q, k, v, heads: int, groups: int, kind: str) -> dict[str, torch.Tensor]:
    """Our attention `kind` ("weight" or "bias") from HF's q, k, v: per head [q k v] rows in
    one `qkv` without grouped-query attention, else `q` as HF's and `kv` per group [k v]."""
    if groups == heads:
        return {f"qkv.{kind}": qkv_from_hf(torch.cat([q, k, v]), heads)}
    return {f"q.{kind}": q, f"kv.{kind}": kv_from_hf(k, v, groups)}


def _attention_to_hf(weights: dict, prefix: str, heads: int, groups: int, kind: str):
    """The inverse of `_attention_from_hf`: (q, k, v)."""
    if groups == heads:
        return qkv_to_hf(weights[f"{prefix}qkv.{kind}"], heads).chunk(3)
    return (weights[f"{prefix}q.{kind}"], *kv_to_hf(weights[f"{prefix}kv.{kind}"], groups))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])


def load_hf_config(hf_dir: Path) -> tuple[Path, dict]:
    """(config.json's path, its contents), refused naming the file when absent or not JSON."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise HFFormatError(f"{config_file} does not exist: expected a Hugging Face model")
    return config_file, read_json(config_file)


def refuser(config_file: Path, c: dict):
    """refuse(field, why): an HFFormatError naming config.json, the field and its value."""

    def refuse(field: str, why: str):
        raise HFFormatError(f"{config_file}: {field} is {c.get(field)!r}: {why}")

    return refuse


def decoder_fields(
    config_file: Path,
    c: dict,
    required: tuple = (),
    head_dim: int | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> dict:
    """What the Llama-like decoders (Llama, Mistral, Qwen2/3 and their MoE) share in config.json,
    refusing by field what our transformer cannot compute: {layers, hidden, heads, groups,
    head_dim, ffn, positions, vocab, eps, std, theta, scaling, tied, dropout, eos, bos,
    qkv_bias, qk_norm}.  `required`: the family's own integer fields; `head_dim`: the
    family's default when config.json has none (None: hidden_size / num_attention_heads)."""
    refuse = refuser(config_file, c)
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
                *required)  # fmt: skip
    missing = [f for f in required if not isinstance(c.get(f), int)]
    if missing:
        raise HFFormatError(
            f"{config_file}: no integer {', '.join(missing)}: a {c['model_type']} config.json "
            f"needs {', '.join(required)}"
        )
    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "expected 'silu' (SwiGLU)")
    if c.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", "expected 1")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    d = c.get("head_dim") or head_dim
    if d is None:
        if hidden % heads:
            refuse("num_attention_heads", f"hidden_size ({hidden}) is not a multiple of it")
        d = hidden // heads
    if not isinstance(d, int) or d <= 0 or d % 2:
        refuse("head_dim", "expected an even positive integer (rotary halves)")
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
        "model_type": c["model_type"],
        "layers": int(c["num_hidden_layers"]),
        "hidden": hidden,
        "heads": heads,
        "groups": groups,
        "head_dim": d,
        "ffn": int(c.get("intermediate_size") or 0),
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
        "qkv_bias": qkv_bias,
        "qk_norm": qk_norm,
    }


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
    `decoder_fields` reads it, with Qwen's switches."""
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


def dense_mlp_shapes(c: dict, i: int, f: int | None = None) -> dict[str, tuple]:
    """HF's SwiGLU MLP of layer `i` (of width `f`, default intermediate_size), its names under
    model.layers.i."""
    h, f = c["hidden"], f or c["ffn"]
    return {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f)}  # fmt: skip


def hf_shapes(c: dict, mlp_shapes=dense_mlp_shapes) -> dict[str, tuple]:
    """Every HF tensor name and shape config.json describes; `mlp_shapes(c, i)`: layer i's
    MLP, under model.layers.i."""
    h, v, d = c["hidden"], c["vocab"], c["head_dim"]
    q, kv = c["heads"] * d, c["groups"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c["tied"]:
        shapes["lm_head.weight"] = (v, h)
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
    }  # fmt: skip
    if c["qkv_bias"]:
        per_layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)}  # fmt: skip
    if c["qk_norm"]:
        per_layer |= {name: (d,) for name in QK_NORMS.values()}
    for i in range(c["layers"]):
        layer = {**per_layer, **mlp_shapes(c, i)}
        shapes |= {f"model.layers.{i}.{k}": s for k, s in layer.items()}
    return shapes


def weight_shapes(hf_dir: Path, c: dict) -> tuple[dict[str, tuple], dict[str, str]]:
    """({name: shape}, {name: file}) of the safetensors of `hf_dir` (sharded or not), from
    the files' headers alone (no tensor read)."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFFormatError(
            f"{hf_dir}: no model.safetensors (or model.safetensors.index.json); a "
            f"{c['model_type']} is read from safetensors only, never unpickled"
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
    return shapes, where


def read_weights(hf_dir: Path, c: dict, expected: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The safetensors of `hf_dir` (sharded or not): names and shapes checked against
    `expected` (config.json's) from the files' headers, before any tensor is read."""
    from safetensors import safe_open

    shapes, where = weight_shapes(hf_dir, c)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        raise HFFormatError(
            f"{hf_dir}: the weights are not those of the {c['model_type']} its config.json "
            "describes"
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
    for name in sorted(set(where.values())):
        with safe_open(str(hf_dir / name), framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k, file in where.items() if file == name}
    return tensors


def dense_mlp_from_hf(hf: dict, c: dict, i: int) -> dict[str, torch.Tensor]:
    """Our layer i's SwiGLU MLP (names under layers.i.) from HF's."""
    return {ours: hf[f"model.layers.{i}.{theirs}"] for ours, theirs in DENSE_MLP.items()}


def dense_mlp_to_hf(weights: dict, m: dict, i: int) -> dict[str, torch.Tensor]:
    """HF's layer i's MLP (names under model.layers.i.) from ours."""
    return {theirs: weights[f"layers.{i}.{ours}"] for ours, theirs in DENSE_MLP.items()}


def from_hf_state(hf: dict, c: dict, padded_vocab: int, mlp=dense_mlp_from_hf) -> dict:
    """Our weights from HF's tensors; `mlp(hf, c, i)`: layer i's MLP, named under layers.i."""
    out = {
        "embedding.weight": _pad_rows(hf["model.embed_tokens.weight"], padded_vocab),
        "final_layernorm.weight": hf["model.norm.weight"],
    }
    if not c["tied"]:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], padded_vocab)
    for i in range(c["layers"]):
        layer = f"model.layers.{i}."
        ours = {k: hf[layer + theirs] for k, theirs in NORMS.items()}
        ours["attention.proj.weight"] = hf[layer + "self_attn.o_proj.weight"]
        kinds = ("weight", "bias") if c["qkv_bias"] else ("weight",)
        for kind in kinds:
            q, k, v = (hf[f"{layer}{name}.{kind}"] for name in QKV)
            attention = _attention_from_hf(q, k, v, c["heads"], c["groups"], kind)
            ours |= {f"attention.{name}": t for name, t in attention.items()}
        if c["qk_norm"]:
            ours |= {k: hf[layer + theirs] for k, theirs in QK_NORMS.items()}
        ours |= mlp(hf, c, i)
        out |= {f"layers.{i}.{name}": t for name, t in ours.items()}
    return {n: t.contiguous() for n, t in out.items()}


def to_hf_state(weights: dict, m: dict, vocab: int, mlp=dense_mlp_to_hf) -> dict:
    """HF's tensors from our weights (`m`: the resolved [model] section); `mlp(weights, m, i)`:
    layer i's MLP, named under model.layers.i."""
    groups, heads = m["num_query_groups"], m["num_attention_heads"]
    out = {
        "model.embed_tokens.weight": weights["embedding.weight"][:vocab],
        "model.norm.weight": weights["final_layernorm.weight"],
    }
    if "output_layer.weight" in weights:
        out["lm_head.weight"] = weights["output_layer.weight"][:vocab]
    for i in range(m["num_layers"]):
        layer, ours = f"model.layers.{i}.", f"layers.{i}."
        theirs = {t: weights[ours + k] for k, t in NORMS.items()}
        theirs["self_attn.o_proj.weight"] = weights[ours + "attention.proj.weight"]
        kinds = ("weight", "bias") if m["add_qkv_bias"] else ("weight",)
        for kind in kinds:
            qkv = _attention_to_hf(weights, ours + "attention.", heads, groups, kind)
            theirs |= {f"{name}.{kind}": t for name, t in zip(QKV, qkv, strict=True)}
        if m["qk_layernorm"]:
            theirs |= {t: weights[ours + k] for k, t in QK_NORMS.items()}
        theirs |= mlp(weights, m, i)
        out |= {layer + name: t for name, t in theirs.items()}
    return {n: t.contiguous() for n, t in out.items()}


def import_decoder(
    hf_dir: Path,
    out_ckpt: str | Path,
    tokenizer_file: str | Path | None,
    c: dict,
    configure=None,
    mlp_shapes=dense_mlp_shapes,
    mlp_from_hf=dense_mlp_from_hf,
) -> Path:
    """Write the Llama-like decoder of `hf_dir` as a megatrain checkpoint of kind llama
    (iteration 0, weights only) under `out_ckpt`; returns the iteration directory.  `c`: its
    family's `decoder_fields` (a Llama's `llama.read_hf_config`, ...), `configure(m, c)` sets
    the family's own [model] fields, `mlp_shapes`/`mlp_from_hf` read its MLPs."""
    from tokenizers import Tokenizer

    source = Path(tokenizer_file) if tokenizer_file is not None else hf_dir / "tokenizer.json"
    if not source.is_file():
        raise HFFormatError(
            f"{source} does not exist: a {c['model_type']} import needs its tokenizer.json"
        )
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
    if c["head_dim"] * c["heads"] != c["hidden"]:
        m.kv_channels = c["head_dim"]
    m.qk_layernorm, m.add_qkv_bias = c["qk_norm"], c["qkv_bias"]
    m.ffn_hidden_size, m.max_position_embeddings = c["ffn"] or None, c["positions"]
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
    if configure is not None:
        configure(m, c)
    padded = checked_padding(config, hf_dir)
    tensors = read_weights(hf_dir, c, hf_shapes(c, mlp_shapes))
    weights = from_hf_state(tensors, c, padded, mlp_from_hf)
    imported = {"hf_dir": str(hf_dir.resolve()), "bos_token_id": c["bos"],
                "model_type": c["model_type"]}  # fmt: skip
    return write_imported(out_ckpt, config, weights, tokenizer_bytes, eos, imported)
