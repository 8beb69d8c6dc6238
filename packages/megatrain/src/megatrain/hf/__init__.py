"""Hugging Face conversions both ways (`megatrain export-hf`, `megatrain import-hf`): GPT-2
(`gpt2`), BERT (`bert`), Llama and Mistral (`llama`), Qwen2 and Qwen3 (`qwen`), Mixtral,
Qwen2-MoE and Qwen3-MoE (`moe`), gpt-oss (`gpt_oss`), DeepSeek-V2 and V3 (`deepseek`): the
decoder families over their shared base (`decoder`, the classes an export writes in
`families`), every kind over what all share (`common`).  The two functions here pick the model
kind; transformers is needed by export only."""

import json
from pathlib import Path

from megatrain.hf.common import HFFormatError


def export_hf(
    ckpt: str | Path,
    out: str | Path,
    dtype: str = "float32",
    progress: bool = True,
    max_shard_size="5GB",
    workers: int = 1,
):
    """Write the model of checkpoint `ckpt` as a Hugging Face directory `out`, its weights in
    safetensors shards of at most `max_shard_size` (transformers' syntax: "5GB", "500MB", bytes)
    with model.safetensors.index.json, or one model.safetensors: a GPT-2 (`gpt2.export_gpt2`),
    a BERT (model.kind "bert", `bert.export_bert`) or a Llama-kind model as the class its
    switches make (`llama.export_llama`: Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE;
    streamed, a tensor at a time, by `workers` processes when more than one; GPT-2 and BERT
    are read whole)."""
    from megatrain.checkpoint.convert import dtype_of
    from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
    from megatrain.checkpoint.load import read_full_state
    from megatrain.hf.shards import parse_shard_size
    from megatrain.inference.load import model_kind

    dtype_of(dtype)  # an unknown dtype or shard size is refused before anything is read
    parse_shard_size(max_shard_size)
    try:
        import safetensors  # noqa: F401  (save_weights uses it; refuse early without it)
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"megatrain export-hf needs transformers ({e}); pip install 'megatrain[hf]'"
        ) from e
    directory = find_checkpoint(ckpt)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(
            f"{tokenizer_file} does not exist: export needs the tokenizer the model was trained "
            "with (saved there from the corpus directory's tokenizer.json)"
        )
    meta = read_meta(directory)
    if model_kind(meta) == "llama":
        from megatrain.hf.llama import export_llama

        return export_llama(meta, directory, out, dtype, max_shard_size, progress, workers)
    meta, state = read_full_state(ckpt, progress=progress)
    if model_kind(meta) == "bert":
        from megatrain.hf.bert import export_bert

        return export_bert(meta, state, tokenizer_file, out, dtype, max_shard_size)
    from megatrain.hf.gpt2 import export_gpt2

    return export_gpt2(meta, state, tokenizer_file, out, dtype, max_shard_size)


# The config.json model_types import reads (BERT's and the Llama family's from their modules).
GPT2_TYPES = ("gpt2",)


def _llama_family_importers() -> dict:
    """model_type -> the importer of the Llama-like decoders (Llama and Mistral, Qwen2/3, and
    the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    from megatrain.hf import deepseek, gpt_oss, llama, moe, qwen

    return (
        {t: gpt_oss.import_gpt_oss for t in gpt_oss.MODEL_TYPES}
        | {t: llama.import_llama for t in llama.MODEL_TYPES}
        | {t: qwen.import_qwen for t in qwen.MODEL_TYPES}
        | {t: moe.import_moe for t in moe.MODEL_TYPES}
        | {t: deepseek.import_deepseek for t in deepseek.MODEL_TYPES}
    )


def read_model_types() -> tuple[str, ...]:
    """Every config.json model_type `import_hf` reads."""
    from megatrain.hf import bert

    return GPT2_TYPES + tuple(bert.BLOCK_ORDER) + tuple(_llama_family_importers())


def import_hf(
    hf_dir: str | Path,
    out_ckpt: str | Path,
    tokenizer_file: str | Path | None = None,
    dtype: str | None = None,
    progress: bool = False,
) -> Path:
    """Write the Hugging Face model of `hf_dir` as a megatrain checkpoint (iteration 0, weights
    only) under `out_ckpt`; returns the iteration directory.  config.json's model_type picks
    the reader: a BERT ("bert" or "megatron-bert") `bert.import_bert`, a Llama or Mistral
    `llama.import_llama`, a Qwen2 or Qwen3 `qwen.import_qwen`, a Mixtral, Qwen2-MoE or
    Qwen3-MoE `moe.import_moe`, a DeepSeek-V2 or V3 `deepseek.import_deepseek`, a GPT-2
    `gpt2.import_gpt2`;
    any other model_type is refused naming the ones read.  The weights keep the files' dtype
    unless `dtype` ("float32", "bfloat16", "float16") says another; the Llama family is
    streamed, a tensor (or an expert) at a time."""
    from megatrain.checkpoint.convert import dtype_of
    from megatrain.hf import bert, gpt2

    kw = {"dtype": dtype_of(dtype) if dtype else None, "progress": progress}
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HFFormatError(
            f"{hf_dir} is not a directory: expected a Hugging Face model "
            f"(model_type one of {', '.join(read_model_types())})"
        )
    if bert.is_bert(hf_dir):
        return bert.import_bert(hf_dir, out_ckpt, tokenizer_file, **kw)
    model_type = _model_type(hf_dir)
    importers = _llama_family_importers()
    if model_type in importers:
        return importers[model_type](hf_dir, out_ckpt, tokenizer_file, **kw)
    if model_type is not None and model_type not in GPT2_TYPES:
        from megatrain.hf.moe import UNREPRESENTED

        fields = json.loads((hf_dir / "config.json").read_text())
        named = [f for f in UNREPRESENTED if fields.get(f) is not None]  # DeepSeek's, say
        raise HFFormatError(
            f"{hf_dir / 'config.json'}: model_type is {model_type!r}"
            + (f" (with {', '.join(named)}: not supported)" if named else "")
            + f"; megatrain import-hf reads {', '.join(read_model_types())}"
        )
    # GPT-2, or a config.json that is missing, unreadable or without model_type: the GPT-2
    # reader names what is wrong with it.
    return gpt2.import_gpt2(hf_dir, out_ckpt, tokenizer_file, **kw)


def _model_type(hf_dir: Path) -> str | None:
    try:
        model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # the importer it goes to names what is wrong with config.json
    return model_type if isinstance(model_type, str) else None


__all__ = ["HFFormatError", "export_hf", "import_hf", "read_model_types"]
