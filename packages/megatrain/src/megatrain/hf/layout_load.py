"""`megatrain run --load-hf DIR`: a run starts from a Hugging Face Llama-family model's files at
its own tp x pp x ep x cp layout, no checkpoint written in between.  Each rank reads, with
`safe_open(...).get_slice`, only the boxes of HF's tensors its parameters and optimizer shards
hold (`decoder.decoder_map` says where they lie), through the same load as a checkpoint of
weights only (`checkpoint.load.start_from_weights`, here with `HFTensors` for the checkpoint's
`DCPTensors`); the bytes each rank read are counted and logged.
"""

import hashlib
from pathlib import Path

import torch.distributed as dist

from megatrain.checkpoint.files import MODEL_FIELDS, CheckpointError
from megatrain.config import Config
from megatrain.hf.common import HFFormatError
from megatrain.hf.decoder import (
    checked_headers,
    decoder_config,
    decoder_map,
    read_qwen_config,
)
from megatrain.hf.tensor_map import HFFiles, Target, hf_shapes_of, read_box


class HFTensors:
    """The tensors of a Hugging Face decoder's files as our global tensors (`shapes`: the word
    embeddings with the files' rows, no padding), read a box at a time: `read(pieces)` fills
    each (offsets, view) piece from the boxes of HF's tensors it meets (`bytes_read` counts
    them).  Not a collective: a rank without pieces reads nothing."""

    def __init__(self, hf_dir: Path, targets: dict[str, Target], files: HFFiles):
        self.where, self.targets, self.files = Path(hf_dir), targets, files
        self.shapes = {name: t.shape for name, t in targets.items()}

    def read(self, pieces: dict[str, list]) -> None:
        for name, chunks in pieces.items():
            for offsets, view in chunks:
                read_box(self.targets[name], self.files, offsets, tuple(view.shape), view)

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read


def decoder_fields_of(hf_dir: Path) -> tuple[dict, object]:
    """(config.json's fields as `decoder.decoder_map` reads them, the family's [model]
    configure) of a Llama, Mistral, Qwen2/3, Mixtral or Qwen-MoE; another model is refused."""
    from megatrain.hf import _model_type, deepseek, gpt_oss, llama, moe, qwen

    model_type = _model_type(hf_dir)
    if model_type in llama.MODEL_TYPES:
        return llama.read_hf_config(hf_dir), None
    if model_type in qwen.MODEL_TYPES:
        return read_qwen_config(hf_dir), None
    if model_type in moe.MODEL_TYPES:
        return moe.read_moe_files(hf_dir), moe.configure_moe
    if model_type in gpt_oss.MODEL_TYPES:
        return gpt_oss.read_gpt_oss_config(hf_dir), gpt_oss.configure_gpt_oss
    if model_type in deepseek.MODEL_TYPES:
        return deepseek.read_deepseek_files(hf_dir), deepseek.configure_deepseek
    families = (*llama.MODEL_TYPES, *qwen.MODEL_TYPES, *moe.MODEL_TYPES, *gpt_oss.MODEL_TYPES,
                *deepseek.MODEL_TYPES)  # fmt: skip
    raise HFFormatError(
        f"{hf_dir / 'config.json'}: model_type is {model_type!r}; --load-hf reads "
        f"{', '.join(families)} (a GPT-2 or BERT: `megatrain import-hf` it, then --load that)"
    )


def hf_run_config(hf_dir: str | Path) -> Config:
    """The run config of the HF model in `hf_dir`, as import-hf resolves it: what `megatrain run
    --load-hf DIR` trains without --config (its data and training from the overrides)."""
    hf_dir = Path(hf_dir)
    c, configure = decoder_fields_of(hf_dir)
    return decoder_config(hf_dir, c, configure)


def load_hf(run, hf_dir: str | Path) -> dict:
    """Start `run` from the weights of the HF model in `hf_dir` at its own layout (iteration 0,
    fresh Adam, as from a checkpoint of weights only): the model refused when it is not the
    run's, the tokenizer when it is not the corpus's; each rank reads only its boxes.  Returns
    a meta dict (iteration 0, `imported_from`, `bytes_read` per rank).  Every rank calls it."""
    from megatrain.checkpoint.load import check_model_matches, start_from_weights

    hf_dir = Path(hf_dir)
    c, configure = decoder_fields_of(hf_dir)
    config = decoder_config(hf_dir, c, configure)
    meta = {
        "iteration": 0,
        "model": {k: getattr(config.model, k) for k in MODEL_FIELDS},
        "vocab_size": config.model.vocab_size,
    }
    corpus = run.train_data.corpus
    check_model_matches(meta, run.model_config, corpus.vocab_size, hf_dir, "config.json")
    tokenizer = hf_dir / "tokenizer.json"
    here = (corpus.manifest.get("tokenizer") or {}).get("sha256")
    if tokenizer.is_file() and here is not None:
        theirs = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        if theirs != here:
            raise CheckpointError(
                f"{tokenizer} has sha256 {theirs}; the corpus {corpus.path} was tokenized with "
                f"{here}: build it with this tokenizer (megadata's tokenizer_json)"
            )
    targets = decoder_map(c, c["vocab"])
    headers = checked_headers(hf_dir, c, hf_shapes_of(targets))
    files = HFFiles(hf_dir, headers.where, quantized=headers.quantized)
    saved = HFTensors(hf_dir, targets, files)
    try:
        meta = start_from_weights(run, saved, meta, source=str(hf_dir))
    finally:
        files.close()
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, saved.bytes_read)
    total = headers.stored_bytes()
    if dist.get_rank() == 0:
        share = max(counts) / max(total, 1)
        print(
            f"megatrain: read {hf_dir} at this layout: bytes by rank {counts} of {total} in its "
            f"files (the most any rank read: {share:.0%} of them; masters and parameters both)",
            flush=True,
        )
    imported = {"hf_dir": str(hf_dir.resolve()), "bos_token_id": c["bos"],
                "model_type": c["model_type"]}  # fmt: skip
    return {**meta, "imported_from": imported, "bytes_read": counts, "bytes_in_files": total}


def check_hf_source(config: Config) -> None:
    """Refuse, before any worker starts, a `checkpoint.load_hf` that is not a Llama-family
    model whose files' headers match its config.json, or whose model is not the run's."""
    from megatrain.checkpoint.load import check_model_matches

    hf_dir = Path(config.checkpoint.load_hf)
    if not (hf_dir / "config.json").is_file():
        raise HFFormatError(
            f"checkpoint.load_hf (--load-hf) {hf_dir}: no config.json there; expected a Hugging "
            "Face model directory"
        )
    c, configure = decoder_fields_of(hf_dir)
    imported = decoder_config(hf_dir, c, configure)
    meta = {"model": {k: getattr(imported.model, k) for k in MODEL_FIELDS},
            "vocab_size": imported.model.vocab_size}  # fmt: skip
    vocab = config.model.vocab_size or imported.model.vocab_size  # unset: the corpus's
    check_model_matches(meta, config.model, vocab, hf_dir, "config.json")
    checked_headers(hf_dir, c, hf_shapes_of(decoder_map(c, c["vocab"])))
