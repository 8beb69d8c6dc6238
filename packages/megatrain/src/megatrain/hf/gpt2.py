"""Hugging Face GPT-2 export and import (`megatrain export-hf`, `megatrain import-hf`).

Our GPT-2 and `transformers.GPT2LMHeadModel` compute the same function; only the
storage differs:

- HF's Conv1D keeps weights as [in, out], our Linear layers as [out, in]: transposed;
- our QKV rows are laid out per head as [q k v] blocks of head_dim rows (so a
  contiguous tensor-parallel slice is whole heads), HF's c_attn columns as
  [q of all heads; k; v];
- our word embeddings are padded to a multiple of 128 x tp (padding logits masked
  out); HF's have exactly the tokenizer's rows;
- the output layer is tied to the word embeddings in both (HF stores no lm_head).

Export writes config.json, model.safetensors, the tokenizer files and
generation_config.json; the tokenizer.json is the checkpoint's, byte for byte, so
its sha256 (which corpora and checkpoints pin) survives a round trip.  Import
needs no transformers: config.json is read as JSON, weights with safetensors (or
`torch.load(weights_only=True)`), the tokenizer with `tokenizers`; it writes a
checkpoint of iteration 0 holding the weights only, which `megatrain run --load`
fine-tunes from.  transformers (the `hf` extra) is imported by export only.
"""

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
    read_hf_weights,
    read_json,
    refuse_switches,
    run_model_config,
    write_hf_tokenizer,
    write_imported,
)
from megatrain.hf.shards import save_weights

EOD_TOKEN = "<|endoftext|>"


TOKENIZER_KIND = "gpt2-bpe"


# GPT2Config's defaults, for keys a config.json leaves out (as transformers reads it).
GPT2_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}


# Config values that change the computation away from our GPT-2: field -> accepted values.
GPT2_REQUIRED = {
    "model_type": ("gpt2",),
    # Both are GeLU's tanh approximation, which our MLP uses.
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "tie_word_embeddings": (True,),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "add_cross_attention": (False,),
}


# The resolved [model] switches a GPT2LMHeadModel computes (its tie is read from the config).
GPT2_SWITCHES = {
    "normalization": "layernorm",
    "position_embedding_type": "learned_absolute",
    "swiglu": False,
    "add_bias_linear": True,
}


# Per layer: our parameter -> (HF parameter under transformer.h.N., stored transposed).
LAYER_PARAMS = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attention.qkv.weight": ("attn.c_attn.weight", True),
    "attention.qkv.bias": ("attn.c_attn.bias", False),
    "attention.proj.weight": ("attn.c_proj.weight", True),
    "attention.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}


OTHER_PARAMS = {
    "embedding.weight": "wte.weight",
    "position_embedding.weight": "wpe.weight",
    "final_layernorm.weight": "ln_f.weight",
    "final_layernorm.bias": "ln_f.bias",
}


def to_hf_state(weights: dict[str, torch.Tensor], num_layers: int, heads: int, vocab: int):
    """Our weights (global names, padded vocabulary) -> HF GPT2LMHeadModel names and layouts;
    an output layer of its own (untied) is HF's lm_head."""
    out = {}
    for ours, theirs in OTHER_PARAMS.items():
        out[f"transformer.{theirs}"] = weights[ours]
    out["transformer.wte.weight"] = out["transformer.wte.weight"][:vocab]  # drop the padding
    if "output_layer.weight" in weights:
        out["lm_head.weight"] = weights["output_layer.weight"][:vocab]
    for i in range(num_layers):
        for ours, (theirs, transposed) in LAYER_PARAMS.items():
            t = weights[f"layers.{i}.{ours}"]
            if ours.startswith("attention.qkv"):
                t = qkv_to_hf(t, heads)
            out[f"transformer.h.{i}.{theirs}"] = t.t() if transposed else t
    return {n: t.contiguous() for n, t in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], num_layers: int, heads: int, padded_vocab: int):
    """HF GPT-2 tensors (names without "transformer.") -> our weights, vocabulary padded."""
    out = {ours: hf[theirs] for ours, theirs in OTHER_PARAMS.items()}
    wte = out["embedding.weight"]
    out["embedding.weight"] = torch.cat(
        [wte, wte.new_zeros(padded_vocab - wte.shape[0], wte.shape[1])]
    )
    for i in range(num_layers):
        for ours, (theirs, transposed) in LAYER_PARAMS.items():
            t = hf[f"h.{i}.{theirs}"]
            t = t.t() if transposed else t
            if ours.startswith("attention.qkv"):
                t = qkv_from_hf(t, heads)
            out[f"layers.{i}.{ours}"] = t.contiguous()
    return out


def export_gpt2(
    meta: dict, state: dict, tokenizer_file: Path, out: str | Path, dtype: str, max_shard_size=None
):
    """Write a GPT checkpoint's `meta` and full `state` as a transformers GPT2LMHeadModel
    directory `out`, in `dtype`."""
    import transformers

    directory = tokenizer_file.parent
    torch_dtype = dtype_of(dtype)
    tok_info = meta.get("tokenizer") or {}
    if tok_info.get("kind", TOKENIZER_KIND) != TOKENIZER_KIND or "eod_id" not in tok_info:
        raise CheckpointError(
            f"{directory / 'meta.json'}: tokenizer {tok_info}: expected kind {TOKENIZER_KIND!r} "
            "with an eod_id"
        )
    from tokenizers import Tokenizer

    eod_id = int(tok_info["eod_id"])
    eod = Tokenizer.from_file(str(tokenizer_file)).id_to_token(eod_id)
    m = run_model_config(meta)
    heads = {"num_query_groups": m["num_attention_heads"]}  # one key/value head per head
    refuse_switches(directory / "meta.json", m, "GPT-2", GPT2_SWITCHES | heads)
    vocab = int(meta["vocab_size"])
    fields = {
        "vocab_size": vocab,
        "n_positions": m["max_position_embeddings"],
        "n_embd": m["hidden_size"],
        "n_layer": m["num_layers"],
        "n_head": m["num_attention_heads"],
        "n_inner": m["ffn_hidden_size"],
        "activation_function": "gelu_new",  # GeLU's tanh approximation, as ours
        "resid_pdrop": m["hidden_dropout"],
        "embd_pdrop": m["hidden_dropout"],
        "attn_pdrop": m["attention_dropout"],
        "layer_norm_epsilon": m["layernorm_epsilon"],
        "initializer_range": m["init_method_std"],
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
        "architectures": ["GPT2LMHeadModel"],
    }
    # transformers 5 names the weights' dtype `dtype`, 4.x `torch_dtype`.
    fields["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    config = transformers.GPT2Config(**fields)
    weights = to_hf_state(state, m["num_layers"], m["num_attention_heads"], vocab)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_weights(weights, torch_dtype, out, max_shard_size)
    write_hf_tokenizer(tokenizer_file, out, eod, eod, eod, m["max_position_embeddings"])
    transformers.GenerationConfig(bos_token_id=eod_id, eos_token_id=eod_id).save_pretrained(
        str(out)
    )
    return out


def read_hf_config(hf_dir: Path) -> dict:
    """config.json with GPT2Config's defaults filled in; refuses a model that is not GPT-2,
    naming the config field."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise HFFormatError(
            f"{config_file} does not exist: expected a Hugging Face GPT-2 model directory "
            "(config.json, model.safetensors or pytorch_model.bin, tokenizer files)"
        )
    config = {**GPT2_DEFAULTS, **read_json(config_file)}
    for field, accepted in GPT2_REQUIRED.items():
        if config.get(field) not in accepted:
            raise HFFormatError(
                f"{config_file}: {field} is {config.get(field)!r}, expected "
                f"{' or '.join(map(repr, accepted))}: not a GPT-2 this import can represent"
            )
    if config["n_embd"] % config["n_head"]:
        raise HFFormatError(
            f"{config_file}: n_embd ({config['n_embd']}) is not divisible by n_head "
            f"({config['n_head']})"
        )
    return config


def _check_hf_weights(tensors: dict, expected: dict[str, tuple], hf_dir: Path) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise HFFormatError(
            f"{hf_dir}: the weights are not those of the GPT-2 its config.json describes"
            + (f"; missing {missing[:5]}" if missing else "")
            + (f"; unexpected {extra[:5]}" if extra else "")
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HFFormatError(
                f"{hf_dir}: {name} has shape {tuple(tensors[name].shape)}, config.json says {shape}"
            )


def _hf_shapes(c: dict) -> dict[str, tuple]:
    h, f, v, n = c["n_embd"], c["n_inner"] or 4 * c["n_embd"], c["vocab_size"], c["n_layer"]
    shapes = {"wte.weight": (v, h), "wpe.weight": (c["n_positions"], h)}
    shapes |= {"ln_f.weight": (h,), "ln_f.bias": (h,)}
    per_layer = {
        "ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
        "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
        "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,),
        "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,),
        "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,),
    }  # fmt: skip
    for i in range(n):
        shapes |= {f"h.{i}.{k}": s for k, s in per_layer.items()}
    return shapes


def read_hf_tokenizer(hf_dir: Path, tokenizer_file: Path | None = None) -> bytes:
    """The tokenizer.json bytes to keep with the imported checkpoint.

    `tokenizer_file` (e.g. the corpus's tokenizer.json) wins.  Else GPT-2's vocab.json +
    merges.txt, built and serialised as megadata builds them, so a corpus made from the
    same two files has the same tokenizer sha256; else the directory's tokenizer.json as is.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer_file is not None:
        if not Path(tokenizer_file).is_file():
            raise HFFormatError(f"tokenizer file {tokenizer_file} does not exist")
        return Path(tokenizer_file).read_bytes()
    vocab, merges = hf_dir / "vocab.json", hf_dir / "merges.txt"
    if vocab.is_file() and merges.is_file():
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok.to_str().encode()
    if (hf_dir / "tokenizer.json").is_file():
        return (hf_dir / "tokenizer.json").read_bytes()
    raise HFFormatError(
        f"{hf_dir}: no tokenizer; expected tokenizer.json or vocab.json + merges.txt "
        "(or pass a tokenizer.json)"
    )


def import_gpt2(
    hf_dir: Path, out_ckpt: str | Path, tokenizer_file: str | Path | None, **kw
) -> Path:
    """Write the GPT2LMHeadModel of `hf_dir` as a megatrain checkpoint (iteration 0, weights
    only) under `out_ckpt`; returns the iteration directory.  `kw`: `write_imported`'s dtype
    and progress (a GPT-2 is read whole: it is small)."""
    from tokenizers import Tokenizer

    c = read_hf_config(hf_dir)
    tokenizer_bytes = read_hf_tokenizer(hf_dir, tokenizer_file)
    tok = Tokenizer.from_str(tokenizer_bytes.decode())
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != c["vocab_size"]:
        raise HFFormatError(
            f"{hf_dir / 'config.json'}: vocab_size is {c['vocab_size']}, but the tokenizer has "
            f"{vocab} tokens; our vocabulary is the tokenizer's"
        )
    eod_id = c.get("eos_token_id")
    eod_id = tok.token_to_id(EOD_TOKEN) if eod_id is None else eod_id
    if not isinstance(eod_id, int) or not 0 <= eod_id < vocab:
        raise HFFormatError(
            f"{hf_dir / 'config.json'}: eos_token_id is {c.get('eos_token_id')!r}; expected the "
            f"end-of-document id below vocab_size {vocab} (or a {EOD_TOKEN} token)"
        )
    tensors = read_hf_weights(hf_dir)
    _check_hf_weights(tensors, _hf_shapes(c), hf_dir)
    config = Config(name=hf_dir.name)
    m = config.model
    m.num_layers, m.hidden_size, m.num_attention_heads = c["n_layer"], c["n_embd"], c["n_head"]
    m.ffn_hidden_size = c["n_inner"] or 4 * c["n_embd"]
    m.max_position_embeddings, m.vocab_size = c["n_positions"], vocab
    # One dropout for embeddings and residuals here; HF's resid_pdrop stands for both.
    m.hidden_dropout, m.attention_dropout = float(c["resid_pdrop"]), float(c["attn_pdrop"])
    m.init_method_std, m.layernorm_epsilon = c["initializer_range"], c["layer_norm_epsilon"]
    padded = checked_padding(config, hf_dir)
    weights = from_hf_state(tensors, m.num_layers, m.num_attention_heads, padded)
    imported = {"hf_dir": str(hf_dir.resolve()), "embd_pdrop": c["embd_pdrop"]}
    return write_imported(out_ckpt, config, weights, tokenizer_bytes, eod_id, imported, **kw)
