"""A corpus in megadata's format, written directly: megatrain reads files, not megadata."""

import hashlib
import json
from pathlib import Path

import pyarrow as pa

EOD = 0
VOCAB = 1000
TOKENIZER_SHA = "ab" * 32


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_corpus(
    root: Path,
    splits: dict[str, list[list[list[int]]]],
    *,
    dtype: str = "uint16",
    kind: str = "gpt2-bpe",
    batch_rows: int = 3,
    vocab_size: int = VOCAB,
    **manifest_overrides,
) -> Path:
    """A corpus directory in megadata's format: splits -> shards -> documents (token lists)."""
    root.mkdir(parents=True, exist_ok=True)
    value_type = {"uint16": pa.uint16(), "uint32": pa.uint32()}[dtype]
    schema = pa.schema([("doc_id", pa.string()), ("tokens", pa.list_(value_type))])
    entries = {}
    for split, shards in splits.items():
        (root / split).mkdir(exist_ok=True)
        listed = []
        for i, docs in enumerate(shards):
            file = f"{split}/shard-{i:05d}.arrow"
            table = pa.table(
                {"doc_id": [f"{split}-{i}-{r}" for r in range(len(docs))], "tokens": docs},
                schema=schema,
            )
            with pa.ipc.new_file(str(root / file), schema) as writer:
                # Several record batches per shard, as megadata writes large shards.
                for batch in table.to_batches(max_chunksize=batch_rows):
                    writer.write_batch(batch)
            listed.append(
                {
                    "docs": len(docs),
                    "file": file,
                    "sha256": sha256(root / file),
                    "tokens": sum(map(len, docs)),
                }
            )
        entries[split] = {
            "docs": sum(s["docs"] for s in listed),
            "tokens": sum(s["tokens"] for s in listed),
            "shards": listed,
        }
    manifest = {
        "format_version": 1,
        "sentence_boundaries": False,
        "token_dtype": dtype,
        "tokenizer": {
            "eod_id": EOD,
            "file": "tokenizer.json",
            "kind": kind,
            "sha256": TOKENIZER_SHA,
            "vocab_size": vocab_size,
        },
        "splits": entries,
        **manifest_overrides,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def random_documents(rng, count: int, vocab_size: int, low: int, high: int) -> list[list[int]]:
    """`count` documents of random ids in [1, vocab_size), between low and high tokens, + EOD."""
    return [
        [*rng.integers(1, vocab_size, rng.integers(low, high)).tolist(), EOD] for _ in range(count)
    ]
