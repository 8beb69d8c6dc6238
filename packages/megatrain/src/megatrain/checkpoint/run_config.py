"""The run config a checkpoint carries (its meta.json "config"), as a run takes it: written
beside an imported model as `run.toml` (`megatrain import-hf`), which `megatrain run --config`
reads, and read straight from meta.json by `megatrain run --load DIR` without --config.

A model imported from Hugging Face names no corpus: a run of it must be given one built with
the model's own tokenizer (`check_corpus_named` refuses it otherwise, naming the field and
the file to set it in).  Torch-free, as `checkpoint.files`.
"""

import dataclasses
import json
import math
from pathlib import Path

from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.config import MOE_FIELDS, Config, ConfigError
from megatrain.config.load import apply_overrides, apply_sections

RUN_FILE = "run.toml"  # beside `latest` in the directory import-hf writes

# The fields run.toml always writes outside [model] (with any other whose value is not the
# default), each with what to know when editing it.
EDITED = {
    "parallel": {
        "tensor_model_parallel_size": "tp: heads and ffn split over this many ranks",
        "pipeline_model_parallel_size": "pp: layers split into this many stages",
    },
    "optimizer": {
        "lr": "peak learning rate (a fine-tune usually wants less than pretraining's)",
        "min_lr": None,
        "lr_decay_style": "cosine | linear | constant",
        "lr_warmup_iters": None,
        "weight_decay": None,
        "clip_grad": None,
    },
    "training": {
        "seq_length": "at most model.max_position_embeddings",
        "micro_batch_size": None,
        "global_batch_size": "a multiple of micro_batch_size x data-parallel size",
        "train_iters": None,
        "precision": "fp32 | bf16 | fp16 | fp8",
        "eval_interval": None,
        "eval_iters": None,
        "seed": None,
        "output_dir": "logs, TensorBoard events and the loss plot",
    },
    "data": {},
    "checkpoint": {"load": "the imported weights: the run starts from them at iteration 0"},
    "logging": {"log_interval": None},
}


def toml_value(value) -> str:
    """`value` (a config field's: bool, int, float, str or a list of them) as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def saved_config(directory: Path, meta: dict) -> Config:
    """The run config of the checkpoint `directory` (its meta.json `meta`), every field checked
    as a config file's (an unknown one refused naming meta.json), less where that run loaded
    and saved (--load and --save say where this one does) and with the shards' sha256 check
    on again (the launcher turns it off once it has checked them for its workers)."""
    meta_file = directory / "meta.json"
    saved = meta.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(f'{meta_file} holds no run config ("config"): give --config FILE')
    saved = dict(saved)
    name = saved.pop("name", None)
    config = Config()
    if isinstance(name, str):
        config.name = name
    apply_sections(config, saved, f'{meta_file} ("config")')
    config.checkpoint.load = config.checkpoint.save = None
    config.data.verify_sha256 = True
    return config


def checkpoint_config(ckpt: str | Path, overrides: list[str] = ()) -> Config:
    """The config of `megatrain run --load CKPT` without --config: the checkpoint's own
    (`saved_config`), then the `section.field=value` overrides."""
    try:
        directory = find_checkpoint(ckpt)
    except CheckpointError as e:
        raise ConfigError(
            f"--load {ckpt} without --config takes the run config from the checkpoint's "
            f"meta.json: {e}"
        ) from None
    config = saved_config(directory, read_meta(directory))
    apply_overrides(config, list(overrides))
    return config


def check_corpus_named(config: Config, config_file: str | Path | None) -> None:
    """Refuse a run that loads a model imported from Hugging Face and names no corpus
    (data.corpus and data.blend unset: the default corpus, of another tokenizer), naming
    the field and `config_file` (None: the config came from the checkpoint)."""
    d, load = config.data, config.checkpoint.load
    if d.corpus is not None or d.blend is not None:
        return
    if config.checkpoint.load_hf:
        tokenizer = Path(config.checkpoint.load_hf) / "tokenizer.json"
        raise ConfigError(
            f"checkpoint.load_hf (--load-hf) {config.checkpoint.load_hf} and the run names no "
            "corpus: pass data.corpus=DIR"
            + (f" (or set it in {config_file})" if config_file else "")
            + f", a corpus built with the model's own tokenizer ({tokenizer})"
        )
    if not load:
        return
    try:
        directory = find_checkpoint(load)
        imported = read_meta(directory).get("imported_from")
    except CheckpointError:
        return  # none yet, or a broken one, which the checks of the inputs name
    if not imported:
        return
    where = (
        f"set data.corpus (corpus in the [data] section of {config_file}), or pass data.corpus=DIR"
        if config_file
        else "pass data.corpus=DIR"
    )
    run_file = Path(load) / RUN_FILE
    recipe = f"; {run_file} shows the recipe's [tokenizer] section" if run_file.is_file() else ""
    raise ConfigError(
        f"{load} holds a model imported from Hugging Face ({imported.get('hf_dir')}) and the "
        f"run names no corpus: {where}, a corpus built with the model's own tokenizer "
        f"({directory / 'tokenizer.json'}{recipe})"
    )


def _tokenizer_lines(directory: Path, meta: dict) -> list[str]:
    """A megadata recipe's [tokenizer] section that tokenizes a corpus as this model reads it."""
    tok = meta.get("tokenizer") or {}
    lines = [f"kind = {toml_value(tok.get('kind', 'gpt2-bpe'))}",
             f"tokenizer_json = {toml_value(str((directory / 'tokenizer.json').resolve()))}",
             f"vocab_size = {tok.get('vocab_size')}"]  # fmt: skip
    if tok.get("kind") == "bert-wordpiece":
        return lines
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eod = vocab.id_to_token(tok["eod_id"]) if isinstance(tok.get("eod_id"), int) else None
    bos_id = (meta.get("imported_from") or {}).get("bos_token_id")
    bos = vocab.id_to_token(bos_id) if isinstance(bos_id, int) else None
    if eod is not None:
        lines.append(f"eod_token = {toml_value(eod)}   # ends each document")
    if bos is not None and bos != eod:
        lines.append(f"bos_token = {toml_value(bos)}   # starts each document")
    return lines


def _section_lines(config: Config, section: str, always, notes: dict) -> list[str]:
    values = getattr(config, section)
    defaults = type(values)()
    lines = [f"[{section}]"]
    for f in dataclasses.fields(values):
        value = getattr(values, f.name)
        if value is None or (f.name not in always and value == getattr(defaults, f.name)):
            continue
        note = notes.get(f.name)
        lines.append(f"{f.name} = {toml_value(value)}" + (f"   # {note}" if note else ""))
    return lines


def run_file_text(ckpt: Path, directory: Path, meta: dict) -> str:
    """run.toml of the imported checkpoint `ckpt` (`directory`: its iteration, `meta`: its
    meta.json): the checkpoint's run config, [model] whole, the other sections' fields to
    edit (and any not at its default), [data] to fill in, [checkpoint] load set to `ckpt`."""
    config = saved_config(directory, meta)
    config.checkpoint.load = str(ckpt.resolve())
    imported = meta.get("imported_from") or {}
    source = imported.get("hf_dir", "a Hugging Face model")
    model = config.model
    dense = model.num_moe_experts is None
    model_fields = [f.name for f in dataclasses.fields(model)]
    always = {"model": [n for n in model_fields if not (dense and n in MOE_FIELDS)]}
    header = [
        f"# The run config of the {model.kind} model `megatrain import-hf` wrote to",
        f"# {ckpt.resolve()} from {source}.",
        f"#   megatrain run --config {ckpt / RUN_FILE} [section.field=value ...]",
        "# fine-tunes it from those weights (iteration 0, a fresh optimizer); command-line",
        "# overrides apply on top as with any config, e.g. --save DIR to keep checkpoints.",
        "#",
        "# To edit before the first run:",
        "# - [data] corpus (required): a corpus built by megadata with this model's own",
        "#   tokenizer, i.e. a recipe whose [tokenizer] section is",
        *(f"#     {line}" for line in _tokenizer_lines(directory, meta)),
        "# - [training], [optimizer] and [parallel] to suit the fine-tune; the fields left",
        "#   out take their defaults (docs/training.md; megatrain/config/sections.py).",
        "# [model] is the imported model's, field for field: leave it (a checkpoint of another",
        "# shape is refused).",
    ]
    body = ["", *_section_lines(config, "model", always["model"], {})]
    for section, notes in EDITED.items():
        lines = _section_lines(config, section, notes, notes)
        if section == "data" and config.data.corpus is None and config.data.blend is None:
            lines.append('# corpus = "data/corpus/NAME"   # required: the corpus to fine-tune on')
        if section == "checkpoint":
            lines.append('# save = "DIR"   # where the fine-tune saves (--save DIR); unset: none')
        body += ["", *lines]
    return "\n".join(header + body) + "\n"


def write_run_file(ckpt: str | Path) -> Path:
    """Write `run_file_text` of the checkpoint `ckpt` (an import) as `ckpt`/run.toml."""
    ckpt = Path(ckpt)
    directory = find_checkpoint(ckpt)
    path = ckpt / RUN_FILE
    path.write_text(run_file_text(ckpt, directory, read_meta(directory)))
    return path
