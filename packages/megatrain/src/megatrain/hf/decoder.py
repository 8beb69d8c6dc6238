"""What the Hugging Face decoder families (`hf.llama`: Llama and Mistral, `hf.qwen`: Qwen2 and
Qwen3, `hf.moe`: Mixtral, Qwen2-MoE and Qwen3-MoE) share: the names of HF's tensors and ours,
config.json read as JSON and refused by field (`load_hf_config`, `refuser`, `decoder_fields`,
Qwen's switches in `read_qwen_config`), the safetensors' headers read and checked before any
tensor is (`read_headers`, `checked_headers`), where each of our tensors lies in HF's
(`decoder_map`, a `tensor_map.Target` each: import, export and `run --load-hf` all read it) and
the import of a family's fields as a megatrain checkpoint of kind llama (`decoder_config`,
`import_decoder`, streamed: one tensor, or one expert, held at a time).  The classes an
export writes are in `hf.families`.  This module imports none of the families.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatrain.config import Config
from megatrain.hf.common import HFFormatError, checked_padding, read_json, write_imported
from megatrain.hf.quantized import logical_headers, read_quantization
from megatrain.hf.tensor_map import (
    HFFiles,
    Target,
    attention_map,
    experts_map,
    fused_experts_map,
    hf_shapes_of,
    interleaved_experts_map,
    streamed,
    whole,
)
from megatrain.hf.windows import configure_windows, sliding_window_fields

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


def load_hf_config(hf_dir: Path) -> tuple[Path, dict]:
    """(config.json's path, its contents), refused naming the file when absent or not JSON."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise HFFormatError(f"{config_file} does not exist: expected a Hugging Face model")
    return config_file, read_json(config_file)


def _yarn_fields(config_file: Path, rope: dict) -> dict:
    """YaRN's rope parameters (HF's names) as our [model] fields take them, refusing what we
    do not compute (an explicit attention_factor)."""
    absent = [f for f in ("factor", "original_max_position_embeddings")
              if not isinstance(rope.get(f), int | float)]  # fmt: skip
    if absent:
        raise HFFormatError(f"{config_file}: rope type yarn without a number for {absent[0]}")
    if rope.get("attention_factor") is not None:
        raise HFFormatError(
            f"{config_file}: rope attention_factor is {rope['attention_factor']!r}: an explicit "
            "YaRN attention factor is not supported (it follows from factor and mscale)"
        )
    return {
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        "mscale": float(rope.get("mscale") or 0.0),
        "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        "correction_range_round_to_int": bool(rope.get("truncate", True)),
    }


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
    rope_types: tuple = ROPE_TYPES,
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
    if rope_type not in rope_types:
        field = "rope_parameters" if "rope_parameters" in c else "rope_scaling"
        raise HFFormatError(
            f"{config_file}: {field} has rope type {rope_type!r}; supported: {rope_types}"
        )
    scaling = None
    yarn = _yarn_fields(config_file, rope) if rope_type == "yarn" else None
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
        "yarn": yarn,
        "tied": bool(c.get("tie_word_embeddings", False)),
        "dropout": float(c.get("attention_dropout", 0.0)),
        "eos": eos[0] if isinstance(eos, list) else eos,
        "bos": c.get("bos_token_id"),
        "qkv_bias": qkv_bias,
        "qk_norm": qk_norm,
        "quantization": read_quantization(config_file, c),
        **sliding_window_fields(config_file, c),
    }


def read_qwen_config(hf_dir: Path, required: tuple = ("intermediate_size",)) -> dict:
    """config.json of a Qwen2 or Qwen3 (or their MoE: `required` then names their sizes) as
    `decoder_fields` reads it, with Qwen's switches."""
    config_file, c = load_hf_config(hf_dir)
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


def mlp_map(c: dict, i: int) -> dict[str, Target]:
    """Layer i's MLP (our names under layers.i.): the SwiGLU of intermediate_size, or, where
    `c["moe_layers"]` says so, the router, the experts (per expert, or transformers 5's fused
    3-D tensors when `c["fused"]`) and Qwen2-MoE's shared expert and its gate."""
    h, layer = c["hidden"], f"model.layers.{i}."
    kinds = c.get("moe_layers") or [False]
    if not kinds[min(i, len(kinds) - 1)]:  # past the last layer (an MTP depth's): its kind
        f = c["ffn"]
        shapes = {"gate": (f, h), "fc1": (f, h), "fc2": (h, f)}
        return {
            ours: whole(layer + theirs, shapes[ours.split(".")[1]])
            for ours, theirs in DENSE_MLP.items()
        }
    f, E = c["expert_ffn"], c["experts"]
    if c["model_type"] == "gpt_oss":  # the router's bias, the experts' interleaved gate/up
        out = {"mlp.router.weight": whole(f"{layer}mlp.router.weight", (E, h)),
               "mlp.router.bias": whole(f"{layer}mlp.router.bias", (E,))}  # fmt: skip
        return out | interleaved_experts_map("mlp.", f"{layer}mlp.experts.", E, h, f)
    prefix, router, (gate, up, down) = expert_names(c["model_type"])
    if c.get("fused"):
        out = {"mlp.router.weight": whole(f"{layer}mlp.{router}", (E, h))}
        out |= fused_experts_map("mlp.", f"{layer}mlp.experts.", E, h, f)
    else:
        out = {"mlp.router.weight": whole(layer + prefix + router, (E, h))}
        names = tuple(f"{layer}{prefix}experts.{{e}}.{n}.weight" for n in (gate, up, down))
        out |= experts_map("mlp.", names, E, h, f)
    if c.get("shared_ffn"):  # Qwen2-MoE's gated shared_expert, DeepSeek's shared_experts
        s, name = c["shared_ffn"], c.get("shared_name", "shared_expert")
        shapes = {"gate": (s, h), "fc1": (s, h), "fc2": (h, s)}
        out |= {f"mlp.shared_expert.{ours}.weight":
                whole(f"{layer}mlp.{name}.{theirs}.weight", shapes[ours])
                for ours, theirs in SHARED.items()}  # fmt: skip
        if c.get("shared_gate", True):
            out["mlp.shared_expert_gate.weight"] = whole(
                f"{layer}mlp.shared_expert_gate.weight", (1, h)
            )
    if c.get("expert_bias"):  # DeepSeek-V3's correction bias: our fp32 buffer
        out["mlp.router.expert_bias"] = whole(f"{layer}mlp.gate.e_score_correction_bias", (E,))
    return out


# DeepSeek's multi-latent attention: ours (under layers.N.attention.) -> HF's (under
# model.layers.N.self_attn.), each as it is.
MLA_NAMES = {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj", "q": "q_proj",
             "kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj",
             "proj": "o_proj"}  # fmt: skip


def mla_map(ours: str, layer: str, c: dict) -> dict[str, Target]:
    """One layer's multi-latent attention (`c["mla"]`'s sizes), our module's order."""
    a, h, heads = c["mla"], c["hidden"], c["heads"]
    r, qk = a["q_lora_rank"], a["nope"] + a["rope"]
    if r:
        shapes = {"q_a": (r, h), "q_a_norm": (r,), "q_b": (heads * qk, r)}
    else:
        shapes = {"q": (heads * qk, h)}
    shapes |= {"kv_a": (a["kv_lora_rank"] + a["rope"], h), "kv_a_norm": (a["kv_lora_rank"],),
               "kv_b": (heads * (a["nope"] + a["v"]), a["kv_lora_rank"]),
               "proj": (h, heads * a["v"])}  # fmt: skip
    return {f"{ours}attention.{k}.weight": whole(f"{layer}self_attn.{MLA_NAMES[k]}.weight", s)
            for k, s in shapes.items()}  # fmt: skip


def layer_map(c: dict, i: int, ours: str, layer: str) -> dict[str, Target]:
    """Decoder layer i's tensors (ours under `ours`, HF's under `layer`): its norms, attention
    (grouped-query, or multi-latent with `c["mla"]`) and MLP."""
    h, d = c["hidden"], c["head_dim"]
    out = {ours + k: whole(layer + t, (h,)) for k, t in NORMS.items()}
    if c.get("mla"):
        return out | mla_map(ours, layer, c) | {ours + k: t for k, t in mlp_map(c, i).items()}
    for kind in ("weight", "bias") if c["qkv_bias"] else ("weight",):
        out |= attention_map(ours, layer, c, kind)
    out[ours + "attention.proj.weight"] = whole(layer + "self_attn.o_proj.weight",
                                                 (h, c["heads"] * d))  # fmt: skip
    if c.get("o_bias"):  # gpt-oss's
        out[ours + "attention.proj.bias"] = whole(layer + "self_attn.o_proj.bias", (h,))
    if c.get("sinks"):
        out[ours + "attention.sinks"] = whole(layer + "self_attn.sinks", (c["heads"],))
    if c["qk_norm"]:
        out |= {ours + k: whole(layer + t, (d,)) for k, t in QK_NORMS.items()}
    return out | {ours + k: t for k, t in mlp_map(c, i).items()}


# DeepSeek's multi-token prediction depth k, stored as model.layers.{num_hidden_layers + k}:
# ours (under mtp.layers.k.) -> HF's, beside its decoder layer (ours under mtp.layers.k.layer.).
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "final_layernorm.weight": "shared_head.norm.weight"}  # fmt: skip
# Its copies of the model's word embedding and output layer, which the depths share: never
# read (ours are the model's), written from the model's own by an export.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _with_copies(target: Target, names: list[str]) -> Target:
    """`target` with HF tensors `names` as copies of its first box: written by an export."""
    box = target.sources[0]
    return Target(target.shape, (*target.sources, *(replace(box, hf=n) for n in names)))


def mtp_map(c: dict, out: dict[str, Target]) -> dict[str, Target]:
    """The `c["mtp_layers"]` multi-token prediction depths' tensors, and, with
    `c["mtp_copies"]` (an export), each depth's copies of the word embedding and the output
    layer (`out`'s, the model's) as more boxes of ours."""
    h, first = c["hidden"], c["layers"]
    depths = range(c.get("mtp_layers") or 0)
    mtp = {}
    for k in depths:
        layer, ours = f"model.layers.{first + k}.", f"mtp.layers.{k}."
        mtp |= {ours + n: whole(layer + t, (h,)) for n, t in MTP_NAMES.items()}
        mtp[ours + "eh_proj.weight"] = whole(layer + "eh_proj.weight", (h, 2 * h))
        mtp |= layer_map(c, first + k, ours + "layer.", layer)
    if c.get("mtp_copies") and depths:
        embed, head = ([f"model.layers.{first + k}.{n}" for k in depths] for n in MTP_COPIES)
        if c["tied"]:  # the output layer is the embedding
            mtp["embedding.weight"] = _with_copies(out["embedding.weight"], embed + head)
        else:
            mtp["embedding.weight"] = _with_copies(out["embedding.weight"], embed)
            mtp["output_layer.weight"] = _with_copies(out["output_layer.weight"], head)
    return mtp


def decoder_map(c: dict, padded_vocab: int) -> dict[str, Target]:
    """Where each of our tensors lies in the HF decoder `c` describes (`decoder_fields`, with a
    mixture's fields), in HF's order: embeddings (padded to `padded_vocab` rows), the layers,
    the final norm, an untied output layer, DeepSeek's multi-token prediction depths."""
    h, v = c["hidden"], c["vocab"]
    out = {"embedding.weight": whole("model.embed_tokens.weight", (v, h), rows=padded_vocab)}
    for i in range(c["layers"]):
        out |= layer_map(c, i, f"layers.{i}.", f"model.layers.{i}.")
    out["final_layernorm.weight"] = whole("model.norm.weight", (h,))
    if not c["tied"]:
        out["output_layer.weight"] = whole("lm_head.weight", (v, h), rows=padded_vocab)
    return out | mtp_map(c, out)


# safetensors' dtype names -> torch's (the float ones a model's weights are stored in).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}  # fmt: skip
# Bytes an element of each safetensors dtype takes (a quantized model's stored ones too).
STORED_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
                   "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8,
                   "F64": 8}  # fmt: skip


@dataclass
class Headers:
    """What the safetensors headers of an HF directory say: name -> shape, file, dtype; a
    tensor stored quantized at its dequantised shape and dtype, with its dequantiser in
    `quantized` (`hf.quantized`; `where` also holds its stored blocks' and scales' files)."""

    shapes: dict[str, tuple]
    where: dict[str, str]
    dtypes: dict[str, str]
    quantized: dict = field(default_factory=dict)

    def stored_bytes(self) -> int:
        """The bytes the files hold of these tensors (a quantized one's blocks and scales)."""
        return sum(
            self.quantized[n].nbytes
            if n in self.quantized
            else torch.Size(s).numel() * STORED_ITEMSIZE[self.dtypes[n]]
            for n, s in self.shapes.items()
        )


def safetensors_files(hf_dir: Path, model_type: str) -> list[str]:
    """The weight files of `hf_dir`: those model.safetensors.index.json lists (each must be
    there), else model.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFFormatError(f"{index}: no weight_map (tensor name -> file)")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (hf_dir / f).is_file()]
        if absent:
            raise HFFormatError(
                f"{index} lists {', '.join(absent[:3])}"
                + (f" (and {len(absent) - 3} more)" if len(absent) > 3 else "")
                + f", not in {hf_dir}: is the download complete?"
            )
        return files
    if (hf_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise HFFormatError(
        f"{hf_dir}: no model.safetensors (or model.safetensors.index.json); a "
        f"{model_type} is read from safetensors only, never unpickled"
    )


def read_headers(hf_dir: Path, c: dict) -> Headers:
    """The headers of the safetensors of `hf_dir` (sharded or not), no tensor read; a file
    that is not whole safetensors (truncated, say) is refused naming it.  A quantized model's
    (config.json's quantization_config) tensors as they dequantise (`hf.quantized`).
    Skipped, by name: rotary `inv_freq` buffers and, for tied embeddings, a stored copy of
    lm_head."""
    from safetensors import safe_open

    skipped = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if c["tied"] else ())
    shapes, dtypes, where = {}, {}, {}
    for name in safetensors_files(hf_dir, c["model_type"]):
        try:
            with safe_open(str(hf_dir / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    piece = f.get_slice(key)
                    shapes[key], dtypes[key] = tuple(piece.get_shape()), piece.get_dtype()
                    where[key] = name
        except Exception as e:
            raise HFFormatError(
                f"{hf_dir / name}: cannot be read as safetensors ({e}); a truncated or partly "
                "downloaded file reads so"
            ) from e
    shapes, dtypes, where, quantized = logical_headers(
        hf_dir, c.get("quantization"), shapes, dtypes, where
    )
    # c["skipped_prefixes"]: tensors no module of ours holds (DeepSeek's MTP layers), named
    # by the family's reader.
    prefixes = tuple(c.get("skipped_prefixes", ()))
    kept = [n for n in shapes if not n.endswith(skipped) and not n.startswith(prefixes)]
    return Headers(
        {n: shapes[n] for n in kept},
        where,
        {n: dtypes[n] for n in kept},
        {n: quantized[n] for n in kept if n in quantized},
    )


def checked_headers(hf_dir: Path, c: dict, expected: dict[str, tuple]) -> Headers:
    """`read_headers`, the names and shapes checked against `expected` (config.json's, from
    `decoder_map`) before any tensor is read: every tensor the model needs and the files lack
    named, every tensor the files hold and nothing maps named, a float dtype."""
    headers = read_headers(hf_dir, c)
    shapes = headers.shapes
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
        if headers.dtypes[name] not in SAFETENSORS_DTYPES:
            raise HFFormatError(
                f"{hf_dir / headers.where[name]}: {name} is {headers.dtypes[name]}; expected "
                f"one of {', '.join(SAFETENSORS_DTYPES)}"
            )
    return headers


def decoder_config(hf_dir: Path, c: dict, configure=None) -> Config:
    """The run config of the Llama-like decoder `c` describes (kind llama), checked; its
    sequence length what the positions allow.  `configure(m, c)`: the family's own fields."""
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
    if c.get("yarn"):
        m.rope_type = "yarn"
        for name, value in c["yarn"].items():
            setattr(m, name, value)
    if c["scaling"] is not None:
        factor, low, high, original = c["scaling"]
        m.rope_scaling_factor, m.rope_low_freq_factor = factor, low
        m.rope_high_freq_factor, m.rope_original_max_position_embeddings = high, original
    m.untie_embeddings_and_output_weights = not c["tied"]
    configure_windows(m, c)
    if configure is not None:
        configure(m, c)
    checked_padding(config, hf_dir)
    return config


def import_decoder(
    hf_dir: Path,
    out_ckpt: str | Path,
    tokenizer_file: str | Path | None,
    c: dict,
    configure=None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """Write the Llama-like decoder of `hf_dir` as a megatrain checkpoint of kind llama
    (iteration 0, weights only) under `out_ckpt`; returns the iteration directory.  `c`: its
    family's `decoder_fields` (a Llama's `llama.read_hf_config`, ...), `configure(m, c)` sets
    the family's own [model] fields.  Streamed: each of our tensors (a stacked expert tensor,
    an expert at a time) is read from the files and written as it is made; in the files'
    dtype unless `dtype` says another."""
    from tokenizers import Tokenizer

    from megacore.tensor_parallel import vocab_size_with_padding

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
    config = decoder_config(hf_dir, c, configure)
    m = config.model
    padded = vocab_size_with_padding(m.vocab_size, 1, m.make_vocab_size_divisible_by)
    targets = decoder_map(c, padded)
    headers = checked_headers(hf_dir, c, hf_shapes_of(targets))
    files = HFFiles(hf_dir, headers.where, quantized=headers.quantized)
    dtypes = {n: SAFETENSORS_DTYPES[t] for n, t in headers.dtypes.items()}
    imported = {"hf_dir": str(hf_dir.resolve()), "bos_token_id": c["bos"],
                "model_type": c["model_type"]}  # fmt: skip
    if headers.quantized:
        imported["dequantized_from"] = c["quantization"].method
    try:
        weights = streamed(targets, files, dtypes, dtype)
        return write_imported(
            out_ckpt, config, weights, tokenizer_bytes, eos, imported, progress=progress
        )
    finally:
        files.close()
