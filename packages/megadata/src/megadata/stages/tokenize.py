"""Tokenize: documents -> token ids with the end-of-document id appended.

BERT corpora also keep sentence boundaries (`sentence_ends`: the token offset after each
sentence; megadata.encode says how sentences are found).  The filter stage has already
encoded every document it kept (`tokens_path`, the same ids and ends); the documents
still here are taken from it, and only without such a file is a partition encoded.
"""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megadata.documents import read_docs, read_meta, read_table, text_bytes, write_table
from megadata.encode import DEFAULT_SPLITTER, encoder, token_table, token_type


def _from_filter(tokens_path: str | None, doc_ids: list[str], sentences: bool) -> pa.Table | None:
    """The filter stage's rows of `doc_ids`, in their order, or None when it has none."""
    if tokens_path is None or not Path(tokens_path).exists():
        return None
    if read_meta(Path(tokens_path)).get("sentences") != sentences:
        return None
    table = read_table(Path(tokens_path))
    table = table.filter(pc.is_in(table.column("doc_id"), pa.array(doc_ids, pa.string())))
    return table if table.column("doc_id").to_pylist() == doc_ids else None


def _with_eod(
    tokens: pa.ChunkedArray, eod_id: int, dtype: pa.DataType, bos_id: int | None = None
) -> pa.Array:
    """Each row's ids with `eod_id` appended (and `bos_id` prepended, when given)."""
    tokens = tokens.combine_chunks()
    offsets = tokens.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]  # a sliced array's offsets start past zero
    values = tokens.flatten().to_numpy(zero_copy_only=False)
    values = np.insert(values, offsets[1:], eod_id)
    offsets = offsets + np.arange(len(offsets))
    if bos_id is not None:
        values = np.insert(values, offsets[:-1], bos_id)
        offsets = offsets + np.arange(len(offsets))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, dtype))


def tokenize_partition(
    in_path: str,
    out_path: str,
    tokenizer_path: str,
    eod_id: int,
    sentences: bool,
    tokens_path: str | None = None,
    splitter: str = DEFAULT_SPLITTER,
    bos_id: int | None = None,
) -> dict:
    enc = encoder(tokenizer_path, os.stat(tokenizer_path).st_mtime_ns)
    dtype = token_type(enc.tok.get_vocab_size(with_added_tokens=True))
    docs = list(read_docs(Path(in_path)))
    ids = [d["doc_id"] for d in docs]
    table = _from_filter(tokens_path, ids, sentences)
    if table is None:
        tokens, ends, _ = token_table(tokenizer_path, docs, sentences, splitter)
        table = pa.table({"doc_id": pa.array(ids, pa.string()), "tokens": tokens})
        if sentences:
            table = table.append_column("sentence_ends", ends)
    columns = {
        "doc_id": pa.array(ids, pa.string()),
        "tokens": _with_eod(table.column("tokens"), eod_id, dtype, bos_id),
    }
    if sentences:
        columns["sentence_ends"] = table.column("sentence_ends").combine_chunks()
    write_table(Path(out_path), pa.table(columns))
    lengths = pc.list_value_length(columns["tokens"])
    return {
        "docs_in": len(docs),
        "docs_out": len(docs),
        "bytes_in": text_bytes(docs),
        "tokens": int(pc.sum(lengths).as_py() or 0),
    }
