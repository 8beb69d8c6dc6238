"""The corpus directory, the contract between megadata (which builds it) and megatrain (which
trains on it): one writer and one reader specification, with its version.

    <corpus>/manifest.json                written last: a corpus without it is incomplete
    <corpus>/tokenizer.json
    <corpus>/<split>/shard-NNNNN.arrow    Arrow IPC files, whole documents in order

A shard's columns: `doc_id` (string), `tokens` (list of `token_dtype`, each document ending
with the tokenizer's `eod_id`) and, in a corpus with `sentence_boundaries`, `sentence_ends`
(list<uint32>: the token offset after each sentence, the EOD excluded).  The manifest:

    format_version        FORMAT_VERSION
    tokenizer             {kind, file, sha256, vocab_size, eod_id}
    token_dtype           "uint16" or "uint32": the narrowest that holds the vocabulary
    sentence_boundaries   whether the shards carry `sentence_ends`
    splits                {split: {docs, tokens, shards: [{file, docs, tokens, sha256}]}}

and whatever its writer adds (megadata: the recipe, the split rule, each stage's row).
The shard stage of megadata, megatrain's test corpora and the benchmarks all write through
`write_shard` and `write_manifest`; megatrain's `open_corpus` reads through `read_manifest`
and `check_shard_schema`.
"""

from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import pyarrow.compute as pc

from megacommon.files import atomic_write_bytes, atomic_write_json, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "valid")
TOKEN_DTYPES = {"uint16": pa.uint16(), "uint32": pa.uint32()}
SENTENCE_ENDS_TYPE = pa.list_(pa.uint32())
# Rows per Arrow record batch: a reader maps a shard and walks it a batch at a time.
SHARD_BATCH_ROWS = 1024


def token_dtype(vocab_size: int) -> str:
    """The corpus' token type: the narrowest that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_schema(dtype: str = "uint16", sentence_ends: bool = False) -> pa.Schema:
    columns = [("doc_id", pa.string()), ("tokens", pa.list_(TOKEN_DTYPES[dtype]))]
    if sentence_ends:
        columns.append(("sentence_ends", SENTENCE_ENDS_TYPE))
    return pa.schema(columns)


def shard_file(split: str, index: int) -> str:
    """A shard's path relative to the corpus directory, as the manifest lists it."""
    return f"{split}/shard-{index:05d}.arrow"


def write_shard(path: str | Path, table: pa.Table, batch_rows: int = SHARD_BATCH_ROWS) -> dict:
    """`table` as one shard at `path`, complete or not at all, in record batches of
    `batch_rows`: its manifest entry less the file name ({docs, tokens, sha256})."""
    path = Path(path)
    check_shard_schema(table.schema, path)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    tokens = pc.sum(pc.list_value_length(table.column("tokens"))).as_py() or 0
    return {"docs": table.num_rows, "tokens": tokens, "sha256": sha256_file(path)}


def split_entry(shards: list[dict]) -> dict:
    """A split of the manifest from its shards' entries ({file, docs, tokens, sha256})."""
    return {
        "docs": sum(s["docs"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
    }


def write_manifest(
    corpus: str | Path,
    *,
    tokenizer: dict,
    token_dtype: str,
    sentence_boundaries: bool,
    splits: dict[str, list[dict]],
    **extra,
) -> Path:
    """manifest.json, atomically: the last file of a corpus.  `splits` maps each split to
    its shards' entries; `extra` adds (or, for a test's broken corpus, replaces) fields."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "token_dtype": token_dtype,
        "sentence_boundaries": sentence_boundaries,
        "splits": {split: split_entry(shards) for split, shards in splits.items()},
        **extra,
    }
    path = Path(corpus) / MANIFEST
    atomic_write_json(path, manifest)
    return path


def manifest_field(manifest: dict, where: str | Path, *keys: str) -> Any:
    """manifest[k1][k2]..., or a ValueError naming the file and the missing field."""
    value: Any = manifest
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            name = ".".join(keys[: i + 1])
            raise ValueError(f"{where}: field {name!r} is missing")
        value = value[key]
    return value


def refuse(where: str | Path, name: str, expected: Any, found: Any, hint: str = "") -> NoReturn:
    raise ValueError(f"{where}: {name} is {found!r}, expected {expected!r}{hint}")


def read_manifest(corpus: str | Path) -> tuple[dict, Path]:
    """(the manifest, its path), its version and token type checked: FileNotFoundError for
    a directory that holds no corpus, ValueError naming the file and field otherwise."""
    import json

    path = Path(corpus) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no corpus manifest; build the corpus with "
            "`megadata run --recipe ...` (or `make data`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    version = manifest_field(manifest, path, "format_version")
    if version != FORMAT_VERSION:
        refuse(path, "format_version", FORMAT_VERSION, version)
    return manifest, path


def check_shard_schema(
    schema: pa.Schema, file: str | Path, dtype: str | None = None, manifest: Path | None = None
) -> None:
    """A shard's columns as the format has them (`tokens` of `dtype` when given), or a
    ValueError naming the file, the column and what was expected."""
    tokens_type = schema.field("tokens").type if "tokens" in schema.names else None
    is_list = tokens_type is not None and (
        pa.types.is_list(tokens_type) or pa.types.is_large_list(tokens_type)
    )
    wanted = [TOKEN_DTYPES[dtype]] if dtype is not None else list(TOKEN_DTYPES.values())
    if not (is_list and tokens_type.value_type in wanted):
        expected = f"list<{dtype}>" if dtype else "list<uint16> or list<uint32>"
        source = f" (token_dtype of {manifest})" if manifest and dtype else ""
        raise ValueError(f"{file}: column 'tokens' is {tokens_type}, expected {expected}{source}")
    if "sentence_ends" in schema.names:
        ends_type = schema.field("sentence_ends").type
        if not (pa.types.is_list(ends_type) and ends_type.value_type == pa.uint32()):
            raise ValueError(
                f"{file}: column 'sentence_ends' is {ends_type}, expected list<uint32>"
            )
