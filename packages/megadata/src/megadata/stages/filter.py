"""Filter: drop documents shorter than `min_tokens` tokens of the corpus tokenizer (paper: 128).

Counting a document's tokens means encoding it, so the ids (and, for a BERT corpus, the
sentence ends) are kept: `tokens_path` receives them for every document kept, and the
tokenize stage takes them from there instead of encoding the corpus a second time (the
stages between only remove documents, never change a text).
"""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from megadata.documents import read_table, text_bytes, write_kept, write_table
from megadata.encode import DEFAULT_SPLITTER, encoder


def token_table(
    tokenizer_path: str, docs: list[dict], sentences: bool, splitter: str
) -> tuple[pa.ListArray, pa.ListArray | None, np.ndarray]:
    """(ids, sentence ends or None, lengths) of each document, without the end-of-document
    id: list arrays of the corpus' token type and uint32."""
    from megadata.stages.tokenize import token_type

    enc = encoder(tokenizer_path, os.stat(tokenizer_path).st_mtime_ns)
    dtype = token_type(enc.tok.get_vocab_size(with_added_tokens=True))
    texts = [d["text"] for d in docs]
    if not sentences:
        ids, lengths = enc.encode_flat(texts)
        return _list_array(ids, lengths, dtype), None, lengths
    ids, lengths, ends, count = enc.encode_sentences(texts, splitter)
    return _list_array(ids, lengths, dtype), _list_array(ends, count, pa.uint32()), lengths


def _list_array(values: np.ndarray, lengths: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, dtype))


def filter_partition(
    in_path: str,
    out_path: str,
    tokenizer_path: str,
    min_tokens: int,
    tokens_path: str | None = None,
    sentences: bool = False,
    splitter: str = DEFAULT_SPLITTER,
) -> dict:
    table = read_table(Path(in_path))
    docs = table.to_pylist()
    tokens, ends, lengths = token_table(tokenizer_path, docs, sentences, splitter)
    keep = lengths >= min_tokens
    kept = [d for d, k in zip(docs, keep.tolist(), strict=True) if k]
    if tokens_path is not None:
        mask = pa.array(keep, pa.bool_())
        columns = {
            "doc_id": pa.array([d["doc_id"] for d in kept], pa.string()),
            "tokens": tokens.filter(mask),
        }
        if ends is not None:
            columns["sentence_ends"] = ends.filter(mask)
        write_table(Path(tokens_path), pa.table(columns), {"sentences": sentences})
    write_kept(Path(out_path), table, keep)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
        "tokens": int(lengths[keep].sum()),
        "extra": {"too_short": len(docs) - len(kept)},
    }
