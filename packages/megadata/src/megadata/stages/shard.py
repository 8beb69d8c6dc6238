"""Shard: tokenized partitions -> train/ and valid/ Arrow shards and manifest.json.

The split is by document and deterministic: a document is in valid when the
sha256 of its id falls in 1 of `valid_every` (30: the paper's 29:1) buckets.
Shards hold whole documents, about `shard_tokens` tokens each, in partition
order.  The manifest, written last and atomically, is what makes a corpus
directory complete; it records each shard's sha256.
"""

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from megadata.documents import atomic_write_json, read_table, write_table
from megadata.tokenizer import sha256_file

FORMAT_VERSION = 1


def is_valid_doc(doc_id: str, valid_every: int) -> bool:
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % valid_every == 0


def write_shards(tokenized: list[str], corpus: str, valid_every: int, shard_tokens: int) -> dict:
    corpus = Path(corpus)
    pending = {"train": [], "valid": []}
    sizes = {"train": 0, "valid": 0}
    shards = {"train": [], "valid": []}
    counts = {s: {"docs": 0, "tokens": 0} for s in pending}

    def flush(split):
        tables = pending[split]
        if not tables:
            return
        table = pa.concat_tables(tables).combine_chunks()
        path = corpus / split / f"shard-{len(shards[split]):05d}.arrow"
        write_table(path, table)
        tokens = sizes[split]
        shards[split].append(
            {
                "file": f"{split}/{path.name}",
                "docs": table.num_rows,
                "tokens": tokens,
                "sha256": sha256_file(path),
            }
        )
        pending[split], sizes[split] = [], 0

    for part in tokenized:
        table = read_table(Path(part))
        if table.num_rows == 0:
            continue
        valid = pa.array([is_valid_doc(d, valid_every) for d in table.column("doc_id").to_pylist()])
        lengths = pc.list_value_length(table.column("tokens"))
        for split, mask in (("train", pc.invert(valid)), ("valid", valid)):
            rows = table.filter(mask)
            if rows.num_rows == 0:
                continue
            n_tokens = pc.sum(lengths.filter(mask)).as_py() or 0
            pending[split].append(rows)
            sizes[split] += n_tokens
            counts[split]["docs"] += rows.num_rows
            counts[split]["tokens"] += n_tokens
            if sizes[split] >= shard_tokens:
                flush(split)
    for split in pending:
        flush(split)
    return {"shards": shards, "counts": counts}


def write_manifest(corpus: Path, manifest: dict) -> None:
    atomic_write_json(
        Path(corpus) / "manifest.json", {"format_version": FORMAT_VERSION, **manifest}
    )
