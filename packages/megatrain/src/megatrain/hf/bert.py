"""Hugging Face BERT export and import, both block orders (`megatrain export-hf`, `import-hf`).

Our BERT (`models/bert.py`) and transformers' pre-training models compute the same function:

- block_order "pre_ln" (the paper's BERT, Fig. 7 b) is `MegatronBertForPreTraining`
  (model_type "megatron-bert"): LayerNorm before attention (`attention.ln`, our `ln1`) and
  before the MLP (`ln`, our `ln2`), a final `encoder.ln`, no LayerNorm on the embeddings;
- block_order "post_ln" (the original BERT, Fig. 7 a) is `BertForPreTraining` (model_type
  "bert"): LayerNorm on the embeddings, after attention's residual add
  (`attention.output.LayerNorm`, our `ln1`) and after the MLP's (`output.LayerNorm`, `ln2`).

Both use the exact (erf) GeLU and two token types.  The storage differs:

- HF keeps query, key and value as three [h, h] linears; our QKV rows are per head
  [q_j; k_j; v_j] (`hf.qkv_to_hf` / `hf.qkv_from_hf`);
- our word embeddings and MLM bias are padded to a multiple of 128 x tp; HF's have exactly
  the tokenizer's rows;
- the MLM decoder is tied to the word embeddings in both (HF stores no decoder weight, and
  its decoder bias is `cls.predictions.bias`).

The heads: our masked-LM head is HF's `cls.predictions` (transform dense, GeLU, LayerNorm,
tied decoder + bias); our sentence-order head, a 2-way linear on the pooled [CLS] state, is
HF's `cls.seq_relationship` (NSP), the same shape on the same pooler.  The labels line up:
our SOP label 0 is "in order" and HF's NSP index 0 is "B follows A"; our 1 is "swapped",
HF's 1 "B is random".

Export writes config.json, model.safetensors and the tokenizer: our tokenizer.json byte for
byte, a vocab.txt of its WordPiece vocabulary in id order, and tokenizer_config.json for
`BertTokenizerFast` / `AutoTokenizer`.  Import (no transformers needed) reads config.json,
model.safetensors or pytorch_model.bin (`torch.load(weights_only=True)`) and the tokenizer;
a vocab.txt is built into tokenizer.json as megadata builds a bert-wordpiece corpus from
one, so a corpus made from the same vocab.txt has the same tokenizer sha256.  It refuses,
naming file and field, what our BERT cannot represent, and a checkpoint without the
pre-training heads (BertModel, BertForMaskedLM...): we do not invent a pooler or an SOP
head.
"""

import json
from pathlib import Path

import torch

from megatrain.checkpoint.convert import dtype_of
from megatrain.checkpoint.files import CheckpointError
from megatrain.config import Config
from megatrain.data.bert import SPECIAL_TOKENS
from megatrain.hf.common import (
    HFFormatError,
    checked_padding,
    qkv_from_hf,
    qkv_to_hf,
    read_hf_weights,
    read_json,
    refuse_switches,
    run_model_config,
    write_imported,
)
from megatrain.hf.shards import save_weights

TOKENIZER_KIND = "bert-wordpiece"
UNK_TOKEN = "[UNK]"
# Every special token our BERT's data uses, and WordPiece's unknown token.
BERT_TOKENS = (*SPECIAL_TOKENS.values(), UNK_TOKEN)
# HF model_type -> our block order, and the class that loads it.
BLOCK_ORDER = {"megatron-bert": "pre_ln", "bert": "post_ln"}
ARCHITECTURE = {"pre_ln": "MegatronBertForPreTraining", "post_ln": "BertForPreTraining"}
# BertConfig's defaults (MegatronBertConfig's differ in the sizes), for keys a config.json
# leaves out, as transformers reads it.
BERT_DEFAULTS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}
MEGATRON_BERT_SIZES = {
    "vocab_size": 29056,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
}
# Config values that change the computation away from our BERT: field -> accepted values.
BERT_REQUIRED = {
    "hidden_act": ("gelu",),  # the exact (erf) GeLU, ours
    "position_embedding_type": ("absolute",),
    "is_decoder": (False,),
    "add_cross_attention": (False,),
    "tie_word_embeddings": (True,),
    "type_vocab_size": (2,),  # our BERT has two token types (segments A and B)
}
# Our parameter -> HF's, the QKV aside (split in three there).
OTHER_PARAMS = {
    "embedding.weight": "bert.embeddings.word_embeddings.weight",
    "position_embedding.weight": "bert.embeddings.position_embeddings.weight",
    "tokentype_embedding.weight": "bert.embeddings.token_type_embeddings.weight",
    "lm_dense.weight": "cls.predictions.transform.dense.weight",
    "lm_dense.bias": "cls.predictions.transform.dense.bias",
    "lm_layernorm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_layernorm.bias": "cls.predictions.transform.LayerNorm.bias",
    "lm_bias": "cls.predictions.bias",
    "pooler.weight": "bert.pooler.dense.weight",
    "pooler.bias": "bert.pooler.dense.bias",
    "sop_head.weight": "cls.seq_relationship.weight",
    "sop_head.bias": "cls.seq_relationship.bias",
}
ORDER_PARAMS = {
    "pre_ln": {"final_layernorm": "bert.encoder.ln"},
    "post_ln": {"embedding_layernorm": "bert.embeddings.LayerNorm"},
}
# Per layer (under layers.N. and bert.encoder.layer.N.).
LAYER_PARAMS = {
    "attention.proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
LAYER_NORMS = {
    "pre_ln": {"ln1": "attention.ln", "ln2": "ln"},
    "post_ln": {"ln1": "attention.output.LayerNorm", "ln2": "output.LayerNorm"},
}
QKV = ("query", "key", "value")
VOCAB_ROWS = ("embedding.weight", "lm_bias")  # padded in ours, exactly the vocabulary in HF's
# HF tensors that are no weights of their own: buffers, and the decoder tied to others.
BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}


def param_names(num_layers: int, block_order: str) -> dict[str, str]:
    """Our parameter -> HF's, for every tensor but the QKV."""
    names = dict(OTHER_PARAMS)
    for ours, theirs in ORDER_PARAMS[block_order].items():
        names |= {f"{ours}.{p}": f"{theirs}.{p}" for p in ("weight", "bias")}
    per_layer = LAYER_PARAMS | LAYER_NORMS[block_order]
    for i in range(num_layers):
        for ours, theirs in per_layer.items():
            for p in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{p}"] = f"bert.encoder.layer.{i}.{theirs}.{p}"
    return names


def to_hf_state(weights: dict[str, torch.Tensor], m: dict, vocab: int) -> dict[str, torch.Tensor]:
    """Our weights (global names, padded vocabulary) -> HF *ForPreTraining names and layouts;
    `m`: the checkpoint's [model] section."""
    out = {}
    for ours, theirs in param_names(m["num_layers"], m["block_order"]).items():
        t = weights[ours]
        out[theirs] = t[:vocab] if ours in VOCAB_ROWS else t
    for i in range(m["num_layers"]):
        for p in ("weight", "bias"):
            t = qkv_to_hf(weights[f"layers.{i}.attention.qkv.{p}"], m["num_attention_heads"])
            for name, part in zip(QKV, t.chunk(3), strict=True):
                out[f"bert.encoder.layer.{i}.attention.self.{name}.{p}"] = part
    return {n: t.contiguous() for n, t in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], c: dict, block_order: str, padded_vocab: int):
    """HF tensors (as `read_bert_weights` names them) -> our weights, vocabulary padded."""
    out = {}
    for ours, theirs in param_names(c["num_hidden_layers"], block_order).items():
        t = hf[theirs]
        if ours in VOCAB_ROWS:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        out[ours] = t.contiguous()
    for i in range(c["num_hidden_layers"]):
        for p in ("weight", "bias"):
            parts = [hf[f"bert.encoder.layer.{i}.attention.self.{n}.{p}"] for n in QKV]
            qkv = qkv_from_hf(torch.cat(parts), c["num_attention_heads"])
            out[f"layers.{i}.attention.qkv.{p}"] = qkv.contiguous()
    return out


def hf_shapes(c: dict, block_order: str) -> dict[str, tuple]:
    """The HF tensor shapes config.json `c` describes."""
    h, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    ours = {
        "embedding.weight": (v, h), "position_embedding.weight": (c["max_position_embeddings"], h),
        "tokentype_embedding.weight": (c["type_vocab_size"], h),
        "lm_dense.weight": (h, h), "lm_dense.bias": (h,), "lm_bias": (v,),
        "lm_layernorm.weight": (h,), "lm_layernorm.bias": (h,),
        "pooler.weight": (h, h), "pooler.bias": (h,),
        "sop_head.weight": (2, h), "sop_head.bias": (2,),
    }  # fmt: skip
    for name in ORDER_PARAMS[block_order]:
        ours |= {f"{name}.weight": (h,), f"{name}.bias": (h,)}
    per_layer = {
        "ln1.weight": (h,), "ln1.bias": (h,), "ln2.weight": (h,), "ln2.bias": (h,),
        "attention.proj.weight": (h, h), "attention.proj.bias": (h,),
        "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,),
        "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,),
    }  # fmt: skip
    for i in range(n):
        ours |= {f"layers.{i}.{k}": s for k, s in per_layer.items()}
    shapes = {theirs: ours[name] for name, theirs in param_names(n, block_order).items()}
    for i in range(n):
        for name in QKV:
            prefix = f"bert.encoder.layer.{i}.attention.self.{name}"
            shapes |= {f"{prefix}.weight": (h, h), f"{prefix}.bias": (h,)}
    return shapes


# --- export -------------------------------------------------------------------------------


def _wordpiece_files(tokenizer_file: Path, vocab: int, meta_file: Path) -> tuple[list, dict]:
    """(the tokens in id order, for vocab.txt; BertTokenizer's settings) of our WordPiece
    tokenizer.json."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer_file.read_text())
    model = spec.get("model") or {}
    if model.get("type") != "WordPiece":
        raise CheckpointError(
            f"{tokenizer_file}: model.type is {model.get('type')!r}; a BERT export needs a "
            "WordPiece tokenizer (its vocab.txt is what BertTokenizer reads)"
        )
    normalizer = spec.get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer":
        raise CheckpointError(
            f"{tokenizer_file}: normalizer is {normalizer.get('type')!r}; a BERT export needs "
            "BertNormalizer (BertTokenizer's settings are read from it)"
        )
    tok = Tokenizer.from_file(str(tokenizer_file))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if sorted(by_id) != list(range(vocab)):
        raise CheckpointError(
            f"{tokenizer_file}: its ids are not 0..{vocab - 1} (vocab_size of {meta_file}), "
            "so no vocab.txt can list them in order"
        )
    unk = model.get("unk_token", UNK_TOKEN)
    missing = [t for t in dict.fromkeys((*BERT_TOKENS, unk)) if tok.token_to_id(t) is None]
    bad = [by_id[i] for i in range(vocab) if "\n" in by_id[i] or "\r" in by_id[i]]
    if missing or bad:
        raise CheckpointError(
            f"{tokenizer_file}: "
            + (f"the vocabulary has no {missing} token; " if missing else "")
            + (f"tokens {bad[:3]} hold a line break, which vocab.txt cannot; " if bad else "")
            + "BERT's tokenizer needs [PAD], [UNK], [CLS], [SEP] and [MASK]"
        )
    settings = {
        "do_lower_case": bool(normalizer.get("lowercase", True)),
        "strip_accents": normalizer.get("strip_accents"),
        "tokenize_chinese_chars": bool(normalizer.get("handle_chinese_chars", True)),
        "unk_token": unk,
        **{f"{name}_token": token for name, token in SPECIAL_TOKENS.items()},
    }
    return [by_id[i] for i in range(vocab)], settings


def export_bert(
    meta: dict,
    state: dict[str, torch.Tensor],
    tokenizer_file: Path,
    out,
    dtype: str = "float32",
    max_shard_size=None,
) -> Path:
    """Write the BERT of a checkpoint (meta.json, whole weights, its tokenizer.json) as a
    Hugging Face directory `out` that `MegatronBertForPreTraining` (block_order "pre_ln") or
    `BertForPreTraining` ("post_ln") and `AutoTokenizer` load."""
    import transformers

    torch_dtype = dtype_of(dtype)
    tokenizer_file = Path(tokenizer_file)
    meta_file = tokenizer_file.parent / "meta.json"
    tok_info = meta.get("tokenizer") or {}
    if tok_info.get("kind") != TOKENIZER_KIND:
        raise CheckpointError(
            f"{meta_file}: tokenizer {tok_info}: expected kind {TOKENIZER_KIND!r} for a BERT"
        )
    m = run_model_config(meta)
    # The switches BERT's classes compute; the MLM decoder is always tied to the embeddings.
    switches = {"normalization": "layernorm", "position_embedding_type": "learned_absolute",
                "swiglu": False, "add_bias_linear": True,
                "untie_embeddings_and_output_weights": False,
                "num_query_groups": m["num_attention_heads"]}  # fmt: skip
    refuse_switches(meta_file, m, "BERT", switches)
    order, vocab = m["block_order"], int(meta["vocab_size"])
    tokens, settings = _wordpiece_files(tokenizer_file, vocab, meta_file)
    fields = {
        "vocab_size": vocab,
        "hidden_size": m["hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "intermediate_size": m["ffn_hidden_size"],
        "hidden_act": "gelu",  # the exact (erf) GeLU, as ours
        "hidden_dropout_prob": m["hidden_dropout"],
        "attention_probs_dropout_prob": m["attention_dropout"],
        "max_position_embeddings": m["max_position_embeddings"],
        "type_vocab_size": int(state["tokentype_embedding.weight"].shape[0]),
        "initializer_range": m["init_method_std"],
        "layer_norm_eps": m["layernorm_epsilon"],
        "pad_token_id": tokens.index(SPECIAL_TOKENS["pad"]),
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
        "architectures": [ARCHITECTURE[order]],
    }
    # transformers 5 names the weights' dtype `dtype`, 4.x `torch_dtype`.
    fields["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    config_class = transformers.MegatronBertConfig if order == "pre_ln" else transformers.BertConfig
    weights = to_hf_state(state, m, vocab)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config_class(**fields).save_pretrained(str(out))
    save_weights(weights, torch_dtype, out, max_shard_size)
    tok = transformers.BertTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        model_max_length=m["max_position_embeddings"],
        **settings,
    )
    tok.save_pretrained(str(out))
    # As GPT-2's export: our tokenizer.json byte for byte (its sha256 is the corpus's), and
    # vocab.txt in id order (which transformers 5 does not write, 4.x from the model only).
    (out / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (out / "vocab.txt").write_text("".join(t + "\n" for t in tokens))
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    # The name transformers 4.x (which picks BertTokenizerFast for it) and 5.x both resolve.
    config["tokenizer_class"] = "BertTokenizer"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return out


# --- import -------------------------------------------------------------------------------


def bert_model_type(config: dict) -> str | None:
    """ "bert" or "megatron-bert" for a BERT config.json (by model_type, else by its
    architectures), None for anything else."""
    model_type = config.get("model_type")
    if model_type is None:
        for name in config.get("architectures") or ():
            if name.startswith("MegatronBert"):
                return "megatron-bert"
            if name.startswith("Bert"):
                return "bert"
    return model_type if model_type in BLOCK_ORDER else None


def is_bert(hf_dir: Path) -> bool:
    """Whether `hf_dir`'s config.json describes a BERT (so `import_hf` hands it here)."""
    config_file = Path(hf_dir) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False  # import_hf's own checks name the file
    return isinstance(config, dict) and bert_model_type(config) is not None


def read_bert_config(hf_dir: Path) -> tuple[dict, str]:
    """(config.json with the defaults of its class filled in, our block order); refuses what
    our BERT cannot represent, naming the config field."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise HFFormatError(f"{config_file} does not exist: expected a Hugging Face BERT model")
    config = read_json(config_file)
    model_type = bert_model_type(config)
    if model_type is None:
        raise HFFormatError(
            f"{config_file}: model_type is {config.get('model_type')!r}, expected 'bert' or "
            "'megatron-bert'"
        )
    sizes = MEGATRON_BERT_SIZES if model_type == "megatron-bert" else {}
    config = {**BERT_DEFAULTS, **sizes, **config}
    for field, accepted in BERT_REQUIRED.items():
        if config.get(field) not in accepted:
            raise HFFormatError(
                f"{config_file}: {field} is {config.get(field)!r}, expected "
                f"{' or '.join(map(repr, accepted))}: not a BERT this import can represent"
            )
    if config["hidden_size"] % config["num_attention_heads"]:
        raise HFFormatError(
            f"{config_file}: hidden_size ({config['hidden_size']}) is not divisible by "
            f"num_attention_heads ({config['num_attention_heads']})"
        )
    return config, BLOCK_ORDER[model_type]


def _from_vocab_txt(vocab: Path, hf_dir: Path) -> bytes:
    """tokenizer.json built from a WordPiece vocab.txt as megadata builds a bert-wordpiece
    corpus's (BertNormalizer, BertPreTokenizer, WordPiece decoder, [CLS] A [SEP] B [SEP]),
    lowercasing as HF_DIR's tokenizer_config.json says (do_lower_case, default true)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    settings_file = hf_dir / "tokenizer_config.json"
    settings = read_json(settings_file) if settings_file.is_file() else {}
    tok = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.BertNormalizer(
        lowercase=bool(settings.get("do_lower_case", True)),
        strip_accents=settings.get("strip_accents"),
        handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = tok.token_to_id(SPECIAL_TOKENS["cls"]), tok.token_to_id(SPECIAL_TOKENS["sep"])
    if cls is None or sep is None:
        raise HFFormatError(f"{vocab}: the vocabulary has no [CLS] or no [SEP] token")
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return tok.to_str().encode()


def read_bert_tokenizer(hf_dir: Path, tokenizer_file: Path | None = None) -> tuple[bytes, Path]:
    """(the tokenizer.json bytes to keep with the imported checkpoint, where they came from).

    `tokenizer_file` wins: a tokenizer.json kept as is (e.g. the corpus's), or a vocab.txt
    built into one (`_from_vocab_txt`).  Else HF_DIR's vocab.txt, built so; else its
    tokenizer.json as is.  It must be a WordPiece tokenizer."""
    if tokenizer_file is not None:
        source = Path(tokenizer_file)
        if not source.is_file():
            raise HFFormatError(f"tokenizer file {source} does not exist")
    elif (hf_dir / "vocab.txt").is_file():
        source = hf_dir / "vocab.txt"
    elif (hf_dir / "tokenizer.json").is_file():
        source = hf_dir / "tokenizer.json"
    else:
        raise HFFormatError(
            f"{hf_dir}: no tokenizer; expected vocab.txt or tokenizer.json (or pass either)"
        )
    if source.suffix == ".txt":
        return _from_vocab_txt(source, hf_dir), source
    data = source.read_bytes()
    try:
        kind = (json.loads(data).get("model") or {}).get("type")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{source}: not a tokenizer.json ({e})") from e
    if kind != "WordPiece":
        raise HFFormatError(f"{source}: model.type is {kind!r}; a BERT needs a WordPiece tokenizer")
    return data, source


def read_bert_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of `hf_dir` (`hf.read_hf_weights`), old names made current (LayerNorm
    gamma / beta), buffers dropped, and the tied decoder checked against what it ties to."""
    tensors = {}
    for name, t in read_hf_weights(hf_dir).items():
        if name.endswith(".gamma") or name.endswith(".beta"):  # TF-converted checkpoints
            name = name.rsplit(".", 1)[0] + (".weight" if name.endswith("gamma") else ".bias")
        if name not in BUFFERS:
            tensors[name] = t
    for tied, to in TIED.items():
        if tied in tensors:
            t = tensors.pop(tied)
            if to in tensors and not torch.equal(t, tensors[to]):
                raise HFFormatError(
                    f"{hf_dir}: {tied} differs from {to}; our BERT's decoder is tied to it"
                )
    return tensors


def _check_weights(tensors: dict, expected: dict[str, tuple], hf_dir: Path, config: dict):
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        heads = [n for n in missing if n.startswith(("cls.", "bert.pooler."))]
        raise HFFormatError(
            f"{hf_dir}: the weights are not those of the BERT its config.json describes "
            f"(architectures {config.get('architectures')})"
            + (f"; missing {missing[:5]}" if missing else "")
            + (f"; unexpected {extra[:5]}" if extra else "")
            + (
                "; our BERT needs the pre-training heads (masked LM, pooler and the NSP head "
                "it takes for sentence order): import a BertForPreTraining or "
                "MegatronBertForPreTraining"
                if heads
                else ""
            )
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HFFormatError(
                f"{hf_dir}: {name} has shape {tuple(tensors[name].shape)}, config.json says {shape}"
            )


def import_bert(
    hf_dir: str | Path, out_ckpt: str | Path, tokenizer_file: str | Path | None = None, **kw
) -> Path:
    """Write the BertForPreTraining (as block_order "post_ln") or MegatronBertForPreTraining
    ("pre_ln") of `hf_dir` as a megatrain checkpoint (iteration 0, weights only, model.kind
    "bert") under `out_ckpt`; returns the iteration directory.  `kw`: `write_imported`'s dtype
    and progress (a BERT is read whole: it is small)."""
    from tokenizers import Tokenizer

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HFFormatError(f"{hf_dir} is not a directory: expected a Hugging Face BERT model")
    c, order = read_bert_config(hf_dir)
    tokenizer_bytes, source = read_bert_tokenizer(hf_dir, tokenizer_file)
    tok = Tokenizer.from_str(tokenizer_bytes.decode())
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != c["vocab_size"]:
        raise HFFormatError(
            f"{hf_dir / 'config.json'}: vocab_size is {c['vocab_size']}, but the tokenizer "
            f"({source}) has {vocab} tokens; our vocabulary is the tokenizer's"
        )
    missing = [t for t in BERT_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise HFFormatError(
            f"{source}: the vocabulary has no {', '.join(missing)}, which our BERT's data needs"
        )
    tensors = read_bert_weights(hf_dir)
    _check_weights(tensors, hf_shapes(c, order), hf_dir, c)
    config = Config(name=hf_dir.name)
    m = config.model
    m.kind, m.block_order = "bert", order
    m.num_layers, m.hidden_size = c["num_hidden_layers"], c["hidden_size"]
    m.num_attention_heads, m.ffn_hidden_size = c["num_attention_heads"], c["intermediate_size"]
    m.max_position_embeddings, m.vocab_size = c["max_position_embeddings"], vocab
    m.hidden_dropout = float(c["hidden_dropout_prob"])
    m.attention_dropout = float(c["attention_probs_dropout_prob"])
    m.init_method_std, m.layernorm_epsilon = c["initializer_range"], c["layer_norm_eps"]
    padded = checked_padding(config, hf_dir)
    weights = from_hf_state(tensors, c, order, padded)
    # A BERT corpus ends its documents with [SEP].
    eod_id = tok.token_to_id(SPECIAL_TOKENS["sep"])
    imported = {"hf_dir": str(hf_dir.resolve()), "architecture": ARCHITECTURE[order]}
    return write_imported(out_ckpt, config, weights, tokenizer_bytes, eod_id, imported, **kw)


__all__ = [
    "export_bert",
    "from_hf_state",
    "hf_shapes",
    "import_bert",
    "is_bert",
    "param_names",
    "read_bert_config",
    "read_bert_tokenizer",
    "read_bert_weights",
    "to_hf_state",
]
