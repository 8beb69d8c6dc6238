"""A checkpoint directory's files, read without torch: which iteration `latest` names, its
meta.json, and whether every file it lists is whole.  Tools that only need to know what a
checkpoint holds (is a run finished? are cached results still valid?) ask here, in a
fraction of a second, before anything imports torch (`checkpoint.save` and `checkpoint.load`
write and load the tensors).

```
<ckpt>/latest                      the newest complete iteration, e.g. "iter_0000200"
<ckpt>/iter_0000200/meta.json      iteration, run and model config, layout, tokenizer, data
                                   position, Adam step, loss scaler, sizes of every file below
<ckpt>/iter_0000200/model/         torch.distributed.checkpoint: weights by global name
<ckpt>/iter_0000200/optimizer/     the same for the fp32 masters and Adam moments
<ckpt>/iter_0000200/rng/rank-N.pt  each rank's generator states (tensors only)
<ckpt>/iter_0000200/tokenizer.json the corpus tokenizer
```
"""

import contextlib
import json
import os
from pathlib import Path

FORMAT_VERSION = 1
LATEST = "latest"
# Fields that make two models different: a checkpoint of another shape is refused with them.
MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "max_position_embeddings",
)


OPTIMIZER_STATES = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message names the file and what differs."""


def iteration_dir(ckpt: Path, iteration: int) -> Path:
    return Path(ckpt) / f"iter_{iteration:07d}"


def find_checkpoint(ckpt: str | Path) -> Path:
    """The iteration directory `latest` names, checked: exists, complete, no file truncated."""
    ckpt = Path(ckpt)
    latest = ckpt / LATEST
    if not latest.is_file():
        found = sorted(p.name for p in ckpt.glob("iter_*")) if ckpt.is_dir() else []
        raise CheckpointError(
            f"{latest} does not exist: {ckpt} is not a megatrain checkpoint directory or no save "
            "finished" + (f" (iteration directories there: {', '.join(found)})" if found else "")
        )
    name = latest.read_text().strip()
    directory = ckpt / name
    meta_file = directory / "meta.json"
    if not meta_file.is_file() and (ckpt / f".old-{name}" / "meta.json").is_file():
        # Killed between `publish`'s two renames of a re-saved iteration: the old copy stands.
        with contextlib.suppress(OSError):  # another rank may have moved it back already
            os.replace(ckpt / f".old-{name}", directory)
    if not name.startswith("iter_") or not meta_file.is_file():
        raise CheckpointError(
            f"{latest} names {name!r}, but {meta_file} does not exist: the checkpoint was moved "
            "or deleted; point `latest` at an existing iter_* directory"
        )
    meta = read_meta(directory)
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{meta_file} has no file list: not written by megatrain's save")
    for rel, size in meta["files"].items():
        f = directory / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing (listed in {meta_file})")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {f} has {f.stat().st_size} bytes, {size} when saved: "
                "truncated or overwritten"
            )
    return directory


def read_meta(directory: Path) -> dict:
    meta_file = directory / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file} cannot be read as JSON: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_file}: format_version {meta.get('format_version')}, "
            f"this megatrain reads {FORMAT_VERSION}"
        )
    check_config_known(meta, meta_file)
    return meta


def check_config_known(meta: dict, meta_file: Path) -> None:
    """Refuse a run config holding a field this megatrain lacks (written by a newer one, or
    by an older one with a field since removed), naming the field and the version that wrote
    it (meta.json's "megatrain_version"), before any reader builds a model from it."""
    if not isinstance(meta.get("config"), dict):
        return
    from megatrain import __version__
    from megatrain.config.load import unknown_field

    field = unknown_field(meta["config"])
    if field is not None:
        writer = meta.get("megatrain_version")
        by = f"megatrain {writer}" if writer else "a megatrain that did not record its version"
        raise CheckpointError(
            f"{meta_file}: the run config holds {field}, which this megatrain ({__version__}) "
            f"does not have: the checkpoint was written by {by}; read it with that megatrain"
        )
