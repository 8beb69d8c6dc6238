"""What the Hugging Face conversions of every model kind share: the error, the QKV row order,
reading and writing weight files (safetensors; `torch.load(weights_only=True)` for old
.bin files), and writing an imported model as a megatrain checkpoint.
"""

import hashlib
import json
from pathlib import Path

import torch

from megacore.tensor_parallel import vocab_size_with_padding
from megatrain.checkpoint.convert import Streamed, write_checkpoint
from megatrain.checkpoint.files import MODEL_FIELDS, CheckpointError
from megatrain.config import KIND_DEFAULTS, MODEL_SWITCHES, Config, ConfigError, validate
from megatrain.data.corpus import TOKENIZER_KINDS


class HFFormatError(ValueError):
    """A Hugging Face directory that is not a GPT-2 we can import; names the file and field."""


def read_json(path: Path) -> dict:
    """A JSON file of an HF directory; invalid JSON is refused naming the file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{path}: not valid JSON ({e})") from e


def qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (of a weight [3h, h] or a bias [3h]) from per head [q k v] to [q all; k all; v all]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `qkv_to_hf`."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def run_model_config(meta: dict) -> dict:
    """The [model] section a checkpoint was trained with (defaults where meta has none), as
    the model was built from it: each unset switch (None) is the kind's (KIND_DEFAULTS), an
    unset ffn_hidden_size 4 x hidden_size and unset num_query_groups one per head, so every
    exported field says what the weights compute (a Llama trained from a config that leaves
    `untie_embeddings_and_output_weights` unset has an output layer of its own, and its export
    must not say it is tied)."""
    section = dict(Config().model.__dict__)
    section.update((meta.get("config") or {}).get("model") or {})
    section.update(meta["model"])
    defaults = KIND_DEFAULTS[section["kind"]]
    for name, default in zip(MODEL_SWITCHES, defaults, strict=True):
        if section.get(name) is None:
            section[name] = default
    section["ffn_hidden_size"] = section["ffn_hidden_size"] or 4 * section["hidden_size"]
    section["num_query_groups"] = section["num_query_groups"] or section["num_attention_heads"]
    return section


def refuse_switches(meta_file: Path, m: dict, family: str, required: dict) -> None:
    """Refuse, naming the [model] field, a resolved switch of `m` (run_model_config) that the
    Hugging Face `family` cannot represent; `required`: field -> the value it must have."""
    for name, value in required.items():
        if m.get(name) != value:
            raise CheckpointError(
                f"{meta_file}: model.{name} is {m.get(name)!r}; a {family} export needs "
                f"{value!r} (the Hugging Face model has no such switch)"
            )


def layer_is_moe(m: dict) -> list[bool]:
    """Which layers of resolved [model] section `m` are MoE layers (`moe_layer_freq` N: every
    N-th from the first; a list: its 1s)."""
    freq, n = m["moe_layer_freq"], m["num_layers"]
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    return [bool(x) for x in freq]


def write_hf_tokenizer(
    tokenizer_file: Path, out: Path, bos: str, eos: str, unk: str | None, max_length: int
) -> None:
    """tokenizer_config.json and friends for `AutoTokenizer`, around our tokenizer.json."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        model_max_length=max_length,
    )
    tok.save_pretrained(str(out))
    # save_pretrained re-serialises tokenizer.json (a no-op post-processor added); keep ours,
    # byte for byte, so its sha256 still matches the corpora it tokenized.
    (out / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    # The class name transformers 4.x and 5.x both resolve (5.x writes one 4.x lacks).
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors / pytorch_model.bin (sharded or not), named without
    "transformer.", the tied lm_head and the attention-mask buffers of old files left out."""
    from safetensors.torch import load_file

    def load_bin(path: Path) -> dict:
        return torch.load(path, map_location="cpu", weights_only=True)

    for index_name, load in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", load_bin),
    ):
        index = hf_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [(hf_dir / shard, load) for shard in shards]
            break
    else:
        files = [
            (hf_dir / name, load)
            for name, load in (("model.safetensors", load_file), ("pytorch_model.bin", load_bin))
            if (hf_dir / name).is_file()
        ][:1]
    if not files:
        raise HFFormatError(
            f"{hf_dir}: no weights; expected model.safetensors or pytorch_model.bin "
            "(or their .index.json for sharded files)"
        )
    tensors = {}
    for path, load in files:
        try:
            loaded = load(str(path))
        except Exception as e:  # safetensors or unpickling errors, by file kind
            raise HFFormatError(f"{path}: cannot be read as a file of tensors ({e})") from e
        for name, t in loaded.items():
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # tied to wte; causal-mask buffers of older files
            tensors[name] = t
    return tensors


def checked_padding(config: Config, hf_dir: Path) -> int:
    """Validate an imported model's run config (refused naming config.json); its padded
    vocabulary at tp 1.  Sets the sequence length to what the positions allow."""
    m = config.model
    config.training.seq_length = min(config.training.seq_length, m.max_position_embeddings)
    try:
        validate(config)
    except ConfigError as e:
        raise HFFormatError(f"{hf_dir / 'config.json'}: {e}") from e
    return vocab_size_with_padding(m.vocab_size, 1, m.make_vocab_size_divisible_by)


def write_imported(
    out_ckpt,
    config: Config,
    weights: dict,
    tokenizer_bytes: bytes,
    eod_id: int,
    imported: dict,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """An imported model as a megatrain checkpoint of weights only (iteration 0, tp = pp = 1),
    which `megatrain run --load` fine-tunes from; returns the iteration directory.  `weights`:
    whole tensors (cast to `dtype` if given), or `checkpoint.convert.Streamed` ones read as
    they are written (made in their dtype)."""
    if dtype is not None:
        weights = {n: t if isinstance(t, Streamed) else t.to(dtype) for n, t in weights.items()}
    m = config.model
    vocab = m.vocab_size
    meta = {
        "iteration": 0,
        "model": {k: getattr(m, k) for k in MODEL_FIELDS},
        "padded_vocab_size": vocab_size_with_padding(vocab, 1, m.make_vocab_size_divisible_by),
        "vocab_size": vocab,
        "tokenizer": {
            "eod_id": eod_id,
            "file": "tokenizer.json",
            "kind": TOKENIZER_KINDS[m.kind],
            "sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
            "vocab_size": vocab,
        },
        "layout": {
            "world_size": None,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None,
            "data_parallel_size": None,
            "use_distributed_optimizer": None,
        },
        "config": config.to_dict(),
        "data": None,
        "optimizer": None,  # weights only: a run starts from them at iteration 0
        "dtype": str(weights["embedding.weight"].dtype).removeprefix("torch."),
        "imported_from": imported,
    }
    return write_checkpoint(out_ckpt, meta, weights, None, tokenizer_bytes, progress=progress)


def return_freed_tensors() -> None:
    """Have glibc's malloc give every block of 1 MB or more its own mapping, unmapped when
    freed, for the rest of this process (a conversion command's).  Its default raises that
    threshold to 32 MB once it sees such blocks freed, and then keeps freed tensors in a heap
    it cannot shrink past the ones still alive: a conversion that makes and frees tensors one
    after another grows by holes (measured: a 2 GB Mixtral's import held 0.67 GB above its
    start without this, 0.28 GB with it).  Not for training processes (mapping each large
    block costs its page faults again); elsewhere than glibc, nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
