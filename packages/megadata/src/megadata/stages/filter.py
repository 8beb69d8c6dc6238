"""Filter: drop documents shorter than `min_tokens` tokens of the corpus tokenizer (paper: 128).

Counting a document's tokens means encoding it, so the ids (and, for a BERT corpus, the
sentence ends) are kept: `tokens_path` receives them for every document kept, and the
tokenize stage takes them from there instead of encoding the corpus a second time (the
stages between only remove documents, never change a text).
"""

import os
from pathlib import Path

import pyarrow as pa

from megadata.documents import read_docs, text_bytes, write_docs, write_table
from megadata.encode import DEFAULT_SPLITTER, encoder


def token_table(
    tokenizer_path: str, docs: list[dict], sentences: bool, splitter: str
) -> tuple[list[list[int]], list[list[int]] | None]:
    """(ids, sentence ends or None) of each document, without the end-of-document id."""
    enc = encoder(tokenizer_path, os.stat(tokenizer_path).st_mtime_ns)
    if not sentences:
        return enc.encode_many([d["text"] for d in docs]), None
    return enc.encode_sentences([d["text"] for d in docs], splitter)


def filter_partition(
    in_path: str,
    out_path: str,
    tokenizer_path: str,
    min_tokens: int,
    tokens_path: str | None = None,
    sentences: bool = False,
    splitter: str = DEFAULT_SPLITTER,
) -> dict:
    from megadata.stages.tokenize import token_type

    docs = list(read_docs(Path(in_path)))
    ids, ends = token_table(tokenizer_path, docs, sentences, splitter)
    keep = [len(t) >= min_tokens for t in ids]
    kept = [d for d, k in zip(docs, keep, strict=True) if k]
    if tokens_path is not None:
        vocab = encoder(tokenizer_path, os.stat(tokenizer_path).st_mtime_ns).tok.get_vocab_size(
            with_added_tokens=True
        )
        columns = {
            "doc_id": pa.array([d["doc_id"] for d in kept], pa.string()),
            "tokens": pa.array(
                [t for t, k in zip(ids, keep, strict=True) if k], pa.list_(token_type(vocab))
            ),
        }
        if ends is not None:
            columns["sentence_ends"] = pa.array(
                [e for e, k in zip(ends, keep, strict=True) if k], pa.list_(pa.uint32())
            )
        write_table(Path(tokens_path), pa.table(columns), {"sentences": sentences})
    write_docs(Path(out_path), kept)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
        "tokens": sum(len(t) for t, k in zip(ids, keep, strict=True) if k),
        "extra": {"too_short": len(docs) - len(kept)},
    }
