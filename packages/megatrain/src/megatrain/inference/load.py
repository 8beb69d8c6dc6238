"""A checkpoint loaded to run forward only (generation, evaluation), at any tp / pp.

Every rank of the job calls `load_model` after `megacore.parallel_state` has its
groups; the checkpoint's layout does not matter (weights are stored by global
name and read as the slices this layout needs).  The tokenizer travels in the
checkpoint directory and is checked against the hash the training corpus had,
so a model is never run with another tokenizer's ids.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from megacommon.files import sha256_file
from megacore import parallel_state as ps
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.checkpoint.load import load_weights
from megatrain.config import Config
from megatrain.models import build_model_chunks
from megatrain.models import model_config as run_model_config
from megatrain.models.transformer_config import TransformerConfig
from megatrain.parallelize import parallelize_model


@dataclass
class LoadedModel:
    chunks: list  # this rank's pipeline chunks, in eval mode
    config: TransformerConfig
    meta: dict
    directory: Path  # the iteration directory
    tokenizer: "object"  # tokenizers.Tokenizer
    eod_id: int | None
    device: torch.device


def load_tokenizer(directory: Path, meta: dict):
    """The checkpoint's tokenizer.json, refused unless it is the one the model was trained with."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: the checkpoint {directory} has no tokenizer; copy the "
            "training corpus's tokenizer.json there"
        )
    info = meta.get("tokenizer") or {}
    expected = info.get("sha256")
    actual = sha256_file(path)
    if expected and actual != expected:
        raise CheckpointError(
            f"{path} does not match the checkpoint: sha256 {actual}, but the model was trained "
            f"with tokenizer sha256 {expected} ({directory / 'meta.json'})"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path} is not a Hugging Face tokenizers file: {e}") from e
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != meta["vocab_size"]:
        raise CheckpointError(
            f"{path} has {size} tokens, the model in {directory} was trained with "
            f"{meta['vocab_size']}"
        )
    return tokenizer


def model_kind(meta: dict) -> str:
    """ "gpt", "bert" or "llama": the model.kind of the checkpoint's run config (GPT before
    BERT was)."""
    return ((meta.get("config") or {}).get("model") or {}).get("kind", "gpt")


def require_kind(meta: dict, kind: str | tuple[str, ...], what: str, where) -> None:
    """Refuse a checkpoint of another model kind (or of none of `kind`'s) for `what` (e.g.
    "generation")."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    found = model_kind(meta)
    if found not in kinds:
        raise CheckpointError(
            f"{where}: holds a {found.upper()} model (model.kind = {found!r}); {what} needs a "
            f"{' or '.join(k.upper() for k in kinds)} checkpoint"
        )


def forward_pipeline_layout(num_layers: int, pp: int, mtp_num_layers: int | None) -> str | None:
    """The layers of a forward pass's `pp` stages: None (the even split) where pp divides
    them, else the first num_layers % pp stages take a layer more than the rest (the last,
    which also holds the output layer, fewer), as a pipeline layout string: DeepSeek-V3's
    61 layers at pp 8 are 8, 8, 8, 8, 8, 7, 7, 7."""
    if pp == 1 or num_layers % pp == 0:
        return None
    each, more = divmod(num_layers, pp)
    stages = [each + (stage < more) for stage in range(pp)]
    text = "|".join(f"t*{n}" if n else "" for n in stages)
    return f"E{text}{'m' * (mtp_num_layers or 0)}L"


def _forward_stages(config: Config) -> None:
    """`config`'s stages for a forward pass at its pp: the saved virtual stages and layout are
    the training run's (its pp x vpp), so the layers split over this pp instead."""
    p, m = config.parallel, config.model
    p.virtual_pipeline_model_parallel_size = None
    p.pipeline_model_parallel_layout = forward_pipeline_layout(
        m.num_layers, p.pipeline_model_parallel_size, m.mtp_num_layers
    )


def checkpoint_model_config(meta: dict) -> TransformerConfig:
    """The checkpoint's model at this process's layout, for forward passes only."""

    config = Config.from_dict(meta["config"])
    config.parallel.tensor_model_parallel_size = ps.get_tensor_model_parallel_world_size()
    config.parallel.pipeline_model_parallel_size = ps.get_pipeline_model_parallel_world_size()
    _forward_stages(config)  # as `check_layout` checked them
    config.parallel.sequence_parallel = config.parallel.tp_comm_overlap = False
    config.model.recompute = "none"
    return run_model_config(config, meta["vocab_size"])


def load_model(
    ckpt: str | Path,
    device: torch.device,
    dtype=torch.float32,
    kind: str | tuple[str, ...] | None = None,
) -> LoadedModel:
    """This rank's part of the checkpoint's model (GPT, BERT or Llama, as its config says), in
    eval mode (every rank calls it); `kind` refuses a checkpoint of another model kind."""
    directory = find_checkpoint(ckpt)
    meta = read_meta(directory)
    if kind is not None:
        kinds = (kind,) if isinstance(kind, str) else kind
        require_kind(meta, kinds, f"a {' or '.join(k.upper() for k in kinds)} model", directory)
    tokenizer = load_tokenizer(directory, meta)
    cfg = checkpoint_model_config(meta)
    # Built on `device` in `dtype` without drawing weights (the checkpoint fills every
    # parameter); loading casts the saved tensors to `dtype`, rounding them as `.to(dtype)`
    # would.
    chunks = build_model_chunks(model_kind(meta), cfg, device=device, dtype=dtype, initialize=False)
    chunks = parallelize_model(chunks)  # the experts' place, which the checkpoint is read by
    load_weights(chunks, directory, device)
    for c in chunks:
        c.eval()
    return LoadedModel(
        chunks=chunks,
        config=cfg,
        meta=meta,
        directory=directory,
        tokenizer=tokenizer,
        eod_id=(meta.get("tokenizer") or {}).get("eod_id"),
        device=device,
    )


def check_layout(meta: dict, tp: int, pp: int, where: Path) -> Config:
    """The checkpoint's run config at tensor-parallel `tp` and pipeline-parallel `pp`, refused
    (naming the field) when the model cannot be split so: megatrain.config's own checks
    (heads and ffn divisible; vocabulary padding follows tp; the layers split over pp as
    `forward_pipeline_layout` splits them, so at most one a stage more).  Checked before any
    worker starts."""
    from megatrain.config import ConfigError, validate

    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{where / 'meta.json'} has no run config to check a layout against")
    config = Config.from_dict(meta["config"])
    p = config.parallel
    if pp > config.model.num_layers:
        raise CheckpointError(
            f"{where}: cannot be split to --tp {tp} --pp {pp}: the model has "
            f"{config.model.num_layers} transformer layers, fewer than the pipeline stages; use "
            f"--pp {config.model.num_layers} or fewer"
        )
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    # The saved interleaving, stage layout (its pp x vpp stages), dp and cp belong to the old
    # layout; a run at the new one sets its own (context parallelism splits sequences, not the
    # model), and here the layers split over `pp` as forward passes split them.
    _forward_stages(config)
    p.data_parallel_size = None
    p.context_parallel_size = 1
    p.tp_comm_overlap = False  # a training overlap; forward passes run without it
    # Forward passes split experts over tp (expert tensor parallelism, no expert parallelism)
    # and have no gradients, so training's rule that MoE at tp > 1 needs sequence parallelism
    # (else each token's expert gradient counts once per TP rank) is not checked here: the TP
    # ranks' shared tokens each come back from the experts once.
    checked = copy.deepcopy(config)
    checked.parallel.expert_model_parallel_size = 1
    checked.parallel.expert_tensor_parallel_size = None
    checked.parallel.sequence_parallel |= config.model.num_moe_experts is not None
    try:
        validate(checked)
    except ConfigError as e:
        raise CheckpointError(f"{where}: cannot be split to --tp {tp} --pp {pp}: {e}") from e
    return config
